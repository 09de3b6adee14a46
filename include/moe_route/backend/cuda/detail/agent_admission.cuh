// moe_route CUDA backend: the steps of cuda::admit (the sequence:
// admission_launch.cuh; the pipeline: backend/cuda/admit.cuh). Token steps are
// warp agents over the warp type W (one warp per token; run<W>(t, scratch)),
// item steps are per-thread functors (operator()(i)); both replay
// backend/cpu/detail/admission.hpp bit for bit.
//
// A padding token (token_mask byte 0) reads no input: its slots are dropped
// outside every segment, get index -1 and gate 0, and are in no report field;
// the group sizes leave it out (count_groups).
#pragma once

#include <cstdint>

#include <moe_route/admission/admission.hpp>
#include <moe_route/admission/gates.hpp>
#include <moe_route/admission/scores.hpp>
#include <moe_route/backend/cuda/detail/admission_common.cuh>
#include <moe_route/backend/cuda/detail/config.cuh>
#include <moe_route/backend/cuda/detail/warp_reduce.cuh>
#include <moe_route/config.hpp>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/types.hpp>

namespace moe_route::cuda::admission_detail {

namespace adm = moe_route::admission;
using adm::detail::state_below_threshold;
using adm::detail::state_dropped;
using adm::detail::state_invalid;
using adm::detail::state_kept;
using adm::detail::state_over_capacity;
using adm::detail::state_pending;
using adm::detail::state_rerouted;
using adm::detail::state_status_mask;

template <class S>
struct admit_params {
  const S* logits;                 // [N x E]
  std::int64_t num_tokens;
  int num_experts;
  int top_k;
  const std::int32_t* routed;      // [N x K]
  const float* routed_gates;       // [N x K]
  const float* hidden_norms;       // [N] or null
  const float* weight_norms;       // [E] or null
  const std::int32_t* group_ids;   // [N] or null
  int num_groups;
  const std::int64_t* capacity;    // [E] or null
  const std::uint8_t* token_mask;  // [N] or null: 0 marks a padding token
  double capacity_factor;
  std::int64_t min_capacity;
  double fill_factor;
  float threshold;
  std::uint32_t sentinel;          // num_groups * E: the segment of items that take no part
  // workspace
  std::int64_t* group_tokens;      // [G]
  std::int64_t* cap;               // [G * E] C_e of each (group, expert)
  std::int64_t* limit;             // [G * E] min(F_g, C_e), the reroute limit
  std::int64_t* load;              // [G * E]
  std::uint8_t* state;             // [N x K]
  std::int32_t* target;            // [N x K] the expert a slot holds or proposes

