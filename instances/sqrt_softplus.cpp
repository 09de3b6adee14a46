// The runtime router calls for sqrt_softplus gating, compiled once for the project's own
// executables (instances/README.md).
#include <moe_route/runtime_instantiate.hpp>

MOE_ROUTE_RUNTIME_INSTANTIATE(, moe_route::gating::sqrt_softplus)
