// moe_route: a gating's routing distribution p(z) on the host (docs/policies.md
// section 1): softmax -> its scores; sigmoid and sqrt_softplus -> s / sum(s);
// softmax_after_topk -> the full softmax of the logits. Used by the prior
// builder and the probability-space penalties.
#pragma once

#include <moe_route/detail/numerics.hpp>
#include <moe_route/detail/reduction.hpp>
#include <moe_route/gating/gating.hpp>
#include <moe_route/gating/softmax.hpp>

namespace moe_route::cpu::detail {

// p[0..n) from sanitised logits v[0..n). A row whose scores sum to 0 (every
// logit NaN, or all scores underflowed) gets p = 0: there is no distribution.
template <class Gating>
void distribution(const float* v, int n, float* p) {
  using namespace moe_route::detail;
  if constexpr (Gating::shape == gating::kind::elementwise) {
    for (int e = 0; e < n; ++e) p[e] = Gating::score(v[e]);
  } else {
    float m = -float_max;
    for (int e = 0; e < n; ++e) m = max(m, v[e]);
    for (int e = 0; e < n; ++e) p[e] = gating::softmax::term(v[e], m);
  }
  const float sum = canonical_sum(p, n);
  for (int e = 0; e < n; ++e) p[e] = sum > 0.0f ? div(p[e], sum) : 0.0f;
}

}  // namespace moe_route::cpu::detail