  MOE_ROUTE_CUDA_DEVICE int group_of(std::int64_t t) const { return group_ids != nullptr ? group_ids[t] : 0; }
  MOE_ROUTE_CUDA_DEVICE std::uint32_t segment(int g, int e) const {
    return static_cast<std::uint32_t>(g) * static_cast<std::uint32_t>(num_experts) + static_cast<std::uint32_t>(e);
  }
};

// The buffers a ranking round fills: key, item id and segment by slot.
struct ranking_items {
  std::uint64_t* keys;
  std::uint32_t* items;
  std::uint32_t* segs;
};

// Whether the affinity of policy P under gating G needs the row's softmax statistics.
template <class Policy, class G>
inline constexpr bool affinity_needs_row =
    Policy::affinity_type::kind == adm::affinity_kind::probability && adm::probability_needs_row<G>;

// C_e and the reroute limit min(F_g, C_e) of every (group, expert), once per call.
template <class S>
struct limits_step {
  admit_params<S> p;
  MOE_ROUTE_CUDA_DEVICE void operator()(std::int64_t seg) const {
    const int g = static_cast<int>(seg / p.num_experts);
    const int e = static_cast<int>(seg - static_cast<std::int64_t>(g) * p.num_experts);
    const std::int64_t tokens = p.group_tokens[g];
    std::int64_t c;
    if (p.capacity != nullptr) {
      c = p.capacity[e];
      c = c > 0 ? c : 0;
    } else {
      c = adm::capacity_from_factor(p.capacity_factor, p.min_capacity, tokens, p.top_k, p.num_experts);
    }
    const std::int64_t f = adm::capacity_from_factor(p.fill_factor, 0, tokens, p.top_k, p.num_experts);
    p.cap[seg] = c;
    p.limit[seg] = f < c ? f : c;
  }
};

// 1. Affinity, threshold and ranking item of every routed slot (lane j: slot j).
template <class G, class Policy, class S>
struct strict_items_agent {
  admit_params<S> p;
  ranking_items out;
  template <class W>
  MOE_ROUTE_CUDA_DEVICE void run(std::int64_t t, std::uint32_t*) const {
    using A = typename Policy::affinity_type;
    const int lane = W::lane();
    const int k = p.top_k, e_count = p.num_experts;
    const std::uint8_t rejected = Policy::reroutes ? state_pending : state_dropped;
    const std::int64_t s = t * k + lane;
    if (moe_route::detail::token_masked(p.token_mask, t)) {  // warp-uniform
      if (lane < k) {
        p.state[s] = state_dropped;
        p.target[s] = -1;
        out.keys[s] = 0;
        out.items[s] = static_cast<std::uint32_t>(s);
        out.segs[s] = p.sentinel;
      }
      return;
    }
    const S* z = p.logits + t * e_count;
    adm::row_stats st;
    if constexpr (affinity_needs_row<Policy, G>) st = warp_row_stats<W>(z, e_count);
    if (lane >= k) return;
    const int g = p.group_of(t);
    const int e = p.routed[s];
    bool invalid = g < 0 || g >= p.num_groups || e < 0 || e >= e_count;
    float xn = 1.0f, wn = 1.0f;
    if constexpr (A::needs_norms) {
      if (!invalid) {
        xn = p.hidden_norms[t];
        wn = p.weight_norms[e];
        invalid = !adm::valid_norm(xn) || !adm::valid_norm(wn);
      }
    }
    std::uint8_t state = state_kept;
    std::uint64_t key = 0;
    std::uint32_t seg = p.sentinel;
    if (invalid) {
      state = static_cast<std::uint8_t>(state_dropped | state_invalid);
    } else {
      const float a = adm::slot_affinity<A, G>(num::sanitize(num::to_float(z[e])), st, xn, wn, p.routed_gates[s]);
      if (a < p.threshold) {
        state = static_cast<std::uint8_t>(rejected | state_below_threshold);
      } else {
        key = adm::rank_key(a, t);
        seg = p.segment(g, e);
      }
    }
    p.state[s] = state;
    p.target[s] = e;
    out.keys[s] = key;
    out.items[s] = static_cast<std::uint32_t>(s);
    out.segs[s] = seg;
  }
};

// 2. The strict cut over the ranked slots: rank >= C_e is rejected; loads = min(C_e, |pool|).
template <class Policy, class S>
struct strict_decide_step {
  admit_params<S> p;
  ranked r;
  MOE_ROUTE_CUDA_DEVICE void operator()(std::int64_t i) const {
    const std::uint8_t rejected = Policy::reroutes ? state_pending : state_dropped;
    const std::uint32_t s = r.seg[i];
    if (s == p.sentinel) return;
    const std::int64_t rank = r.rank(i);
    const std::int64_t cap = p.cap[s];
    if (rank >= cap) p.state[r.items[i]] = static_cast<std::uint8_t>(rejected | state_over_capacity);
    if (r.ends_segment(i)) p.load[s] = rank + 1 < cap ? rank + 1 : cap;
  }
};

// 3a. Reroute proposals, against the loads at the start of the round. The
// pending slots of a token propose in slot order, each its best expert with
// room and affinity >= tau that the token neither holds nor has proposed.
// scratch: one bit per expert (held or proposed).
template <class G, class Policy, class S>
struct propose_agent {
  admit_params<S> p;
  ranking_items out;

