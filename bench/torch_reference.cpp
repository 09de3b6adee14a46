// moe_route benchmarks: the LibTorch composition (the only LibTorch TU).
#include "torch_reference.hpp"

#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

namespace moe_route_bench {

struct torch_router::impl {
  torch_spec spec;
  torch::Tensor logits;      // borrowed from spec.logits
  torch::Tensor bias;        // [E]
  torch::Tensor grad_gates;  // [N x K]
  torch::Tensor indices, gates;
  torch::Tensor leaf, graph_gates, grad_logits;  // backward state

  // The composition: score, key, top-k, gather of the unbiased scores,
  // normalise, scale. Autograd records it when the input requires grad.
  std::tuple<torch::Tensor, torch::Tensor> compose(const torch::Tensor& z) const {
    torch::Tensor idx, w;
    if (spec.sigmoid_bias) {
      const torch::Tensor s = torch::sigmoid(z);
      idx = std::get<1>(torch::topk(s + bias, spec.top_k, -1, /*largest=*/true, /*sorted=*/true));
      w = s.gather(-1, idx);
    } else {
      const torch::Tensor s = torch::softmax(z, -1);
      std::tie(w, idx) = torch::topk(s, spec.top_k, -1, /*largest=*/true, /*sorted=*/true);
    }
    if (spec.normalize) w = w / (w.sum(-1, /*keepdim=*/true) + 1e-20);
    if (spec.scaling_factor != 1.0f) w = w * spec.scaling_factor;
    return {idx, w};
  }
};

torch_router::torch_router(const torch_spec& spec) : p_(std::make_unique<impl>()) {
  p_->spec = spec;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  p_->logits = torch::from_blob(const_cast<float*>(spec.logits), {spec.num_tokens, spec.num_experts}, f32);
  if (spec.expert_bias != nullptr)
    p_->bias = torch::from_blob(const_cast<float*>(spec.expert_bias), {spec.num_experts}, f32).clone();
  if (spec.grad_gates != nullptr)
    p_->grad_gates = torch::from_blob(const_cast<float*>(spec.grad_gates), {spec.num_tokens, spec.top_k}, f32).clone();
}

torch_router::~torch_router() = default;

void torch_router::forward() {
  c10::InferenceMode guard;
  std::tie(p_->indices, p_->gates) = p_->compose(p_->logits);
}

void torch_router::read_forward(std::int32_t* indices, float* gates) const {
  const torch::Tensor idx = p_->indices.to(torch::kInt32).contiguous();
  const torch::Tensor w = p_->gates.contiguous();
  std::memcpy(indices, idx.data_ptr<std::int32_t>(), sizeof(std::int32_t) * idx.numel());
  std::memcpy(gates, w.data_ptr<float>(), sizeof(float) * w.numel());
}

void torch_router::prepare_backward() {
  p_->leaf = p_->logits.clone().set_requires_grad(true);
  p_->graph_gates = std::get<1>(p_->compose(p_->leaf));
}

void torch_router::backward() {
  p_->grad_logits = torch::autograd::grad({p_->graph_gates}, {p_->leaf}, {p_->grad_gates},
                                          /*retain_graph=*/true, /*create_graph=*/false)[0];
}

void torch_router::read_backward(float* grad_logits) const {
  const torch::Tensor g = p_->grad_logits.contiguous();
  std::memcpy(grad_logits, g.data_ptr<float>(), sizeof(float) * g.numel());
}

void torch_router::set_threads(int threads) {
  torch::set_num_threads(threads);
}

std::string torch_router::version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}


// ---------------------------------------------------------------- training

struct torch_training::impl {
  torch_training_spec spec;
  torch::Tensor leaf;          // [N x E] logits, requires grad
  torch::Tensor ebias;         // [E]
  torch::Tensor grad_gates;    // [N x K]
  torch::Tensor rows;          // [N] int64, -1 mapped to S (the padding row)
  torch::Tensor mask;          // [N] float, 1 where the token has a prior row
  double prior_tokens = 0;     // |T|
  torch::Tensor bias_table;    // [S+1 x E], padding row 0
  torch::Tensor probs_table;   // [S+1 x E], padding row uniform (masked out)
  torch::Tensor log_probs_table;  // log of probs_table (constant, taken once)
  torch::Tensor log_target;    // [E] log D_l of locality
  // Results of the last step.
  torch::Tensor indices, gates, grad_logits;
  std::vector<torch::Tensor> values;
};

torch_training::torch_training(const torch_training_spec& spec) : p_(std::make_unique<impl>()) {
  impl& m = *p_;
  m.spec = spec;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  const auto i32 = torch::TensorOptions().dtype(torch::kInt32);
  const std::int64_t N = spec.num_tokens, E = spec.num_experts, S = spec.prior_rows;
  m.leaf = torch::from_blob(const_cast<float*>(spec.logits), {N, E}, f32).clone().set_requires_grad(true);
  if (spec.expert_bias != nullptr) m.ebias = torch::from_blob(const_cast<float*>(spec.expert_bias), {E}, f32).clone();
  m.grad_gates = torch::from_blob(const_cast<float*>(spec.grad_gates), {N, spec.top_k}, f32).clone();
  if (spec.token_prior_row != nullptr) {
    const torch::Tensor r = torch::from_blob(const_cast<std::int32_t*>(spec.token_prior_row), {N}, i32).to(torch::kInt64);
    m.rows = torch::where(r < 0, torch::full_like(r, S), r);
    m.mask = (r >= 0).to(torch::kFloat32);
    m.prior_tokens = m.mask.sum().item<double>();
  }
  if (spec.prior_bias != nullptr)
    m.bias_table = torch::cat({torch::from_blob(const_cast<float*>(spec.prior_bias), {S, E}, f32), torch::zeros({1, E}, f32)});
  if (spec.prior_probs != nullptr) {
    m.probs_table =
        torch::cat({torch::from_blob(const_cast<float*>(spec.prior_probs), {S, E}, f32), torch::full({1, E}, 1.0f / E, f32)});
    m.log_probs_table = m.probs_table.log();
  }
  if (spec.locality != 0.0f) {
    std::vector<float> target(E);
    int local = 0;
    for (std::int64_t e = 0; e < E; ++e) local += spec.expert_rank[e] == spec.rank ? 1 : 0;
    for (std::int64_t e = 0; e < E; ++e)
      target[e] = local == E ? std::log(1.0f / E)
                             : std::log(spec.expert_rank[e] == spec.rank ? (1.0f - spec.locality_epsilon) / local
                                                                          : spec.locality_epsilon / (E - local));
    m.log_target = torch::from_blob(target.data(), {E}, f32).clone();
  }
}

