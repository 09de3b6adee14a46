// moe_route CUDA backend: per-token pieces shared by the forward and backward
// agents. One warp handles one token; lane l owns experts e = l + 32 j. The
// per-token math replays backend/cpu/detail/rows.hpp (route_row, backward_row,
// mask_groups, row_state) exactly: the same shared HD functions, the same
// reduction order, the same packed keys.
#pragma once

#include <cstdint>

#include <moe_route/backend/cuda/detail/config.cuh>
#include <moe_route/backend/cuda/detail/warp_reduce.cuh>
#include <moe_route/config.hpp>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/gating/gating.hpp>
#include <moe_route/router.hpp>
#include <moe_route/selection/selection.hpp>
#include <moe_route/types.hpp>

namespace moe_route::cuda::detail {

namespace num = moe_route::detail;

// Group-limited selection, precomputed on the host (make_group_layout). Groups are
// scored from the warp's packed keys staged in shared memory: the groups are
// spread over aligned segments of lanes_per_group lanes (32 / the power of two
// >= groups); each segment finds its group's best keys, one round per key.
struct group_layout {
  int groups = 1;           // G <= 32
  int size = 1;             // E / G experts per group
  int top_groups = 1;       // groups kept
  int per_group_k = 1;      // keys summed per group score
  int lanes_per_group = 32;
  int lane_shift = 5;       // log2(lanes_per_group)
  std::uint32_t magic = 0;  // ceil(2^32 / size) for size > 1: e / size = (e * magic) >> 32 for e < 4096
  bool active = false;      // top_groups < groups: some groups are masked out

