// moe_route: the CPU calls of the routers configured at run time
// (runtime/config.hpp):
//
//   route_report runtime::route(config, inputs, outputs, execution)
//   void runtime::backward(config, inputs, backward_args, execution)
//   admission_report runtime::admit(config, admission, inputs, outputs, execution)
//
// The prior fields and the penalty inputs of route_inputs must be given only
// when a policy that reads them is on: route and backward fill the others with
// neutral values (runtime/detail/neutral.hpp) before calling the CPU backend.
// Each call reaches every router of its gating; a framework compiles them once
// (runtime/instantiate.hpp, the library moe_route::runtime).
#pragma once

#include <cstring>
#include <vector>

#include <moe_route/backend/cpu/admit.hpp>
#include <moe_route/backend/cpu/backward.hpp>
#include <moe_route/backend/cpu/route.hpp>
#include <moe_route/runtime/config.hpp>
#include <moe_route/runtime/detail/neutral.hpp>

namespace moe_route::runtime {

namespace detail {

// The neutral inputs in host memory.
struct host_neutral_inputs {
  std::vector<std::uint64_t> storage;  // 8-byte aligned bytes

  route_inputs<float> complete(const router_config& c, const route_inputs<float>& in) {
    const missing_inputs m = find_missing(c, in);
    const neutral_layout l = layout_of(m, in.num_tokens, in.num_experts);
    storage.assign((l.bytes + sizeof(std::uint64_t) - 1) / sizeof(std::uint64_t), 0);
    auto* base = reinterpret_cast<unsigned char*>(storage.data());
    return fill_neutral(m, l, in, base, host_fill{});
  }

  struct host_fill {
    void bytes(void* p, unsigned char value, std::size_t count, const char*) const { std::memset(p, value, count); }
    void floats(float* p, float value, std::size_t count) const { std::fill_n(p, count, value); }
  };
};

}  // namespace detail

// The CPU calls of a runtime router. The *_with<Gating> forms instantiate one
// gating only, so a framework can spread the instantiations over translation
// units (runtime/instantiate.hpp).

// cpu::route with the router of `c`. out.penalty_values holds num_penalties
// doubles in penalty_names order.
template <class Gating>
route_report route_with(const router_config& c, const route_inputs<float>& in, const route_outputs& out,
                        cpu::execution ex) {
  detail::host_neutral_inputs neutral;
  const route_inputs<float> full = neutral.complete(c, in);
  return visit_router_with<Gating>(c, [&](const auto& r) { return cpu::route(r, full, out, ex); });
}

// cpu::backward with the router of `c`, for the same inputs as route().
template <class Gating>
void backward_with(const router_config& c, const route_inputs<float>& in, const backward_args& args,
                   cpu::execution ex) {
  detail::host_neutral_inputs neutral;
  const route_inputs<float> full = neutral.complete(c, in);
  visit_router_with<Gating>(c, [&](const auto& r) { cpu::backward(r, full, args, ex); });
}

// cpu::admit with the policy of `a`, on admission_router<Gating>(c).
template <class Gating>
admission_report admit_with(const router_config& c, const admission_config& a, const admission_inputs<float>& in,
                            const admission_outputs& out, cpu::execution ex) {
  const auto r = admission_router<Gating>(c);
  return visit_admission(a, [&](const auto& p) { return cpu::admit(r, p, in, out, ex); });
}

inline route_report route(const router_config& c, const route_inputs<float>& in, const route_outputs& out,
                          cpu::execution ex = {}) {
  return detail::by_gating(c.gating, [&](auto g) { return route_with<decltype(g)>(c, in, out, ex); });
}

inline void backward(const router_config& c, const route_inputs<float>& in, const backward_args& args,
                     cpu::execution ex = {}) {
  detail::by_gating(c.gating, [&](auto g) { backward_with<decltype(g)>(c, in, args, ex); });
}

inline admission_report admit(const router_config& c, const admission_config& a, const admission_inputs<float>& in,
                              const admission_outputs& out, cpu::execution ex = {}) {
  return detail::by_gating(c.gating, [&](auto g) { return admit_with<decltype(g)>(c, a, in, out, ex); });
}

}  // namespace moe_route::runtime
