// moe_route: the per-token quantities admission needs, shared by the CPU and
// CUDA backends so both compute the same fp32 bits: the row statistics of a
// softmax, the router's gate inputs (the values detail::gate_weights consumes)
// and the affinity a(t, e) of every admission policy.
#pragma once

#include <cstdint>

#include <moe_route/admission/admission.hpp>
#include <moe_route/config.hpp>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/detail/reduction.hpp>
#include <moe_route/gating/gating.hpp>
#include <moe_route/gating/softmax.hpp>
#include <moe_route/types.hpp>

namespace moe_route::admission {

// Softmax statistics of one row of sanitised logits v: the maximum (starting
// from -FLT_MAX, so a row of NaNs keeps a finite maximum) and the sum of
// exp(v_e - max) in the canonical 32-lane order (detail/numerics.hpp). These
// are the bits backend/cpu/detail/rows.hpp and the CUDA warps compute.
struct row_stats {
  float max = 0.0f;
  float sum = 0.0f;
};

// Host: the statistics of v[0..n), v already sanitised. `terms` is scratch of n floats.
inline row_stats softmax_row_stats(const float* v, int n, float* terms) {
  float m = -moe_route::detail::float_max;
  for (int e = 0; e < n; ++e) m = moe_route::detail::max(m, v[e]);
  for (int e = 0; e < n; ++e) terms[e] = gating::softmax::row_term(v[e], m);
  return {m, moe_route::detail::canonical_sum(terms, n)};
}

// Whether a gating's gate inputs need the row statistics (row softmax), and
// whether its probability affinity does (row softmax, and softmax_after_topk,
// whose distribution is the full softmax).
template <class Gating>
inline constexpr bool gate_input_needs_row = Gating::shape == gating::kind::row_softmax;
template <class Gating>
inline constexpr bool probability_needs_row = Gating::shape != gating::kind::elementwise;

// The row-softmax score of expert e from its term (gating::softmax::term(v_e,
// max), which softmax_row_stats writes into `terms`): the canonical
// div(exp(v - max), sum), 0 if sum is 0. A caller holding the terms gets the
// same bits without a second exp.
MOE_ROUTE_HD float softmax_score_from_term(float term, const row_stats& st) {
  return st.sum > 0.0f ? moe_route::detail::div(term, st.sum) : 0.0f;
}

// The value the router's detail::gate_weights consumes for expert e: the score
// s_e (softmax: div(exp(v - max), sum), 0 if sum is 0; elementwise: the
// gating's score), or for softmax_after_topk the sanitised logit itself.
template <class Gating>
MOE_ROUTE_HD float gate_input(float v, const row_stats& st) {
  if constexpr (Gating::shape == gating::kind::row_softmax)
    return softmax_score_from_term(Gating::term(v, st.max), st);
  else if constexpr (Gating::shape == gating::kind::elementwise)
    return Gating::score(v);
  else
    return v;
}

// The probability affinity s_{t,e}: the gating's score, the full softmax for
// softmax_after_topk.
template <class Gating>
MOE_ROUTE_HD float probability_score(float v, const row_stats& st) {
  if constexpr (Gating::shape == gating::kind::elementwise)
    return Gating::score(v);
  else
    return softmax_score_from_term(gating::softmax::term(v, st.max), st);
}

// a(t, e) from the sanitised logit v = v_{t,e}, the row statistics (probability
// affinity with a softmax-shaped gating only) and the norms (cosine only).
template <class Affinity, class Gating>
MOE_ROUTE_HD float affinity_value(float v, const row_stats& st, float hidden_norm, float weight_norm) {
  static_assert(Affinity::kind != affinity_kind::gate, "the gate affinity is a routed slot's (slot_affinity)");
  if constexpr (Affinity::kind == affinity_kind::position) {
    (void)v, (void)st, (void)hidden_norm, (void)weight_norm;
    return 0.0f;  // every candidate ties; the token index decides
  } else if constexpr (Affinity::kind == affinity_kind::logit) {
    (void)st, (void)hidden_norm, (void)weight_norm;
    return v;
  } else if constexpr (Affinity::kind == affinity_kind::cosine) {
    (void)st;
    return moe_route::detail::div(v, hidden_norm * weight_norm);
  } else {
    (void)hidden_norm, (void)weight_norm;
    return probability_score<Gating>(v, st);
  }
}

// a(t, e) of a routed slot whose router gate is `routed_gate`: that gate,
// sanitised, for the gate affinity; affinity_value for every other.
template <class Affinity, class Gating>
MOE_ROUTE_HD float slot_affinity(float v, const row_stats& st, float hidden_norm, float weight_norm,
                                 float routed_gate) {
  if constexpr (Affinity::kind == affinity_kind::gate) {
    (void)v, (void)st, (void)hidden_norm, (void)weight_norm;
    return moe_route::detail::sanitize(routed_gate);
  } else {
    (void)routed_gate;
    return affinity_value<Affinity, Gating>(v, st, hidden_norm, weight_norm);
  }
}

// Whether a norm can divide a cosine: finite and > 0.
MOE_ROUTE_HD bool valid_norm(float n) { return n > 0.0f && moe_route::detail::is_finite(n); }

// Host convenience (tests, tools): the exact affinity a(t, e) admission uses
// for one token's logit row z[0..E) and expert e. Recomputes the row
// statistics on every call.
template <class Affinity, class Router, class T>
float affinity_of(const Router&, const T* z, int num_experts, int e, float hidden_norm = 1.0f,
                  float weight_norm = 1.0f) {
  using G = typename Router::gating_type;
  row_stats st;
  if constexpr (Affinity::kind == affinity_kind::probability && probability_needs_row<G>) {
    float v[max_experts], t[max_experts];
    for (int j = 0; j < num_experts; ++j) v[j] = moe_route::detail::sanitize(moe_route::detail::to_float(z[j]));
    st = softmax_row_stats(v, num_experts, t);
  }
  const float v = moe_route::detail::sanitize(moe_route::detail::to_float(z[e]));
  return affinity_value<Affinity, G>(v, st, hidden_norm, weight_norm);
}

}  // namespace moe_route::admission
