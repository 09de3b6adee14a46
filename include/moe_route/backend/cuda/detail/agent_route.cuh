// moe_route CUDA backend: the forward agent. One warp routes one token at a
// time (tokens first, first + stride, ...); it returns the number of rows with
// NaN or +-inf logits that it saw (the same value in every lane).
//
//   route_rows_bucket<W, Router, T, Slots>: E <= 32 * Slots; the row lives in
//     registers (lane l holds experts l + 32 j, j < Slots; slots with e >= E
//     hold the packed key 0, "no candidate", and add nothing to any sum).
//   route_rows_general<W, Router, T>: any E <= 4096; the row is re-read from
//     global memory (L1/L2) and the packed keys live in shared memory.
//
// Both compute exactly what cpu::detail::route_row computes:
//   v_e = sanitize(z_e); nonfinite = any z_e not finite;
//   row_softmax: m = max(-FLT_MAX, v), t_e = G::term(v_e, m), sum = canonical 32-lane sum of t;
//   key_e = v_e == -inf ? -inf : S::key(v_e, score_e | 0, bias_e | 0), packed with pack_key;
//   grouped: keys outside the kept groups are set to 0 (mask_groups);
//   top-K: K rounds of a warp-wide maximum of the packed keys (descending, ties to the lower index);
//   gates: detail::gate_weights on the K selected scores.
// A padding token (token_mask byte 0) reads no logit and is not counted as
// non-finite: its K slots get index -1 and gate 0. Under routing replay the
// top-K step is skipped: the caller's experts are gated (replayed_expert).
#pragma once

#include <cstdint>

#include <moe_route/backend/cuda/detail/agent_common.cuh>
#include <moe_route/backend/cuda/detail/config.cuh>
#include <moe_route/backend/cuda/detail/warp_reduce.cuh>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/gating/gating.hpp>
#include <moe_route/selection/selection.hpp>

