// moe_route CPU backend: one token's forward and backward (selection, gates,
// the prior policies, admitted gates), over per-worker scratch buffers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <moe_route/admission/gates.hpp>
#include <moe_route/admission/scores.hpp>
#include <moe_route/backend/cpu/detail/simd.hpp>
#include <moe_route/backend/cpu/detail/training.hpp>
#include <moe_route/config.hpp>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/router.hpp>
#include <moe_route/types.hpp>

MOE_ROUTE_CPU_SIMD_WARNINGS_OFF

namespace moe_route::cpu::detail {

// Per-worker row buffers, sized for the general path (E <= 4096).
struct row_scratch {
  float v[max_experts];               // sanitised logits
  float t[max_experts];               // softmax terms exp(v - max), or scores
  std::uint64_t keys[max_experts];    // packed selection keys
  std::uint32_t order[max_experts];   // order-preserving images of the keys
  std::uint64_t candidates[max_experts];           // packed keys that can be among the top K
  std::int32_t candidate_experts[max_experts + 16];  // their experts (+16: vector stores)
  float biased[max_experts];          // z + beta b of a token under log_prior_bias
  penalty_scratch penalties;          // the penalties' row buffers
  router_row routed;                  // what the last row_state left in t, for the penalties
  std::int32_t counted[max_top_k];    // load_balance::count::top_k: a token's counted experts
  bool x86_64_v3;                     // the rows run on the run-time x86-64-v3 path (detail/simd.hpp)
};

// The k largest of count distinct packed keys, descending, branch-free: each
// key's rank is the number of keys above it (vector compares up to 16 keys).
// Repeated keys are allowed only where at least k keys rank above them.
inline void rank_top(const std::uint64_t* keys, int count, int k, std::uint64_t* best,
                     [[maybe_unused]] bool x86_64_v3) {
  std::uint64_t slots[max_top_k + 1];
#if defined(__AVX512F__)
  if (count <= 16) {
    const __mmask8 lo = static_cast<__mmask8>(count >= 8 ? 0xffu : (1u << count) - 1u);
    const __mmask8 hi = static_cast<__mmask8>(count >= 16 ? 0xffu : count <= 8 ? 0u : (1u << (count - 8)) - 1u);
    const __m512i c0 = _mm512_maskz_loadu_epi64(lo, keys);  // absent lanes are 0, below every key
    const __m512i c1 = _mm512_maskz_loadu_epi64(hi, keys + 8);
    for (int i = 0; i < count; ++i) {
      const __m512i ci = _mm512_set1_epi64(static_cast<long long>(keys[i]));
      const int rank = popcount16(_mm512_cmpgt_epu64_mask(c0, ci)) + popcount16(_mm512_cmpgt_epu64_mask(c1, ci));
      slots[rank < k ? rank : k] = keys[i];
    }
    for (int j = 0; j < k; ++j) best[j] = slots[j];
    return;
  }
#elif MOE_ROUTE_CPU_AVX2_KERNELS
  if (count <= 16 && use_avx2(x86_64_v3)) {
    rank_candidates_avx2(keys, count, k, slots);
    for (int j = 0; j < k; ++j) best[j] = slots[j];
    return;
  }
#endif
  for (int i = 0; i < count; ++i) {
    int rank = 0;
    for (int j = 0; j < count; ++j) rank += keys[j] > keys[i] ? 1 : 0;
    slots[rank < k ? rank : k] = keys[i];
  }
  for (int j = 0; j < k; ++j) best[j] = slots[j];
}

// The k largest packed keys (order[e], then the lower e), descending: the
// result of top_keys over every packed key, found by ranking only the few
// keys at or above a lane bound, or all of them in short rows. `keys` holds
// the packed keys when some are masked to 0 (group-limited selection; their
// order is 0 too, and at least k keys are not masked), else nullptr.
inline void select_top(const std::uint32_t* order, const std::uint64_t* keys, int n, int k, std::uint64_t* best,
                       row_scratch& s) {
  constexpr int small = 16, large = 32, max_ranked = 64;
  std::uint32_t bound = 0;
  if (k <= small && n >= 2 * small)
    bound = lane_bound<small>(order, n, k, s.x86_64_v3);
  else if (n >= 2 * large)
    bound = lane_bound<large>(order, n, k, s.x86_64_v3);
  if (bound == 0) {  // short rows, or fewer than k lanes with a key
    if (keys == nullptr) {
      for (int e = 0; e < n; ++e) s.keys[e] = packed_key(order, e);
      keys = s.keys;
    }
    if (n <= small)
      rank_top(keys, n, k, best, s.x86_64_v3);
    else
      top_keys(keys, n, k, best);
    return;
  }
  // Candidates have order >= bound > 0: never masked, packed key = packed_key().
  const int count = compact_at_least(order, n, bound, s.candidate_experts, s.x86_64_v3);
  std::uint64_t* candidates = s.candidates;
  for (int i = 0; i < count; ++i) candidates[i] = packed_key(order, s.candidate_experts[i]);
  if (count > max_ranked)
    top_keys(candidates, count, k, best);
  else
    rank_top(candidates, count, k, best, s.x86_64_v3);
}

#if MOE_ROUTE_CPU_AVX2_KERNELS
// group_top_orders in AVX2: one gather loads the i-th order of eight groups.
template <int P>
MOE_ROUTE_CPU_AVX2_TARGET void group_top_orders_avx2(const std::uint32_t* order, int groups, int size,
                                                     std::uint32_t (*top)[moe_route::detail::reduction_lanes]) {
  constexpr int width = 8;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int first = 0; first < groups; first += width) {
    const int last = std::min(groups - first, width) - 1;
    const __m256i offsets = _mm256_mullo_epi32(_mm256_min_epi32(lane, _mm256_set1_epi32(last)), _mm256_set1_epi32(size));
    const int* base = reinterpret_cast<const int*>(order + first * size);
    __m256i chain[P];
    for (int j = 0; j < P; ++j) chain[j] = _mm256_setzero_si256();
    for (int i = 0; i < size; ++i) {
      __m256i x = _mm256_i32gather_epi32(base + i, offsets, 4);
      for (int j = 0; j < P; ++j) {
        const __m256i larger = _mm256_max_epu32(chain[j], x);
        x = _mm256_min_epu32(chain[j], x);
        chain[j] = larger;
      }
    }
    for (int j = 0; j < P; ++j) {
      alignas(32) std::uint32_t lanes[width];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), chain[j]);
      for (int l = 0; l <= last; ++l) top[j][first + l] = lanes[l];
    }
  }
}
#endif

