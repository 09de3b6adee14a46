// moe_route: the gate of every slot after admission, and its VJP.
//
// Notation for one token t with K slots j = 0..K-1:
//   p_j    the routed expert of slot j (route's indices)
//   f_j    the admitted expert: p_j (kept), -1 (dropped) or e' != p_j (rerouted)
//   sigma_j = the gate input of p_j, phi_j = the gate input of f_j, where the
//          gate input of expert e is what detail::gate_weights consumes:
//          the score s_e (softmax: exp(v_e - max) / sum over all E in the
//          canonical order; sigmoid / sqrt_softplus: the elementwise score), or
//          the sanitised logit v_e for softmax_after_topk
//   w_j    the routed gate: w = detail::gate_weights(router, sigma) (what route wrote)
//   scale  router.scaling_factor
//
// 1. The token's normaliser comes from its ROUTED experts, exactly as route
//    computed it, and is never recomputed over the admitted set:
//      normalize on:       S = (sigma_0 + ... + sigma_{K-1}) + 1e-20f     (slot order)
//                          y(x) = div(x, S) * scale   (rounded once, as fma(., scale, 0))
//      softmax_after_topk: M = max_j sigma_j, D = sum_j exp(sigma_j - M)   (slot order)
//                          y(x) = div(exp(x - M), D) * scale   (0 if D = 0: all NaN)
//      otherwise:          y(x) = x * scale
//    so w_j = y(sigma_j) (up to the sign of a zero, which no sum can see).
// 2. base_j = w_j (kept: the routed gate, copied), y(phi_j) (rerouted: "s_{t,e'}
//    put through the same normalisation as the token's other gates"), 0 (dropped).
// 3. Renormalisation (drop policy with renormalize): active iff at least one
//    slot is dropped and W' != 0, with W = sum_j w_j over all K slots and W' =
//    sum of base_j over the surviving slots (both in slot order from 0.0f;
//    every product in these sums is sealed against fma contraction);
//    then g_j = base_j * div(W, W') for survivors. Otherwise g_j = base_j.
//    (A token with no drop is therefore untouched: g = w bit for bit.)
// 4. Dropped slots: g_j = 0.
//
// Gradients (admitted_gate_weights_vjp): dropped slots pass nothing to their
// own expert's score except through the normaliser S / D (and W when
// renormalising); a rerouted slot's gradient flows into the score of its new
// expert f_j, and through the normaliser into the routed experts' scores.
// With no drop and no reroute the VJP equals detail::gate_weights_vjp bit for
// bit. The fused backward recomputes sigma and phi from the logits, the
// routed indices and the admitted indices; cpu::admission_backward
// (backend/cpu/admit.hpp) is the reference.
#pragma once

#include <cstdint>

#include <moe_route/admission/admission.hpp>
#include <moe_route/config.hpp>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/gating/gating.hpp>
#include <moe_route/router.hpp>

