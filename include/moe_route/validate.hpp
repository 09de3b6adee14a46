// moe_route: host-side argument validation shared by every backend. A call
// that fails validation throws moe_route::error before writing any output.
#pragma once

#include <cmath>
#include <string>

#include "config.hpp"
#include "router.hpp"
#include "types.hpp"

namespace moe_route::detail {

[[noreturn]] inline void fail(const std::string& what) { throw error("moe_route: " + what); }

template <class Router>
void validate_router(const Router& r, int num_experts) {
  using S = typename Router::selection_type;
  if (num_experts < 1 || num_experts > max_experts)
    fail("num_experts (= " + std::to_string(num_experts) + ") must be in [1, " + std::to_string(max_experts) + "]");
  if (r.top_k < 1 || r.top_k > Router::max_k)
    fail("top_k (= " + std::to_string(r.top_k) + ") must be in [1, " + std::to_string(Router::max_k) +
         "], the router's compiled bound MaxK");
  if (r.top_k > num_experts)
    fail("top_k (= " + std::to_string(r.top_k) + ") must not exceed num_experts (= " + std::to_string(num_experts) + ")");
  if (!std::isfinite(r.scaling_factor))
    fail("scaling_factor must be finite");
  if constexpr (S::shape == selection::kind::grouped) {
    const auto& g = r.selection;
    if (g.groups < 1 || num_experts % g.groups != 0)
      fail("selection.groups (= " + std::to_string(g.groups) + ") must be positive and divide num_experts (= " +
           std::to_string(num_experts) + ")");
    if (g.groups > reduction_lanes)
      fail("selection.groups (= " + std::to_string(g.groups) + ") must be at most 32");
    const int group_size = num_experts / g.groups;
    if (g.top_groups < 1 || g.top_groups > g.groups)
      fail("selection.top_groups (= " + std::to_string(g.top_groups) + ") must be in [1, groups = " +
           std::to_string(g.groups) + "]");
    if (g.per_group_k < 1 || g.per_group_k > group_size)
      fail("selection.per_group_k (= " + std::to_string(g.per_group_k) + ") must be in [1, experts per group = " +
           std::to_string(group_size) + "]");
    if (g.top_groups * group_size < r.top_k)
      fail("top_k (= " + std::to_string(r.top_k) + ") exceeds the experts in the kept groups (top_groups * E / groups = " +
           std::to_string(g.top_groups * group_size) + ")");
  }
}

template <class Router, class T>
void validate_inputs(const Router& r, const route_inputs<T>& in) {
  using S = typename Router::selection_type;
  if (in.num_tokens < 0) fail("num_tokens (= " + std::to_string(in.num_tokens) + ") must be >= 0");
  validate_router(r, in.num_experts);
  if (in.num_tokens > 0 && in.logits == nullptr) fail("logits is null");
  if constexpr (S::needs_expert_bias) {
    if (in.expert_bias == nullptr) fail("expert_bias is null, but the selection policy needs it");
  }
}

template <class Router, class T>
void validate_route(const Router& r, const route_inputs<T>& in, const route_outputs& out) {
  validate_inputs(r, in);
  if (in.num_tokens > 0 && out.indices == nullptr) fail("indices (output) is null");
  if (in.num_tokens > 0 && out.gates == nullptr) fail("gates (output) is null");
}

template <class Router, class T>
void validate_backward(const Router& r, const route_inputs<T>& in, const backward_args& b) {
  validate_inputs(r, in);
  if (in.num_tokens == 0) return;
  if (b.indices == nullptr) fail("indices is null");
  if (b.grad_gates == nullptr) fail("grad_gates is null");
  if (b.grad_logits == nullptr) fail("grad_logits (output) is null");
}

}  // namespace moe_route::detail
