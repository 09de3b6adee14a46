// moe_route: the router z-loss (ST-MoE). docs/policies.md section 5.
#pragma once

#include <moe_route/penalty/penalty.hpp>

namespace moe_route::penalty {

// L = c * (1/N) sum_t (logsumexp z_t)^2; dz_t = c * (2/N) * lse_t * softmax(z_t).
// It acts on the logits whatever the gating is.
struct z_loss {
  static constexpr penalty::space space = penalty::space::logits;
  static constexpr const char* name = "z_loss";

  float coefficient = 1e-3f;
};

template <>
inline constexpr bool is_penalty<z_loss> = true;

}  // namespace moe_route::penalty
