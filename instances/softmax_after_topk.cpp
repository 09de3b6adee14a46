#include <moe_route/runtime_instantiate.hpp>

MOE_ROUTE_RUNTIME_INSTANTIATE(, moe_route::gating::softmax_after_topk)