torch_training::~torch_training() = default;

void torch_training::step() {
  impl& m = *p_;
  const torch_training_spec& sp = m.spec;
  const torch::Tensor& z = m.leaf;
  const bool need_b = sp.beta != 0.0f || sp.logit_l2 != 0.0f;
  const torch::Tensor b = need_b ? m.bias_table.index_select(0, m.rows) : torch::Tensor();  // b[r(t)]
  const torch::Tensor zp = sp.beta != 0.0f ? z + sp.beta * b : z;

  // Gating, selection and gates on z'; the routing distribution p of the
  // unbiased z for the penalties (and its log where kl_to_base needs it).
  torch::Tensor idx, w, p, logp;
  const bool need_p = sp.load_balance != 0.0f || sp.locality != 0.0f || sp.kl_to_base != 0.0f;
  if (sp.sigmoid_bias) {
    const torch::Tensor s = torch::sigmoid(zp);
    idx = std::get<1>(torch::topk(s + m.ebias, sp.top_k, -1, true, true));
    w = s.gather(-1, idx);
    if (need_p) {
      const torch::Tensor su = sp.beta != 0.0f ? torch::sigmoid(z) : s;
      const torch::Tensor total = su.sum(-1, /*keepdim=*/true);
      p = su / total;
      if (sp.kl_to_base != 0.0f) logp = torch::log_sigmoid(z) - total.log();
    }
  } else {
    const torch::Tensor s = torch::softmax(zp, -1);
    std::tie(w, idx) = torch::topk(s, sp.top_k, -1, true, true);
    if (need_p) {
      p = sp.beta != 0.0f ? torch::softmax(z, -1) : s;
      if (sp.kl_to_base != 0.0f) logp = torch::log_softmax(z, -1);
    }
  }
  if (sp.normalize) w = w / (w.sum(-1, true) + 1e-20);
  if (sp.scaling_factor != 1.0f) w = w * sp.scaling_factor;

  const double N = static_cast<double>(sp.num_tokens), E = sp.num_experts;
  m.values.clear();
  torch::Tensor loss = (m.grad_gates * w).sum();
  if (sp.load_balance != 0.0f) {  // alpha E sum_e f_e P_e, f from the selection or the top-K of z (no gradient)
    const torch::Tensor counted =
        sp.load_balance_top_k ? std::get<1>(torch::topk(z.detach(), sp.top_k, -1, true, true)) : idx;
    const torch::Tensor f =
        torch::bincount(counted.reshape({-1}), {}, sp.num_experts).to(torch::kFloat32) / (N * sp.top_k);
    m.values.push_back(sp.load_balance * E * (f * p.mean(0)).sum());
  }
  if (sp.z_loss != 0.0f) m.values.push_back(sp.z_loss * torch::logsumexp(z, -1).square().mean());
  if (sp.kl_to_base != 0.0f) {  // KL(pi || p) over the tokens with a prior row
    const torch::Tensor pi = m.probs_table.index_select(0, m.rows);
    const torch::Tensor kl = (pi * (m.log_probs_table.index_select(0, m.rows) - logp)).sum(-1);
    m.values.push_back(sp.kl_to_base * (kl * m.mask).sum() / m.prior_tokens);
  }
  if (sp.logit_l2 != 0.0f) {  // ||center(z - b)||^2 over the tokens with a prior row
    torch::Tensor d = z - b;
    d = d - d.mean(-1, true);
    m.values.push_back(sp.logit_l2 * (d.square().sum(-1) * m.mask).sum() / m.prior_tokens);
  }
  if (sp.locality != 0.0f) {  // lambda KL(D_c || D_l), D_c = mean_t p
    const torch::Tensor dc = p.mean(0);
    m.values.push_back(sp.locality * (dc * (dc.log() - m.log_target)).sum());
  }
  for (const torch::Tensor& v : m.values) loss = loss + v;
  m.grad_logits = torch::autograd::grad({loss}, {m.leaf})[0];
  m.indices = idx;
  m.gates = w.detach();
}

int torch_training::read(std::int32_t* indices, float* gates, float* grad_logits, double* values) const {
  const impl& m = *p_;
  const torch::Tensor idx = m.indices.to(torch::kInt32).contiguous();
  const torch::Tensor w = m.gates.contiguous();
  const torch::Tensor g = m.grad_logits.contiguous();
  std::memcpy(indices, idx.data_ptr<std::int32_t>(), sizeof(std::int32_t) * idx.numel());
  std::memcpy(gates, w.data_ptr<float>(), sizeof(float) * w.numel());
  std::memcpy(grad_logits, g.data_ptr<float>(), sizeof(float) * g.numel());
  for (std::size_t i = 0; i < m.values.size(); ++i) values[i] = m.values[i].item<double>();
  return static_cast<int>(m.values.size());
}

}  // namespace moe_route_bench
