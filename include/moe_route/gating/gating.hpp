// moe_route: what every gating policy declares (docs/policies.md section 1).
#pragma once

namespace moe_route::gating {

// How a gating turns logits into scores. The backends implement the three
// shapes of computation; a policy only supplies its elementwise math.
enum class kind {
  elementwise,       // s_e = f(z_e): sigmoid, sqrt_softplus
  row_softmax,       // s = softmax(z) over all experts
  selected_softmax,  // selection on z, gates = softmax over the K selected (Mixtral)
};

template <class G>
inline constexpr bool is_gating = false;

}  // namespace moe_route::gating
