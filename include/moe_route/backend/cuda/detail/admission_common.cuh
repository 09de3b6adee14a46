// moe_route CUDA backend: pieces shared by the launch sequences of admission,
// expert choice and dispatch metadata (admission_launch.cuh,
// expert_choice_launch.cuh, dispatch_launch.cuh): workspace carving, the
// canonical warp row statistics, group sizes, and the deterministic "rank
// within segment" built on two stable radix sorts.
//
// Everything here is written over an executor (executor.cuh on a GPU; the host
// warp emulator's executor in tests/emulator) and, for warp code, over the warp
// type W, so the emulator runs the same sequence as the device.
//
// Ranking: every item carries a segment id (group * E + expert, or the
// sentinel `segments` for items that take no part) and a 64-bit key
// (admission::rank_key: affinity desc, token asc). Two stable LSD passes sort
// the items by (segment asc, key desc): first by key (descending, all 64
// bits), then by segment (ascending, only the bits the segment ids need).
// The position of an item inside its segment is its rank; no atomic counter
// ever decides an order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <moe_route/admission/scores.hpp>
#include <moe_route/backend/cuda/detail/config.cuh>
#include <moe_route/backend/cuda/detail/tuning.cuh>
#include <moe_route/backend/cuda/detail/warp_reduce.cuh>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/gating/softmax.hpp>
#include <moe_route/types.hpp>

namespace moe_route::cuda::admission_detail {

namespace num = moe_route::detail;

inline constexpr std::size_t workspace_alignment = 256;

// Bits needed to hold every value in [0, max_value].
inline int bits_for(std::uint64_t max_value) {
  int b = 1;
  while (b < 64 && (max_value >> b) != 0) ++b;
  return b;
}

// Two buffers of one sort key or value; `selector` names the current one (the
// contract of cub::DoubleBuffer, which the device executor passes it on to).
template <class T>
struct double_buffer {
  T* buffers[2] = {nullptr, nullptr};
  int selector = 0;
  T* current() const { return buffers[selector]; }
};

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

// Softmax statistics of one row of E logits, computed by a whole warp in the
// canonical order (detail/numerics.hpp): lane l adds exp(v_e - max) for
// e = l, l + 32, ... in increasing order from 0.0f, then the butterfly 16, 8,
// 4, 2, 1. Every lane returns the bits admission::softmax_row_stats computes
// on the host. Must be called by all 32 lanes.
template <class W, class S>
MOE_ROUTE_CUDA_DEVICE admission::row_stats warp_row_stats(const S* z, int num_experts) {
  const int lane = W::lane();
  float m = -num::float_max;
  for (int e = lane; e < num_experts; e += warp_threads) m = num::max(m, num::sanitize(num::to_float(z[e])));
  m = detail::warp_max<W>(m);
  float part = 0.0f;
  for (int e = lane; e < num_experts; e += warp_threads)
    part += gating::softmax::term(num::sanitize(num::to_float(z[e])), m);
  return {m, detail::warp_sum<W>(part)};
}

// Warps that cover `tokens` tokens at one token per lane (warp w, lane l: token 32 w + l).
inline std::int64_t token_warps(std::int64_t tokens) { return (tokens + warp_threads - 1) / warp_threads; }

// Valid tokens per admission group (N_g), counted by warps of 32 tokens
// (token_warps). Integer atomics: the totals do not depend on their order.
// Padding tokens and ids outside [0, num_groups) are not counted; null
// group_ids: one group. counts must be zeroed first.
struct count_groups {
  const std::int32_t* group_ids;
  const std::uint8_t* token_mask;
  std::int64_t num_tokens;
  int num_groups;
  std::int64_t* counts;

