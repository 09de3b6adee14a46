// moe_route CUDA backend: the steps of cuda::expert_choice (the sequence:
// expert_choice_launch.cuh) and its backward, replaying
// backend/cpu/detail/expert_choice.hpp exactly. Token steps are warp agents
// over the warp type W; item steps are per-thread functors.
//
// Forward: each token's softmax statistics (warp), the ranking item of every
// (token, expert) pair (thread), the cut at C_e over the ranked pairs
// (thread), each token's chosen experts compacted in ascending order with
// ballots (warp), and the report (warps of 32 tokens). A padding token
// (token_mask byte 0) reads no input: its pairs rank nowhere, so no expert
// picks it, its row is -1 / 0, and it is in no report field.
//
// Backward (cpu::expert_choice_backward replayed exactly). One warp per token: the
// row's softmax statistics, <ds, s> over the chosen slots in the canonical
// lane order (slot j in lane j mod 32), the dense row dz = s * -dot, then,
// after W::sync(), the chosen experts' entries s * (ds - dot). Slots with an
// index outside [0, E) are ignored (the CPU backend rejects them). A padding
// token's row is +0, its logits and indices unread.
#pragma once

#include <cstdint>

#include <moe_route/admission/admission.hpp>
#include <moe_route/admission/scores.hpp>
#include <moe_route/backend/cuda/detail/admission_common.cuh>
#include <moe_route/backend/cuda/detail/config.cuh>
#include <moe_route/backend/cuda/detail/warp_reduce.cuh>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/gating/softmax.hpp>
#include <moe_route/selection/expert_choice.hpp>

namespace moe_route::cuda::detail {

template <class W, class T>
MOE_ROUTE_CUDA_DEVICE void expert_choice_backward_row(const T* z, const std::int32_t* idx, const float* dg, int E,
                                                      float* dz) {
  namespace num = moe_route::detail;
  using moe_route::admission::gate_input;
  const int lane = W::lane();
  const auto v = [z](int e) { return num::sanitize(num::to_float(W::load(z + e))); };
  float m = -num::float_max;
  for (int e = lane; e < E; e += warp_threads) m = num::max(m, v(e));
  moe_route::admission::row_stats st;
  st.max = warp_max<W>(m);
  float partial = 0.0f;
  for (int e = lane; e < E; e += warp_threads) partial += gating::softmax::term(v(e), st.max);
  st.sum = warp_sum<W>(partial);
  float dot_part = 0.0f;
  for (int j = lane; j < E; j += warp_threads) {
    const std::int32_t e = W::load(idx + j);
    if (e >= 0 && e < E) dot_part = num::fma(W::load(dg + j), gate_input<gating::softmax>(v(e), st), dot_part);
  }
  const float dot = warp_sum<W>(dot_part);
  for (int e = lane; e < E; e += warp_threads) dz[e] = gate_input<gating::softmax>(v(e), st) * -dot;
  W::sync();
  for (int j = lane; j < E; j += warp_threads) {
    const std::int32_t e = W::load(idx + j);
    if (e >= 0 && e < E) dz[e] = gate_input<gating::softmax>(v(e), st) * (W::load(dg + j) - dot);
  }
}

}  // namespace moe_route::cuda::detail

namespace moe_route::cuda::admission_detail {

template <class S>
struct ec_params {
  const S* logits;
  std::int64_t num_tokens;
  int num_experts;
  const std::int32_t* group_ids;
  int num_groups;
  const std::int64_t* capacity;
  const std::uint8_t* token_mask;  // [N] or null: 0 marks a padding token
  int top_k;
  double capacity_factor;
  std::int64_t min_capacity;
  std::uint32_t sentinel;
  std::int64_t* group_tokens;    // [G]
  admission::row_stats* stats;   // [N]
  unsigned char* chosen;         // [N x E]
};

template <class S>
struct ec_stats_agent {
  ec_params<S> p;
  template <class W>
  MOE_ROUTE_CUDA_DEVICE void run(std::int64_t t, std::uint32_t*) const {
    if (moe_route::detail::token_masked(p.token_mask, t)) return;  // warp-uniform
    const admission::row_stats st = warp_row_stats<W>(p.logits + t * p.num_experts, p.num_experts);
    if (W::lane() == 0) p.stats[t] = st;
  }
};

// Pair i = (t, e): key rank_key(s_{t,e}, t), segment group * E + e (or the
// sentinel, for an invalid group or a padding token).
template <class S>
struct ec_items_step {
  ec_params<S> p;
  std::uint64_t* keys;
  std::uint32_t* items;
  std::uint32_t* segs;
  MOE_ROUTE_CUDA_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t t = i / p.num_experts;
    const int e = static_cast<int>(i - t * p.num_experts);
    items[i] = static_cast<std::uint32_t>(i);
    if (moe_route::detail::token_masked(p.token_mask, t)) {
      keys[i] = 0;
      segs[i] = p.sentinel;
      return;
    }
    const int g = p.group_ids != nullptr ? p.group_ids[t] : 0;
    const float s = admission::gate_input<gating::softmax>(num::sanitize(num::to_float(p.logits[i])), p.stats[t]);
    keys[i] = admission::rank_key(s, t);
    segs[i] = g >= 0 && g < p.num_groups
                  ? static_cast<std::uint32_t>(g) * static_cast<std::uint32_t>(p.num_experts) + static_cast<std::uint32_t>(e)
                  : p.sentinel;
  }
};

