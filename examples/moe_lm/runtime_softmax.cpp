#include "runtime_calls.hpp"

MOE_LM_RUNTIME_CALLS(, moe_route::gating::softmax)