  MOE_ROUTE_HD static int words(int num_experts) { return (num_experts + 31) / 32; }

  template <class W>
  MOE_ROUTE_CUDA_DEVICE void run(std::int64_t t, std::uint32_t* taken) const {
    using A = typename Policy::affinity_type;
    const int lane = W::lane();
    const int k = p.top_k, e_count = p.num_experts;
    const int word_count = words(e_count);
    const std::int64_t s = t * k + lane;
    std::uint8_t status = state_dropped;
    if (lane < k) status = p.state[s] & state_status_mask;
    const std::uint32_t pending = W::ballot(lane < k && status == state_pending);
    std::int32_t proposal = -1;
    std::uint64_t proposal_key = 0;
    int g = 0;
    if (pending != 0) {  // warp-uniform; a padding token has no pending slot
      g = p.group_of(t);
      const S* z = p.logits + t * e_count;
      adm::row_stats st;
      if constexpr (affinity_needs_row<Policy, G>) st = warp_row_stats<W>(z, e_count);
      const float xn = A::needs_norms ? p.hidden_norms[t] : 1.0f;
      for (int w = lane; w < word_count; w += warp_threads) taken[w] = 0u;
      W::sync();
      if (lane == 0) {
        for (int j = 0; j < k; ++j) {
          const std::uint8_t held = p.state[t * k + j] & state_status_mask;
          if (held == state_kept || held == state_rerouted) {
            const int e = p.target[t * k + j];
            taken[e >> 5] |= 1u << (e & 31);
          }
        }
      }
      W::sync();
      for (int j = 0; j < k; ++j) {
        if (!((pending >> j) & 1u)) continue;  // warp-uniform
        std::uint64_t best = 0;
        for (int e = lane; e < e_count; e += warp_threads) {
          if ((taken[e >> 5] >> (e & 31)) & 1u) continue;
          const std::int64_t seg = static_cast<std::int64_t>(g) * e_count + e;
          if (p.load[seg] >= p.limit[seg]) continue;
          const float wn = A::needs_norms ? p.weight_norms[e] : 1.0f;
          if (A::needs_norms && !adm::valid_norm(wn)) continue;  // invalid input (the CPU backend throws)
          const float a = adm::affinity_value<A, G>(num::sanitize(num::to_float(z[e])), st, xn, wn);
          if (a < p.threshold) continue;
          const std::uint64_t candidate = num::pack_key(a, e);
          best = candidate > best ? candidate : best;
        }
        best = detail::warp_max_key<W>(best);
        if (best != 0) {
          const int e = num::packed_expert(best);
          if (lane == j) {
            proposal = e;
            proposal_key = adm::rank_key(num::packed_value(best), t);
          }
          if (lane == 0) taken[e >> 5] |= 1u << (e & 31);
        }
        W::sync();
      }
    }
    if (lane >= k) return;
    out.items[s] = static_cast<std::uint32_t>(s);
    if (proposal >= 0) {
      out.keys[s] = proposal_key;
      out.segs[s] = p.segment(g, proposal);
      p.target[s] = proposal;  // a pending slot's target is its proposal
    } else {
      out.keys[s] = 0;
      out.segs[s] = p.sentinel;
    }
  }
};

// 3b. Acceptance over the ranked proposals: rank < room (room from the loads
// at the start of the round).
template <class S>
struct accept_step {
  admit_params<S> p;
  ranked r;
  MOE_ROUTE_CUDA_DEVICE void operator()(std::int64_t i) const {
    const std::uint32_t s = r.seg[i];
    if (s == p.sentinel) return;
    if (r.rank(i) < p.limit[s] - p.load[s]) {
      const std::uint32_t slot = r.items[i];
      p.state[slot] = static_cast<std::uint8_t>((p.state[slot] & ~state_status_mask) | state_rerouted);
    }
  }
};

// 3c. Loads after the round (one thread per segment end; after accept_step).
template <class S>
struct update_loads_step {
  admit_params<S> p;
  ranked r;
  MOE_ROUTE_CUDA_DEVICE void operator()(std::int64_t i) const {
    const std::uint32_t s = r.seg[i];
    if (s == p.sentinel || !r.ends_segment(i)) return;
    std::int64_t room = p.limit[s] - p.load[s];
    room = room > 0 ? room : 0;
    const std::int64_t size = r.rank(i) + 1;
    p.load[s] += size < room ? size : room;
  }
};

// 4. Outputs: pending slots become dropped; lane 0 applies the gate rule of
// admission/gates.hpp.
template <class Router, class S>
struct outputs_agent {
  Router r;
  admit_params<S> p;
  bool renormalize;
  std::int32_t* out_indices;
  float* out_gates;
  std::int8_t* out_status;

