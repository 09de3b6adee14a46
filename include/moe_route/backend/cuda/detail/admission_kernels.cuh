// moe_route CUDA backend: the kernels and launch sequence of cuda::admit
// (backend/cuda/admit.cuh: the pipeline is described there).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include <moe_route/admission/admission.hpp>
#include <moe_route/admission/detail/validate.hpp>
#include <moe_route/admission/gates.hpp>
#include <moe_route/admission/scores.hpp>
#include <moe_route/backend/cuda/detail/admission_common.cuh>
#include <moe_route/backend/cuda/detail/error.cuh>
#include <moe_route/backend/cuda/detail/storage.cuh>
#include <moe_route/config.hpp>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/router.hpp>
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
  double capacity_factor;
  std::int64_t min_capacity;
  double fill_factor;
  float threshold;
  std::uint32_t sentinel;          // num_groups * E: the segment of items that take no part
  // workspace
  unsigned long long* group_tokens;  // [G]
  std::int64_t* cap;                 // [G * E] C_e of each (group, expert)
  std::int64_t* limit;               // [G * E] min(F_g, C_e), the reroute limit
  std::int64_t* load;                // [G * E]
  std::uint8_t* state;               // [N x K]
  std::int32_t* target;              // [N x K] the expert a slot holds or proposes
};

__device__ __forceinline__ int group_of(const std::int32_t* group_ids, std::int64_t t) {
  return group_ids != nullptr ? group_ids[t] : 0;
}

// C_e and the reroute limit min(F_g, C_e) of every (group, expert), once per call.
template <class S>
MOE_ROUTE_KERNEL void limits_kernel(admit_params<S> p) {
  const std::int64_t segments = static_cast<std::int64_t>(p.num_groups) * p.num_experts;
  for (std::int64_t seg = global_thread(); seg < segments; seg += thread_count()) {
    const int g = static_cast<int>(seg / p.num_experts);
    const int e = static_cast<int>(seg - static_cast<std::int64_t>(g) * p.num_experts);
    const std::int64_t tokens = static_cast<std::int64_t>(p.group_tokens[g]);
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
}

// 1. Affinity, threshold and ranking items of every routed slot (warp per token).
template <class Router, class Policy, class S>
MOE_ROUTE_KERNEL void __launch_bounds__(block_threads)
    strict_items_kernel(admit_params<S> p, std::uint64_t* __restrict__ keys, std::uint32_t* __restrict__ items,
                        std::uint32_t* __restrict__ segs) {
  using A = typename Policy::affinity_type;
  using G = typename Router::gating_type;
  constexpr bool row = A::kind == adm::affinity_kind::probability && adm::probability_needs_row<G>;
  const int lane = lane_id();
  const int k = p.top_k, e_count = p.num_experts;
  const std::uint8_t rejected = Policy::reroutes ? state_pending : state_dropped;
  for (std::int64_t t = global_warp(); t < p.num_tokens; t += warp_count()) {
    const S* z = p.logits + t * e_count;
    adm::row_stats st;
    if constexpr (row) st = warp_row_stats(z, e_count);
    if (lane < k) {
      const std::int64_t s = t * k + lane;
      const int g = group_of(p.group_ids, t);
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
        const float v = num::sanitize(num::to_float(z[e]));
        const float a = adm::affinity_value<A, G>(v, st, xn, wn);
        if (a < p.threshold) {
          state = static_cast<std::uint8_t>(rejected | state_below_threshold);
        } else {
          key = adm::rank_key(a, t);
          seg = static_cast<std::uint32_t>(g) * static_cast<std::uint32_t>(e_count) + static_cast<std::uint32_t>(e);
        }
      }
      p.state[s] = state;
      p.target[s] = e;
      keys[s] = key;
      items[s] = static_cast<std::uint32_t>(s);
      segs[s] = seg;
    }
  }
}

