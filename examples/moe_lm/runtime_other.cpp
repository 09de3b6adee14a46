// The two gatings no preset of the driver uses by default; a router_config may still name them.
#include "runtime_calls.hpp"

MOE_LM_RUNTIME_CALLS(, moe_route::gating::sqrt_softplus)
MOE_LM_RUNTIME_CALLS(, moe_route::gating::softmax_after_topk)
