// moe_route: a router is a gating policy and a selection policy composed into
// one value type, plus the run-time parameters shared by all of them, plus any
// training policies: at most one prior policy (prior/policy.hpp) and any set of
// distinct penalties (penalty/*.hpp).
#pragma once

#include <cstdint>
#include <type_traits>

#include <moe_route/config.hpp>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/gating/gating.hpp>
#include <moe_route/penalty/penalty.hpp>
#include <moe_route/prior/policy.hpp>
#include <moe_route/selection/selection.hpp>

namespace moe_route {

namespace detail {

// The policies of a router, stored as bases so that each is reached by its
// type (get<P>) and the whole pack stays a trivially copyable aggregate that
// kernels take by value.
template <class... Policies>
struct policy_pack : Policies... {};

template <class P, class... Policies>
inline constexpr bool contains = (std::is_same_v<P, Policies> || ...);

template <class... Policies>
struct all_distinct : std::true_type {};
template <class P, class... Rest>
struct all_distinct<P, Rest...>
    : std::bool_constant<!contains<P, Rest...> && all_distinct<Rest...>::value> {};

}  // namespace detail

// Structure is compile time (which policies, the largest K the generated code
// supports); everything users switch between runs is a data member.
template <class Gating, class Selection, int MaxK = default_max_k, class... Policies>
struct router {
  static_assert(gating::is_gating<Gating>,
                "router<Gating, Selection>: Gating must be a policy from moe_route::gating");
  static_assert(selection::is_selection<Selection>,
                "router<Gating, Selection>: Selection must be a policy from moe_route::selection");
  static_assert(MaxK >= 1 && MaxK <= max_top_k, "router<..., MaxK>: MaxK must be in [1, 32]");
  static_assert(!(Gating::shape == gating::kind::selected_softmax && Selection::needs_scores),
                "softmax_after_topk has scores only after selection, so it cannot be combined with a "
                "selection that keys on scores (expert_bias); use softmax or sigmoid gating instead");
  static_assert(((prior::is_prior_policy<Policies> || penalty::is_penalty<Policies>) && ...),
                "router<..., Policies...>: each policy must be a prior policy (moe_route::prior) or a penalty "
                "(moe_route::penalty)");
  static_assert((0 + ... + int(prior::is_prior_policy<Policies>)) <= 1,
                "router<..., Policies...>: at most one prior policy (log_prior_bias or prior_override)");
  static_assert(detail::all_distinct<Policies...>::value, "router<..., Policies...>: a policy is listed twice");

  using gating_type = Gating;
  using selection_type = Selection;
  static constexpr int max_k = MaxK;

  Gating gating{};
  Selection selection{};
  int top_k = 1;                                   // K, 1 <= K <= min(E, MaxK)
  bool normalize = Gating::normalize_by_default;   // w_k /= (sum_k s_k + 1e-20)
  float scaling_factor = 1.0f;                     // w_k *= scaling_factor (routed scaling factor)
  detail::policy_pack<Policies...> policies{};     // reach one with get<P>(router)

  template <class P>
  static constexpr bool has = detail::contains<P, Policies...>;
  static constexpr int num_penalties = (0 + ... + int(penalty::is_penalty<Policies>));
  static constexpr bool has_prior = (false || ... || prior::is_prior_policy<Policies>);
  static constexpr bool has_penalties = num_penalties > 0;
};

template <class R>
inline constexpr bool is_router = false;
template <class G, class S, int K, class... P>
inline constexpr bool is_router<router<G, S, K, P...>> = true;

// The policy P of a router, to read or change its run-time parameters:
//   get<penalty::z_loss>(r).coefficient = 1e-3f;
template <class P, class G, class S, int K, class... Ps>
MOE_ROUTE_HD constexpr P& get(router<G, S, K, Ps...>& r) {
  static_assert(detail::contains<P, Ps...>, "get<P>(router): P is not one of the router's policies");
  return static_cast<P&>(r.policies);
}
template <class P, class G, class S, int K, class... Ps>
MOE_ROUTE_HD constexpr const P& get(const router<G, S, K, Ps...>& r) {
  static_assert(detail::contains<P, Ps...>, "get<P>(router): P is not one of the router's policies");
  return static_cast<const P&>(r.policies);
}

// The same router (gating, selection, K, normalisation, scaling) with a new
// policy list, e.g. switching a training condition from lbl to rpb:
//   auto rpb = with_policies(base, prior::log_prior_bias{1.0f});
template <class G, class S, int K, class... Old, class... New>
router<G, S, K, New...> with_policies(const router<G, S, K, Old...>& base, New... policies) {
  router<G, S, K, New...> r;
  r.gating = base.gating;
  r.selection = base.selection;
  r.top_k = base.top_k;
  r.normalize = base.normalize;
  r.scaling_factor = base.scaling_factor;
  r.policies = detail::policy_pack<New...>{policies...};
  return r;
}

// The index of penalty P among a router's penalties (its slot in
// route_outputs::penalty_values and backward_args::penalty_grads).
template <class P, class Router>
inline constexpr int penalty_slot = -1;

namespace detail {
template <class P, class... Policies>
constexpr int penalty_index() {
  int index = 0, found = -1;
  ((found = (found < 0 && std::is_same_v<P, Policies>) ? index : found,
    index += penalty::is_penalty<Policies> ? 1 : 0),
   ...);
  return found;
}
}  // namespace detail

template <class P, class G, class S, int K, class... Ps>
inline constexpr int penalty_slot<P, router<G, S, K, Ps...>> = detail::penalty_index<P, Ps...>();

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
    const float neg_dot = negate(dot);  // not -dot: see detail::negate
    for (int j = 0; j < k; ++j) dsel[j] = dsel[j] * fma(scale, dw[j], neg_dot);
  } else if (r.normalize) {
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += selected[j];
    sum += 1e-20f;
    float dot = 0.0f;  // <g, s / S>
    for (int j = 0; j < k; ++j) dot = fma(scale * dw[j], div(selected[j], sum), dot);
    const float neg_dot = negate(dot);  // not -dot: see detail::negate
    for (int j = 0; j < k; ++j) dsel[j] = div(fma(scale, dw[j], neg_dot), sum);
  } else {
    // fma(., ., 0) rounds like a product but cannot be fused into the caller's
    // later subtraction, which would change the bits on one backend only.
    for (int j = 0; j < k; ++j) dsel[j] = fma(scale, dw[j], 0.0f);
  }
}

}  // namespace detail
}  // namespace moe_route
