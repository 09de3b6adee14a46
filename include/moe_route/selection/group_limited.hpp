// moe_route: group-limited (node-limited) selection, DeepSeek-V3. docs/policies.md section 2.
#pragma once

#include <moe_route/config.hpp>
#include <moe_route/selection/selection.hpp>
#include <moe_route/selection/top_k.hpp>

namespace moe_route::selection {

// The E experts form `groups` equal contiguous groups. A group's score is the
// sum of its `per_group_k` largest keys, added in descending key order; the
// `top_groups` best groups are kept (ties to the lower group index) and the
// top-K runs over their union. Key is the per-expert key policy: top_k (logits),
// by_score (s) or expert_bias (s + b, as DeepSeek-V3 does).
template <class Key = top_k>
struct group_limited {
  static_assert(is_selection<Key> && Key::shape == kind::keyed,
                "group_limited<Key>: Key must be a keyed selection (top_k, by_score or expert_bias)");
  static constexpr kind shape = kind::grouped;
  static constexpr bool needs_expert_bias = Key::needs_expert_bias;
  static constexpr bool needs_scores = Key::needs_scores;
  using key_policy = Key;

  Key inner{};
  int groups = 1;       // G, must divide E
  int top_groups = 1;   // groups kept, 1 <= top_groups <= G
  int per_group_k = 2;  // keys summed per group score, 1 <= per_group_k <= E / G

  MOE_ROUTE_HD static float key(float v, float score, float bias) { return Key::key(v, score, bias); }
};

template <class Key>
inline constexpr bool is_selection<group_limited<Key>> = true;

}  // namespace moe_route::selection
