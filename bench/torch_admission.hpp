// moe_route benchmarks: route + admission + dispatch composed from LibTorch
// operators, the way a PyTorch MoE layer writes it (Megatron-LM's
// topk_softmax_with_capacity and permute). Only torch_admission.cpp includes
// LibTorch, behind this plain interface.
//
// Token choice (every kind but expert_choice):
//   route     s = softmax(z); (w, idx) = topk(s, K)            (no normalisation)
//   admit     probs:    A = zeros(N, E).scatter(1, idx, w); topk(A, C, dim 0)
//                       per expert, masked by the routing map (Megatron
//                       drop_policy "probs")
//             position: p = cumsum(routing map, dim 0); keep p <= C (GShard /
//                       Switch: earliest tokens first)
//             cosine:   c = z[t, idx] / (||x_t|| ||w_e||) at the routed slots,
//                       A = -inf except routed slots with c >= tau; topk(A, C,
//                       dim 0), masked (the strict CIPHER / LocMoE pass)
//             dropless: nothing
//             admitted = where(kept, idx, -1), gates = w * kept
//   dispatch  key = where(admitted >= 0, admitted, E) over the N*K slots;
//             stable argsort(key); counts = bincount(key)[:E]; offsets =
//             cumsum of the align-padded counts; rows, permutation, inverse by
//             index_put; rank_counts = counts summed per rank.
// Expert choice:
//   route+admit s = softmax(z); topk(s^T, C, dim 1): [E x C] tokens; mask [E x N]
//   dispatch    nonzero(mask) (expert-major, token ascending); counts =
//               mask.sum(1); rows as above; slot id of (t, e) = t * E + e.
#pragma once

#include <cstdint>
#include <memory>

namespace moe_route_bench {

enum class torch_admission_kind { probs, position, cosine, dropless, expert_choice };

struct torch_admission_spec {
  torch_admission_kind kind = torch_admission_kind::probs;
  const float* logits = nullptr;  // [N x E], borrowed
  std::int64_t num_tokens = 0;
  int num_experts = 0;
  int top_k = 1;                  // K (token choice); the nominal k of expert choice's capacity
  double capacity_factor = 1.0;   // C = ceil(N K / E * capacity_factor)
  float tau = 0.0f;               // cosine only
  const float* hidden_norms = nullptr;  // [N], cosine only
  const float* weight_norms = nullptr;  // [E], cosine only
  int align = 1;
  int num_ranks = 1;              // contiguous expert -> rank map
};

class torch_admission {
 public:
  explicit torch_admission(const torch_admission_spec& spec);
  ~torch_admission();
  torch_admission(const torch_admission&) = delete;
  torch_admission& operator=(const torch_admission&) = delete;

  // The three stages, in this order (expert choice: route() does the
  // selection, admit() nothing).
  void route();
  void admit();
  void dispatch();

  // Token choice: the routed indices and gates [N x K] of route().
  void read_routed(std::int32_t* indices, float* gates) const;
  // Token choice: admitted indices and gates [N x K]. Expert choice: the dense
  // chosen gates [N x E] (0 where not chosen) in gates; indices unused.
  void read_admitted(std::int32_t* indices, float* gates) const;
  // The per-(token, expert) affinity the admission ranked by, dense [N x E]
  // (probs: scattered gates; cosine: -inf off the eligible slots; expert
  // choice: s). Empty for position and dropless.
  void read_affinity(float* affinity) const;
  // counts [E], offsets [E + 1], permutation [rows bound], inverse [slots],
  // rank_counts [R]; returns rows = offsets[E].
  std::int64_t read_dispatch(std::int64_t* counts, std::int64_t* offsets, std::int64_t* permutation,
                             std::int64_t* inverse, std::int64_t* rank_counts) const;

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};

}  // namespace moe_route_bench
