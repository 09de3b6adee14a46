// moe_route: the prior policies a router can carry (RPB section 3). docs/policies.md section 3.
//
// A router holds at most one prior policy in its policy list. It reads the
// prepared table (prior::prepare: b[S x E]) through route_inputs::prior_bias,
// prior_rows and token_prior_row (r(t) in [0, S), or -1 for a token without a
// prior: it is routed as if there were none). The prior is constant: no
// gradient flows into it. In mode::eval a prior policy does nothing, so probes
// of a post-trained router see the router alone.
#pragma once

namespace moe_route::prior {

// RPB soft (eq. 4): z' = z + beta * b[r(t)] in training. With bias_gates (the
// paper's form) z' feeds gating, selection and gate weights, and dL/dz = dL/dz';
// without it z' only selects and the gate weights are the scores of z at the
// selected experts. beta = 0 is plain fine-tuning, bit for bit.
struct log_prior_bias {
  float beta = 1.0f;
  bool bias_gates = true;
};

// RPB hard: in training, a token with a prior row takes the K experts with the
// largest b[r(t)] (ties to the lower expert index), ignoring the router's own
// selection; the gate weights are the unmodified router's scores at those
// experts (normalised and scaled as the router says), so the router is still
// trained through them.
struct prior_override {};

template <class P>
inline constexpr bool is_prior_policy = false;
template <>
inline constexpr bool is_prior_policy<log_prior_bias> = true;
template <>
inline constexpr bool is_prior_policy<prior_override> = true;

}  // namespace moe_route::prior
