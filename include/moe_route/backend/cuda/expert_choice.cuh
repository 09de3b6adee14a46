// moe_route CUDA backend: expert-choice selection (admission/expert_choice.hpp).
//
//   std::size_t cuda::expert_choice_workspace_size(policy, num_tokens, num_experts, num_groups = 1)
//   void cuda::expert_choice(policy, expert_choice_inputs, expert_choice_outputs, workspace, bytes, stream)
//   void cuda::expert_choice_backward(expert_choice_inputs, indices, grad_gates, grad_logits, stream)
//
// Same bits as cpu::expert_choice: canonical softmax scores, every (group,
// expert) ranks all its tokens by rank_key(s_{t,e}, t) through the stable
// radix sorts of admission_common.cuh, and keeps the first C_e. The output
// rows are compacted in ascending expert order with warp ballots. The
// workspace holds N * E ranking items (about 33 bytes each). Tokens with a
// group id outside [0, num_groups) are never picked and are counted in
// report->invalid. out.report, if set, is a device pointer, overwritten.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../../admission/admission.hpp"
#include "../../admission/expert_choice.hpp"
#include "../../admission/scores.hpp"
#include "../../admission/validate.hpp"
#include "../../gating/softmax.hpp"
#include "admission_common.cuh"
#include "agent_expert_choice.cuh"
#include "error.cuh"
#include "kernels.cuh"
#include "route.cuh"

