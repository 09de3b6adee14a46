// moe_route: the CUDA runtime-router calls that choose the gating at run time
// (runtime::cuda::route, backward, admit, admit_workspace_bytes), with the
// per-gating instantiations they need declared extern, so that they are
// compiled once, spread over translation units, as runtime_instantiate.hpp
// does for the CPU calls. Include this header where the calls are made. Then
// compile, each in its own .cu,
//   #include <moe_route/backend/cuda/runtime_instantiate.cuh>
//   MOE_ROUTE_CUDA_RUNTIME_INSTANTIATE(, moe_route::gating::softmax)
// and likewise for sigmoid, sqrt_softplus and softmax_after_topk.
#pragma once

#include "runtime.cuh"

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

namespace moe_route::runtime::cuda {

inline void route(const router_config& c, const route_inputs<float>& in, const route_outputs& out, void* scratch,
                  std::size_t scratch_bytes, cudaStream_t stream = 0) {
  runtime::detail::by_gating(c.gating, [&](auto g) { route_with<decltype(g)>(c, in, out, scratch, scratch_bytes, stream); });
}

inline void backward(const router_config& c, const route_inputs<float>& in, const backward_args& args, void* scratch,
                     std::size_t scratch_bytes, cudaStream_t stream = 0) {
  runtime::detail::by_gating(c.gating,
                             [&](auto g) { backward_with<decltype(g)>(c, in, args, scratch, scratch_bytes, stream); });
}

inline std::size_t admit_workspace_bytes(const router_config& c, const admission_config& a, std::int64_t num_tokens,
                                         int num_experts, int num_groups = 1) {
  return runtime::detail::by_gating(c.gating, [&](auto g) {
    return admit_workspace_bytes_with<decltype(g)>(c, a, num_tokens, num_experts, num_groups);
  });
}

inline void admit(const router_config& c, const admission_config& a, const admission_inputs<float>& in,
                  const admission_outputs& out, void* workspace, std::size_t workspace_bytes, cudaStream_t stream = 0) {
  runtime::detail::by_gating(c.gating, [&](auto g) {
    admit_with<decltype(g)>(c, a, in, out, workspace, workspace_bytes, stream);
  });
}

}  // namespace moe_route::runtime::cuda