  template <class W>
  MOE_ROUTE_CUDA_DEVICE void run(std::int64_t t, std::uint32_t*) const {
    using G = typename Router::gating_type;
    const int lane = W::lane();
    const int k = p.top_k, e_count = p.num_experts;
    const std::int64_t s = t * k + lane;
    if (moe_route::detail::token_masked(p.token_mask, t)) {  // warp-uniform; its routed slots are not read
      if (lane < k) {
        out_indices[s] = -1;
        out_gates[s] = 0.0f;
        if (out_status != nullptr) out_status[s] = static_cast<std::int8_t>(adm::slot_status::dropped);
      }
      return;
    }
    std::uint8_t status = state_dropped;
    if (lane < k) {
      std::uint8_t state = p.state[s];
      if ((state & state_status_mask) == state_pending) {
        state = static_cast<std::uint8_t>((state & ~state_status_mask) | state_dropped);
        p.state[s] = state;
      }
      status = state & state_status_mask;
      out_indices[s] = status == state_dropped ? -1 : p.target[s];
      if (out_status != nullptr)
        out_status[s] = static_cast<std::int8_t>(status == state_kept       ? adm::slot_status::kept
                                                 : status == state_rerouted ? adm::slot_status::rerouted
                                                                            : adm::slot_status::dropped);
    }
    const bool any_rerouted = W::ballot(lane < k && status == state_rerouted) != 0;
    const S* z = p.logits + t * e_count;
    adm::row_stats st;
    if constexpr (adm::gate_input_needs_row<G>) {
      if (any_rerouted) st = warp_row_stats<W>(z, e_count);  // warp-uniform branch
    }
    W::sync();  // out_indices of this token are visible to lane 0
    if (lane != 0) return;
    std::int32_t routed[max_top_k], admitted[max_top_k];
    float sigma[max_top_k], phi[max_top_k], g[max_top_k];
    for (int j = 0; j < k; ++j) {
      routed[j] = p.routed[t * k + j];
      admitted[j] = out_indices[t * k + j];
      sigma[j] = 0.0f;
      phi[j] = 0.0f;
    }
    if (any_rerouted) {
      for (int j = 0; j < k; ++j) {
        if (routed[j] >= 0 && routed[j] < e_count)  // out of range only for invalid input
          sigma[j] = adm::gate_input<G>(num::sanitize(num::to_float(z[routed[j]])), st);
        if (admitted[j] >= 0) phi[j] = adm::gate_input<G>(num::sanitize(num::to_float(z[admitted[j]])), st);
      }
    }
    adm::admitted_gate_weights(r, p.routed_gates + t * k, sigma, phi, routed, admitted, renormalize, g, k);
    for (int j = 0; j < k; ++j) out_gates[t * k + j] = g[j];
  }
};

// 5. The report: integer sums by warps of 32 tokens (lane l: token 32 w + l),
// one atomic add per warp and field: the totals do not depend on the order.
// Padding tokens are in no field. The report must be zeroed first.
struct report_agent {
  const std::uint8_t* state;
  const std::uint8_t* token_mask;
  std::int64_t num_tokens;
  int k;
  admission_report* report;

