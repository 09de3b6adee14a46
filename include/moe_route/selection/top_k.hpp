// moe_route: plain top-K selection. docs/policies.md section 2.
#pragma once

#include <moe_route/config.hpp>
#include <moe_route/selection/selection.hpp>

namespace moe_route::selection {

// The K experts with the largest scores; ties to the lower expert index.
//
// Every gating is strictly increasing in the logit, so ranking by score equals
// ranking by logit wherever the scores are distinct floats. The key is the
// (sanitised) logit itself: it separates experts whose scores round to the same
// float (e.g. sigmoid saturating at 1) and it is available before any
// transcendental is evaluated. NaN logits rank below every number, -inf included.
struct top_k {
  static constexpr kind shape = kind::keyed;
  static constexpr bool needs_expert_bias = false;
  static constexpr bool needs_scores = false;

  MOE_ROUTE_HD static float key(float v, float /*score*/, float /*bias*/) { return v; }
};

template <>
inline constexpr bool is_selection<top_k> = true;

}  // namespace moe_route::selection
