// moe_route: what every selection policy declares (docs/policies.md section 2).
#pragma once

namespace moe_route::selection {

// How a selection picks experts. The backends implement the three shapes.
enum class kind {
  keyed,    // top-K of a per-expert key; ties to the lower expert index
  grouped,  // keyed, restricted to the best groups of experts (DeepSeek-V3)
  fixed,    // experts fixed by token position (CIPHER eq. 3), no key at all
};

template <class S>
inline constexpr bool is_selection = false;

}  // namespace moe_route::selection