// 2. The strict cut: rank >= C_e is rejected; loads = min(C_e, |pool|).
template <class Policy, class S>
MOE_ROUTE_KERNEL void strict_decide_kernel(admit_params<S> p, const std::uint32_t* __restrict__ seg,
                                           const std::uint32_t* __restrict__ items,
                                           const std::uint32_t* __restrict__ begin, int n) {
  const std::uint8_t rejected = Policy::reroutes ? state_pending : state_dropped;
  for (std::int64_t i = global_thread(); i < n; i += thread_count()) {
    const std::uint32_t s = seg[i];
    if (s == p.sentinel) continue;
    const std::int64_t rank = i - static_cast<std::int64_t>(begin[s]);
    const std::int64_t cap = p.cap[s];
    if (rank >= cap) p.state[items[i]] = static_cast<std::uint8_t>(rejected | state_over_capacity);
    if (i + 1 == n || seg[i + 1] != s) p.load[s] = rank + 1 < cap ? rank + 1 : cap;
  }
}

// 3a. Reroute proposals (warp per token), against the loads at the start of
// the round. shared: one bit per expert per warp (experts held or proposed).
template <class Router, class Policy, class S>
MOE_ROUTE_KERNEL void __launch_bounds__(block_threads)
    propose_kernel(admit_params<S> p, std::uint64_t* __restrict__ keys, std::uint32_t* __restrict__ items,
                   std::uint32_t* __restrict__ segs) {
  using A = typename Policy::affinity_type;
  using G = typename Router::gating_type;
  constexpr bool row = A::kind == adm::affinity_kind::probability && adm::probability_needs_row<G>;
  extern __shared__ std::uint32_t taken_all[];
  const int lane = lane_id();
  const int k = p.top_k, e_count = p.num_experts;
  const int words = (e_count + 31) / 32;
  std::uint32_t* taken = taken_all + static_cast<std::size_t>(threadIdx.x >> 5) * words;
  for (std::int64_t t = global_warp(); t < p.num_tokens; t += warp_count()) {
    const std::int64_t s = t * k + lane;
    std::uint8_t status = state_dropped;
    std::int32_t held = -1;
    if (lane < k) {
      status = p.state[s] & state_status_mask;
      held = p.target[s];
    }
    const unsigned pending = __ballot_sync(0xffffffffu, lane < k && status == state_pending);
    std::int32_t proposal = -1;
    std::uint64_t proposal_key = 0;
    if (pending != 0) {
      const int g = group_of(p.group_ids, t);
      const S* z = p.logits + t * e_count;
      adm::row_stats st;
      if constexpr (row) st = warp_row_stats(z, e_count);
      const float xn = A::needs_norms ? p.hidden_norms[t] : 1.0f;
      for (int w = lane; w < words; w += 32) taken[w] = 0u;
      __syncwarp();
      if (lane < k && (status == state_kept || status == state_rerouted))
        atomicOr(taken + (held >> 5), 1u << (held & 31));
      __syncwarp();
      for (int j = 0; j < k; ++j) {
        if (!((pending >> j) & 1u)) continue;  // warp-uniform
        std::uint64_t best = 0;
        for (int e = lane; e < e_count; e += 32) {
          if ((taken[e >> 5] >> (e & 31)) & 1u) continue;
          const std::int64_t seg = static_cast<std::int64_t>(g) * e_count + e;
          if (p.load[seg] >= p.limit[seg]) continue;
          const float wn = A::needs_norms ? p.weight_norms[e] : 1.0f;
          if (A::needs_norms && !adm::valid_norm(wn)) continue;  // invalid input (the CPU backend throws)
          const float v = num::sanitize(num::to_float(z[e]));
          const float a = adm::affinity_value<A, G>(v, st, xn, wn);
          if (a < p.threshold) continue;
          const std::uint64_t candidate = num::pack_key(a, e);
          best = candidate > best ? candidate : best;
        }
        best = warp_max_u64(best);
        if (best != 0) {
          const int e = num::packed_expert(best);
          if (lane == j) {
            proposal = e;
            proposal_key = adm::rank_key(num::packed_value(best), t);
          }
          if (lane == 0) taken[e >> 5] |= 1u << (e & 31);
        }
        __syncwarp();
      }
      if (lane < k && proposal >= 0) {
        keys[s] = proposal_key;
        segs[s] = static_cast<std::uint32_t>(g) * static_cast<std::uint32_t>(e_count) + static_cast<std::uint32_t>(proposal);
        p.target[s] = proposal;  // a pending slot's target is its proposal
      }
    }
    if (lane < k) {
      items[s] = static_cast<std::uint32_t>(s);
      if (proposal < 0) {
        keys[s] = 0;
        segs[s] = p.sentinel;
      }
    }
  }
}

