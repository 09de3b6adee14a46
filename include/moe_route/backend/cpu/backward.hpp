// moe_route CPU backend: the fused backward,
//   void cpu::backward(router, inputs, backward_args, execution)
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <moe_route/admission/detail/validate.hpp>
#include <moe_route/backend/cpu/detail/rows.hpp>
#include <moe_route/backend/cpu/detail/threads.hpp>
#include <moe_route/backend/cpu/detail/training.hpp>
#include <moe_route/backend/cpu/execution.hpp>
#include <moe_route/detail/validate.hpp>
#include <moe_route/router.hpp>
#include <moe_route/types.hpp>

MOE_ROUTE_CPU_SIMD_WARNINGS_OFF

namespace moe_route::cpu {

// Fused backward: dL/dz [N x E] from dL/dgates [N x K] in one pass over the
// logits, plus the penalties' gradients. The indices must be those the forward
// wrote for the same inputs, and the workspace the one it filled. With
// args.admitted_indices the gates are those of admission (cpu::admit) and the
// gradient follows admission/gates.hpp: dropped slots pass nothing but their
// share of the normaliser, rerouted ones flow into their new expert's score.
template <class Router, class T>
void backward(const Router& r, const route_inputs<T>& in, const backward_args& args, execution ex = {}) {
  static_assert(is_router<Router>, "cpu::backward: the first argument must be a moe_route::router");
  moe_route::detail::validate_backward(r, in, args);
  moe_route::detail::validate_training_values(r, in);
  const int num_experts = in.num_experts;
  const int k = r.top_k;
  const std::int64_t entries = in.num_tokens * k;
  for (std::int64_t i = 0; i < entries; ++i)
    if (!moe_route::detail::token_masked(in.token_mask, i / k) && (args.indices[i] < 0 || args.indices[i] >= num_experts))
      moe_route::detail::fail("indices[" + std::to_string(i) + "] (= " + std::to_string(args.indices[i]) +
                              ") is not an expert in [0, num_experts)");
  if (args.admitted_indices != nullptr) admission::detail::validate_admitted(args, in.num_tokens, k, num_experts, in.token_mask);
  const penalty::switches on = penalty::active(r, in);
  const bool penalties = Router::has_penalties && on.any() && in.num_tokens > 0;
  std::optional<detail::workspace_view> ws;
  penalty::token_weights weights;
  if constexpr (Router::has_penalties) {
    if (penalties) {
      ws.emplace(args.workspace, penalty::training_layout<Router>(in.num_tokens, num_experts, in.num_sequences));
      const penalty::upstream_grads up = detail::upstream_of<Router>(args);
      if (on.distribution) detail::distribution_grads(r, in, up, *ws);
      weights = penalty::weights(r, *ws->header, up);
    }
  }
  detail::for_token_blocks(in.num_tokens, in.num_experts, ex, [&](std::int64_t begin, std::int64_t end, int,
                                                   detail::row_scratch& scratch) {
    for (std::int64_t t = begin; t < end; ++t) {
      const T* z = in.logits + t * num_experts;
      float* dz = args.grad_logits + t * num_experts;
      if (moe_route::detail::token_masked(in.token_mask, t)) {
        std::fill_n(dz, num_experts, 0.0f);
        continue;
      }
      scratch.routed = {};  // the admitted path leaves no row_state: reuse nothing from another call
      bool biased = false;
      if constexpr (Router::template has<prior::log_prior_bias>) {
        // With bias_gates the gates were computed from z', and dL/dz = dL/dz'.
        if (get<prior::log_prior_bias>(r).bias_gates && detail::prior_active(r, in, t)) {
          const float* b = in.prior_bias + std::int64_t{in.token_prior_row[t]} * num_experts;
          detail::biased_row(z, b, get<prior::log_prior_bias>(r).beta, num_experts, scratch.biased);
          biased = true;
        }
      }
      if (args.admitted_indices != nullptr) {
        float* v = scratch.v;
        for (int e = 0; e < num_experts; ++e)
          v[e] = moe_route::detail::sanitize(biased ? scratch.biased[e] : moe_route::detail::to_float(z[e]));
        detail::admitted_backward_row(r, v, num_experts, args.indices + t * k, args.admitted_indices + t * k,
                                      args.renormalize, args.grad_gates + t * k, scratch, dz);
      } else if (biased) {
        detail::backward_row(r, scratch.biased, num_experts, args.indices + t * k, args.grad_gates + t * k, scratch, dz);
      } else {
        detail::backward_row(r, z, num_experts, args.indices + t * k, args.grad_gates + t * k, scratch, dz);
      }
      if constexpr (Router::has_penalties)
        if (penalties)
          detail::penalty_backward_row(r, in, on, weights, *ws, t, scratch.routed, scratch.penalties,
                                       scratch.x86_64_v3, dz);
    }
  });
}

}  // namespace moe_route::cpu

MOE_ROUTE_CPU_SIMD_WARNINGS_ON
