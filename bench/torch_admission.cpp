// moe_route benchmarks: route + admission + dispatch composed from LibTorch
// operators (see torch_admission.hpp). Only this file and torch_reference.cpp
// include LibTorch.
#include "torch_admission.hpp"

#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

namespace moe_route_bench {

struct torch_admission::impl {
  torch_admission_spec spec;
  std::int64_t capacity = 0;  // C, clamped to N
  torch::Tensor z, xn, wn;
  torch::Tensor s, w, idx;        // route: scores [N x E], routed gates and indices [N x K]
  torch::Tensor affinity;         // [N x E] what admission ranked by (probs, cosine, expert choice)
  torch::Tensor admitted, gates;  // [N x K] (expert choice: gates [N x E] dense)
  torch::Tensor mask_en;          // expert choice: [E x N] bool
  torch::Tensor counts, offsets, permutation, inverse, rank_counts;

  // Rows of the padded expert-major buffer for entries sorted by expert:
  // offsets[e] + (position among expert e's entries).
  void layout(const torch::Tensor& experts_sorted, const torch::Tensor& cnt) {
    const int E = spec.num_experts, align = spec.align;
    counts = cnt;
    const torch::Tensor padded = torch::div(cnt + (align - 1), align, "floor") * align;
    const torch::Tensor zero = torch::zeros({1}, torch::kLong);
    offsets = torch::cat({zero, torch::cumsum(padded, 0)});
    const torch::Tensor start = torch::cat({zero, torch::cumsum(cnt, 0)}).slice(0, 0, E);
    const std::int64_t m = experts_sorted.size(0);
    rows_ = offsets.index_select(0, experts_sorted) + torch::arange(m, torch::kLong) - start.index_select(0, experts_sorted);
    rank_counts = cnt.view({spec.num_ranks, E / spec.num_ranks}).sum(1);
  }
  torch::Tensor rows_;
};

torch_admission::torch_admission(const torch_admission_spec& spec) : p_(std::make_unique<impl>()) {
  impl& m = *p_;
  m.spec = spec;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  const std::int64_t N = spec.num_tokens, E = spec.num_experts;
  m.z = torch::from_blob(const_cast<float*>(spec.logits), {N, E}, f32);
  if (spec.hidden_norms != nullptr) m.xn = torch::from_blob(const_cast<float*>(spec.hidden_norms), {N}, f32).clone();
  if (spec.weight_norms != nullptr) m.wn = torch::from_blob(const_cast<float*>(spec.weight_norms), {E}, f32).clone();
  // Megatron-LM get_capacity: ceil(num_tokens * topk / num_experts * capacity_factor).
  const double c = std::ceil(static_cast<double>(N * spec.top_k) / static_cast<double>(E) * spec.capacity_factor);
  m.capacity = static_cast<std::int64_t>(std::min<double>(c, static_cast<double>(N)));
}

torch_admission::~torch_admission() = default;

void torch_admission::route() {
  c10::InferenceMode guard;
  impl& m = *p_;
  m.s = torch::softmax(m.z, -1);
  if (m.spec.kind == torch_admission_kind::expert_choice) {
    const torch::Tensor tok = std::get<1>(torch::topk(m.s.t(), m.capacity, 1, /*largest=*/true, /*sorted=*/false));
    m.mask_en = torch::zeros({m.spec.num_experts, m.spec.num_tokens}, torch::kBool).scatter_(1, tok, true);
    m.gates = m.s * m.mask_en.t();
    return;
  }
  std::tie(m.w, m.idx) = torch::topk(m.s, m.spec.top_k, -1, /*largest=*/true, /*sorted=*/true);
}

void torch_admission::admit() {
  c10::InferenceMode guard;
  impl& m = *p_;
  const std::int64_t N = m.spec.num_tokens, E = m.spec.num_experts, K = m.spec.top_k;
  switch (m.spec.kind) {
    case torch_admission_kind::expert_choice: return;
    case torch_admission_kind::dropless:
      m.admitted = m.idx;
      m.gates = m.w;
      return;
    default: break;
  }
  const torch::Tensor routing_map = torch::zeros({N, E}, torch::kBool).scatter_(1, m.idx, true);
  torch::Tensor keep;
  if (m.spec.kind == torch_admission_kind::position) {
    const torch::Tensor pos = torch::cumsum(routing_map.to(torch::kInt32), 0);
    keep = routing_map & (pos <= m.capacity);
  } else {
    torch::Tensor eligible = routing_map;
    if (m.spec.kind == torch_admission_kind::probs) {
      m.affinity = torch::zeros({N, E}, torch::kFloat32).scatter_(1, m.idx, m.w);
    } else {  // cosine at the routed slots, threshold tau
      const torch::Tensor c = m.z.gather(1, m.idx) / (m.xn.unsqueeze(1) * m.wn.index_select(0, m.idx.reshape({-1})).view({N, K}));
      const torch::Tensor ok = c >= m.spec.tau;
      const float ninf = -std::numeric_limits<float>::infinity();
      m.affinity = torch::full({N, E}, ninf, torch::kFloat32).scatter_(1, m.idx, torch::where(ok, c, torch::full_like(c, ninf)));
      eligible = torch::zeros({N, E}, torch::kBool).scatter_(1, m.idx, ok);
    }
    if (m.capacity >= N) {
      keep = eligible;
    } else {
      const torch::Tensor top = std::get<1>(torch::topk(m.affinity, m.capacity, 0, /*largest=*/true, /*sorted=*/false));
      keep = eligible & torch::zeros({N, E}, torch::kBool).scatter_(0, top, true);
    }
  }
  const torch::Tensor slot_keep = keep.gather(1, m.idx);
  m.admitted = torch::where(slot_keep, m.idx, torch::full_like(m.idx, -1));
  m.gates = m.w * slot_keep;
}

void torch_admission::dispatch() {
  c10::InferenceMode guard;
  impl& m = *p_;
  const std::int64_t N = m.spec.num_tokens, E = m.spec.num_experts, align = m.spec.align;
  if (m.spec.kind == torch_admission_kind::expert_choice) {
    const torch::Tensor nz = m.mask_en.reshape({-1}).nonzero().squeeze(1);  // e * N + t, ascending
    const torch::Tensor e_s = torch::div(nz, N, "floor");
    const torch::Tensor slot = (nz - e_s * N) * E + e_s;  // t * E + e
    m.layout(e_s, m.mask_en.sum(1));
    m.permutation = torch::full({N * E + E * (align - 1)}, -1, torch::kLong).index_put_({m.rows_}, slot);
    m.inverse = torch::full({N * E}, -1, torch::kLong).index_put_({slot}, m.rows_);
    return;
  }
  const std::int64_t M = N * m.spec.top_k;
  const torch::Tensor flat = m.admitted.reshape({-1});
  const torch::Tensor key = torch::where(flat >= 0, flat, torch::full_like(flat, E));
  torch::Tensor sorted, order;
  std::tie(sorted, order) = torch::sort(key, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const torch::Tensor all = torch::bincount(key, {}, E + 1);
  const std::int64_t executed = M - all[E].item<std::int64_t>();
  const torch::Tensor kept = order.slice(0, 0, executed);
  m.layout(sorted.slice(0, 0, executed), all.slice(0, 0, E));
  m.permutation = torch::full({M + E * (align - 1)}, -1, torch::kLong).index_put_({m.rows_}, kept);
  m.inverse = torch::full({M}, -1, torch::kLong).index_put_({kept}, m.rows_);
}

void torch_admission::read_routed(std::int32_t* indices, float* gates) const {
  const impl& m = *p_;
  const torch::Tensor a = m.idx.to(torch::kInt32).contiguous();
  const torch::Tensor g = m.w.contiguous();
  std::memcpy(indices, a.data_ptr<std::int32_t>(), sizeof(std::int32_t) * a.numel());
  std::memcpy(gates, g.data_ptr<float>(), sizeof(float) * g.numel());
}

void torch_admission::read_admitted(std::int32_t* indices, float* gates) const {
  const impl& m = *p_;
  if (m.spec.kind != torch_admission_kind::expert_choice) {
    const torch::Tensor a = m.admitted.to(torch::kInt32).contiguous();
    std::memcpy(indices, a.data_ptr<std::int32_t>(), sizeof(std::int32_t) * a.numel());
  }
  const torch::Tensor g = m.gates.contiguous();
  std::memcpy(gates, g.data_ptr<float>(), sizeof(float) * g.numel());
}

void torch_admission::read_affinity(float* affinity) const {
  const impl& m = *p_;
  const torch::Tensor& src = m.spec.kind == torch_admission_kind::expert_choice ? m.s : m.affinity;
  if (!src.defined()) return;
  const torch::Tensor a = src.contiguous();
  std::memcpy(affinity, a.data_ptr<float>(), sizeof(float) * a.numel());
}

std::int64_t torch_admission::read_dispatch(std::int64_t* counts, std::int64_t* offsets, std::int64_t* permutation,
                                            std::int64_t* inverse, std::int64_t* rank_counts) const {
  const impl& m = *p_;
  const auto copy = [](const torch::Tensor& t, std::int64_t* dst) {
    const torch::Tensor c = t.to(torch::kLong).contiguous();
    std::memcpy(dst, c.data_ptr<std::int64_t>(), sizeof(std::int64_t) * c.numel());
  };
  copy(m.counts, counts);
  copy(m.offsets, offsets);
  copy(m.permutation, permutation);
  copy(m.inverse, inverse);
  copy(m.rank_counts, rank_counts);
  return m.offsets[m.spec.num_experts].item<std::int64_t>();
}

}  // namespace moe_route_bench
