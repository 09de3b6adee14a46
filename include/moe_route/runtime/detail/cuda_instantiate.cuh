// moe_route: the per-gating CUDA runtime-router calls (runtime/detail/cuda.cuh) declared
// extern, so that each is compiled once, in its own translation unit, as
// runtime/instantiate.hpp does for the CPU calls:
//   #include <moe_route/runtime/detail/cuda_instantiate.cuh>
//   MOE_ROUTE_CUDA_RUNTIME_INSTANTIATE(, moe_route::gating::softmax)
// and likewise for sigmoid, sqrt_softplus and softmax_after_topk
// (src/cuda_runtime*.cu). The calls that choose the gating at run time
// (runtime/cuda.hpp) are defined over these in src/cuda_runtime.cu.
#pragma once

#include <moe_route/runtime/detail/cuda.cuh>

#define MOE_ROUTE_CUDA_RUNTIME_INSTANTIATE(PREFIX, GATING)                                                  \
  PREFIX template void moe_route::runtime::cuda::route_with<GATING>(                                        \
      const router_config&, const route_inputs<float>&, const route_outputs&, void*, std::size_t,          \
      cudaStream_t);                                                                                        \
  PREFIX template void moe_route::runtime::cuda::backward_with<GATING>(                                     \
      const router_config&, const route_inputs<float>&, const backward_args&, void*, std::size_t,          \
      cudaStream_t);                                                                                        \
  PREFIX template std::size_t moe_route::runtime::cuda::admit_workspace_bytes_with<GATING>(                 \
      const router_config&, const admission_config&, std::int64_t, int, int);                              \
  PREFIX template void moe_route::runtime::cuda::admit_with<GATING>(                                        \
      const router_config&, const admission_config&, const admission_inputs<float>&,                       \
      const admission_outputs&, void*, std::size_t, cudaStream_t);

MOE_ROUTE_CUDA_RUNTIME_INSTANTIATE(extern, moe_route::gating::softmax)
MOE_ROUTE_CUDA_RUNTIME_INSTANTIATE(extern, moe_route::gating::sigmoid)
MOE_ROUTE_CUDA_RUNTIME_INSTANTIATE(extern, moe_route::gating::sqrt_softplus)
MOE_ROUTE_CUDA_RUNTIME_INSTANTIATE(extern, moe_route::gating::softmax_after_topk)