// The per_group_k = P largest orders of each group, repeats kept, descending:
// top[j][grp]. Eight groups at a time are the lanes of a vector; every order
// passes down its lane's chain of P running maxima (min and max: no branches).
// Lanes past the last group repeat it and are not read.
template <int P>
void group_top_orders(const std::uint32_t* order, int groups, int size,
                      std::uint32_t (*top)[moe_route::detail::reduction_lanes], [[maybe_unused]] bool x86_64_v3) {
#if MOE_ROUTE_CPU_AVX2_KERNELS
  if (use_avx2(x86_64_v3)) return group_top_orders_avx2<P>(order, groups, size, top);
#endif
  for (int grp = 0; grp < groups; ++grp) {
    std::uint32_t chain[P] = {};
    for (int i = 0; i < size; ++i) {
      std::uint32_t x = order[grp * size + i];
      for (int j = 0; j < P; ++j) {
        const std::uint32_t larger = std::max(chain[j], x);
        x = std::min(chain[j], x);
        chain[j] = larger;
      }
    }
    for (int j = 0; j < P; ++j) top[j][grp] = chain[j];
  }
}

// The largest per_group_k served by group_top_orders.
inline constexpr int max_chained_per_group_k = 4;

// Group-limited selection: the experts outside the top_groups best groups get
// order 0 and packed key 0; keys receives the packed key of every other expert.
// A group's score is the sum of its per_group_k largest keys, added in
// descending order. Equal orders are equal keys, so the score needs only the
// largest orders with their repeats (group_top_orders).
template <class Grouped>
void mask_groups(const Grouped& g, std::uint32_t* order, std::uint64_t* keys, int num_experts, bool x86_64_v3) {
  constexpr int lanes = moe_route::detail::reduction_lanes;
  const int groups = g.groups, size = num_experts / groups, pk = g.per_group_k;
  for (int e = 0; e < num_experts; ++e) keys[e] = packed_key(order, e);
  float score[lanes] = {};
  if (pk <= max_chained_per_group_k) {
    std::uint32_t top[max_chained_per_group_k][lanes];
    switch (pk) {
      case 1: group_top_orders<1>(order, groups, size, top, x86_64_v3); break;
      case 2: group_top_orders<2>(order, groups, size, top, x86_64_v3); break;
      case 3: group_top_orders<3>(order, groups, size, top, x86_64_v3); break;
      default: group_top_orders<4>(order, groups, size, top, x86_64_v3); break;
    }
    for (int j = 0; j < pk; ++j)
      for (int grp = 0; grp < groups; ++grp)
        score[grp] += moe_route::detail::packed_value(static_cast<std::uint64_t>(top[j][grp]) << 32);
  } else {
    std::uint64_t best[max_experts];
    for (int grp = 0; grp < groups; ++grp) {
      top_keys(keys + grp * size, size, pk, best);
      for (int j = 0; j < pk; ++j) score[grp] += moe_route::detail::packed_value(best[j]);
    }
  }
  std::uint64_t group_keys[lanes], kept[lanes];
  for (int grp = 0; grp < groups; ++grp) group_keys[grp] = moe_route::detail::pack_key(score[grp], grp);
  top_keys(group_keys, groups, g.top_groups, kept);
  bool keep[lanes] = {};
  for (int j = 0; j < g.top_groups; ++j) keep[moe_route::detail::packed_expert(kept[j])] = true;
  for (int grp = 0; grp < groups; ++grp)
    if (!keep[grp])
      for (int e = grp * size; e < (grp + 1) * size; ++e) order[e] = 0, keys[e] = 0;
}

