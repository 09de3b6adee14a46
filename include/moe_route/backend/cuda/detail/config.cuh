// moe_route CUDA backend: the qualifier of the per-warp device code.
//
// The agents (agent_route.cuh, agent_backward.cuh) and the warp algorithms
// (warp_reduce.cuh) are templates over a warp-operations type W, so the same
// code runs on a GPU (W = cuda_warp, warp.cuh) and, in development harnesses,
// under a host emulation of a 32-lane warp. Under nvcc they are device
// functions; under a host compiler they are ordinary inline functions. Only
// warp.cuh, kernels.cuh, dispatch.cuh and route.cuh need the CUDA toolkit.
#pragma once

#include <moe_route/config.hpp>

#if defined(__CUDACC__)
#define MOE_ROUTE_CUDA_DEVICE __device__ __forceinline__
#else
#define MOE_ROUTE_CUDA_DEVICE inline
#endif

namespace moe_route::cuda {

// Threads of one warp; the kernels assign one warp to one token.
inline constexpr int warp_threads = 32;
inline constexpr unsigned full_warp_mask = 0xffffffffu;

}  // namespace moe_route::cuda
