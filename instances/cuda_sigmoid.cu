// The runtime router calls on the CUDA backend for sigmoid gating, compiled once
// when MOE_ROUTE_BUILD_CUDA_RUNTIME is on (instances/README.md).
#include <moe_route/backend/cuda/runtime_instantiate.cuh>

MOE_ROUTE_CUDA_RUNTIME_INSTANTIATE(, moe_route::gating::sigmoid)