// 3b. Acceptance: rank < room (room from the loads at the start of the round).
template <class S>
MOE_ROUTE_KERNEL void accept_kernel(admit_params<S> p, const std::uint32_t* __restrict__ seg,
                                    const std::uint32_t* __restrict__ items, const std::uint32_t* __restrict__ begin,
                                    int n) {
  for (std::int64_t i = global_thread(); i < n; i += thread_count()) {
    const std::uint32_t s = seg[i];
    if (s == p.sentinel) continue;
    const std::int64_t rank = i - static_cast<std::int64_t>(begin[s]);
    const std::int64_t room = p.limit[s] - p.load[s];
    if (rank < room) {
      const std::uint32_t slot = items[i];
      p.state[slot] = static_cast<std::uint8_t>((p.state[slot] & ~state_status_mask) | state_rerouted);
    }
  }
}

// 3c. Loads after the round (one thread per segment end; after accept_kernel).
template <class S>
MOE_ROUTE_KERNEL void update_loads_kernel(admit_params<S> p, const std::uint32_t* __restrict__ seg,
                                          const std::uint32_t* __restrict__ begin, int n) {
  for (std::int64_t i = global_thread(); i < n; i += thread_count()) {
    const std::uint32_t s = seg[i];
    if (s == p.sentinel || !(i + 1 == n || seg[i + 1] != s)) continue;
    std::int64_t room = p.limit[s] - p.load[s];
    room = room > 0 ? room : 0;
    const std::int64_t size = i + 1 - static_cast<std::int64_t>(begin[s]);
    p.load[s] += size < room ? size : room;
  }
}