// The first C_e ranked pairs of every (group, expert) are chosen.
template <class S>
struct ec_decide_step {
  ec_params<S> p;
  ranked r;
  MOE_ROUTE_CUDA_DEVICE void operator()(std::int64_t i) const {
    const std::uint32_t s = r.seg[i];
    if (s == p.sentinel) return;
    const int g = static_cast<int>(s / static_cast<std::uint32_t>(p.num_experts));
    const int e = static_cast<int>(s - static_cast<std::uint32_t>(g) * static_cast<std::uint32_t>(p.num_experts));
    const std::int64_t cap =
        p.capacity != nullptr
            ? p.capacity[e]
            : admission::capacity_from_factor(p.capacity_factor, p.min_capacity, p.group_tokens[g], p.top_k, p.num_experts);
    if (r.rank(i) < cap) p.chosen[r.items[i]] = 1;
  }
};

// Row t: the chosen experts in ascending order, then -1.
template <class S>
struct ec_outputs_agent {
  ec_params<S> p;
  std::int32_t* out_indices;
  float* out_gates;
  std::int32_t* per_token;
  template <class W>
  MOE_ROUTE_CUDA_DEVICE void run(std::int64_t t, std::uint32_t*) const {
    const int lane = W::lane();
    const int e_count = p.num_experts;
    const admission::row_stats st = p.stats[t];
    const std::int64_t row = t * e_count;
    int count = 0;
    for (int base = 0; base < e_count; base += warp_threads) {  // warp-uniform
      const int e = base + lane;
      const bool c = e < e_count && p.chosen[row + e] != 0;
      const std::uint32_t mask = W::ballot(c);
      if (c) {
        const int pos = count + detail::popcount(mask & ((1u << lane) - 1u));
        out_indices[row + pos] = e;
        out_gates[row + pos] = admission::gate_input<gating::softmax>(num::sanitize(num::to_float(p.logits[row + e])), st);
      }
      count += detail::popcount(mask);
    }
    for (int j = count + lane; j < e_count; j += warp_threads) {
      out_indices[row + j] = -1;
      out_gates[row + j] = 0.0f;
    }
    if (per_token != nullptr && lane == 0) per_token[t] = count;
  }
};

// The report by warps of 32 tokens (token_warps); zeroed first.
struct ec_report_agent {
  const std::int32_t* indices;
  const std::int32_t* group_ids;
  const std::uint8_t* token_mask;
  std::int64_t num_tokens;
  int num_experts;
  int num_groups;
  expert_choice_report* report;
  template <class W>
  MOE_ROUTE_CUDA_DEVICE void run(std::int64_t w, std::uint32_t*) const {
    std::uint64_t assignments = 0, none = 0, invalid = 0;
    std::uint32_t most = 0;
    const std::int64_t t = w * warp_threads + W::lane();
    if (t < num_tokens && !moe_route::detail::token_masked(token_mask, t)) {
      std::uint32_t c = 0;
      const std::int32_t* row = indices + t * num_experts;
      while (c < static_cast<std::uint32_t>(num_experts) && row[c] >= 0) ++c;
      assignments = c;
      none = c == 0;
      most = c;
      if (group_ids != nullptr) invalid = group_ids[t] < 0 || group_ids[t] >= num_groups;
    }
    assignments = detail::warp_sum_count<W>(assignments);
    none = detail::warp_sum_count<W>(none);
    invalid = detail::warp_sum_count<W>(invalid);
    most = W::reduce_max(most);
    if (W::lane() != 0) return;
    if (assignments) W::atomic_add(&report->assignments, static_cast<std::int64_t>(assignments));
    if (none) W::atomic_add(&report->tokens_without_experts, static_cast<std::int64_t>(none));
    if (invalid) W::atomic_add(&report->invalid, static_cast<std::int64_t>(invalid));
    if (most) W::atomic_max(&report->max_experts_per_token, static_cast<std::int64_t>(most));
  }
};

// The backward, one warp per token.
template <class T>
struct ec_backward_agent {
  const T* logits;
  int num_experts;
  const std::uint8_t* token_mask;
  const std::int32_t* indices;
  const float* grad_gates;
  float* grad_logits;
  template <class W>
  MOE_ROUTE_CUDA_DEVICE void run(std::int64_t t, std::uint32_t*) const {
    const std::int64_t row = t * num_experts;
    if (moe_route::detail::token_masked(token_mask, t)) {  // warp-uniform
      for (int e = W::lane(); e < num_experts; e += warp_threads) grad_logits[row + e] = 0.0f;
      return;
    }
    detail::expert_choice_backward_row<W>(logits + row, indices + row, grad_gates + row, num_experts, grad_logits + row);
  }
};

}  // namespace moe_route::cuda::admission_detail
