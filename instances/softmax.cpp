// The runtime router calls for softmax gating, compiled once for the project's own
// executables (instances/README.md).
#include <moe_route/runtime_instantiate.hpp>

MOE_ROUTE_RUNTIME_INSTANTIATE(, moe_route::gating::softmax)