// The sanitised logits of one row and whether the row held NaN or +-inf.
// Sanitising changes only non-finite values, so a finite fp32 row is used in
// place; other rows are converted (and sanitised if needed) into buf.
template <class T>
const float* load_row(const T* z, int num_experts, float* buf, bool& nonfinite) {
  const float* v;
  if constexpr (std::is_same_v<T, float>) {
    v = z;
  } else {
    for (int e = 0; e < num_experts; ++e) buf[e] = moe_route::detail::to_float(z[e]);
    v = buf;
  }
  nonfinite = any_nonfinite(v, num_experts);
  if (nonfinite) {
    for (int e = 0; e < num_experts; ++e) buf[e] = moe_route::detail::sanitize(v[e]);
    v = buf;
  }
  return v;
}

// Row state shared by forward and backward: sanitised logits, and for
// row_softmax the terms and their canonical sum.
template <class Router, class T>
struct row_state {
  using G = typename Router::gating_type;
  row_scratch& s;
  const float* v;  // sanitised logits
  int num_experts;
  float sum = 0.0f;
  bool nonfinite = false;

  row_state(row_scratch& scratch, const T* z, int e_count) : s(scratch), num_experts(e_count) {
    v = load_row(z, num_experts, s.v, nonfinite);
    float m = 0.0f;
    if constexpr (G::shape == gating::kind::row_softmax) {
      m = row_max(v, num_experts, s.x86_64_v3);
      for (int e = 0; e < num_experts; ++e) s.t[e] = G::row_term(v[e], m);
      sum = lane_sum(s.t, num_experts, s.x86_64_v3);
    }
    const bool terms = G::shape == gating::kind::row_softmax;
    s.routed = {z, v, s.t, terms ? router_row::holds::terms : router_row::holds::nothing, nonfinite, m, sum};
  }

