// moe_route: sqrt-softplus gating (DeepSeek-V4). docs/policies.md section 1.
#pragma once

#include <moe_route/detail/numerics.hpp>
#include <moe_route/gating/gating.hpp>

namespace moe_route::gating {

// s_e = sqrt(softplus(z_e)), softplus(z) = max(z, 0) + log1p(exp(-|z|));
// ds/dz = sigmoid(z) / (2 s). Where s underflows to 0 (z below about -87, or a
// NaN logit) the derivative's limit, 0, is used. Gates are normalised by default.
struct sqrt_softplus {
  static constexpr kind shape = kind::elementwise;
  static constexpr bool normalize_by_default = true;
  static constexpr const char* name = "sqrt_softplus";

  MOE_ROUTE_HD static float score(float v) { return detail::sqrt(detail::softplus(v)); }
  MOE_ROUTE_HD static float derivative(float v, float s) {
    return s > 0.0f ? detail::div(detail::sigmoid(v), s + s) : 0.0f;
  }
  // log s = log(softplus(z)) / 2 and d(log s)/dz = sigmoid(z) / (2 softplus(z)).
  // Below z = -16, softplus(z) = e^z to within float rounding, so the limits
  // z / 2 and 1/2 are used (they stay finite where softplus underflows).
  MOE_ROUTE_HD static float log_score(float v) { return v < -16.0f ? 0.5f * v : 0.5f * detail::log(detail::softplus(v)); }
  MOE_ROUTE_HD static float log_derivative(float v) {
    return v < -16.0f ? 0.5f : detail::div(detail::sigmoid(v), 2.0f * detail::softplus(v));
  }
};

template <>
inline constexpr bool is_gating<sqrt_softplus> = true;

}  // namespace moe_route::gating
