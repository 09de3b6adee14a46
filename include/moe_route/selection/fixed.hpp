// moe_route: fixed (affinity-free) assignment, CIPHER eq. 3. docs/policies.md section 2.
#pragma once

#include <cstdint>

#include <moe_route/config.hpp>
#include <moe_route/selection/selection.hpp>

namespace moe_route::selection {

// Expert j of token t is (t K + j) mod E, t the token's 0-based position in the
// call: perfectly balanced, blind to the logits. Gate weights are the gating's
// scores at those experts with the router's normalisation and scaling, so the
// logits still receive a gradient.
struct fixed {
  static constexpr kind shape = kind::fixed;
  static constexpr bool needs_expert_bias = false;
  static constexpr bool needs_scores = false;

  MOE_ROUTE_HD static int expert(std::int64_t token, int slot, int top_k, int num_experts) {
    return static_cast<int>((token * top_k + slot) % num_experts);
  }
};

template <>
inline constexpr bool is_selection<fixed> = true;

}  // namespace moe_route::selection
