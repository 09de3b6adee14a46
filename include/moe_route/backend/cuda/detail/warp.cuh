// moe_route CUDA backend: the warp operations of a real GPU warp (the W of
// warp_reduce.cuh and the agents). All collectives use the full warp mask: the
// kernels keep every lane of a warp alive and in step until the warp is done.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include <moe_route/backend/cuda/detail/config.cuh>
#include <moe_route/types.hpp>

namespace moe_route::cuda::detail {

struct cuda_warp {
  __device__ __forceinline__ static int lane() { return static_cast<int>(threadIdx.x) & (warp_threads - 1); }

  __device__ __forceinline__ static float shfl_xor(float v, int offset) {
    return __shfl_xor_sync(full_warp_mask, v, offset);
  }
  __device__ __forceinline__ static std::uint32_t shfl_xor(std::uint32_t v, int offset) {
    return __shfl_xor_sync(full_warp_mask, v, offset);
  }
  __device__ __forceinline__ static float shfl(float v, int src) { return __shfl_sync(full_warp_mask, v, src); }
  __device__ __forceinline__ static int shfl(int v, int src) { return __shfl_sync(full_warp_mask, v, src); }

  // Maximum over the warp: one redux.sync on sm_80 and newer, a butterfly before.
  __device__ __forceinline__ static std::uint32_t reduce_max(std::uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return __reduce_max_sync(full_warp_mask, v);
#else
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const std::uint32_t other = __shfl_xor_sync(full_warp_mask, v, offset);
      v = other > v ? other : v;
    }
    return v;
#endif
  }

  __device__ __forceinline__ static double shfl_xor(double v, int offset) {
    return __shfl_xor_sync(full_warp_mask, v, offset);
  }
  __device__ __forceinline__ static std::uint64_t shfl_xor(std::uint64_t v, int offset) {
    return __shfl_xor_sync(full_warp_mask, static_cast<unsigned long long>(v), offset);
  }

  // Integer atomics (shared or global memory): their sums do not depend on order.
  __device__ __forceinline__ static void atomic_add(std::int64_t* p, std::int64_t v) {
    atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
  }
  __device__ __forceinline__ static void atomic_add(int* p, int v) { atomicAdd(p, v); }
  __device__ __forceinline__ static void atomic_max(std::int64_t* p, std::int64_t v) {
    atomicMax(reinterpret_cast<long long*>(p), static_cast<long long>(v));
  }

  __device__ __forceinline__ static bool any(bool p) { return __any_sync(full_warp_mask, p) != 0; }
  __device__ __forceinline__ static std::uint32_t ballot(bool p) { return __ballot_sync(full_warp_mask, p); }
  __device__ __forceinline__ static void sync() { __syncwarp(full_warp_mask); }

  // Read-only loads (the inputs are never written during a call).
  __device__ __forceinline__ static float load(const float* p) { return __ldg(p); }
  __device__ __forceinline__ static std::int32_t load(const std::int32_t* p) { return __ldg(p); }
  __device__ __forceinline__ static std::uint8_t load(const std::uint8_t* p) { return __ldg(p); }
  __device__ __forceinline__ static bfloat16 load(const bfloat16* p) {
    return bfloat16{__ldg(reinterpret_cast<const unsigned short*>(p))};
  }
  __device__ __forceinline__ static float16 load(const float16* p) {
    return float16{__ldg(reinterpret_cast<const unsigned short*>(p))};
  }
};

}  // namespace moe_route::cuda::detail
