// moe_route CPU backend: the forward,
//   route_report cpu::route(router, inputs, outputs, execution)
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <moe_route/backend/cpu/detail/rows.hpp>
#include <moe_route/backend/cpu/detail/threads.hpp>
#include <moe_route/backend/cpu/detail/training.hpp>
#include <moe_route/backend/cpu/execution.hpp>
#include <moe_route/detail/validate.hpp>
#include <moe_route/router.hpp>
#include <moe_route/types.hpp>

MOE_ROUTE_CPU_SIMD_WARNINGS_OFF

namespace moe_route::cpu {

// Forward: indices and gate weights of every token (docs/policies.md sections 1-3),
// and with penalties their values and the training workspace (section 5).
// Throws moe_route::error, writing nothing, if an argument is invalid.
template <class Router, class T>
route_report route(const Router& r, const route_inputs<T>& in, const route_outputs& out, execution ex = {}) {
  static_assert(is_router<Router>, "cpu::route: the first argument must be a moe_route::router");
  moe_route::detail::validate_route(r, in, out);
  moe_route::detail::validate_training_values(r, in);
  if (in.replay_indices != nullptr) moe_route::detail::validate_replay_data(in, r.top_k);
  const int num_experts = in.num_experts;
  const int k = r.top_k;
  const std::size_t workers = detail::workers_of(ex);
  std::vector<std::int64_t> nonfinite(workers, 0);

  const penalty::switches on = penalty::active(r, in);
  const bool penalties = Router::has_penalties && on.any() && in.num_tokens > 0;
  const auto layout = penalty::training_layout<Router>(in.num_tokens, num_experts, in.num_sequences);
  std::vector<detail::penalty_partials> partials(penalties ? workers : 0);
  if constexpr (Router::has_penalties)
    for (auto& part : partials) detail::prepare_partials(r, in, part);
  std::optional<detail::workspace_view> ws;
  if (penalties) ws.emplace(out.workspace, layout);

  detail::for_token_blocks(in.num_tokens, num_experts, ex, [&](std::int64_t begin, std::int64_t end, int worker,
                                                   detail::row_scratch& scratch) {
    std::int64_t bad = 0;
    for (std::int64_t t = begin; t < end; ++t) {
      if (moe_route::detail::token_masked(in.token_mask, t)) {
        std::fill_n(out.indices + t * k, k, -1);
        std::fill_n(out.gates + t * k, k, 0.0f);
        if constexpr (Router::has_penalties)
          if (penalties) detail::clear_token_values<Router>(*ws, t);
        continue;
      }
      std::int32_t* routed = out.indices + t * k;
      bad += detail::route_token(r, in, t, scratch, routed, out.gates + t * k);
      if constexpr (Router::has_penalties)
        if (penalties)
          detail::penalty_forward_row(r, in, on, detail::counted_experts(r, in, t, routed, scratch), t,
                                      scratch.routed, scratch.penalties, scratch.x86_64_v3, partials[worker], *ws);
    }
    nonfinite[worker] = bad;
  });
  if constexpr (Router::has_penalties) {
    for (int j = 0; j < Router::num_penalties; ++j) out.penalty_values[j] = 0.0;
    if (penalties) {
      detail::reduce_partials(partials, *ws, layout, num_experts, in.num_sequences);
      detail::chunk_totals<Router>(*ws, in.num_tokens);
      penalty::values(r, ws->state(r, in), out.penalty_values);
    }
  }
  route_report report;
  for (std::int64_t n : nonfinite) report.nonfinite_rows += n;
  if (out.nonfinite_rows != nullptr) *out.nonfinite_rows += report.nonfinite_rows;
  return report;
}

}  // namespace moe_route::cpu

MOE_ROUTE_CPU_SIMD_WARNINGS_ON