namespace moe_route::admission {

namespace detail {

// The normaliser of a token (step 1 above) from its K routed gate inputs.
struct normaliser {
  float max = 0.0f;  // softmax_after_topk: M
  float sum = 0.0f;  // S (with the 1e-20f) or D
};

template <class Router>
MOE_ROUTE_HD normaliser make_normaliser(const Router& r, const float* sigma, int k) {
  using G = typename Router::gating_type;
  normaliser n;
  if constexpr (G::shape == gating::kind::selected_softmax) {
    float m = -moe_route::detail::float_max;
    for (int j = 0; j < k; ++j) m = moe_route::detail::max(m, sigma[j]);
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += G::term(sigma[j], m);
    n.max = m;
    n.sum = sum;
  } else if (r.normalize) {
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += sigma[j];
    n.sum = sum + 1e-20f;
  }
  return n;
}

// y(x): one value through the token's normaliser, then the scaling factor.
// The final product is sealed as fma(a, scale, 0) (numerics.md): the caller
// sums these values, and no compiler may fuse the product into that sum.
template <class Router>
MOE_ROUTE_HD float normalised(const Router& r, const normaliser& n, float x) {
  using G = typename Router::gating_type;
  if constexpr (G::shape == gating::kind::selected_softmax)  // D = 0: every routed logit NaN, no distribution
    return n.sum > 0.0f ? moe_route::detail::fma(moe_route::detail::div(G::term(x, n.max), n.sum), r.scaling_factor, 0.0f)
                        : 0.0f;
  else if (r.normalize)
    return moe_route::detail::fma(moe_route::detail::div(x, n.sum), r.scaling_factor, 0.0f);
  else
    return moe_route::detail::fma(x, r.scaling_factor, 0.0f);
}

// acc + x written as fma(x, 1, acc): the same value (x * 1 is exact), but a
// product that computed x can no longer be contracted into the addition.
MOE_ROUTE_HD float add_sealed(float acc, float x) { return moe_route::detail::fma(x, 1.0f, acc); }

// num / S for a routed gate input's gradient (normalize on, S >= 1e-20). When
// every routed gate input is about 0 (S near 1e-20) and a slot is rerouted to
// a real score, a finite num gives a quotient beyond the float range. It is
// then held at +-FLT_MAX: it reaches dL/dz only times the derivative of a
// routed score that is about 0 (at most about S), where an infinity would make
// 0 * inf = NaN of a gradient whose limit is 0. Infinite or NaN num pass as is.
MOE_ROUTE_HD float over_normaliser(float num, float sum) {
  const float q = moe_route::detail::div(num, sum);
  if (moe_route::detail::is_finite(num) && !moe_route::detail::is_finite(q))
    return q > 0.0f ? moe_route::detail::float_max : -moe_route::detail::float_max;
  return q;
}

}  // namespace detail

// The admitted gates g[0..k) of one token (the rule above).
//   w        the routed gates [k] (route's output for this token)
//   sigma    gate inputs of the routed experts [k]; phi: of the admitted
//            experts [k] (only rerouted entries are read). Both are read only
//            if some slot is rerouted, and may be null otherwise.
//   routed / admitted   the token's routed and admitted indices [k]
template <class Router>
MOE_ROUTE_HD void admitted_gate_weights(const Router& r, const float* w, const float* sigma, const float* phi,
                                        const std::int32_t* routed, const std::int32_t* admitted, bool renormalize,
                                        float* g, int k) {
  bool any_dropped = false, any_rerouted = false;
  for (int j = 0; j < k; ++j) {
    const slot_status s = status_of(routed[j], admitted[j]);
    any_dropped |= s == slot_status::dropped;
    any_rerouted |= s == slot_status::rerouted;
  }
  detail::normaliser n;
  if (any_rerouted) n = detail::make_normaliser(r, sigma, k);
  for (int j = 0; j < k; ++j) {
    const slot_status s = status_of(routed[j], admitted[j]);
    g[j] = s == slot_status::kept ? w[j] : (s == slot_status::rerouted ? detail::normalised(r, n, phi[j]) : 0.0f);
  }
  if (renormalize && any_dropped) {
    float total = 0.0f, survived = 0.0f;
    for (int j = 0; j < k; ++j) total = detail::add_sealed(total, w[j]);
    for (int j = 0; j < k; ++j) survived = detail::add_sealed(survived, g[j]);  // dropped slots hold 0.0f
    if (survived != 0.0f) {
      const float ratio = moe_route::detail::div(total, survived);
      for (int j = 0; j < k; ++j) g[j] = g[j] * ratio;
    }
  }
}

// The VJP of admitted_gate_weights with w = detail::gate_weights(r, sigma):
// from dL/dg [k] to dL/dsigma [k] (gradient with respect to the gate input of
// the routed expert p_j) and dL/dphi [k] (gradient with respect to the gate
// input of the admitted expert f_j; 0 unless slot j was rerouted; for a kept
// slot the whole gradient is in d_sigma). dL/dg of dropped slots is ignored.
// sigma [k] is always read; phi only at rerouted slots.
template <class Router>
MOE_ROUTE_HD void admitted_gate_weights_vjp(const Router& r, const float* sigma, const float* phi,
                                            const std::int32_t* routed, const std::int32_t* admitted,
                                            bool renormalize, const float* dg, float* d_sigma, float* d_phi, int k) {
  using G = typename Router::gating_type;
  const float scale = r.scaling_factor;
  bool any_dropped = false;
  for (int j = 0; j < k; ++j) any_dropped |= status_of(routed[j], admitted[j]) == slot_status::dropped;

  // Forward quantities: the routed gates w, the pre-renormalisation gates base.
  float w[max_top_k], base[max_top_k];
  moe_route::detail::gate_weights(r, sigma, w, k);
  const detail::normaliser n = detail::make_normaliser(r, sigma, k);
  for (int j = 0; j < k; ++j) {
    const slot_status s = status_of(routed[j], admitted[j]);
    base[j] = s == slot_status::kept ? w[j] : (s == slot_status::rerouted ? detail::normalised(r, n, phi[j]) : 0.0f);
  }

  // dL/dw (as a function of sigma) in d_sigma, dL/dbase of rerouted slots in d_phi.
  float total = 0.0f, survived = 0.0f;
  if (renormalize && any_dropped) {
    for (int j = 0; j < k; ++j) total = detail::add_sealed(total, w[j]);
    for (int j = 0; j < k; ++j) survived = detail::add_sealed(survived, base[j]);
  }
  if (renormalize && any_dropped && survived != 0.0f) {
    // g_j = base_j * rho, rho = W / W':  dL/dbase_j = rho (dg_j - c), dL/dw_j += c, c = R / W'.
    const float rho = moe_route::detail::div(total, survived);
    float dot = 0.0f;  // R = sum over survivors of dg_j * base_j
    for (int j = 0; j < k; ++j)
      if (status_of(routed[j], admitted[j]) != slot_status::dropped) dot = moe_route::detail::fma(dg[j], base[j], dot);
    const float c = moe_route::detail::div(dot, survived);
    for (int j = 0; j < k; ++j) {
      const slot_status s = status_of(routed[j], admitted[j]);
      const float through = moe_route::detail::fma(rho, dg[j] - c, 0.0f);  // sealed: added to c below
      d_sigma[j] = (s == slot_status::kept ? through : 0.0f) + c;
      d_phi[j] = s == slot_status::rerouted ? through : 0.0f;
    }
  } else {
    for (int j = 0; j < k; ++j) {
      const slot_status s = status_of(routed[j], admitted[j]);
      d_sigma[j] = s == slot_status::kept ? dg[j] : 0.0f;
      d_phi[j] = s == slot_status::rerouted ? dg[j] : 0.0f;
    }
  }

  // Back through y(.) and the normaliser. The order of every sum is the order
  // of detail::gate_weights_vjp (slot order), then the rerouted slots.
  if constexpr (G::shape == gating::kind::selected_softmax) {
    float q[max_top_k], qn[max_top_k];
    for (int j = 0; j < k; ++j) {  // as detail::gate_weights_vjp: q = 0 when D = 0
      q[j] = n.sum > 0.0f ? moe_route::detail::div(G::term(sigma[j], n.max), n.sum) : 0.0f;
      qn[j] = status_of(routed[j], admitted[j]) == slot_status::rerouted && n.sum > 0.0f
                  ? moe_route::detail::div(G::term(phi[j], n.max), n.sum)
                  : 0.0f;
    }
    float dot = 0.0f;
    for (int j = 0; j < k; ++j) dot = moe_route::detail::fma(q[j], scale * d_sigma[j], dot);
    for (int j = 0; j < k; ++j)
      if (status_of(routed[j], admitted[j]) == slot_status::rerouted)
        dot = moe_route::detail::fma(qn[j], scale * d_phi[j], dot);
    const float neg_dot = moe_route::detail::negate(dot);  // not -dot: see detail::negate
    for (int j = 0; j < k; ++j) {
      d_sigma[j] = q[j] * moe_route::detail::fma(scale, d_sigma[j], neg_dot);
      d_phi[j] = qn[j] * (scale * d_phi[j]);
    }
  } else if (r.normalize) {
    const float sum = n.sum;
    float dot = 0.0f;
    for (int j = 0; j < k; ++j)
      dot = moe_route::detail::fma(scale * d_sigma[j], moe_route::detail::div(sigma[j], sum), dot);
    for (int j = 0; j < k; ++j)
      if (status_of(routed[j], admitted[j]) == slot_status::rerouted)
        dot = moe_route::detail::fma(scale * d_phi[j], moe_route::detail::div(phi[j], sum), dot);
    const float neg_dot = moe_route::detail::negate(dot);  // not -dot: see detail::negate
    for (int j = 0; j < k; ++j) {
      d_sigma[j] = detail::over_normaliser(moe_route::detail::fma(scale, d_sigma[j], neg_dot), sum);
      d_phi[j] = moe_route::detail::div(scale * d_phi[j], sum);
    }
  } else {
    for (int j = 0; j < k; ++j) {
      d_sigma[j] = moe_route::detail::fma(scale, d_sigma[j], 0.0f);
      d_phi[j] = moe_route::detail::fma(scale, d_phi[j], 0.0f);
    }
  }
}

}  // namespace moe_route::admission
