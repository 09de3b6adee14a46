// moe_route: expert-choice selection (Zhou et al. 2022; docs/policies.md section 2).
//
// s = softmax over experts per token (the canonical softmax of the sanitised
// logits, as gating::softmax computes it). In each admission group g, every
// expert e picks the top C_e tokens by s_{t,e}, ties to the lower token index,
// where C_e = max(min_capacity, ceil(N_g * top_k / E * capacity_factor)) or a
// caller per-expert array (the capacity rule of docs/policies.md §4; top_k is the
// nominal number of experts per token, e.g. 2 for Zhou et al.'s "EC-CF2"). A
// token gets 0..E experts; its gates are s_{t,e} (no normalisation, no scale).
//
// Output, token-major with width E:
//   indices [N x E]  row t: the experts that picked t in ascending expert
//                    order, then -1
//   gates   [N x E]  s_{t,e} for those entries, then 0
//   experts_per_token [N] (optional) how many entries of row t are set
// Dispatch metadata (admission/dispatch.hpp) takes this output with S = E.
// Gradient: dz_t = s_t * (ds - <ds, s_t>) with ds the gate gradients placed at
// the chosen experts (cpu::expert_choice_backward, cuda::expert_choice_backward);
// the dot runs in the canonical 32-lane order.
//
// This is a stage of its own, not a router selection: it replaces route +
// admit (the router's gating is not used).
#pragma once

#include <cstdint>

#include <moe_route/config.hpp>
#include <moe_route/types.hpp>

namespace moe_route::selection {

struct expert_choice {
  static constexpr bool is_cross_token = true;
  static constexpr const char* name = "expert_choice";

  int top_k = 2;                  // nominal experts per token in the capacity rule
  double capacity_factor = 1.0;   // C = max(min_capacity, ceil(N_g * top_k / E * capacity_factor))
  std::int64_t min_capacity = 0;
};

}  // namespace moe_route::selection

namespace moe_route {

template <class T>
struct expert_choice_inputs {
  static_assert(detail::is_logit_type<T>, "logits must be float, moe_route::bfloat16 or moe_route::float16");
  const T* logits = nullptr;                // [N x E]
  std::int64_t num_tokens = 0;              // N, with N * E < 2^31 - 1
  int num_experts = 0;                      // E in [1, max_experts]
  const std::int32_t* group_ids = nullptr;  // [N] in [0, num_groups); null: one group
  int num_groups = 1;
  const std::int64_t* capacity = nullptr;   // [E] C_e >= 0 for every group; null: the factor rule
  const std::uint8_t* token_mask = nullptr; // [N] 0: a padding token no expert picks; null: all valid
};

struct expert_choice_report {
  std::int64_t assignments = 0;             // chosen (token, expert) pairs
  std::int64_t tokens_without_experts = 0;  // tokens no expert picked
  std::int64_t max_experts_per_token = 0;
  std::int64_t invalid = 0;                 // CUDA only: tokens with a group id outside [0, num_groups), never picked
};

struct expert_choice_outputs {
  std::int32_t* indices = nullptr;            // [N x E]
  float* gates = nullptr;                     // [N x E]
  std::int32_t* experts_per_token = nullptr;  // [N], optional
  expert_choice_report* report = nullptr;     // optional (CUDA: a device pointer, overwritten)
};

}  // namespace moe_route
