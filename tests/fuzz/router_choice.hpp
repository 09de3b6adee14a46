// A runtime router configuration chosen by the fuzzer (every gating and
// selection, groups, normalisation, scaling; valid by construction), and the
// test suite's reference spec of it. Shared by the route and training targets;
// the bytes are read in a fixed order, so a committed input keeps its case.
#pragma once

#include <moe_route/runtime/config.hpp>

#include "cpu/reference.hpp"
#include "fuzz_input.hpp"

#include <algorithm>
#include <vector>

namespace fuzz {

// Also chooses E in [1, max_experts], between the selection and the groups.
inline moe_route::runtime::router_config decode_router(input& in, int max_experts, int& E) {
  namespace rt = moe_route::runtime;
  rt::router_config r;
  r.gating = static_cast<rt::gating_kind>(in.in(0, 3));
  r.selection = static_cast<rt::selection_kind>(in.in(0, 5));
  const bool after_topk = r.gating == rt::gating_kind::softmax_after_topk;
  if (after_topk && (rt::selection_uses_bias(r.selection) || r.selection == rt::selection_kind::group_limited_score))
    r.selection = rt::selection_kind::top_k;
  E = in.in(1, max_experts);
  int selectable = E;
  if (rt::selection_is_grouped(r.selection)) {
    std::vector<int> divisors;
    for (int g = 1; g <= std::min(E, 32); ++g)
      if (E % g == 0) divisors.push_back(g);
    r.groups = divisors[in.in(0, static_cast<int>(divisors.size()) - 1)];
    const int size = E / r.groups;
    r.top_groups = in.in(1, r.groups);
    r.per_group_k = in.in(1, size);
    selectable = r.top_groups * size;
  }
  r.top_k = in.in(1, std::min(selectable, rt::router_max_k));
  r.normalize = in.flag();
  const float scalings[] = {1.0f, 2.5f, 0.5f, 16.0f, 1e-3f, 100.0f};
  r.scaling_factor = scalings[in.in(0, 5)];
  return r;
}

inline ref::spec spec_of(const moe_route::runtime::router_config& r) {
  namespace rt = moe_route::runtime;
  ref::spec sp;
  sp.gate = static_cast<ref::gate_kind>(static_cast<int>(r.gating));  // same order
  switch (r.selection) {
    case rt::selection_kind::top_k: case rt::selection_kind::group_limited: sp.key = ref::key_kind::logit; break;
    case rt::selection_kind::expert_bias: case rt::selection_kind::group_limited_bias:
      sp.key = ref::key_kind::biased_score; break;
    case rt::selection_kind::group_limited_score: sp.key = ref::key_kind::score; break;
    case rt::selection_kind::fixed: sp.key = ref::key_kind::fixed; break;
  }
  sp.grouped = rt::selection_is_grouped(r.selection);
  sp.groups = r.groups;
  sp.top_groups = r.top_groups;
  sp.per_group_k = r.per_group_k;
  sp.K = r.top_k;
  sp.normalize = r.normalize;
  sp.scaling = r.scaling_factor;
  return sp;
}

}  // namespace fuzz