  // The gating score of expert e (the logit itself for selected_softmax).
  float score(int e) const {
    if constexpr (G::shape == gating::kind::row_softmax)
      return sum > 0.0f ? moe_route::detail::div(s.t[e], sum) : 0.0f;
    else if constexpr (G::shape == gating::kind::elementwise)
      return G::score(v[e]);
    else
      return v[e];
  }
};

// row(k) with k = r.top_k, passed as the constant 2 when it is 2: the compiler
// then unrolls the slot loops of a top-2 router (Mixtral), which it leaves as
// scalar loops for a run-time k bounded by a larger MaxK (the runtime
// routers' 16): 2.0-2.4x on a Mixtral backward row.
template <class Router, class Row>
MOE_ROUTE_ALWAYS_INLINE inline auto with_top_k(const Router& r, Row&& row) {
  if constexpr (Router::max_k > 2)
    if (r.top_k == 2) return row(std::integral_constant<int, 2>{});
  return row(r.top_k);
}

template <class Router, class T, class K>
bool route_row_k(const Router& r, const T* z, int num_experts, std::int64_t token, const float* bias,
                 row_scratch& scratch, std::int32_t* indices, float* gates, K k) {
  using G = typename Router::gating_type;
  using S = typename Router::selection_type;
  row_state<Router, T> row(scratch, z, num_experts);
  const float* v = row.v;

  int chosen[Router::max_k];
  float selected[Router::max_k] = {};  // zeroed: silences a GCC -Wmaybe-uninitialized false positive
  if constexpr (S::shape == selection::kind::fixed) {
    for (int j = 0; j < k; ++j) chosen[j] = S::expert(token, j, k, num_experts);
    for (int j = 0; j < k; ++j) selected[j] = row.score(chosen[j]);
  } else {
    const float neg_inf = -moe_route::detail::infinity();
    const std::uint32_t lowest = ordered_key(neg_inf);
    std::uint32_t* order = scratch.order;
    if constexpr (!S::needs_scores && !S::needs_expert_bias) {
      // Keys from the logits alone (top_k: the logit, -inf for a NaN logit).
      for (int e = 0; e < num_experts; ++e)
        order[e] = v[e] != neg_inf ? ordered_key(S::key(v[e], 0.0f, 0.0f)) : lowest;
    } else {
      // Scores of every expert first (kept for the gates), then the keys; a
      // NaN logit (v = -inf) ranks below every number whatever its key.
      float* scores = scratch.t;
      if constexpr (G::shape == gating::kind::row_softmax) {
        if (row.sum > 0.0f)
          for (int e = 0; e < num_experts; ++e) scores[e] = moe_route::detail::div(scratch.t[e], row.sum);
        else
          for (int e = 0; e < num_experts; ++e) scores[e] = 0.0f;
        scratch.routed.what = router_row::holds::distribution;
      } else if constexpr (G::shape == gating::kind::elementwise) {
        for (int e = 0; e < num_experts; ++e) scores[e] = G::score(v[e]);
        scratch.routed.what = router_row::holds::scores;
      } else {
        for (int e = 0; e < num_experts; ++e) scores[e] = 0.0f;
      }
      for (int e = 0; e < num_experts; ++e) {
        const float sc = S::needs_scores ? scores[e] : 0.0f;
        const float b = S::needs_expert_bias ? bias[e] : 0.0f;
        const std::uint32_t key = ordered_key(S::key(v[e], sc, b));
        order[e] = v[e] != neg_inf ? key : lowest;
      }
    }
    std::uint64_t best[Router::max_k];
    if constexpr (S::shape == selection::kind::grouped) {
      mask_groups(r.selection, order, scratch.keys, num_experts, scratch.x86_64_v3);
      select_top(order, scratch.keys, num_experts, k, best, scratch);
    } else {
      select_top(order, nullptr, num_experts, k, best, scratch);
    }
    for (int j = 0; j < k; ++j) chosen[j] = moe_route::detail::packed_expert(best[j]);
    if constexpr (S::needs_scores || S::needs_expert_bias) {
      if constexpr (G::shape != gating::kind::selected_softmax) {
        for (int j = 0; j < k; ++j) selected[j] = scratch.t[chosen[j]];
      } else {
        for (int j = 0; j < k; ++j) selected[j] = row.score(chosen[j]);
      }
    } else {
      for (int j = 0; j < k; ++j) selected[j] = row.score(chosen[j]);
    }
  }

  for (int j = 0; j < k; ++j) indices[j] = chosen[j];
  moe_route::detail::gate_weights(r, selected, gates, k);
  return row.nonfinite;
}

