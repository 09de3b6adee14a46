// moe_route CUDA backend: warp-wide reductions written once over a warp-operations
// type W (warp.cuh: W = cuda_warp). Every function must be called by all 32
// lanes of the warp with warp-uniform control flow.
//
// W provides: lane(), shfl_xor(float|double|uint32|uint64, offset), shfl(float|int, src),
// reduce_max(uint32) (maximum over the warp), any(bool), ballot(bool), sync()
// (__syncwarp: execution and memory ordering among the lanes), load(const T*),
// and the integer atomics atomic_add(int|int64*) and atomic_max(int64*).
#pragma once

#include <cstdint>

#include <moe_route/backend/cuda/detail/config.cuh>
#include <moe_route/detail/numerics.hpp>

namespace moe_route::cuda::detail {

// The canonical row sum (detail/numerics.hpp): the caller has summed its own
// elements e = lane, lane + 32, ... in increasing order starting from 0.0f;
// the lanes combine by the butterfly 16, 8, 4, 2, 1. Every lane returns the
// same bits, the bits cpu::detail::lane_sum computes.
template <class W>
MOE_ROUTE_CUDA_DEVICE float warp_sum(float lane_partial) {
  float v = lane_partial;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = v + W::shfl_xor(v, offset);
  return v;
}

// Maximum of non-NaN floats. The result can depend on the order only through
// the sign of a zero maximum, which no caller can observe (exp(+-0 - +-0) = 1).
template <class W>
MOE_ROUTE_CUDA_DEVICE float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = moe_route::detail::max(v, W::shfl_xor(v, offset));
  return v;
}

// The largest packed key of the warp (packed keys order by key, then by lower
// expert index; 0 means "no candidate"). Two 32-bit maxima: the high words
// first, then the low words of the lanes holding the highest high word.
template <class W>
MOE_ROUTE_CUDA_DEVICE std::uint64_t warp_max_key(std::uint64_t key) {
  const std::uint32_t hi = static_cast<std::uint32_t>(key >> 32);
  const std::uint32_t top = W::reduce_max(hi);
  const std::uint32_t lo = hi == top ? static_cast<std::uint32_t>(key) : 0u;
  return (static_cast<std::uint64_t>(top) << 32) | W::reduce_max(lo);
}

// The largest packed key within each aligned segment of `width` lanes (a power
// of two in [1, 32]); every lane of a segment gets its segment's maximum.
template <class W>
MOE_ROUTE_CUDA_DEVICE std::uint64_t segment_max_key(std::uint64_t key, int width) {
  for (int offset = width >> 1; offset > 0; offset >>= 1) {
    const std::uint32_t hi = W::shfl_xor(static_cast<std::uint32_t>(key >> 32), offset);
    const std::uint32_t lo = W::shfl_xor(static_cast<std::uint32_t>(key), offset);
    const std::uint64_t other = (static_cast<std::uint64_t>(hi) << 32) | lo;
    key = other > key ? other : key;
  }
  return key;
}

// Sum of non-negative integer counts over the warp (exact: any order gives the same total).
template <class W>
MOE_ROUTE_CUDA_DEVICE std::uint64_t warp_sum_count(std::uint64_t v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += W::shfl_xor(v, offset);
  return v;
}

// Set bits of a ballot mask.
MOE_ROUTE_CUDA_DEVICE int popcount(std::uint32_t mask) {
#if defined(__CUDA_ARCH__)
  return __popc(mask);
#else
  return __builtin_popcount(mask);
#endif
}

}  // namespace moe_route::cuda::detail
