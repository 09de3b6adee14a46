// moe_route: spreading a framework's runtime-router instantiations over
// translation units. runtime::route/backward/admit instantiate 9 routers and
// 8 admission policies per gating, which is slow to compile in one file.
// Include this header where they are called: it declares the per-gating
// instantiations extern. Then compile, each in its own .cpp,
//   #include <moe_route/runtime_instantiate.hpp>
//   MOE_ROUTE_RUNTIME_INSTANTIATE(, moe_route::gating::softmax)
// and likewise for sigmoid, sqrt_softplus and softmax_after_topk.
#pragma once

#include "runtime.hpp"

#define MOE_ROUTE_RUNTIME_INSTANTIATE(PREFIX, GATING)                                                     \
  PREFIX template moe_route::route_report moe_route::runtime::route_with<GATING>(                         \
      const router_config&, const route_inputs<float>&, const route_outputs&, cpu::execution);            \
  PREFIX template void moe_route::runtime::backward_with<GATING>(const router_config&,                    \
                                                                 const route_inputs<float>&,              \
                                                                 const backward_args&, cpu::execution);   \
  PREFIX template moe_route::admission_report moe_route::runtime::admit_with<GATING>(                     \
      const router_config&, const admission_config&, const admission_inputs<float>&,                      \
      const admission_outputs&, cpu::execution);

MOE_ROUTE_RUNTIME_INSTANTIATE(extern, moe_route::gating::softmax)
MOE_ROUTE_RUNTIME_INSTANTIATE(extern, moe_route::gating::sigmoid)
MOE_ROUTE_RUNTIME_INSTANTIATE(extern, moe_route::gating::sqrt_softplus)
MOE_ROUTE_RUNTIME_INSTANTIATE(extern, moe_route::gating::softmax_after_topk)