template <class Router, class T>
bool route_row(const Router& r, const T* z, int num_experts, std::int64_t token, const float* bias,
               row_scratch& scratch, std::int32_t* indices, float* gates) {
  return with_top_k(r, [&](auto k) { return route_row_k(r, z, num_experts, token, bias, scratch, indices, gates, k); });
}

// Gate weights of the experts in indices[0..K) from the unbiased logits z (the
// prior policies' gates); returns whether the row held NaN or +-inf.
template <class Router, class T>
bool gates_at(const Router& r, const T* z, int num_experts, const std::int32_t* indices, row_scratch& scratch,
              float* gates) {
  row_state<Router, T> row(scratch, z, num_experts);
  float selected[Router::max_k] = {};
  for (int j = 0; j < r.top_k; ++j) selected[j] = row.score(indices[j]);
  moe_route::detail::gate_weights(r, selected, gates, r.top_k);
  return row.nonfinite;
}

// The experts token t's load-balance counts take (docs/policies.md §5.2): the
// routed ones, or under load_balance::count::top_k the K largest unbiased
// logits, ties to the lower expert (a NaN logit ranks last).
template <class Router, class T>
const std::int32_t* counted_experts(const Router& r, const route_inputs<T>& in, std::int64_t t,
                                    const std::int32_t* routed, row_scratch& scratch) {
  if constexpr (Router::template has<penalty::load_balance>) {
    if (get<penalty::load_balance>(r).counts == penalty::load_balance::count::top_k) {
      const int num_experts = in.num_experts;
      const T* z = in.logits + t * num_experts;
      for (int e = 0; e < num_experts; ++e)
        scratch.order[e] = ordered_key(moe_route::detail::sanitize(num::to_float(z[e])));
      std::uint64_t best[Router::max_k];
      select_top(scratch.order, nullptr, num_experts, r.top_k, best, scratch);
      for (int j = 0; j < r.top_k; ++j) scratch.counted[j] = moe_route::detail::packed_expert(best[j]);
      return scratch.counted;
    }
  }
  return routed;
}

// One token of a replayed forward: the caller's experts, gated as the router
// gates its own choice (from z' under log_prior_bias with bias_gates).
template <class Router, class T>
bool replay_token(const Router& r, const route_inputs<T>& in, std::int64_t t, row_scratch& scratch,
                  std::int32_t* indices, float* gates) {
  const int num_experts = in.num_experts;
  const T* z = in.logits + t * num_experts;
  std::copy_n(in.replay_indices + t * r.top_k, r.top_k, indices);
  if constexpr (Router::template has<prior::log_prior_bias>) {
    if (prior_active(r, in, t) && get<prior::log_prior_bias>(r).bias_gates) {
      const float* b = in.prior_bias + std::int64_t{in.token_prior_row[t]} * num_experts;
      const bool nonfinite = biased_row(z, b, get<prior::log_prior_bias>(r).beta, num_experts, scratch.biased);
      gates_at(r, scratch.biased, num_experts, indices, scratch, gates);
      return nonfinite;
    }
  }
  return gates_at(r, z, num_experts, indices, scratch, gates);
}

