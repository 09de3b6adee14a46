// The runtime router's CPU calls, instantiated once per gating in
// instantiate_<gating>.cpp so the four heavy translation units build in
// parallel; bindings.cpp sees only these declarations.
#pragma once

#include <moe_route/runtime.hpp>

#define MOE_ROUTE_PY_RUNTIME_CALLS(PREFIX, GATING)                                                        \
  PREFIX template moe_route::route_report moe_route::runtime::route_with<GATING>(                         \
      const router_config&, const route_inputs<float>&, const route_outputs&, cpu::execution);            \
  PREFIX template void moe_route::runtime::backward_with<GATING>(const router_config&,                    \
                                                                 const route_inputs<float>&,              \
                                                                 const backward_args&, cpu::execution);   \
  PREFIX template moe_route::admission_report moe_route::runtime::admit_with<GATING>(                     \
      const router_config&, const admission_config&, const admission_inputs<float>&,                      \
      const admission_outputs&, cpu::execution);

MOE_ROUTE_PY_RUNTIME_CALLS(extern, moe_route::gating::softmax)
MOE_ROUTE_PY_RUNTIME_CALLS(extern, moe_route::gating::sigmoid)
MOE_ROUTE_PY_RUNTIME_CALLS(extern, moe_route::gating::sqrt_softplus)
MOE_ROUTE_PY_RUNTIME_CALLS(extern, moe_route::gating::softmax_after_topk)
