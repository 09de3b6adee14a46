// moe_lm: the library's run-time router calls, instantiated once per gating
// in runtime_<gating>.cpp (translation units without LibTorch), so the torch
// translation units only see these declarations.
#pragma once

#include <moe_route/runtime.hpp>

#define MOE_LM_RUNTIME_CALLS(PREFIX, GATING)                                                               \
  PREFIX template moe_route::route_report moe_route::runtime::route_with<GATING>(                          \
      const router_config&, const route_inputs<float>&, const route_outputs&, cpu::execution);             \
  PREFIX template void moe_route::runtime::backward_with<GATING>(const router_config&,                     \
                                                                 const route_inputs<float>&,               \
                                                                 const backward_args&, cpu::execution);    \
  PREFIX template moe_route::admission_report moe_route::runtime::admit_with<GATING>(                      \
      const router_config&, const admission_config&, const admission_inputs<float>&,                       \
      const admission_outputs&, cpu::execution);

MOE_LM_RUNTIME_CALLS(extern, moe_route::gating::softmax)
MOE_LM_RUNTIME_CALLS(extern, moe_route::gating::sigmoid)
MOE_LM_RUNTIME_CALLS(extern, moe_route::gating::sqrt_softplus)
MOE_LM_RUNTIME_CALLS(extern, moe_route::gating::softmax_after_topk)
