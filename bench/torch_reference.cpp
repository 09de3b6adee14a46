// moe_route benchmarks: the LibTorch composition (the only LibTorch TU).
#include "torch_reference.hpp"

#include <torch/torch.h>

#include <cstring>
#include <tuple>

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

}  // namespace moe_route_bench
