// moe_route: auxiliary-loss-free balancing by a per-expert selection bias
// (DeepSeek-V3, Moonlight). docs/policies.md section 2.
#pragma once

#include <cstdint>
#include <string>

#include <moe_route/config.hpp>
#include <moe_route/selection/selection.hpp>
#include <moe_route/types.hpp>

namespace moe_route::selection {

// key_e = s_e + b_e. The bias steers selection only: gate weights use s and no
// gradient flows through b. b is caller-owned fp32 state (route_inputs::expert_bias)
// updated between steps with update().
struct expert_bias {
  static constexpr kind shape = kind::keyed;
  static constexpr bool needs_expert_bias = true;
  static constexpr bool needs_scores = true;

  float update_rate = 1e-3f;  // u in b_e += u * sign(mean load - load_e)

  MOE_ROUTE_HD static float key(float /*v*/, float score, float bias) { return score + bias; }

  // One bias step from per-expert loads (assignment counts or any load measure,
  // all-reduced over data-parallel ranks by the caller if wanted):
  // b_e += u * sign(mean_e' load_e' - load_e). Underloaded experts gain.
  // The mean is taken in double so the result does not depend on E's size.
  template <class Load>
  void update(float* bias, const Load* loads, int num_experts) const {
    if (num_experts <= 0) throw error("moe_route: expert_bias::update: num_experts must be positive");
    if (bias == nullptr) throw error("moe_route: expert_bias::update: bias is null");
    if (loads == nullptr) throw error("moe_route: expert_bias::update: loads is null");
    double total = 0.0;
    for (int e = 0; e < num_experts; ++e) total += static_cast<double>(loads[e]);
    const double mean = total / num_experts;
    for (int e = 0; e < num_experts; ++e) {
      const double load = static_cast<double>(loads[e]);
      bias[e] += load < mean ? update_rate : (load > mean ? -update_rate : 0.0f);
    }
  }
};

template <>
inline constexpr bool is_selection<expert_bias> = true;

}  // namespace moe_route::selection
