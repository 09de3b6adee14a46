// moe_route: the penalties (auxiliary losses) a router can carry. docs/policies.md
// section 5.
//
// A penalty is a small value type in the router's policy list
// (router<Gating, Selection, MaxK, Policies...>). Its run-time coefficient is
// a data member; a coefficient of 0 skips its work. The forward writes its
// value to route_outputs::penalty_values (in the order of the policy list) and
// the fused backward adds coefficient-scaled dL/dz, times the caller's upstream
// gradient of the value (backward_args::penalty_grads, 1 when null).
//
// Every penalty acts on the *unbiased* logits z and the gating's routing
// distribution p(z) (softmax: the scores; sigmoid and sqrt_softplus: s / sum s;
// softmax_after_topk: the full softmax), never on the prior-biased z'. Rows
// with a NaN or +-inf logit, or whose scores sum to 0, take no part: they are
// left out of every count and sum, and receive no penalty gradient.
// In mode::eval every penalty is inactive (value 0, no gradient).
#pragma once

namespace moe_route::penalty {

// How a penalty's gradient enters dL/dz.
enum class space {
  distribution,  // through p(z), with a per-expert dL/dp shared by all tokens (load_balance, locality)
  prior,         // per token against the token's prior row (kl_to_base, logit_l2)
  logits,        // per token from the logits alone (z_loss)
};

template <class P>
inline constexpr bool is_penalty = false;

}  // namespace moe_route::penalty