// One token of the forward, with the router's prior policy where it acts.
template <class Router, class T>
bool route_token(const Router& r, const route_inputs<T>& in, std::int64_t t, row_scratch& scratch,
                 std::int32_t* indices, float* gates) {
  if (in.replay_indices != nullptr) return replay_token(r, in, t, scratch, indices, gates);
  const int num_experts = in.num_experts;
  const T* z = in.logits + t * num_experts;
  if constexpr (Router::has_prior) {
    if (prior_active(r, in, t)) {
      const float* b = in.prior_bias + std::int64_t{in.token_prior_row[t]} * num_experts;
      if constexpr (Router::template has<prior::log_prior_bias>) {
        const auto& policy = get<prior::log_prior_bias>(r);
        const bool nonfinite = biased_row(z, b, policy.beta, num_experts, scratch.biased);
        route_row(r, scratch.biased, num_experts, t, in.expert_bias, scratch, indices, gates);
        if (!policy.bias_gates) gates_at(r, z, num_experts, indices, scratch, gates);
        return nonfinite;
      } else {  // prior_override: the K largest prior biases, ties to the lower expert
        for (int e = 0; e < num_experts; ++e) scratch.order[e] = ordered_key(b[e]);
        std::uint64_t best[Router::max_k];
        select_top(scratch.order, nullptr, num_experts, r.top_k, best, scratch);
        for (int j = 0; j < r.top_k; ++j) indices[j] = moe_route::detail::packed_expert(best[j]);
        return gates_at(r, z, num_experts, indices, scratch, gates);
      }
    }
  }
  return route_row(r, z, num_experts, t, in.expert_bias, scratch, indices, gates);
}

template <class Router, class T, class K>
void backward_row_k(const Router& r, const T* z, int num_experts, const std::int32_t* indices, const float* dw,
                    row_scratch& scratch, float* dz, K k) {
  using G = typename Router::gating_type;
  float selected[Router::max_k] = {};  // zeroed: silences a GCC -Wmaybe-uninitialized false positive
  float dsel[Router::max_k];

  if constexpr (G::shape == gating::kind::row_softmax) {
    row_state<Router, T> row(scratch, z, num_experts);
    for (int j = 0; j < k; ++j) selected[j] = row.score(indices[j]);
    moe_route::detail::gate_weights_vjp(r, selected, dw, dsel, k);
    float dot = 0.0f;  // <ds, s>, nonzero terms only at the selected experts
    for (int j = 0; j < k; ++j) dot = moe_route::detail::fma(dsel[j], selected[j], dot);
    const float neg_dot = moe_route::detail::negate(dot);  // not -dot: see detail::negate
    if (row.sum > 0.0f) {
      const float sum = row.sum;
      for (int e = 0; e < num_experts; ++e) dz[e] = moe_route::detail::div(scratch.t[e], sum) * neg_dot;
    } else {
      for (int e = 0; e < num_experts; ++e) dz[e] = 0.0f * neg_dot;
    }
    for (int j = 0; j < k; ++j) dz[indices[j]] = selected[j] * (dsel[j] - dot);
  } else {
    // Elementwise and selected-softmax gradients are nonzero only at the
    // selected experts. The whole row is still loaded: that measured faster
    // than K scattered loads (the sequential loads keep the prefetcher busy).
    float v[Router::max_k];
    row_state<Router, T> row(scratch, z, num_experts);
    for (int j = 0; j < k; ++j) v[j] = row.v[indices[j]];
    for (int j = 0; j < k; ++j) {
      if constexpr (G::shape == gating::kind::elementwise)
        selected[j] = G::score(v[j]);
      else
        selected[j] = v[j];
    }
    moe_route::detail::gate_weights_vjp(r, selected, dw, dsel, k);
    for (int e = 0; e < num_experts; ++e) dz[e] = 0.0f;
    for (int j = 0; j < k; ++j) {
      if constexpr (G::shape == gating::kind::elementwise)
        dz[indices[j]] = dsel[j] * G::derivative(v[j], selected[j]);
      else
        dz[indices[j]] = dsel[j];
    }
  }
}

