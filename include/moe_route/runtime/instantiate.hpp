// moe_route: the runtime router calls (runtime/cpu.hpp) declared extern.
// runtime::route/backward/admit instantiate 9 routers and 8 admission
// policies per gating, slow to compile: include this header where they are
// called, and link moe_route::runtime, which compiles each gating once
// (src/runtime_<gating>.cpp), or compile in your own project, one .cpp each,
//   #include <moe_route/runtime/instantiate.hpp>
//   MOE_ROUTE_RUNTIME_INSTANTIATE(, moe_route::gating::softmax)
// and likewise for sigmoid, sqrt_softplus and softmax_after_topk.
#pragma once

#include <moe_route/runtime/cpu.hpp>

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
