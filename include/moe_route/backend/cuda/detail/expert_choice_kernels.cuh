// moe_route CUDA backend: the kernels and launch sequence of cuda::expert_choice
// (backend/cuda/expert_choice.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include <moe_route/admission/admission.hpp>
#include <moe_route/admission/detail/validate.hpp>
#include <moe_route/admission/scores.hpp>
#include <moe_route/backend/cuda/detail/admission_common.cuh>
#include <moe_route/backend/cuda/detail/agent_expert_choice.cuh>
#include <moe_route/backend/cuda/detail/error.cuh>
#include <moe_route/backend/cuda/detail/kernels.cuh>
#include <moe_route/backend/cuda/detail/storage.cuh>
#include <moe_route/gating/softmax.hpp>
#include <moe_route/selection/expert_choice.hpp>

namespace moe_route::cuda::admission_detail {

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

template <class T>
void launch_expert_choice(const selection::expert_choice& p, const expert_choice_inputs<T>& in,
                          const expert_choice_outputs& out, void* workspace, std::size_t workspace_bytes,
                          cudaStream_t stream) {
  using S = detail::storage_t<T>;
  const std::int64_t n_tokens = in.num_tokens;
  if (out.report != nullptr)
    check_launch(cudaMemsetAsync(out.report, 0, sizeof(expert_choice_report), stream), "cudaMemsetAsync (report)");
  if (n_tokens == 0) return;
  const std::size_t needed = make_ec_layout(nullptr, n_tokens, in.num_experts, in.num_groups).bytes;
  check_workspace(workspace, workspace_bytes, needed, "cuda::expert_choice");
  ec_layout l = make_ec_layout(align_workspace(workspace), n_tokens, in.num_experts, in.num_groups);
  const std::uint32_t segments = static_cast<std::uint32_t>(in.num_groups) * static_cast<std::uint32_t>(in.num_experts);
  ec_params<S> prm{};
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
    check_launch(cudaMemsetAsync(l.group_tokens, 0, sizeof(unsigned long long) * in.num_groups, stream),
              "cudaMemsetAsync (group sizes)");
    count_groups_kernel<<<grid_for(n_tokens, block_threads), block_threads, 0, stream>>>(
        in.group_ids, n_tokens, in.num_groups, l.group_tokens);
    check_launch("moe_route::cuda::expert_choice: launch of count_groups_kernel");
  } else {
    set_count_kernel<<<1, 1, 0, stream>>>(l.group_tokens, n_tokens);
    check_launch("moe_route::cuda::expert_choice: launch of set_count_kernel");
  }
  check_launch(cudaMemsetAsync(l.chosen, 0, static_cast<std::size_t>(n_tokens) * in.num_experts, stream),
            "cudaMemsetAsync (chosen)");
  const unsigned token_blocks = grid_for(n_tokens, warps_per_block);
  ec_stats_kernel<S><<<token_blocks, block_threads, 0, stream>>>(prm);
  check_launch("moe_route::cuda::expert_choice: launch of ec_stats_kernel");
  const int n = l.rank.n;
  const unsigned item_blocks = grid_for(n, block_threads);
  ec_items_kernel<S><<<item_blocks, block_threads, 0, stream>>>(prm, l.rank.keys[0], l.rank.items[0],
                                                                         l.rank.segs[0]);
  check_launch("moe_route::cuda::expert_choice: launch of ec_items_kernel");
  l.rank.sort(stream);
  ec_decide_kernel<S><<<item_blocks, block_threads, 0, stream>>>(prm, l.rank.sorted_segs, l.rank.sorted_items,
                                                                          l.rank.begin, n);
  check_launch("moe_route::cuda::expert_choice: launch of ec_decide_kernel");
  ec_outputs_kernel<S><<<token_blocks, block_threads, 0, stream>>>(prm, out.indices, out.gates,
                                                                            out.experts_per_token);
  check_launch("moe_route::cuda::expert_choice: launch of ec_outputs_kernel");
  if (out.report != nullptr) {
    ec_report_kernel<<<grid_for(n_tokens, block_threads), block_threads, 0, stream>>>(
        out.indices, in.group_ids, n_tokens, in.num_experts, in.num_groups, out.report);
    check_launch("moe_route::cuda::expert_choice: launch of ec_report_kernel");
  }
}

}  // namespace moe_route::cuda::admission_detail

namespace moe_route::cuda {

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

template <class T>
void launch_expert_choice_backward(const expert_choice_inputs<T>& in, const std::int32_t* indices,
                                   const float* grad_gates, float* grad_logits, cudaStream_t stream) {
  using S = storage_t<T>;
  constexpr tuning::launch_policy policy = tuning::backward_general;
  expert_choice_backward_kernel<S>
      <<<static_cast<unsigned>(policy.blocks_for(in.num_tokens)), policy.block_threads(), 0, stream>>>(
          storage_pointer(in.logits), in.num_tokens, in.num_experts, indices, grad_gates, grad_logits);
  check_launch("moe_route::cuda::expert_choice_backward: launch of the backward kernel");
}

}  // namespace detail

}  // namespace moe_route::cuda
