// The two gatings no preset of the driver uses by default; a router_config may still name them.
#include <moe_route/runtime_instantiate.hpp>

MOE_ROUTE_RUNTIME_INSTANTIATE(, moe_route::gating::sqrt_softplus)
MOE_ROUTE_RUNTIME_INSTANTIATE(, moe_route::gating::softmax_after_topk)
