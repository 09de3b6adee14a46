// moe_route: logit-L2, the logit-space anchor (RPB section 3.3). docs/policies.md section 5.
#pragma once

#include <moe_route/penalty/penalty.hpp>

namespace moe_route::penalty {

// L = c * (1/|T|) sum_{t in T} ||center(z_t) - center(log pi_{r(t)})||^2 with
// the clamped prior; center(log pi) is the prior bias b of prior::prepare
// (route_inputs::prior_bias), so delta_t = center(z_t - b_{r(t)}) and
// dz_t = (2c/|T|) delta_t.
struct logit_l2 {
  static constexpr penalty::space space = penalty::space::prior;
  static constexpr const char* name = "logit_l2";

  float coefficient = 1e-2f;
};

template <>
inline constexpr bool is_penalty<logit_l2> = true;

}  // namespace moe_route::penalty