  template <class W>
  MOE_ROUTE_CUDA_DEVICE void run(std::int64_t w, std::uint32_t*) const {
    const std::int64_t t = w * warp_threads + W::lane();
    if (t >= num_tokens || moe_route::detail::token_masked(token_mask, t)) return;
    const int g = group_ids != nullptr ? group_ids[t] : 0;
    if (g >= 0 && g < num_groups) W::atomic_add(counts + g, std::int64_t{1});
  }
};

// The group sizes of one call: counted, or N for one group and no mask.
struct set_value {
  std::int64_t* target;
  std::int64_t value;
  MOE_ROUTE_CUDA_DEVICE void operator()(std::int64_t) const { *target = value; }
};

template <class Exec>
void group_sizes(const Exec& ex, const std::int32_t* group_ids, const std::uint8_t* token_mask,
                 std::int64_t num_tokens, int num_groups, std::int64_t* counts) {
  if (group_ids != nullptr || token_mask != nullptr) {
    ex.fill(counts, 0, sizeof(std::int64_t) * static_cast<std::size_t>(num_groups), "group sizes");
    ex.for_each_warp(token_warps(num_tokens), 0, count_groups{group_ids, token_mask, num_tokens, num_groups, counts},
                     "count_groups");
  } else {
    ex.for_each(1, set_value{counts, num_tokens}, "set_value");
  }
}

// out[i] = segment of the i-th item id after the key sort.
struct gather_segments {
  const std::uint32_t* seg_by_item;
  const std::uint32_t* items;
  std::uint32_t* out;
  MOE_ROUTE_CUDA_DEVICE void operator()(std::int64_t i) const { out[i] = seg_by_item[items[i]]; }
};

// begin[s] = the first sorted position of segment s (segments absent from the
// input keep whatever begin holds; nothing reads them).
struct segment_begin {
  const std::uint32_t* seg;
  std::uint32_t* begin;
  MOE_ROUTE_CUDA_DEVICE void operator()(std::int64_t i) const {
    const std::uint32_t s = seg[i];
    if (i == 0 || seg[i - 1] != s) begin[s] = static_cast<std::uint32_t>(i);
  }
};

// A sorted ranking as the decision steps read it: position i holds item
// items[i] of segment seg[i], at rank(i) within its segment.
struct ranked {
  const std::uint32_t* seg = nullptr;
  const std::uint32_t* items = nullptr;
  const std::uint32_t* begin = nullptr;
  int n = 0;
  MOE_ROUTE_CUDA_DEVICE std::int64_t rank(std::int64_t i) const { return i - static_cast<std::int64_t>(begin[seg[i]]); }
  MOE_ROUTE_CUDA_DEVICE bool ends_segment(std::int64_t i) const { return i + 1 == n || seg[i + 1] != seg[i]; }
};

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

  ranked sorted;  // the result of sort()

  // Carves the buffers for n items and `segments` segments (+ the sentinel).
  template <class Exec>
  void carve(const Exec& ex, carver& c, int items_count, std::uint32_t segments) {
    n = items_count;
    segment_bits = bits_for(segments);
    keys[0] = c.take<std::uint64_t>(static_cast<std::size_t>(n));
    keys[1] = c.take<std::uint64_t>(static_cast<std::size_t>(n));
    items[0] = c.take<std::uint32_t>(static_cast<std::size_t>(n));
    items[1] = c.take<std::uint32_t>(static_cast<std::size_t>(n));
    segs[0] = c.take<std::uint32_t>(static_cast<std::size_t>(n));
    segs[1] = c.take<std::uint32_t>(static_cast<std::size_t>(n));
    begin = c.take<std::uint32_t>(static_cast<std::size_t>(segments) + 1);
    const std::size_t a = ex.template sort_temp_bytes<std::uint64_t, std::uint32_t>(n, 64, true);
    const std::size_t b = ex.template sort_temp_bytes<std::uint32_t, std::uint32_t>(n, segment_bits, false);
    temp_bytes = a > b ? a : b;
    temp = c.take<unsigned char>(temp_bytes);
  }

  // Sorts keys[0] / items[0] (item ids) / segs[0] (segment of each item id)
  // into (segment asc, key desc) order and records every segment's start.
  template <class Exec>
  void sort(const Exec& ex) {
    if (n == 0) return;
    double_buffer<std::uint64_t> k{{keys[0], keys[1]}};
    double_buffer<std::uint32_t> v{{items[0], items[1]}};
    ex.sort_pairs(temp, temp_bytes, k, v, n, 64, true, "ranking by key");
    ex.for_each(n, gather_segments{segs[0], v.current(), segs[1]}, "gather_segments");
    double_buffer<std::uint32_t> s{{segs[1], segs[0]}};
    ex.sort_pairs(temp, temp_bytes, s, v, n, segment_bits, false, "ranking by segment");
    sorted = ranked{s.current(), v.current(), begin, n};
    ex.for_each(n, segment_begin{sorted.seg, begin}, "segment_begin");
  }
};

}  // namespace moe_route::cuda::admission_detail
