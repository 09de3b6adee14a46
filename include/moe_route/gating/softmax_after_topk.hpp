// moe_route: softmax over the selected experts (Mixtral). docs/policies.md section 1.
#pragma once

#include <moe_route/detail/numerics.hpp>
#include <moe_route/gating/gating.hpp>

namespace moe_route::gating {

// Selection runs on the logits; the K gates are softmax(z_{e_1..e_K}). They sum
// to one, so gate normalisation has no effect; the scaling factor still applies.
// The VJP is the softmax VJP restricted to the K selected logits.
struct softmax_after_topk {
  static constexpr kind shape = kind::selected_softmax;
  static constexpr bool normalize_by_default = false;
  static constexpr const char* name = "softmax_after_topk";

  MOE_ROUTE_HD static float term(float v, float selected_max) { return detail::exp(v - selected_max); }
};

template <>
inline constexpr bool is_gating<softmax_after_topk> = true;

}  // namespace moe_route::gating