namespace moe_route::cuda {

namespace admission_detail {

template <class S>
struct ec_params {
  const S* logits;
  std::int64_t num_tokens;
  int num_experts;
  const std::int32_t* group_ids;
  int num_groups;
  const std::int64_t* capacity;
  int top_k;
  double capacity_factor;
  std::int64_t min_capacity;
  std::uint32_t sentinel;
  unsigned long long* group_tokens;  // [G]
  admission::row_stats* stats;       // [N]
  unsigned char* chosen;             // [N x E]
};

template <class S>
MOE_ROUTE_KERNEL void __launch_bounds__(block_threads) ec_stats_kernel(ec_params<S> p) {
  for (std::int64_t t = global_warp(); t < p.num_tokens; t += warp_count()) {
    const admission::row_stats st = warp_row_stats(p.logits + t * p.num_experts, p.num_experts);
    if (lane_id() == 0) p.stats[t] = st;
  }
}

template <class S>
MOE_ROUTE_KERNEL void ec_items_kernel(ec_params<S> p, std::uint64_t* __restrict__ keys,
                                      std::uint32_t* __restrict__ items, std::uint32_t* __restrict__ segs) {
  const std::int64_t pairs = p.num_tokens * p.num_experts;
  for (std::int64_t i = global_thread(); i < pairs; i += thread_count()) {
    const std::int64_t t = i / p.num_experts;
    const int e = static_cast<int>(i - t * p.num_experts);
    const int g = p.group_ids != nullptr ? p.group_ids[t] : 0;
    const float s = admission::gate_input<gating::softmax>(num::sanitize(num::to_float(p.logits[i])), p.stats[t]);
    keys[i] = admission::rank_key(s, t);
    items[i] = static_cast<std::uint32_t>(i);
    segs[i] = g >= 0 && g < p.num_groups
                  ? static_cast<std::uint32_t>(g) * static_cast<std::uint32_t>(p.num_experts) + static_cast<std::uint32_t>(e)
                  : p.sentinel;
  }
}

template <class S>
MOE_ROUTE_KERNEL void ec_decide_kernel(ec_params<S> p, const std::uint32_t* __restrict__ seg,
                                       const std::uint32_t* __restrict__ items, const std::uint32_t* __restrict__ begin,
                                       int n) {
  for (std::int64_t i = global_thread(); i < n; i += thread_count()) {
    const std::uint32_t s = seg[i];
    if (s == p.sentinel) continue;
    const int g = static_cast<int>(s / static_cast<std::uint32_t>(p.num_experts));
    const int e = static_cast<int>(s - static_cast<std::uint32_t>(g) * static_cast<std::uint32_t>(p.num_experts));
    std::int64_t cap;
    if (p.capacity != nullptr) cap = p.capacity[e];
    else
      cap = admission::capacity_from_factor(p.capacity_factor, p.min_capacity,
                                            static_cast<std::int64_t>(p.group_tokens[g]), p.top_k, p.num_experts);
    if (i - static_cast<std::int64_t>(begin[s]) < cap) p.chosen[items[i]] = 1;
  }
}

// Row t: the chosen experts in ascending order, then -1 (warp per token).
template <class S>
MOE_ROUTE_KERNEL void __launch_bounds__(block_threads)
    ec_outputs_kernel(ec_params<S> p, std::int32_t* __restrict__ out_indices, float* __restrict__ out_gates,
                      std::int32_t* __restrict__ per_token) {
  const int lane = lane_id();
  const int e_count = p.num_experts;
  for (std::int64_t t = global_warp(); t < p.num_tokens; t += warp_count()) {
    const admission::row_stats st = p.stats[t];
    const std::int64_t row = t * e_count;
    int count = 0;
    for (int base = 0; base < e_count; base += 32) {
      const int e = base + lane;
      const bool c = e < e_count && p.chosen[row + e] != 0;
      const unsigned mask = __ballot_sync(0xffffffffu, c);
      if (c) {
        const int pos = count + __popc(mask & ((1u << lane) - 1u));
        out_indices[row + pos] = e;
        out_gates[row + pos] =
            admission::gate_input<gating::softmax>(num::sanitize(num::to_float(p.logits[row + e])), st);
      }
      count += __popc(mask);
    }
    for (int j = count + lane; j < e_count; j += 32) {
      out_indices[row + j] = -1;
      out_gates[row + j] = 0.0f;
    }
    if (per_token != nullptr && lane == 0) per_token[t] = count;
  }
}

MOE_ROUTE_KERNEL void ec_report_kernel(const std::int32_t* __restrict__ indices, const std::int32_t* __restrict__ group_ids,
                                       std::int64_t num_tokens, int num_experts, int num_groups,
                                       expert_choice_report* __restrict__ report) {
  unsigned long long assignments = 0, none = 0, invalid = 0, most = 0;
  for (std::int64_t base = global_warp() * 32; base < num_tokens; base += warp_count() * 32) {
    const std::int64_t t = base + lane_id();
    if (t < num_tokens) {
      unsigned long long c = 0;
      const std::int32_t* row = indices + t * num_experts;
      while (c < static_cast<unsigned long long>(num_experts) && row[c] >= 0) ++c;
      assignments += c;
      none += c == 0;
      most = c > most ? c : most;
      if (group_ids != nullptr) invalid += group_ids[t] < 0 || group_ids[t] >= num_groups;
    }
  }
  assignments = warp_sum_u64(assignments);
  none = warp_sum_u64(none);
  invalid = warp_sum_u64(invalid);
  most = warp_max_u64(most);
  if (lane_id() == 0) {
    if (assignments) atomicAdd(reinterpret_cast<unsigned long long*>(&report->assignments), assignments);
    if (none) atomicAdd(reinterpret_cast<unsigned long long*>(&report->tokens_without_experts), none);
    if (invalid) atomicAdd(reinterpret_cast<unsigned long long*>(&report->invalid), invalid);
    if (most) atomicMax(reinterpret_cast<unsigned long long*>(&report->max_experts_per_token), most);
  }
}

struct ec_layout {
  unsigned long long* group_tokens = nullptr;
  admission::row_stats* stats = nullptr;
  unsigned char* chosen = nullptr;
  ranking rank;
  std::size_t bytes = 0;
};

inline ec_layout make_ec_layout(void* base, std::int64_t num_tokens, int num_experts, int num_groups) {
  carver c(base);
  ec_layout l;
  const std::uint32_t segments = static_cast<std::uint32_t>(num_groups) * static_cast<std::uint32_t>(num_experts);
  l.group_tokens = c.take<unsigned long long>(static_cast<std::size_t>(num_groups));
  l.stats = c.take<admission::row_stats>(static_cast<std::size_t>(num_tokens));
  l.chosen = c.take<unsigned char>(static_cast<std::size_t>(num_tokens * num_experts));
  l.rank.carve(c, static_cast<int>(num_tokens * num_experts), segments);
  l.bytes = c.bytes();
  return l;
}

}  // namespace admission_detail

inline std::size_t expert_choice_workspace_size(const selection::expert_choice& p, std::int64_t num_tokens,
                                                int num_experts, int num_groups = 1) {
  expert_choice_inputs<float> shape;
  shape.num_tokens = num_tokens;
  shape.num_experts = num_experts;
  shape.num_groups = num_groups;
  float dummy = 0.0f;
  std::int32_t dummy_index = 0;
  shape.logits = &dummy;
  admission::detail::validate_expert_choice(p, shape, expert_choice_outputs{&dummy_index, &dummy});
  return admission_detail::make_ec_layout(nullptr, num_tokens, num_experts, num_groups).bytes;
}

template <class T>
void expert_choice(const selection::expert_choice& p, const expert_choice_inputs<T>& in,
                   const expert_choice_outputs& out, void* workspace, std::size_t workspace_bytes,
                   cudaStream_t stream = 0) {
  namespace ad = admission_detail;
  using S = detail::storage_t<T>;
  admission::detail::validate_expert_choice(p, in, out);
  const std::int64_t n_tokens = in.num_tokens;
  if (out.report != nullptr)
    ad::check(cudaMemsetAsync(out.report, 0, sizeof(expert_choice_report), stream), "cudaMemsetAsync (report)");
  if (n_tokens == 0) return;
  const std::size_t needed = expert_choice_workspace_size(p, n_tokens, in.num_experts, in.num_groups);
  ad::check_workspace(workspace, workspace_bytes, needed, "cuda::expert_choice");
  ad::ec_layout l = ad::make_ec_layout(ad::align_workspace(workspace), n_tokens, in.num_experts, in.num_groups);
  const std::uint32_t segments = static_cast<std::uint32_t>(in.num_groups) * static_cast<std::uint32_t>(in.num_experts);
  ad::ec_params<S> prm{};
  prm.logits = detail::storage_pointer(in.logits);
  prm.num_tokens = n_tokens;
  prm.num_experts = in.num_experts;
  prm.group_ids = in.group_ids;
  prm.num_groups = in.num_groups;
  prm.capacity = in.capacity;
  prm.top_k = p.top_k;
  prm.capacity_factor = p.capacity_factor;
  prm.min_capacity = p.min_capacity;
  prm.sentinel = segments;
  prm.group_tokens = l.group_tokens;
  prm.stats = l.stats;
  prm.chosen = l.chosen;

  if (in.group_ids != nullptr) {
    ad::check(cudaMemsetAsync(l.group_tokens, 0, sizeof(unsigned long long) * in.num_groups, stream),
              "cudaMemsetAsync (group sizes)");
    ad::count_groups_kernel<<<ad::grid_for(n_tokens, ad::block_threads), ad::block_threads, 0, stream>>>(
        in.group_ids, n_tokens, in.num_groups, l.group_tokens);
    ad::check_launch("moe_route::cuda::expert_choice: launch of count_groups_kernel");
  } else {
    ad::set_count_kernel<<<1, 1, 0, stream>>>(l.group_tokens, n_tokens);
    ad::check_launch("moe_route::cuda::expert_choice: launch of set_count_kernel");
  }
  ad::check(cudaMemsetAsync(l.chosen, 0, static_cast<std::size_t>(n_tokens) * in.num_experts, stream),
            "cudaMemsetAsync (chosen)");
  const unsigned token_blocks = ad::grid_for(n_tokens, ad::warps_per_block);
  ad::ec_stats_kernel<S><<<token_blocks, ad::block_threads, 0, stream>>>(prm);
  ad::check_launch("moe_route::cuda::expert_choice: launch of ec_stats_kernel");
  const int n = l.rank.n;
  const unsigned item_blocks = ad::grid_for(n, ad::block_threads);
  ad::ec_items_kernel<S><<<item_blocks, ad::block_threads, 0, stream>>>(prm, l.rank.keys[0], l.rank.items[0],
                                                                         l.rank.segs[0]);
  ad::check_launch("moe_route::cuda::expert_choice: launch of ec_items_kernel");
  l.rank.sort(stream);
  ad::ec_decide_kernel<S><<<item_blocks, ad::block_threads, 0, stream>>>(prm, l.rank.sorted_segs, l.rank.sorted_items,
                                                                          l.rank.begin, n);
  ad::check_launch("moe_route::cuda::expert_choice: launch of ec_decide_kernel");
  ad::ec_outputs_kernel<S><<<token_blocks, ad::block_threads, 0, stream>>>(prm, out.indices, out.gates,
                                                                            out.experts_per_token);
  ad::check_launch("moe_route::cuda::expert_choice: launch of ec_outputs_kernel");
  if (out.report != nullptr) {
    ad::ec_report_kernel<<<ad::grid_for(n_tokens, ad::block_threads), ad::block_threads, 0, stream>>>(
        out.indices, in.group_ids, n_tokens, in.num_experts, in.num_groups, out.report);
    ad::check_launch("moe_route::cuda::expert_choice: launch of ec_report_kernel");
  }
}

namespace detail {

template <class T>
MOE_ROUTE_KERNEL void __launch_bounds__(tuning::max_block_threads)
    expert_choice_backward_kernel(const T* logits, std::int64_t num_tokens, int num_experts,
                                  const std::int32_t* indices, const float* grad_gates, float* grad_logits) {
  for (std::int64_t t = warp_first_token(); t < num_tokens; t += warp_stride()) {
    const std::int64_t row = t * num_experts;
    expert_choice_backward_row<cuda_warp>(logits + row, indices + row, grad_gates + row, num_experts,
                                          grad_logits + row);
  }
}

}  // namespace detail

// dL/dz [N x E] (overwritten) from dL/dgates [N x E] of an expert_choice result:
// the bits of cpu::expert_choice_backward. Device pointers; one kernel on `stream`.
template <class T>
void expert_choice_backward(const expert_choice_inputs<T>& in, const std::int32_t* indices, const float* grad_gates,
                            float* grad_logits, cudaStream_t stream = 0) {
  using moe_route::detail::fail;
  if (in.num_tokens < 0) fail("num_tokens must be >= 0");
  if (in.num_experts < 1 || in.num_experts > max_experts) fail("num_experts must be in [1, max_experts]");
  if (in.num_tokens == 0) return;
  if (in.logits == nullptr || indices == nullptr || grad_gates == nullptr || grad_logits == nullptr)
    fail("expert_choice_backward: logits, indices, grad_gates and grad_logits must not be null");
  using S = detail::storage_t<T>;
  constexpr tuning::launch_policy policy = tuning::backward_general;
  detail::expert_choice_backward_kernel<S>
      <<<static_cast<unsigned>(policy.blocks_for(in.num_tokens)), policy.block_threads(), 0, stream>>>(
          detail::storage_pointer(in.logits), in.num_tokens, in.num_experts, indices, grad_gates, grad_logits);
  detail::check_launch("moe_route::cuda::expert_choice_backward: launch of the backward kernel");
}

}  // namespace moe_route::cuda
