// moe_route CUDA backend: pieces shared by admission, expert choice and
// dispatch metadata (admission.cuh, expert_choice.cuh, dispatch.cuh):
// workspace carving, the canonical warp row statistics, and the deterministic
// "rank within segment" machinery built on CUB radix sorts.
//
// Ranking: every item carries a segment id (group * E + expert, or the
// sentinel `segments` for items that take no part) and a 64-bit key
// (admission::rank_key: affinity desc, token asc). Two stable LSD passes sort
// the items by (segment asc, key desc): first by key (descending, all 64
// bits), then by segment (ascending, only the bits the segment ids need).
// The position of an item inside its segment is its rank; no atomic counter
// ever decides an order.
#pragma once

#include <cuda_runtime.h>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <cstddef>
#include <cstdint>
#include <string>

#include <moe_route/admission/scores.hpp>
#include <moe_route/backend/cuda/detail/error.cuh>
#include <moe_route/backend/cuda/detail/tuning.cuh>
#include <moe_route/config.hpp>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/detail/validate.hpp>
#include <moe_route/gating/softmax.hpp>
#include <moe_route/types.hpp>

namespace moe_route::cuda::admission_detail {

namespace num = moe_route::detail;

using moe_route::cuda::detail::check_launch;
inline constexpr int block_threads = tuning::admission_block_threads;
inline constexpr int warps_per_block = block_threads / warp_threads;
inline constexpr std::int64_t max_grid_blocks = tuning::admission_max_blocks;
inline constexpr std::size_t workspace_alignment = 256;

// Blocks for `items` work items of `per_block` each, capped (the kernels loop).
inline unsigned grid_for(std::int64_t items, std::int64_t per_block) {
  std::int64_t b = (items + per_block - 1) / per_block;
  if (b < 1) b = 1;
  return static_cast<unsigned>(b < max_grid_blocks ? b : max_grid_blocks);
}

// Bits needed to hold every value in [0, max_value].
inline int bits_for(std::uint64_t max_value) {
  int b = 1;
  while (b < 64 && (max_value >> b) != 0) ++b;
  return b;
}

// Sub-buffers of one caller workspace, each aligned to 256 bytes. With a null
// base it only measures (the two-phase size query walks the same layout).
class carver {
 public:
  explicit carver(void* base) : base_(static_cast<char*>(base)) {}
  template <class T>
  T* take(std::size_t count) {
    offset_ = (offset_ + workspace_alignment - 1) / workspace_alignment * workspace_alignment;
    T* p = base_ != nullptr ? reinterpret_cast<T*>(base_ + offset_) : nullptr;
    offset_ += count * sizeof(T);
    return p;
  }
  std::size_t bytes() const { return offset_ + workspace_alignment; }  // slack for an unaligned base

 private:
  char* base_;
  std::size_t offset_ = 0;
};

// Aligns a caller's workspace pointer up to 256 bytes (carver::bytes keeps the slack).
inline void* align_workspace(void* p) {
  const std::uintptr_t u = reinterpret_cast<std::uintptr_t>(p);
  return reinterpret_cast<void*>((u + workspace_alignment - 1) / workspace_alignment * workspace_alignment);
}

inline void check_workspace(void* workspace, std::size_t bytes, std::size_t needed, const char* function) {
  if (workspace == nullptr && needed > 0)
    moe_route::detail::fail(std::string(function) + ": workspace is null (query its size first)");
  if (bytes < needed)
    moe_route::detail::fail(std::string(function) + ": workspace_bytes (= " + std::to_string(bytes) +
                            ") is smaller than the queried size (= " + std::to_string(needed) + ")");
}

// ---------------------------------------------------------------------------
// Device helpers.

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x) & 31; }

__device__ __forceinline__ std::int64_t global_warp() {
  return (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
}
__device__ __forceinline__ std::int64_t warp_count() { return (static_cast<std::int64_t>(gridDim.x) * blockDim.x) >> 5; }
__device__ __forceinline__ std::int64_t global_thread() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::int64_t thread_count() { return static_cast<std::int64_t>(gridDim.x) * blockDim.x; }

// The largest 64-bit value of the warp (every lane gets it).
__device__ __forceinline__ std::uint64_t warp_max_u64(std::uint64_t v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const std::uint64_t other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Softmax statistics of one row of E logits, computed by a whole warp in the
// canonical order (detail/numerics.hpp): lane l adds exp(v_e - max) for
// e = l, l + 32, ... in increasing order from 0.0f, then the butterfly 16, 8,
// 4, 2, 1. Every lane returns the bits admission::softmax_row_stats computes
// on the host. Must be called by all 32 lanes.
template <class S>
__device__ __forceinline__ admission::row_stats warp_row_stats(const S* z, int num_experts) {
  const int lane = lane_id();
  float m = -num::float_max;
  for (int e = lane; e < num_experts; e += 32) m = num::max(m, num::sanitize(num::to_float(z[e])));
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) m = num::max(m, __shfl_xor_sync(0xffffffffu, m, offset));
  float part = 0.0f;
  for (int e = lane; e < num_experts; e += 32) part += gating::softmax::term(num::sanitize(num::to_float(z[e])), m);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) part = part + __shfl_xor_sync(0xffffffffu, part, offset);
  return {m, part};
}