template <class Router, class T>
void backward_row(const Router& r, const T* z, int num_experts, const std::int32_t* indices, const float* dw,
                  row_scratch& scratch, float* dz) {
  with_top_k(r, [&](auto k) { backward_row_k(r, z, num_experts, indices, dw, scratch, dz, k); });
}

// The backward of one token whose gates were admitted (admission/gates.hpp):
// the gate inputs sigma (routed experts) and phi (rerouted experts) from the
// sanitised row v, their VJP, then the gating's VJP into dz.
template <class Router>
void admitted_backward_row(const Router& r, const float* v, int num_experts, const std::int32_t* routed,
                           const std::int32_t* admitted, bool renormalize, const float* dg, row_scratch& scratch,
                           float* dz) {
  namespace num = moe_route::detail;
  using namespace moe_route::admission;
  using G = typename Router::gating_type;
  const int k = r.top_k;
  row_stats st;
  if constexpr (gate_input_needs_row<G>) st = softmax_row_stats(v, num_experts, scratch.t);
  float sigma[max_top_k] = {}, phi[max_top_k] = {};  // zeroed: silences a GCC -Wmaybe-uninitialized false positive
  float d_sigma[max_top_k], d_phi[max_top_k];
  bool rerouted[max_top_k];
  for (int j = 0; j < k; ++j) {
    rerouted[j] = status_of(routed[j], admitted[j]) == slot_status::rerouted;
    sigma[j] = gate_input<G>(v[routed[j]], st);
    phi[j] = rerouted[j] ? gate_input<G>(v[admitted[j]], st) : 0.0f;
  }
  admitted_gate_weights_vjp(r, sigma, phi, routed, admitted, renormalize, dg, d_sigma, d_phi, k);
  if constexpr (G::shape == gating::kind::row_softmax) {
    float dot = 0.0f;  // <ds, s> over the nonzero entries: routed slots, then rerouted ones
    for (int j = 0; j < k; ++j) dot = num::fma(d_sigma[j], sigma[j], dot);
    for (int j = 0; j < k; ++j)
      if (rerouted[j]) dot = num::fma(d_phi[j], phi[j], dot);
    const float neg_dot = num::negate(dot);  // not -dot: see detail::negate
    for (int e = 0; e < num_experts; ++e) dz[e] = gate_input<G>(v[e], st) * neg_dot;
    for (int j = 0; j < k; ++j) dz[routed[j]] = sigma[j] * (d_sigma[j] - dot);
    for (int j = 0; j < k; ++j)
      if (rerouted[j]) dz[admitted[j]] = phi[j] * (d_phi[j] - dot);
  } else {
    for (int e = 0; e < num_experts; ++e) dz[e] = 0.0f;
    for (int j = 0; j < k; ++j) {
      if constexpr (G::shape == gating::kind::elementwise) {
        dz[routed[j]] = d_sigma[j] * G::derivative(v[routed[j]], sigma[j]);
        if (rerouted[j]) dz[admitted[j]] = d_phi[j] * G::derivative(v[admitted[j]], phi[j]);
      } else {
        dz[routed[j]] = d_sigma[j];
        if (rerouted[j]) dz[admitted[j]] = d_phi[j];
      }
    }
  }
}

}  // namespace moe_route::cpu::detail

MOE_ROUTE_CPU_SIMD_WARNINGS_ON
