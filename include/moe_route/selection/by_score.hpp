// moe_route: selection keyed on the gating score. docs/policies.md section 2.
#pragma once

#include <moe_route/config.hpp>
#include <moe_route/selection/selection.hpp>

namespace moe_route::selection {

// key_e = s_e, the gating's score (softmax: the full softmax; sigmoid,
// sqrt_softplus: the elementwise score). Alone it ranks as top_k except where
// scores round to the same float; its use is as the key of group_limited,
// whose group scores then sum scores (Megatron-Core's grouped routing under
// moe_router_pre_softmax=True or an unbiased sigmoid) rather than logits.
struct by_score {
  static constexpr kind shape = kind::keyed;
  static constexpr bool needs_expert_bias = false;
  static constexpr bool needs_scores = true;

  MOE_ROUTE_HD static float key(float /*v*/, float score, float /*bias*/) { return score; }
};

template <>
inline constexpr bool is_selection<by_score> = true;

}  // namespace moe_route::selection