// Tokens per admission group (integer counts: the totals do not depend on the
// order of the atomic additions); ids outside [0, num_groups) are not counted.
MOE_ROUTE_KERNEL void count_groups_kernel(const std::int32_t* __restrict__ group_ids, std::int64_t num_tokens,
                                          int num_groups, unsigned long long* __restrict__ counts) {
  for (std::int64_t t = global_thread(); t < num_tokens; t += thread_count()) {
    const int g = group_ids[t];
    if (g >= 0 && g < num_groups) atomicAdd(counts + g, 1ull);
  }
}

MOE_ROUTE_KERNEL void set_count_kernel(unsigned long long* __restrict__ counts, std::int64_t value) {
  counts[0] = static_cast<unsigned long long>(value);
}

// Items of a ranking: segment ids by item (input), keys and item ids in
// double buffers that the sorts reorder.
MOE_ROUTE_KERNEL void gather_segments_kernel(const std::uint32_t* __restrict__ seg_by_item,
                                             const std::uint32_t* __restrict__ items, std::uint32_t* __restrict__ out,
                                             int n) {
  for (std::int64_t i = global_thread(); i < n; i += thread_count()) out[i] = seg_by_item[items[i]];
}

// begin[s] = the first sorted position of segment s (segments absent from the
// input keep whatever begin holds; nothing reads them).
MOE_ROUTE_KERNEL void segment_begin_kernel(const std::uint32_t* __restrict__ seg, std::uint32_t* __restrict__ begin,
                                           int n) {
  for (std::int64_t i = global_thread(); i < n; i += thread_count()) {
    const std::uint32_t s = seg[i];
    if (i == 0 || seg[i - 1] != s) begin[s] = static_cast<std::uint32_t>(i);
  }
}

// The buffers of one ranking over n < 2^31 items.
struct ranking {
  int n = 0;
  int segment_bits = 1;  // bits of the largest segment id (the sentinel included)
  std::uint64_t* keys[2] = {nullptr, nullptr};
  std::uint32_t* items[2] = {nullptr, nullptr};
  std::uint32_t* segs[2] = {nullptr, nullptr};  // segs[0]: segment by item (input), overwritten
  std::uint32_t* begin = nullptr;                // [segments + 1]
  void* temp = nullptr;
  std::size_t temp_bytes = 0;

  // Results of sort(): sorted segment ids and item ids.
  const std::uint32_t* sorted_segs = nullptr;
  const std::uint32_t* sorted_items = nullptr;

  // Carves the buffers for n items and `segments` segments (+ the sentinel).
  void carve(carver& c, int items_count, std::uint32_t segments) {
    n = items_count;
    segment_bits = bits_for(segments);
    keys[0] = c.take<std::uint64_t>(static_cast<std::size_t>(n));
    keys[1] = c.take<std::uint64_t>(static_cast<std::size_t>(n));
    items[0] = c.take<std::uint32_t>(static_cast<std::size_t>(n));
    items[1] = c.take<std::uint32_t>(static_cast<std::size_t>(n));
    segs[0] = c.take<std::uint32_t>(static_cast<std::size_t>(n));
    segs[1] = c.take<std::uint32_t>(static_cast<std::size_t>(n));
    begin = c.take<std::uint32_t>(static_cast<std::size_t>(segments) + 1);
    std::size_t a = 0, b = 0;
    cub::DoubleBuffer<std::uint64_t> k(nullptr, nullptr);
    cub::DoubleBuffer<std::uint32_t> v(nullptr, nullptr);
    check_launch(cub::DeviceRadixSort::SortPairsDescending(nullptr, a, k, v, n, 0, 64),
          "cub::DeviceRadixSort::SortPairsDescending (size query)");
    cub::DoubleBuffer<std::uint32_t> s(nullptr, nullptr);
    check_launch(cub::DeviceRadixSort::SortPairs(nullptr, b, s, v, n, 0, segment_bits),
          "cub::DeviceRadixSort::SortPairs (size query)");
    temp_bytes = a > b ? a : b;
    temp = c.take<unsigned char>(temp_bytes);
  }

  // Sorts keys[0] / items[0] (item ids) / segs[0] (segment of each item id)
  // into (segment asc, key desc) order and records every segment's start.
  void sort(cudaStream_t stream) {
    if (n == 0) return;
    cub::DoubleBuffer<std::uint64_t> k(keys[0], keys[1]);
    cub::DoubleBuffer<std::uint32_t> v(items[0], items[1]);
    std::size_t bytes = temp_bytes;
    check_launch(cub::DeviceRadixSort::SortPairsDescending(temp, bytes, k, v, n, 0, 64, stream),
          "cub::DeviceRadixSort::SortPairsDescending");
    gather_segments_kernel<<<grid_for(n, block_threads), block_threads, 0, stream>>>(segs[0], v.Current(), segs[1], n);
    check_launch("moe_route::cuda admission: launch of gather_segments_kernel");
    cub::DoubleBuffer<std::uint32_t> s(segs[1], segs[0]);
    bytes = temp_bytes;
    check_launch(cub::DeviceRadixSort::SortPairs(temp, bytes, s, v, n, 0, segment_bits, stream),
          "cub::DeviceRadixSort::SortPairs");
    sorted_segs = s.Current();
    sorted_items = v.Current();
    segment_begin_kernel<<<grid_for(n, block_threads), block_threads, 0, stream>>>(sorted_segs, begin, n);
    check_launch("moe_route::cuda admission: launch of segment_begin_kernel");
  }
};

}  // namespace moe_route::cuda::admission_detail