  MOE_ROUTE_HD int group_of(int expert) const {
    return size == 1 ? expert
                     : static_cast<int>((static_cast<std::uint64_t>(static_cast<std::uint32_t>(expert)) * magic) >> 32);
  }
};

// The group layout of a router for E experts (host; the router is validated:
// groups <= 32 divides E). Routers without group-limited selection get the
// default, inactive layout.
template <class Router>
group_layout make_group_layout(const Router& r, int num_experts) {
  (void)r;
  (void)num_experts;
  group_layout gl;
  if constexpr (Router::selection_type::shape == selection::kind::grouped) {
    const auto& g = r.selection;
    gl.groups = g.groups;
    gl.size = num_experts / g.groups;
    gl.top_groups = g.top_groups;
    gl.per_group_k = g.per_group_k;
    int segments = 1, shift = 5;
    while (segments < g.groups) {
      segments <<= 1;
      --shift;
    }
    gl.lanes_per_group = warp_threads / segments;
    gl.lane_shift = shift;
    gl.magic = gl.size > 1 ? static_cast<std::uint32_t>(((std::uint64_t{1} << 32) + gl.size - 1) / gl.size) : 0u;
    gl.active = g.top_groups < g.groups;
  }
  return gl;
}

template <class T>
struct route_params {
  const T* logits;            // [N x E]
  std::int64_t num_tokens;
  int num_experts;
  const float* expert_bias;   // [E] or null
  std::int32_t* indices;      // [N x K]
  float* gates;               // [N x K]
  group_layout groups;
  const std::uint8_t* token_mask;  // [N] or null: 0 marks a padding token
  const std::int32_t* replay_indices;  // [N x K] or null: route to these experts
};

template <class T>
struct backward_params {
  const T* logits;            // [N x E]
  std::int64_t num_tokens;
  int num_experts;
  const std::int32_t* indices;  // [N x K]
  const float* grad_gates;      // [N x K]
  float* grad_logits;           // [N x E]
  const std::uint8_t* token_mask;  // [N] or null: 0 marks a padding token
};

// Whether `token` is a padding token (docs/policies.md, "Token mask"). Every
// lane reads the same byte, so branches on it are warp-uniform.
template <class W>
MOE_ROUTE_CUDA_DEVICE bool is_padding(const std::uint8_t* token_mask, std::int64_t token) {
  return token_mask != nullptr && W::load(token_mask + token) == 0;
}

// The forward outputs of a padding token: routed nowhere.
template <class W>
MOE_ROUTE_CUDA_DEVICE void write_padding(std::int32_t* indices, float* gates, std::int64_t token, int k) {
  const int lane = W::lane();
  if (lane < k) {
    indices[token * k + lane] = -1;
    gates[token * k + lane] = 0.0f;
  }
}

// Lane j < K's expert under routing replay (docs/policies.md §2.9). Device
// data cannot be validated before the launch: an entry outside [0, E) gives
// -1, which is written as the index and gated as a logit of -inf (the CPU
// backend rejects it).
template <class W>
MOE_ROUTE_CUDA_DEVICE int replayed_expert(const std::int32_t* replay_indices, std::int64_t token, int k, int E) {
  if (W::lane() >= k) return 0;
  const int e = W::load(replay_indices + token * k + W::lane());
  return e >= 0 && e < E ? e : -1;
}

// The gating score of a slot without an expert: the weight of a -inf logit.
template <class G>
MOE_ROUTE_CUDA_DEVICE float absent_score() {
  return G::shape == gating::kind::selected_softmax ? -num::infinity() : 0.0f;
}

// The gradient row of a padding token: +0 for every expert.
template <class W>
MOE_ROUTE_CUDA_DEVICE void zero_row(float* dz, int num_experts) {
  for (int e = W::lane(); e < num_experts; e += warp_threads) dz[e] = 0.0f;
}

// The gating score of an expert from its sanitised logit (row_state::score):
// the row maximum and canonical sum are used by row_softmax only; for
// selected_softmax the "score" is the logit itself.
template <class G>
MOE_ROUTE_CUDA_DEVICE float score_of(float v, float row_max, float row_sum) {
  if constexpr (G::shape == gating::kind::row_softmax)
    return row_sum > 0.0f ? num::div(G::term(v, row_max), row_sum) : 0.0f;
  else if constexpr (G::shape == gating::kind::elementwise)
    return G::score(v);
  else
    return v;
}

// A row_softmax score from its already computed term.
MOE_ROUTE_CUDA_DEVICE float softmax_score(float term, float row_sum) {
  return row_sum > 0.0f ? num::div(term, row_sum) : 0.0f;
}

// The packed selection key of expert e (route_row): a NaN logit (v = -inf)
// ranks below every number.
template <class S>
MOE_ROUTE_CUDA_DEVICE std::uint64_t expert_key(float v, float score, float bias, int expert) {
  float key = -num::infinity();
  if (v != -num::infinity()) key = S::key(v, S::needs_scores ? score : 0.0f, S::needs_expert_bias ? bias : 0.0f);
  return num::pack_key(key, expert);
}

// Per-lane constants of the group scoring (token independent).
struct lane_group_slot {
  int group;  // the group this lane's segment scores (>= groups: idle)
  int index;  // position in the segment
  int base;   // first expert of the group
  int skew;   // start offset within the group, spreads segments over banks
};

MOE_ROUTE_CUDA_DEVICE lane_group_slot make_lane_group_slot(const group_layout& gl, int lane) {
  lane_group_slot s;
  s.group = lane >> gl.lane_shift;
  s.index = lane & (gl.lanes_per_group - 1);
  s.base = s.group * gl.size;
  s.skew = s.group < gl.groups ? (s.group * gl.lanes_per_group) % gl.size : 0;
  return s;
}

// The bit mask of the kept groups (cpu::detail::mask_groups). `keys` holds the
// warp's E packed keys in expert order (shared memory, published by W::sync()).
// A group's score is 0.0f + best + second + ... over its per_group_k best keys
// in descending order; the top_groups best groups by pack_key(score, group) are
// kept. Keys are unique (the expert index is in the low bits), so the r-th best
// key is the largest key below the (r-1)-th.
template <class W>
MOE_ROUTE_CUDA_DEVICE std::uint32_t kept_groups(const group_layout& gl, const lane_group_slot& ls,
                                                const std::uint64_t* keys) {
  const bool scoring = ls.group < gl.groups;
  float score = 0.0f;
  std::uint64_t prev = 0;
  for (int r = 0; r < gl.per_group_k; ++r) {
    std::uint64_t local = 0;
    if (scoring) {
      // The lane's share of the group: positions index, index + L, ... rotated by skew.
      for (int p = ls.index; p < gl.size; p += gl.lanes_per_group) {
        int q = p + ls.skew;
        if (q >= gl.size) q -= gl.size;
        const std::uint64_t key = keys[ls.base + q];
        if ((r == 0 || key < prev) && key > local) local = key;
      }
    }
    const std::uint64_t best = segment_max_key<W>(local, gl.lanes_per_group);
    score += num::packed_value(best);
    prev = best;
  }
  const std::uint64_t group_key = scoring ? num::pack_key(score, ls.group) : 0;
  std::uint32_t kept = 0;
  prev = 0;
  for (int r = 0; r < gl.top_groups; ++r) {
    const std::uint64_t candidate = (r == 0 || group_key < prev) ? group_key : 0;
    const std::uint64_t best = warp_max_key<W>(candidate);
    kept |= 1u << num::packed_expert(best);
    prev = best;
  }
  return kept;
}

// Lane j < K's expert of the K largest packed keys in the warp's shared
// `keys` [E]: round j takes the warp's largest remaining key; every key at or
// above it has been taken, so the next round looks below it. Each lane reads
// only its own experts' keys.
template <class W>
MOE_ROUTE_CUDA_DEVICE int shared_top_k(const std::uint64_t* keys, int E, int k) {
  const int lane = W::lane();
  int mine = 0;
  std::uint64_t local = 0;
  for (int e = lane; e < E; e += warp_threads) local = keys[e] > local ? keys[e] : local;
  for (int round = 0; round < k; ++round) {
    const std::uint64_t best = warp_max_key<W>(local);
    if (lane == round) mine = num::packed_expert(best);
    local = 0;
    for (int e = lane; e < E; e += warp_threads) {
      const std::uint64_t key = keys[e];
      if (key < best && key > local) local = key;
    }
  }
  return mine;
}

// Gate weights and outputs of one token (route_row's epilogue). Lane j < K
// holds the j-th selected expert; it recomputes that expert's score from the
// logit with the same functions that built the keys (identical bits), the
// lanes exchange the K scores, and every lane evaluates detail::gate_weights.
template <class W, class Router, class T>
MOE_ROUTE_CUDA_DEVICE void write_selection(const Router& r, const route_params<T>& p, std::int64_t token,
                                           const T* z, int my_expert, float row_max, float row_sum) {
  using G = typename Router::gating_type;
  const int lane = W::lane();
  const int k = r.top_k;
  float mine = absent_score<G>();
  if (lane < k && my_expert >= 0)
    mine = score_of<G>(num::sanitize(num::to_float(W::load(z + my_expert))), row_max, row_sum);
  float selected[Router::max_k];
  float w[Router::max_k];
  for (int j = 0; j < k; ++j) selected[j] = W::shfl(mine, j);
  num::gate_weights(r, selected, w, k);
  if (lane < k) {
    const std::int64_t o = token * k + lane;
    p.indices[o] = my_expert;
    p.gates[o] = w[lane];
  }
}

}  // namespace moe_route::cuda::detail
