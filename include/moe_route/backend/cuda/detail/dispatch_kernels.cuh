// moe_route CUDA backend: the kernels and launch sequence of cuda::dispatch
// (backend/cuda/dispatch.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <cstddef>
#include <cstdint>

#include <moe_route/admission/detail/validate.hpp>
#include <moe_route/admission/dispatch.hpp>
#include <moe_route/backend/cuda/detail/admission_common.cuh>
#include <moe_route/backend/cuda/detail/error.cuh>

namespace moe_route::cuda::admission_detail {

MOE_ROUTE_KERNEL void dispatch_items_kernel(const std::int32_t* __restrict__ indices, int n, int num_experts,
                                            std::uint32_t* __restrict__ keys, std::uint32_t* __restrict__ items) {
  for (std::int64_t i = global_thread(); i < n; i += thread_count()) {
    const std::int32_t e = indices[i];
    keys[i] = e >= 0 && e < num_experts ? static_cast<std::uint32_t>(e) : static_cast<std::uint32_t>(num_experts);
    items[i] = static_cast<std::uint32_t>(i);
  }
}

// first[e] / last[e] (one past): the sorted positions of expert e (zeroed before).
MOE_ROUTE_KERNEL void dispatch_bounds_kernel(const std::uint32_t* __restrict__ keys, int n, int num_experts,
                                             std::uint32_t* __restrict__ first, std::uint32_t* __restrict__ last) {
  for (std::int64_t i = global_thread(); i < n; i += thread_count()) {
    const std::uint32_t e = keys[i];
    if (e >= static_cast<std::uint32_t>(num_experts)) continue;
    if (i == 0 || keys[i - 1] != e) first[e] = static_cast<std::uint32_t>(i);
    if (i + 1 == n || keys[i + 1] != e) last[e] = static_cast<std::uint32_t>(i + 1);
  }
}

MOE_ROUTE_KERNEL void dispatch_counts_kernel(const std::uint32_t* __restrict__ first, const std::uint32_t* __restrict__ last,
                                             int num_experts, int align, std::int64_t* __restrict__ counts,
                                             std::int64_t* __restrict__ padded) {
  for (std::int64_t e = global_thread(); e <= num_experts; e += thread_count()) {
    if (e == num_experts) {
      padded[e] = 0;
      continue;
    }
    const std::int64_t c = static_cast<std::int64_t>(last[e]) - static_cast<std::int64_t>(first[e]);
    counts[e] = c;
    padded[e] = (c + align - 1) / align * align;
  }
}

MOE_ROUTE_KERNEL void dispatch_scatter_kernel(const std::uint32_t* __restrict__ keys, const std::uint32_t* __restrict__ items,
                                              int n, int num_experts, const std::uint32_t* __restrict__ first,
                                              const std::int64_t* __restrict__ offsets,
                                              std::int64_t* __restrict__ permutation, std::int64_t* __restrict__ inverse) {
  for (std::int64_t i = global_thread(); i < n; i += thread_count()) {
    const std::uint32_t e = keys[i];
    if (e >= static_cast<std::uint32_t>(num_experts)) continue;
    const std::int64_t row = offsets[e] + (i - static_cast<std::int64_t>(first[e]));
    const std::int64_t slot = items[i];
    if (permutation != nullptr) permutation[row] = slot;
    if (inverse != nullptr) inverse[slot] = row;
  }
}

MOE_ROUTE_KERNEL void dispatch_ranks_kernel(const std::int64_t* __restrict__ counts, int num_experts,
                                            const std::int32_t* __restrict__ expert_rank, int num_ranks,
                                            std::int64_t* __restrict__ rank_counts) {
  for (std::int64_t r = global_thread(); r < num_ranks; r += thread_count()) {
    std::int64_t sum = 0;
    for (int e = 0; e < num_experts; ++e) {
      const int owner = expert_rank != nullptr ? expert_rank[e] : contiguous_rank(e, num_experts, num_ranks);
      if (owner == r) sum += counts[e];
    }
    rank_counts[r] = sum;
  }
}

struct dispatch_layout_buffers {
  std::uint32_t* keys[2] = {nullptr, nullptr};
  std::uint32_t* items[2] = {nullptr, nullptr};
  std::uint32_t* first = nullptr;
  std::uint32_t* last = nullptr;
  std::int64_t* padded = nullptr;
  void* temp = nullptr;
  std::size_t temp_bytes = 0;
  int key_bits = 1;
  std::size_t bytes = 0;
};

inline dispatch_layout_buffers make_dispatch_layout(void* base, int n, int num_experts) {
  carver c(base);
  dispatch_layout_buffers l;
  l.key_bits = bits_for(static_cast<std::uint64_t>(num_experts));
  for (int i = 0; i < 2; ++i) {
    l.keys[i] = c.take<std::uint32_t>(static_cast<std::size_t>(n));
    l.items[i] = c.take<std::uint32_t>(static_cast<std::size_t>(n));
  }
  l.first = c.take<std::uint32_t>(static_cast<std::size_t>(num_experts));
  l.last = c.take<std::uint32_t>(static_cast<std::size_t>(num_experts));
  l.padded = c.take<std::int64_t>(static_cast<std::size_t>(num_experts) + 1);
  std::size_t a = 0, b = 0;
  cub::DoubleBuffer<std::uint32_t> k(nullptr, nullptr), v(nullptr, nullptr);
  check_launch(cub::DeviceRadixSort::SortPairs(nullptr, a, k, v, n, 0, l.key_bits),
        "cub::DeviceRadixSort::SortPairs (size query)");
  check_launch(cub::DeviceScan::ExclusiveSum(nullptr, b, static_cast<const std::int64_t*>(nullptr),
                                      static_cast<std::int64_t*>(nullptr), num_experts + 1),
        "cub::DeviceScan::ExclusiveSum (size query)");
  l.temp_bytes = a > b ? a : b;
  l.temp = c.take<unsigned char>(l.temp_bytes);
  l.bytes = c.bytes();
  return l;
}

inline void validate_device_dispatch(std::int64_t num_tokens, int slots_per_token) {
  if (num_tokens * slots_per_token >= moe_route::admission::detail::max_sort_items)
    moe_route::detail::fail("cuda::dispatch: num_tokens * slots_per_token (= " +
                            std::to_string(num_tokens * slots_per_token) + ") must be < 2^31 per call");
}

void launch_dispatch(const dispatch_inputs& in, const dispatch_outputs& out, void* workspace, std::size_t workspace_bytes,
                            std::size_t needed, cudaStream_t stream) {
  check_workspace(workspace, workspace_bytes, needed, "cuda::dispatch");
  const int n = static_cast<int>(in.num_tokens * in.slots_per_token);
  const int e_count = in.num_experts;
  dispatch_layout_buffers l = make_dispatch_layout(align_workspace(workspace), n, e_count);
  const std::int64_t bound = dispatch_rows_bound(in.num_tokens, in.slots_per_token, e_count, in.align);
  if (out.permutation != nullptr && bound > 0)
    check_launch(cudaMemsetAsync(out.permutation, 0xff, sizeof(std::int64_t) * bound, stream),
              "cudaMemsetAsync (permutation)");
  if (out.inverse != nullptr && n > 0)
    check_launch(cudaMemsetAsync(out.inverse, 0xff, sizeof(std::int64_t) * n, stream), "cudaMemsetAsync (inverse)");
  check_launch(cudaMemsetAsync(l.first, 0, sizeof(std::uint32_t) * e_count, stream), "cudaMemsetAsync (first)");
  check_launch(cudaMemsetAsync(l.last, 0, sizeof(std::uint32_t) * e_count, stream), "cudaMemsetAsync (last)");
  const std::uint32_t* keys = l.keys[0];
  const std::uint32_t* items = l.items[0];
  if (n > 0) {
    const unsigned blocks = grid_for(n, block_threads);
    dispatch_items_kernel<<<blocks, block_threads, 0, stream>>>(in.indices, n, e_count, l.keys[0], l.items[0]);
    check_launch("moe_route::cuda::dispatch: launch of dispatch_items_kernel");
    cub::DoubleBuffer<std::uint32_t> k(l.keys[0], l.keys[1]), v(l.items[0], l.items[1]);
    std::size_t bytes = l.temp_bytes;
    check_launch(cub::DeviceRadixSort::SortPairs(l.temp, bytes, k, v, n, 0, l.key_bits, stream),
              "cub::DeviceRadixSort::SortPairs");
    keys = k.Current();
    items = v.Current();
    dispatch_bounds_kernel<<<blocks, block_threads, 0, stream>>>(keys, n, e_count, l.first, l.last);
    check_launch("moe_route::cuda::dispatch: launch of dispatch_bounds_kernel");
  }
  dispatch_counts_kernel<<<grid_for(e_count + 1, block_threads), block_threads, 0, stream>>>(
      l.first, l.last, e_count, in.align, out.counts, l.padded);
  check_launch("moe_route::cuda::dispatch: launch of dispatch_counts_kernel");
  std::size_t scan_bytes = l.temp_bytes;
  check_launch(cub::DeviceScan::ExclusiveSum(l.temp, scan_bytes, l.padded, out.offsets, e_count + 1, stream),
            "cub::DeviceScan::ExclusiveSum");
  if (n > 0 && (out.permutation != nullptr || out.inverse != nullptr)) {
    dispatch_scatter_kernel<<<grid_for(n, block_threads), block_threads, 0, stream>>>(
        keys, items, n, e_count, l.first, out.offsets, out.permutation, out.inverse);
    check_launch("moe_route::cuda::dispatch: launch of dispatch_scatter_kernel");
  }
  if (out.rank_counts != nullptr) {
    dispatch_ranks_kernel<<<grid_for(in.num_ranks, block_threads), block_threads, 0, stream>>>(
        out.counts, e_count, in.expert_rank, in.num_ranks, out.rank_counts);
    check_launch("moe_route::cuda::dispatch: launch of dispatch_ranks_kernel");
  }
}

}  // namespace moe_route::cuda::admission_detail
