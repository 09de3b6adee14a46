// moe_route: host-side validation of admission, expert-choice and dispatch
// calls. The shape / parameter checks run on both backends before anything is
// written; the *_data checks read the arrays and run on the CPU backend only
// (the CUDA backend never reads device memory on the host: it drops invalid
// entries and counts them in its report). Errors are moe_route::error naming
// the argument.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <moe_route/admission/admission.hpp>
#include <moe_route/admission/dispatch.hpp>
#include <moe_route/admission/scores.hpp>
#include <moe_route/config.hpp>
#include <moe_route/detail/validate.hpp>
#include <moe_route/router.hpp>
#include <moe_route/selection/expert_choice.hpp>
#include <moe_route/types.hpp>

namespace moe_route::admission::detail {

using moe_route::detail::fail;

inline std::string num(double x) {
  std::string s = std::to_string(x);
  return s;
}

inline constexpr std::int64_t max_sort_items = std::numeric_limits<std::int32_t>::max();

// Whether a * b >= max_sort_items (a >= 0, b >= 1), without forming a * b,
// which overflows 64 bits for a num_tokens near 2^63.
inline bool reaches_sort_limit(std::int64_t a, std::int64_t b) { return a > (max_sort_items - 1) / b; }

template <class Policy>
void validate_policy(const Policy& p) {
  static_assert(is_policy<Policy>, "admission: the policy must be an admission::policy<...> or dropless_policy");
  if constexpr (!Policy::is_dropless) {
    if (std::isnan(p.threshold)) fail("admission: threshold is NaN");
    if constexpr (Policy::affinity_type::kind == affinity_kind::position) {
      if (p.threshold != -std::numeric_limits<float>::infinity())
        fail("admission: threshold (= " + num(p.threshold) +
             ") must be -inf with position affinity (position ranks tokens, it has no value to threshold)");
    }
    if (!std::isfinite(p.capacity_factor) || p.capacity_factor < 0.0)
      fail("admission: capacity_factor (= " + num(p.capacity_factor) + ") must be finite and >= 0");
    if (p.min_capacity < 0) fail("admission: min_capacity (= " + std::to_string(p.min_capacity) + ") must be >= 0");
    if constexpr (Policy::reroutes) {
      if (!std::isfinite(p.overflow.fill_factor) || p.overflow.fill_factor < 0.0)
        fail("admission: overflow.fill_factor (= " + num(p.overflow.fill_factor) + ") must be finite and >= 0");
      if (p.overflow.max_rounds < -1)
        fail("admission: overflow.max_rounds (= " + std::to_string(p.overflow.max_rounds) +
             ") must be >= 0, or -1 for K rounds");
    }
  }
}

inline void validate_groups(int num_groups, int num_experts) {
  if (num_groups < 1) fail("num_groups (= " + std::to_string(num_groups) + ") must be >= 1");
  if (static_cast<std::int64_t>(num_groups) * num_experts >= max_sort_items)
    fail("num_groups * num_experts (= " + std::to_string(static_cast<std::int64_t>(num_groups) * num_experts) +
         ") must be < 2^31 - 1");
}

// Shapes, pointers and parameters (both backends).
template <class Router, class Policy, class T>
void validate_admission(const Router& r, const Policy& p, const admission_inputs<T>& in,
                        const admission_outputs& out) {
  static_assert(is_router<Router>, "admit: the first argument must be a moe_route::router");
  static_assert(moe_route::detail::is_logit_type<T>, "admit: logits must be float, bfloat16 or float16");
  validate_policy(p);
  if (in.num_tokens < 0) fail("num_tokens (= " + std::to_string(in.num_tokens) + ") must be >= 0");
  moe_route::detail::validate_router(r, in.num_experts);
  validate_groups(in.num_groups, in.num_experts);
  if (reaches_sort_limit(in.num_tokens, r.top_k))
    fail("num_tokens (= " + std::to_string(in.num_tokens) + ") * top_k (= " + std::to_string(r.top_k) +
         ") must be < 2^31 - 1 for admission");
  if (in.num_tokens == 0) return;
  if (in.logits == nullptr) fail("logits is null");
  if (in.routed_indices == nullptr) fail("routed_indices is null");
  if (in.routed_gates == nullptr) fail("routed_gates is null");
  if (out.indices == nullptr) fail("indices (output) is null");
  if (out.gates == nullptr) fail("gates (output) is null");
  if constexpr (Policy::needs_norms) {
    if (in.hidden_norms == nullptr) fail("hidden_norms is null, but cosine affinity needs ||x_t||");
    if (in.weight_norms == nullptr) fail("weight_norms is null, but cosine affinity needs ||w_e||");
  }
}

// The arrays' contents (CPU backend: host memory).
template <class Router, class Policy, class T>
void validate_admission_data(const Router& r, const Policy&, const admission_inputs<T>& in) {
  const int k = r.top_k;
  const int e_count = in.num_experts;
  for (std::int64_t t = 0; t < in.num_tokens; ++t) {
    if (moe_route::detail::token_masked(in.token_mask, t)) continue;
    const std::int32_t* idx = in.routed_indices + t * k;
    for (int j = 0; j < k; ++j) {
      if (idx[j] < 0 || idx[j] >= e_count)
        fail("routed_indices[" + std::to_string(t * k + j) + "] (= " + std::to_string(idx[j]) +
             ") is not an expert in [0, num_experts)");
      for (int i = 0; i < j; ++i)
        if (idx[i] == idx[j])
          fail("routed_indices: token " + std::to_string(t) + " selects expert " + std::to_string(idx[j]) +
               " twice");
    }
    if (in.group_ids != nullptr && (in.group_ids[t] < 0 || in.group_ids[t] >= in.num_groups))
      fail("group_ids[" + std::to_string(t) + "] (= " + std::to_string(in.group_ids[t]) +
           ") is outside [0, num_groups = " + std::to_string(in.num_groups) + ")");
    if constexpr (Policy::needs_norms) {
      if (!valid_norm(in.hidden_norms[t]))
        fail("hidden_norms[" + std::to_string(t) + "] (= " + num(in.hidden_norms[t]) +
             ") must be finite and > 0: the cosine affinity z / (||x_t|| ||w_e||) is undefined");
    }
  }
  if constexpr (Policy::needs_norms) {
    for (int e = 0; e < e_count; ++e)
      if (!valid_norm(in.weight_norms[e]))
        fail("weight_norms[" + std::to_string(e) + "] (= " + num(in.weight_norms[e]) +
             ") must be finite and > 0: the cosine affinity z / (||x_t|| ||w_e||) is undefined");
  }
  if (in.capacity != nullptr)
    for (int e = 0; e < e_count; ++e)
      if (in.capacity[e] < 0)
        fail("capacity[" + std::to_string(e) + "] (= " + std::to_string(in.capacity[e]) + ") must be >= 0");
}

template <class T>
void validate_expert_choice(const selection::expert_choice& p, const expert_choice_inputs<T>& in,
                            const expert_choice_outputs& out) {
  if (in.num_tokens < 0) fail("num_tokens (= " + std::to_string(in.num_tokens) + ") must be >= 0");
  if (in.num_experts < 1 || in.num_experts > max_experts)
    fail("num_experts (= " + std::to_string(in.num_experts) + ") must be in [1, " + std::to_string(max_experts) + "]");
  validate_groups(in.num_groups, in.num_experts);
  if (p.top_k < 1) fail("expert_choice.top_k (= " + std::to_string(p.top_k) + ") must be >= 1");
  if (!std::isfinite(p.capacity_factor) || p.capacity_factor < 0.0)
    fail("expert_choice.capacity_factor (= " + num(p.capacity_factor) + ") must be finite and >= 0");
  if (p.min_capacity < 0)
    fail("expert_choice.min_capacity (= " + std::to_string(p.min_capacity) + ") must be >= 0");
  if (reaches_sort_limit(in.num_tokens, in.num_experts))
    fail("num_tokens (= " + std::to_string(in.num_tokens) + ") * num_experts (= " + std::to_string(in.num_experts) +
         ") must be < 2^31 - 1 for expert_choice");
  if (in.num_tokens == 0) return;
  if (in.logits == nullptr) fail("logits is null");
  if (out.indices == nullptr) fail("indices (output) is null");
  if (out.gates == nullptr) fail("gates (output) is null");
}

template <class T>
void validate_expert_choice_data(const expert_choice_inputs<T>& in) {
  if (in.group_ids != nullptr)
    for (std::int64_t t = 0; t < in.num_tokens; ++t)
      if (!moe_route::detail::token_masked(in.token_mask, t) && (in.group_ids[t] < 0 || in.group_ids[t] >= in.num_groups))
        fail("group_ids[" + std::to_string(t) + "] (= " + std::to_string(in.group_ids[t]) +
             ") is outside [0, num_groups = " + std::to_string(in.num_groups) + ")");
  if (in.capacity != nullptr)
    for (int e = 0; e < in.num_experts; ++e)
      if (in.capacity[e] < 0)
        fail("capacity[" + std::to_string(e) + "] (= " + std::to_string(in.capacity[e]) + ") must be >= 0");
}

// The shape arguments of a dispatch, before any output is sized from them:
// the rows a result can need (dispatch_rows_bound) must be countable in 64
// bits, or the bound a caller allocates would wrap.
inline void validate_dispatch_shape(const dispatch_inputs& in) {
  if (in.num_tokens < 0) fail("dispatch: num_tokens (= " + std::to_string(in.num_tokens) + ") must be >= 0");
  if (in.slots_per_token < 1)
    fail("dispatch: slots_per_token (= " + std::to_string(in.slots_per_token) + ") must be >= 1");
  if (in.num_experts < 1 || in.num_experts > max_experts)
    fail("dispatch: num_experts (= " + std::to_string(in.num_experts) + ") must be in [1, " +
         std::to_string(max_experts) + "]");
  if (in.align < 1) fail("dispatch: align (= " + std::to_string(in.align) + ") must be >= 1");
  if (in.capacity < 0) fail("dispatch: capacity (= " + std::to_string(in.capacity) + ") must be >= 0");
  if (in.num_ranks < 1) fail("dispatch: num_ranks (= " + std::to_string(in.num_ranks) + ") must be >= 1");
  if (in.expert_rank == nullptr && in.num_experts % in.num_ranks != 0)
    fail("dispatch: num_ranks (= " + std::to_string(in.num_ranks) + ") must divide num_experts (= " +
         std::to_string(in.num_experts) + ") for the default contiguous expert_rank map");
  constexpr std::int64_t most = std::numeric_limits<std::int64_t>::max();
  const std::int64_t padding = in.align - 1;  // align and E are ints: E * padding fits
  const bool countable =
      in.capacity > 0
          ? in.capacity <= most - padding && expert_rows(in.capacity, in.align, 0) <= most / in.num_experts
          : in.num_tokens <= (most - in.num_experts * padding) / in.slots_per_token;
  if (!countable)
    fail("dispatch: " +
         (in.capacity > 0 ? "capacity (= " + std::to_string(in.capacity) + ")"
                          : "num_tokens (= " + std::to_string(in.num_tokens) + ") * slots_per_token (= " +
                                std::to_string(in.slots_per_token) + ")") +
         " padded to align (= " + std::to_string(in.align) + ") for " + std::to_string(in.num_experts) +
         " experts needs more rows than 64 bits count");
}

inline void validate_dispatch(const dispatch_inputs& in, const dispatch_outputs& out) {
  validate_dispatch_shape(in);
  if (out.counts == nullptr) fail("dispatch: counts (output) is null");
  if (out.offsets == nullptr) fail("dispatch: offsets (output) is null");
  if (in.num_tokens > 0 && in.indices == nullptr) fail("dispatch: indices is null");
}

inline void validate_dispatch_data(const dispatch_inputs& in) {
  const std::int64_t slots = in.num_tokens * in.slots_per_token;
  for (std::int64_t s = 0; s < slots; ++s)
    if (in.indices[s] < -1 || in.indices[s] >= in.num_experts)
      fail("dispatch: indices[" + std::to_string(s) + "] (= " + std::to_string(in.indices[s]) +
           ") must be -1 or an expert in [0, num_experts)");
  if (in.capacity > 0) {
    std::vector<std::int64_t> held(static_cast<std::size_t>(in.num_experts), 0);
    for (std::int64_t s = 0; s < slots; ++s)
      if (in.indices[s] >= 0 && ++held[in.indices[s]] > in.capacity)
        fail("dispatch: indices give expert " + std::to_string(in.indices[s]) + " more than capacity (= " +
             std::to_string(in.capacity) + ") slots");
  }
  if (in.expert_rank != nullptr)
    for (int e = 0; e < in.num_experts; ++e)
      if (in.expert_rank[e] < 0 || in.expert_rank[e] >= in.num_ranks)
        fail("dispatch: expert_rank[" + std::to_string(e) + "] (= " + std::to_string(in.expert_rank[e]) +
             ") is outside [0, num_ranks = " + std::to_string(in.num_ranks) + ")");
}

// The admitted indices of a backward (cpu::backward, on the host): -1 or experts, and a rerouted slot must bring the
// token a new expert.
inline void validate_admitted(const backward_args& args, std::int64_t num_tokens, int k, int num_experts,
                              const std::uint8_t* token_mask) {
  using moe_route::admission::slot_status;
  for (std::int64_t t = 0; t < num_tokens; ++t) {
    if (moe_route::detail::token_masked(token_mask, t)) continue;
    const std::int32_t* routed = args.indices + t * k;
    const std::int32_t* admitted = args.admitted_indices + t * k;
    for (int j = 0; j < k; ++j) {
      if (admitted[j] < -1 || admitted[j] >= num_experts)
        moe_route::detail::fail("admitted_indices[" + std::to_string(t * k + j) + "] must be -1 or in [0, E)");
      if (moe_route::admission::status_of(routed[j], admitted[j]) == slot_status::rerouted)
        for (int i = 0; i < k; ++i)
          if (routed[i] == admitted[j] || (i != j && admitted[i] == admitted[j]))
            moe_route::detail::fail("admitted_indices: token " + std::to_string(t) + " holds expert " +
                                    std::to_string(admitted[j]) + " twice (a rerouted slot must get a new expert)");
    }
  }
}

// The arguments of an expert_choice_backward call (both backends).
template <class T>
void validate_expert_choice_backward(const expert_choice_inputs<T>& in, const std::int32_t* indices,
                                     const float* grad_gates, const float* grad_logits) {
  if (in.num_tokens < 0) fail("num_tokens must be >= 0");
  if (in.num_experts < 1 || in.num_experts > max_experts) fail("num_experts must be in [1, max_experts]");
  if (in.num_tokens == 0) return;
  if (in.logits == nullptr || indices == nullptr || grad_gates == nullptr || grad_logits == nullptr)
    fail("expert_choice_backward: logits, indices, grad_gates and grad_logits must not be null");
}

// Its indices, on the host (the CPU backend); padding tokens' rows are not read.
inline void validate_expert_choice_backward_data(const std::int32_t* indices, std::int64_t num_tokens, int num_experts,
                                                 const std::uint8_t* token_mask) {
  for (std::int64_t s = 0; s < num_tokens * num_experts; ++s)
    if (!moe_route::detail::token_masked(token_mask, s / num_experts) && (indices[s] < -1 || indices[s] >= num_experts))
      fail("indices[" + std::to_string(s) + "] must be -1 or an expert in [0, num_experts)");
}

}  // namespace moe_route::admission::detail
