// moe_route: softmax gating (DeepSeek-V2, Qwen3). docs/policies.md section 1.
#pragma once

#include <moe_route/detail/numerics.hpp>
#include <moe_route/gating/gating.hpp>

namespace moe_route::gating {

// s_e = exp(z_e - max z) / sum_j exp(z_j - max z); VJP: dz = s * (ds - <ds, s>).
// The row sum runs in the canonical 32-lane order (detail/numerics.hpp), so the
// CPU and CUDA backends produce the same bits.
struct softmax {
  static constexpr kind shape = kind::row_softmax;
  static constexpr bool normalize_by_default = false;
  static constexpr const char* name = "softmax";

  // The unnormalised term of expert e given the row maximum.
  MOE_ROUTE_HD static float term(float v, float row_max) { return detail::exp(v - row_max); }
  // term(v, row_max) when row_max is the maximum of v's own sanitised row
  // (v - row_max <= 0): the same bits in fewer steps, for the host's row loops.
  MOE_ROUTE_HD static float row_term(float v, float row_max) { return detail::exp_nonpositive(v - row_max); }
};

template <>
inline constexpr bool is_gating<softmax> = true;

}  // namespace moe_route::gating
