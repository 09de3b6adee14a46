// moe_route: sigmoid gating (DeepSeek-V3, Moonlight). docs/policies.md section 1.
#pragma once

#include <moe_route/detail/numerics.hpp>
#include <moe_route/gating/gating.hpp>

namespace moe_route::gating {

// s_e = 1 / (1 + exp(-z_e)); ds/dz = s (1 - s). Gates are normalised by default.
struct sigmoid {
  static constexpr kind shape = kind::elementwise;
  static constexpr bool normalize_by_default = true;
  static constexpr const char* name = "sigmoid";

  MOE_ROUTE_HD static float score(float v) { return detail::sigmoid(v); }
  // ds/dz at a logit whose score is s.
  MOE_ROUTE_HD static float derivative(float /*v*/, float s) { return s * (1.0f - s); }
  // log s and d(log s)/dz, for the distribution-space penalties:
  // log sigmoid(z) = -softplus(-z), d/dz = sigmoid(-z).
  MOE_ROUTE_HD static float log_score(float v) { return -detail::softplus(-v); }
  MOE_ROUTE_HD static float log_derivative(float v) { return detail::sigmoid(-v); }
};

template <>
inline constexpr bool is_gating<sigmoid> = true;

}  // namespace moe_route::gating
