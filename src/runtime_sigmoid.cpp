// The runtime router calls for sigmoid gating, compiled once into the library
// moe_route::runtime (src/README.md).
#include <moe_route/runtime/instantiate.hpp>

MOE_ROUTE_RUNTIME_INSTANTIATE(, moe_route::gating::sigmoid)
