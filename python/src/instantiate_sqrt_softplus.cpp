#include "instantiate.hpp"

MOE_ROUTE_PY_RUNTIME_CALLS(, moe_route::gating::sqrt_softplus)
