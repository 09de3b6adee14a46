// The runtime router calls on the CUDA backend for softmax_after_topk gating, compiled once into
// moe_route::cuda_runtime (src/README.md).
#include <moe_route/runtime/detail/cuda_instantiate.cuh>

MOE_ROUTE_CUDA_RUNTIME_INSTANTIATE(, moe_route::gating::softmax_after_topk)