// 4. Outputs (warp per token): pending slots become dropped; lane 0 applies
// the gate rule of admission/gates.hpp.
template <class Router, class S>
MOE_ROUTE_KERNEL void __launch_bounds__(block_threads)
    outputs_kernel(Router r, admit_params<S> p, bool renormalize, std::int32_t* __restrict__ out_indices,
                   float* __restrict__ out_gates, std::int8_t* __restrict__ out_status) {
  using G = typename Router::gating_type;
  const int lane = lane_id();
  const int k = p.top_k, e_count = p.num_experts;
  for (std::int64_t t = global_warp(); t < p.num_tokens; t += warp_count()) {
    const std::int64_t s = t * k + lane;
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
    const bool any_rerouted = __ballot_sync(0xffffffffu, lane < k && status == state_rerouted) != 0;
    const S* z = p.logits + t * e_count;
    adm::row_stats st;
    if constexpr (adm::gate_input_needs_row<G>) {
      if (any_rerouted) st = warp_row_stats(z, e_count);  // warp-uniform branch
    }
    __syncwarp();  // out_indices of this token are visible to lane 0
    if (lane == 0) {
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
  }
}

// 5. The report: integer sums (thread per token, warp reduction, one atomic
// add per warp and field: the totals do not depend on the order).
MOE_ROUTE_KERNEL void report_kernel(const std::uint8_t* __restrict__ state, std::int64_t num_tokens, int k,
                                    admission_report* __restrict__ report) {
  unsigned long long kept = 0, rerouted = 0, dropped = 0, below = 0, over = 0, invalid = 0, none = 0;
  const std::int64_t start = global_warp() * 32;
  for (std::int64_t base = start; base < num_tokens; base += warp_count() * 32) {
    const std::int64_t t = base + lane_id();
    if (t < num_tokens) {
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
  }
  kept = warp_sum_u64(kept);
  rerouted = warp_sum_u64(rerouted);
  dropped = warp_sum_u64(dropped);
  below = warp_sum_u64(below);
  over = warp_sum_u64(over);
  invalid = warp_sum_u64(invalid);
  none = warp_sum_u64(none);
  if (lane_id() == 0) {
    auto add = [](std::int64_t* field, unsigned long long v) {
      if (v != 0) atomicAdd(reinterpret_cast<unsigned long long*>(field), v);
    };
    add(&report->kept, kept);
    add(&report->rerouted, rerouted);
    add(&report->dropped, dropped);
    add(&report->below_threshold, below);
    add(&report->over_capacity, over);
    add(&report->invalid, invalid);
    add(&report->tokens_without_experts, none);
    if (global_thread() == 0) add(&report->offered, static_cast<unsigned long long>(num_tokens) * k);
  }
}

MOE_ROUTE_KERNEL void copy_through_kernel(const std::int32_t* __restrict__ indices, const float* __restrict__ gates,
                                          std::int64_t slots, std::int32_t* __restrict__ out_indices,
                                          float* __restrict__ out_gates, std::int8_t* __restrict__ out_status,
                                          admission_report* __restrict__ report) {
  for (std::int64_t s = global_thread(); s < slots; s += thread_count()) {
    out_indices[s] = indices[s];
    out_gates[s] = gates[s];
    if (out_status != nullptr) out_status[s] = static_cast<std::int8_t>(adm::slot_status::kept);
  }
  if (report != nullptr && global_thread() == 0) {
    admission_report r;
    r.offered = slots;
    r.kept = slots;
    *report = r;
  }
}

// The workspace layout (also the size query: a null base only measures).
struct admit_layout {
  unsigned long long* group_tokens = nullptr;
  std::int64_t* cap = nullptr;
  std::int64_t* limit = nullptr;
  std::int64_t* load = nullptr;
  std::uint8_t* state = nullptr;
  std::int32_t* target = nullptr;
  ranking rank;
  std::size_t bytes = 0;
};

inline admit_layout make_admit_layout(void* base, std::int64_t num_tokens, int top_k, int num_experts, int num_groups) {
  carver c(base);
  admit_layout l;
  const std::int64_t slots = num_tokens * top_k;
  const std::uint32_t segments = static_cast<std::uint32_t>(num_groups) * static_cast<std::uint32_t>(num_experts);
  l.group_tokens = c.take<unsigned long long>(static_cast<std::size_t>(num_groups));
  l.cap = c.take<std::int64_t>(segments);
  l.limit = c.take<std::int64_t>(segments);
  l.load = c.take<std::int64_t>(segments);
  l.state = c.take<std::uint8_t>(static_cast<std::size_t>(slots));
  l.target = c.take<std::int32_t>(static_cast<std::size_t>(slots));
  l.rank.carve(c, static_cast<int>(slots), segments);
  l.bytes = c.bytes();
  return l;
}

template <class Router, class Policy, class T>
void launch_admit(const Router& r, const Policy& p, const admission_inputs<T>& in, const admission_outputs& out,
                  void* workspace, std::size_t workspace_bytes, std::size_t needed, cudaStream_t stream) {
  using S = detail::storage_t<T>;
  const std::int64_t n_tokens = in.num_tokens;
  const int k = r.top_k;
  const std::int64_t slots = n_tokens * k;
  if constexpr (Policy::is_dropless) {
    if (slots == 0 && out.report == nullptr) return;
    copy_through_kernel<<<grid_for(slots, block_threads), block_threads, 0, stream>>>(
        in.routed_indices, in.routed_gates, slots, out.indices, out.gates, out.status, out.report);
    check_launch("moe_route::cuda::admit: launch of copy_through_kernel");
    return;
  } else {
    if (n_tokens == 0) {
      if (out.report != nullptr)
        check_launch(cudaMemsetAsync(out.report, 0, sizeof(admission_report), stream), "cudaMemsetAsync (report)");
      return;
    }
    check_workspace(workspace, workspace_bytes, needed, "cuda::admit");
    admit_layout l = make_admit_layout(align_workspace(workspace), n_tokens, k, in.num_experts, in.num_groups);
    const std::uint32_t segments = static_cast<std::uint32_t>(in.num_groups) * static_cast<std::uint32_t>(in.num_experts);

    admit_params<S> prm{};
    prm.logits = detail::storage_pointer(in.logits);
    prm.num_tokens = n_tokens;
    prm.num_experts = in.num_experts;
    prm.top_k = k;
    prm.routed = in.routed_indices;
    prm.routed_gates = in.routed_gates;
    prm.hidden_norms = in.hidden_norms;
    prm.weight_norms = in.weight_norms;
    prm.group_ids = in.group_ids;
    prm.num_groups = in.num_groups;
    prm.capacity = in.capacity;
    prm.capacity_factor = p.capacity_factor;
    prm.min_capacity = p.min_capacity;
    if constexpr (Policy::reroutes) prm.fill_factor = p.overflow.fill_factor;
    else prm.fill_factor = 0.0;
    prm.threshold = p.threshold;
    prm.sentinel = segments;
    prm.group_tokens = l.group_tokens;
    prm.cap = l.cap;
    prm.limit = l.limit;
    prm.load = l.load;
    prm.state = l.state;
    prm.target = l.target;

    const unsigned token_blocks = grid_for(n_tokens, warps_per_block);
    // Group sizes.
    if (in.group_ids != nullptr) {
      check_launch(cudaMemsetAsync(l.group_tokens, 0, sizeof(unsigned long long) * in.num_groups, stream),
                "cudaMemsetAsync (group sizes)");
      count_groups_kernel<<<grid_for(n_tokens, block_threads), block_threads, 0, stream>>>(
          in.group_ids, n_tokens, in.num_groups, l.group_tokens);
      check_launch("moe_route::cuda::admit: launch of count_groups_kernel");
    } else {
      set_count_kernel<<<1, 1, 0, stream>>>(l.group_tokens, n_tokens);
      check_launch("moe_route::cuda::admit: launch of set_count_kernel");
    }
    check_launch(cudaMemsetAsync(l.load, 0, sizeof(std::int64_t) * segments, stream), "cudaMemsetAsync (loads)");
    limits_kernel<S><<<grid_for(segments, block_threads), block_threads, 0, stream>>>(prm);
    check_launch("moe_route::cuda::admit: launch of limits_kernel");

    // 1-2. Strict pass.
    strict_items_kernel<Router, Policy, S><<<token_blocks, block_threads, 0, stream>>>(
        prm, l.rank.keys[0], l.rank.items[0], l.rank.segs[0]);
    check_launch("moe_route::cuda::admit: launch of strict_items_kernel");
    l.rank.sort(stream);
    const int n = l.rank.n;
    const unsigned item_blocks = grid_for(n, block_threads);
    strict_decide_kernel<Policy, S><<<item_blocks, block_threads, 0, stream>>>(
        prm, l.rank.sorted_segs, l.rank.sorted_items, l.rank.begin, n);
    check_launch("moe_route::cuda::admit: launch of strict_decide_kernel");

    // 3. Reroute rounds.
    if constexpr (Policy::reroutes) {
      const int rounds = p.overflow.max_rounds < 0 ? k : p.overflow.max_rounds;
      const std::size_t shared =
          static_cast<std::size_t>(warps_per_block) * ((in.num_experts + 31) / 32) * sizeof(std::uint32_t);
      for (int round = 0; round < rounds; ++round) {
        propose_kernel<Router, Policy, S><<<token_blocks, block_threads, shared, stream>>>(
            prm, l.rank.keys[0], l.rank.items[0], l.rank.segs[0]);
        check_launch("moe_route::cuda::admit: launch of propose_kernel");
        l.rank.sort(stream);
        accept_kernel<S><<<item_blocks, block_threads, 0, stream>>>(prm, l.rank.sorted_segs,
                                                                          l.rank.sorted_items, l.rank.begin, n);
        check_launch("moe_route::cuda::admit: launch of accept_kernel");
        update_loads_kernel<S><<<item_blocks, block_threads, 0, stream>>>(prm, l.rank.sorted_segs,
                                                                                l.rank.begin, n);
        check_launch("moe_route::cuda::admit: launch of update_loads_kernel");
      }
    }

    // 4. Outputs.
    outputs_kernel<Router, S><<<token_blocks, block_threads, 0, stream>>>(
        r, prm, admission::renormalizes(p), out.indices, out.gates, out.status);
    check_launch("moe_route::cuda::admit: launch of outputs_kernel");

    // 5. Report.
    if (out.report != nullptr) {
      check_launch(cudaMemsetAsync(out.report, 0, sizeof(admission_report), stream), "cudaMemsetAsync (report)");
      report_kernel<<<grid_for(n_tokens, block_threads), block_threads, 0, stream>>>(
          l.state, n_tokens, k, out.report);
      check_launch("moe_route::cuda::admit: launch of report_kernel");
    }
  }
}

}  // namespace moe_route::cuda::admission_detail