namespace moe_route::cuda::detail {

template <class W, class Router, class T, int Slots>
MOE_ROUTE_CUDA_DEVICE std::int64_t route_rows_bucket(const Router& r, const route_params<T>& p, std::int64_t first,
                                                     std::int64_t stride, std::uint64_t* shared_keys) {
  using G = typename Router::gating_type;
  using S = typename Router::selection_type;
  constexpr bool row_softmax = G::shape == gating::kind::row_softmax;
  constexpr bool keyed = S::shape != selection::kind::fixed;
  constexpr bool grouped = S::shape == selection::kind::grouped;
  const int lane = W::lane();
  const int E = p.num_experts;
  const int k = r.top_k;

  // Token-independent per-lane data: the expert bias of the lane's slots.
  float bias[Slots];
#pragma unroll
  for (int j = 0; j < Slots; ++j) {
    const int e = lane + warp_threads * j;
    bias[j] = 0.0f;
    if constexpr (S::needs_expert_bias) {
      if (e < E) bias[j] = W::load(p.expert_bias + e);
    }
  }
  lane_group_slot group_slot{};
  if constexpr (grouped) group_slot = make_lane_group_slot(p.groups, lane);

  std::int64_t nonfinite_rows = 0;
  for (std::int64_t token = first; token < p.num_tokens; token += stride) {
    if (is_padding<W>(p.token_mask, token)) {
      write_padding<W>(p.indices, p.gates, token, k);
      continue;
    }
    const T* z = p.logits + token * E;

    // Load and sanitise the row; note non-finite logits.
    float v[Slots];
    bool bad = false;
#pragma unroll
    for (int j = 0; j < Slots; ++j) {
      const int e = lane + warp_threads * j;
      v[j] = -num::infinity();
      if (e < E) {
        const float raw = num::to_float(W::load(z + e));
        bad |= !num::is_finite(raw);
        v[j] = num::sanitize(raw);
      }
    }
    if (W::any(bad)) ++nonfinite_rows;

    // Row softmax: maximum, terms and their canonical sum.
    float row_max = 0.0f, row_sum = 0.0f;
    float term[Slots];
    if constexpr (row_softmax) {
      float m = -num::float_max;
#pragma unroll
      for (int j = 0; j < Slots; ++j)
        if (lane + warp_threads * j < E) m = num::max(m, v[j]);
      row_max = warp_max<W>(m);
      float partial = 0.0f;
#pragma unroll
      for (int j = 0; j < Slots; ++j) {
        term[j] = 0.0f;
        if (lane + warp_threads * j < E) {
          term[j] = G::term(v[j], row_max);
          partial += term[j];
        }
      }
      row_sum = warp_sum<W>(partial);
    }

    int my_expert = 0;  // lane j < K: the j-th selected expert
    if (p.replay_indices != nullptr) {  // warp-uniform
      my_expert = replayed_expert<W>(p.replay_indices, token, k, E);
    } else if constexpr (!keyed) {
      if (lane < k) my_expert = S::expert(token, lane, k, E);
    } else {
      std::uint64_t key[Slots];
#pragma unroll
      for (int j = 0; j < Slots; ++j) {
        const int e = lane + warp_threads * j;
        key[j] = 0;
        if (e < E) {
          float score = 0.0f;
          if constexpr (S::needs_scores) {
            if constexpr (row_softmax)
              score = softmax_score(term[j], row_sum);
            else
              score = score_of<G>(v[j], row_max, row_sum);
          }
          key[j] = expert_key<S>(v[j], score, bias[j], e);
        }
      }

      if constexpr (grouped) {
        if (p.groups.active) {
          W::sync();  // the previous token's group scoring has read its keys
#pragma unroll
          for (int j = 0; j < Slots; ++j) {
            const int e = lane + warp_threads * j;
            if (e < E) shared_keys[e] = key[j];
          }
          W::sync();
          const std::uint32_t kept = kept_groups<W>(p.groups, group_slot, shared_keys);
#pragma unroll
          for (int j = 0; j < Slots; ++j) {
            const int e = lane + warp_threads * j;
            if (e < E && ((kept >> p.groups.group_of(e)) & 1u) == 0) key[j] = 0;
          }
        }
      }

      // Top-K: round j takes the warp's largest remaining key; every key at or
      // above it has been taken, so the next round looks below it.
      std::uint64_t local = 0;
#pragma unroll
      for (int j = 0; j < Slots; ++j) local = key[j] > local ? key[j] : local;
      for (int round = 0; round < k; ++round) {
        const std::uint64_t best = warp_max_key<W>(local);
        if (lane == round) my_expert = num::packed_expert(best);
        local = 0;
#pragma unroll
        for (int j = 0; j < Slots; ++j)
          if (key[j] < best && key[j] > local) local = key[j];
      }
    }

    write_selection<W>(r, p, token, z, my_expert, row_max, row_sum);
  }
  return nonfinite_rows;
}

template <class W, class Router, class T>
MOE_ROUTE_CUDA_DEVICE std::int64_t route_rows_general(const Router& r, const route_params<T>& p, std::int64_t first,
                                                      std::int64_t stride, std::uint64_t* shared_keys) {
  using G = typename Router::gating_type;
  using S = typename Router::selection_type;
  constexpr bool row_softmax = G::shape == gating::kind::row_softmax;
  constexpr bool keyed = S::shape != selection::kind::fixed;
  constexpr bool grouped = S::shape == selection::kind::grouped;
  const int lane = W::lane();
  const int E = p.num_experts;
  const int k = r.top_k;
  lane_group_slot group_slot{};
  if constexpr (grouped) group_slot = make_lane_group_slot(p.groups, lane);

  std::int64_t nonfinite_rows = 0;
  for (std::int64_t token = first; token < p.num_tokens; token += stride) {
    if (is_padding<W>(p.token_mask, token)) {
      write_padding<W>(p.indices, p.gates, token, k);
      continue;
    }
    const T* z = p.logits + token * E;

    // Pass 1: non-finite logits and the row maximum.
    bool bad = false;
    float m = -num::float_max;
    for (int e = lane; e < E; e += warp_threads) {
      const float raw = num::to_float(W::load(z + e));
      bad |= !num::is_finite(raw);
      if constexpr (row_softmax) m = num::max(m, num::sanitize(raw));
    }
    if (W::any(bad)) ++nonfinite_rows;

    // Pass 2 (row_softmax): the canonical sum of the terms.
    float row_max = 0.0f, row_sum = 0.0f;
    if constexpr (row_softmax) {
      row_max = warp_max<W>(m);
      float partial = 0.0f;
      for (int e = lane; e < E; e += warp_threads)
        partial += G::term(num::sanitize(num::to_float(W::load(z + e))), row_max);
      row_sum = warp_sum<W>(partial);
    }

    int my_expert = 0;
    if (p.replay_indices != nullptr) {  // warp-uniform
      my_expert = replayed_expert<W>(p.replay_indices, token, k, E);
    } else if constexpr (!keyed) {
      if (lane < k) my_expert = S::expert(token, lane, k, E);
    } else {
      // Pass 3: packed keys into shared memory (each lane its own experts).
      W::sync();  // the previous token's group scoring has read its keys
      for (int e = lane; e < E; e += warp_threads) {
        const float v = num::sanitize(num::to_float(W::load(z + e)));
        float score = 0.0f;
        if constexpr (S::needs_scores) score = score_of<G>(v, row_max, row_sum);
        float bias = 0.0f;
        if constexpr (S::needs_expert_bias) bias = W::load(p.expert_bias + e);
        shared_keys[e] = expert_key<S>(v, score, bias, e);
      }
      if constexpr (grouped) {
        if (p.groups.active) {
          W::sync();
          const std::uint32_t kept = kept_groups<W>(p.groups, group_slot, shared_keys);
          W::sync();  // every lane has read the keys before they are masked
          for (int e = lane; e < E; e += warp_threads)
            if (((kept >> p.groups.group_of(e)) & 1u) == 0) shared_keys[e] = 0;
        }
      }

      my_expert = shared_top_k<W>(shared_keys, E, k);
    }

    write_selection<W>(r, p, token, z, my_expert, row_max, row_sum);
  }
  return nonfinite_rows;
}

}  // namespace moe_route::cuda::detail
