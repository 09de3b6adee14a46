// moe_route: KL-to-base, the distribution-space anchor (RPB section 3.3). docs/policies.md section 5.
#pragma once

#include <moe_route/penalty/penalty.hpp>

namespace moe_route::penalty {

// L = c * (1/|T|) sum_{t in T} KL(pi_{r(t)} || p(z_t)), T = the tokens with a
// prior row (route_inputs::token_prior_row >= 0), pi = the clamped,
// renormalised prior (prior::prepare's `probs`, route_inputs::prior_probs).
// Softmax gating: dz_t = (c/|T|) (p_t - pi); other gatings through the VJP of
// their distribution s / sum s.
struct kl_to_base {
  static constexpr penalty::space space = penalty::space::prior;
  static constexpr const char* name = "kl_to_base";

  float coefficient = 1e-2f;
};

template <>
inline constexpr bool is_penalty<kl_to_base> = true;

}  // namespace moe_route::penalty
