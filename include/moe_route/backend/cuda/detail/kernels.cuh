// moe_route CUDA backend: the kernels. Each is a thin shell: it finds its warp's
// first token and stride, runs the agent, and adds its count of non-finite rows
// to the caller's counter. Kernels have internal linkage (MOE_ROUTE_KERNEL).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include <moe_route/backend/cuda/detail/agent_backward.cuh>
#include <moe_route/backend/cuda/detail/agent_common.cuh>
#include <moe_route/backend/cuda/detail/agent_route.cuh>
#include <moe_route/backend/cuda/detail/config.cuh>
#include <moe_route/backend/cuda/detail/tuning.cuh>
#include <moe_route/backend/cuda/detail/warp.cuh>

namespace moe_route::cuda::detail {

// The dynamic shared memory of a block: packed keys, one region per warp.
__device__ __forceinline__ std::uint64_t* dynamic_shared_keys() {
  extern __shared__ std::uint64_t moe_route_shared_keys[];
  return moe_route_shared_keys;
}

__device__ __forceinline__ std::int64_t warp_first_token() {
  return static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / warp_threads) + threadIdx.x / warp_threads;
}

__device__ __forceinline__ std::int64_t warp_stride() {
  return static_cast<std::int64_t>(gridDim.x) * (blockDim.x / warp_threads);
}

__device__ __forceinline__ void add_nonfinite(std::int64_t* counter, std::int64_t rows) {
  if (counter != nullptr && rows != 0 && cuda_warp::lane() == 0)
    atomicAdd(reinterpret_cast<unsigned long long*>(counter), static_cast<unsigned long long>(rows));
}

// Forward, E <= 32 * Slots. Shared memory: Slots * 32 keys per warp for
// group-limited selection, none otherwise.
template <class Router, class T, int Slots>
MOE_ROUTE_KERNEL void __launch_bounds__(tuning::max_block_threads)
    route_bucket_kernel(const Router r, const route_params<T> p, std::int64_t* nonfinite_rows) {
  std::uint64_t* keys = dynamic_shared_keys() + (threadIdx.x / warp_threads) * (Slots * warp_threads);
  const std::int64_t rows =
      route_rows_bucket<cuda_warp, Router, T, Slots>(r, p, warp_first_token(), warp_stride(), keys);
  add_nonfinite(nonfinite_rows, rows);
}

// Forward, any E. Shared memory: E keys per warp for keyed selections.
template <class Router, class T>
MOE_ROUTE_KERNEL void __launch_bounds__(tuning::max_block_threads)
    route_general_kernel(const Router r, const route_params<T> p, std::int64_t* nonfinite_rows) {
  std::uint64_t* keys = dynamic_shared_keys() + static_cast<std::int64_t>(threadIdx.x / warp_threads) * p.num_experts;
  const std::int64_t rows = route_rows_general<cuda_warp, Router, T>(r, p, warp_first_token(), warp_stride(), keys);
  add_nonfinite(nonfinite_rows, rows);
}

// Backward, row_softmax gating, E <= 32 * Slots.
template <class Router, class T, int Slots>
MOE_ROUTE_KERNEL void __launch_bounds__(tuning::max_block_threads)
    backward_bucket_kernel(const Router r, const backward_params<T> p) {
  backward_rows_bucket<cuda_warp, Router, T, Slots>(r, p, warp_first_token(), warp_stride());
}

// Backward, any E and gating.
template <class Router, class T>
MOE_ROUTE_KERNEL void __launch_bounds__(tuning::max_block_threads)
    backward_general_kernel(const Router r, const backward_params<T> p) {
  backward_rows_general<cuda_warp, Router, T>(r, p, warp_first_token(), warp_stride());
}

// selection::expert_bias::update on the device, one block: the mean load is
// summed in double in expert order by one thread (the host's order, so the
// result equals the host update bit for bit for any load type), then every
// thread updates its experts.
template <class Load>
MOE_ROUTE_KERNEL void __launch_bounds__(tuning::bias_update_threads)
    expert_bias_update_kernel(float* bias, const Load* loads, int num_experts, float update_rate) {
  __shared__ double staged[tuning::bias_update_threads];
  __shared__ double mean;
  double total = 0.0;  // meaningful in thread 0
  for (int base = 0; base < num_experts; base += tuning::bias_update_threads) {
    const int e = base + static_cast<int>(threadIdx.x);
    if (e < num_experts) staged[threadIdx.x] = static_cast<double>(loads[e]);
    __syncthreads();
    if (threadIdx.x == 0) {
      const int n = num_experts - base < tuning::bias_update_threads ? num_experts - base : tuning::bias_update_threads;
      for (int i = 0; i < n; ++i) total += staged[i];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) mean = total / num_experts;
  __syncthreads();
  const double m = mean;
  for (int e = static_cast<int>(threadIdx.x); e < num_experts; e += static_cast<int>(blockDim.x)) {
    const double load = static_cast<double>(loads[e]);
    bias[e] += load < m ? update_rate : (load > m ? -update_rate : 0.0f);
  }
}

}  // namespace moe_route::cuda::detail