  template <class W>
  MOE_ROUTE_CUDA_DEVICE void run(std::int64_t w, std::uint32_t*) const {
    std::uint64_t offered = 0, kept = 0, rerouted = 0, dropped = 0, below = 0, over = 0, invalid = 0, none = 0;
    const std::int64_t t = w * warp_threads + W::lane();
    if (t < num_tokens && !moe_route::detail::token_masked(token_mask, t)) {
      offered = static_cast<std::uint64_t>(k);
      int alive = 0;
      for (int j = 0; j < k; ++j) {
        const std::uint8_t s = state[t * k + j];
        const std::uint8_t status = s & state_status_mask;
        kept += status == state_kept;
        rerouted += status == state_rerouted;
        dropped += status == state_dropped;
        below += (s & state_below_threshold) != 0;
        over += (s & state_over_capacity) != 0;
        invalid += (s & state_invalid) != 0;
        alive += status != state_dropped;
      }
      none += alive == 0;
    }
    offered = detail::warp_sum_count<W>(offered);
    kept = detail::warp_sum_count<W>(kept);
    rerouted = detail::warp_sum_count<W>(rerouted);
    dropped = detail::warp_sum_count<W>(dropped);
    below = detail::warp_sum_count<W>(below);
    over = detail::warp_sum_count<W>(over);
    invalid = detail::warp_sum_count<W>(invalid);
    none = detail::warp_sum_count<W>(none);
    if (W::lane() != 0) return;
    const auto add = [](std::int64_t* field, std::uint64_t v) {
      if (v != 0) W::atomic_add(field, static_cast<std::int64_t>(v));
    };
    add(&report->offered, offered);
    add(&report->kept, kept);
    add(&report->rerouted, rerouted);
    add(&report->dropped, dropped);
    add(&report->below_threshold, below);
    add(&report->over_capacity, over);
    add(&report->invalid, invalid);
    add(&report->tokens_without_experts, none);
  }
};

// Dropless policies: the routed slots of valid tokens pass through unchanged;
// a padding token's slots are dropped (-1, gate 0), unread.
struct copy_through_step {
  const std::int32_t* indices;
  const float* gates;
  const std::uint8_t* token_mask;
  int k;
  std::int32_t* out_indices;
  float* out_gates;
  std::int8_t* out_status;
  MOE_ROUTE_CUDA_DEVICE void operator()(std::int64_t s) const {
    const bool padding = moe_route::detail::token_masked(token_mask, s / k);
    out_indices[s] = padding ? -1 : indices[s];
    out_gates[s] = padding ? 0.0f : gates[s];
    if (out_status != nullptr)
      out_status[s] = static_cast<std::int8_t>(padding ? adm::slot_status::dropped : adm::slot_status::kept);
  }
};

// The report of a dropless policy: every slot of a valid token is offered and
// kept (warps of 32 tokens, as report_agent). The report must be zeroed first.
struct dropless_report_agent {
  const std::uint8_t* token_mask;
  std::int64_t num_tokens;
  int k;
  admission_report* report;

  template <class W>
  MOE_ROUTE_CUDA_DEVICE void run(std::int64_t w, std::uint32_t*) const {
    const std::int64_t t = w * warp_threads + W::lane();
    const bool valid = t < num_tokens && !moe_route::detail::token_masked(token_mask, t);
    const std::uint64_t slots = detail::warp_sum_count<W>(valid ? static_cast<std::uint64_t>(k) : 0u);
    if (W::lane() != 0 || slots == 0) return;
    W::atomic_add(&report->offered, static_cast<std::int64_t>(slots));
    W::atomic_add(&report->kept, static_cast<std::int64_t>(slots));
  }
};

}  // namespace moe_route::cuda::admission_detail
