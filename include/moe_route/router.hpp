// moe_route: a router is a gating policy and a selection policy composed into
// one value type, plus the run-time parameters shared by all of them.
#pragma once

#include <cstdint>

#include "config.hpp"
#include "detail/numerics.hpp"
#include "gating/gating.hpp"
#include "selection/selection.hpp"

namespace moe_route {

// Structure is compile time (which policies, the largest K the generated code
// supports); everything users switch between runs is a data member.
template <class Gating, class Selection, int MaxK = 16>
struct router {
  static_assert(gating::is_gating<Gating>,
                "router<Gating, Selection>: Gating must be a policy from moe_route::gating");
  static_assert(selection::is_selection<Selection>,
                "router<Gating, Selection>: Selection must be a policy from moe_route::selection");
  static_assert(MaxK >= 1 && MaxK <= max_top_k, "router<..., MaxK>: MaxK must be in [1, 32]");
  static_assert(!(Gating::shape == gating::kind::selected_softmax && Selection::needs_scores),
                "softmax_after_topk has scores only after selection, so it cannot be combined with a "
                "selection that keys on scores (expert_bias); use softmax or sigmoid gating instead");

  using gating_type = Gating;
  using selection_type = Selection;
  static constexpr int max_k = MaxK;

  Gating gating{};
  Selection selection{};
  int top_k = 1;                                   // K, 1 <= K <= min(E, MaxK)
  bool normalize = Gating::normalize_by_default;   // w_k /= (sum_k s_k + 1e-20)
  float scaling_factor = 1.0f;                     // w_k *= scaling_factor (routed scaling factor)
};

template <class R>
inline constexpr bool is_router = false;
template <class G, class S, int K>
inline constexpr bool is_router<router<G, S, K>> = true;

namespace detail {

// Gate weights of one token from the scores of its K selected experts, in the
// order they were selected. For selected_softmax `selected` holds the selected
// sanitised logits instead. Sums run in slot order on every backend.
template <class Router>
MOE_ROUTE_HD void gate_weights(const Router& r, const float* selected, float* w, int k) {
  if constexpr (Router::gating_type::shape == gating::kind::selected_softmax) {
    float m = -float_max;
    for (int j = 0; j < k; ++j) m = max(m, selected[j]);
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
      w[j] = Router::gating_type::term(selected[j], m);
      sum += w[j];
    }
    // sum = 0 only if every selected logit is NaN: no distribution, gates 0.
    for (int j = 0; j < k; ++j) w[j] = sum > 0.0f ? div(w[j], sum) * r.scaling_factor : 0.0f;
  } else if (r.normalize) {
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += selected[j];
    sum += 1e-20f;
    for (int j = 0; j < k; ++j) w[j] = div(selected[j], sum) * r.scaling_factor;
  } else {
    for (int j = 0; j < k; ++j) w[j] = selected[j] * r.scaling_factor;
  }
}

// The VJP of gate_weights: dL/d(selected) from dL/dw for one token.
template <class Router>
MOE_ROUTE_HD void gate_weights_vjp(const Router& r, const float* selected, const float* dw, float* dsel,
                                   int k) {
  const float scale = r.scaling_factor;
  if constexpr (Router::gating_type::shape == gating::kind::selected_softmax) {
    float m = -float_max;
    for (int j = 0; j < k; ++j) m = max(m, selected[j]);
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
      dsel[j] = Router::gating_type::term(selected[j], m);  // q_j * sum, held temporarily
      sum += dsel[j];
    }
    float dot = 0.0f;  // <q, g>, g = scale * dw
    for (int j = 0; j < k; ++j) {
      dsel[j] = sum > 0.0f ? div(dsel[j], sum) : 0.0f;
      dot = fma(dsel[j], scale * dw[j], dot);
    }
    for (int j = 0; j < k; ++j) dsel[j] = dsel[j] * fma(scale, dw[j], -dot);
  } else if (r.normalize) {
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += selected[j];
    sum += 1e-20f;
    float dot = 0.0f;  // <g, s / S>
    for (int j = 0; j < k; ++j) dot = fma(scale * dw[j], div(selected[j], sum), dot);
    for (int j = 0; j < k; ++j) dsel[j] = div(fma(scale, dw[j], -dot), sum);
  } else {
    // fma(., ., 0) rounds like a product but cannot be fused into the caller's
    // later subtraction, which would change the bits on one backend only.
    for (int j = 0; j < k; ++j) dsel[j] = fma(scale, dw[j], 0.0f);
  }
}

}  // namespace detail
}  // namespace moe_route
