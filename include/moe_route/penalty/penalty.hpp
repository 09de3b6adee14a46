// moe_route: what every penalty (auxiliary loss) declares. POLICIES.md section 5.
#pragma once

namespace moe_route::penalty {

template <class P>
inline constexpr bool is_penalty = false;

}  // namespace moe_route::penalty
