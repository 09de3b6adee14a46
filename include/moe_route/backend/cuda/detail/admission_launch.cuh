// moe_route CUDA backend: the launch sequence of cuda::admit (the pipeline is
// described in backend/cuda/admit.cuh), written over an executor
// (executor.cuh) so the host warp emulator runs the same steps. The inputs'
// logits are of a library storage type (float, bfloat16, float16).
#pragma once

#include <cstddef>
#include <cstdint>

#include <moe_route/admission/admission.hpp>
#include <moe_route/backend/cuda/detail/admission_common.cuh>
#include <moe_route/backend/cuda/detail/agent_admission.cuh>
#include <moe_route/types.hpp>

namespace moe_route::cuda::admission_detail {

// The workspace layout (also the size query: a null base only measures).
struct admit_layout {
  std::int64_t* group_tokens = nullptr;
  std::int64_t* cap = nullptr;
  std::int64_t* limit = nullptr;
  std::int64_t* load = nullptr;
  std::uint8_t* state = nullptr;
  std::int32_t* target = nullptr;
  ranking rank;
  std::size_t bytes = 0;
};

template <class Exec>
admit_layout make_admit_layout(const Exec& ex, void* base, std::int64_t num_tokens, int top_k, int num_experts,
                               int num_groups) {
  carver c(base);
  admit_layout l;
  const std::int64_t slots = num_tokens * top_k;
  const std::uint32_t segments = static_cast<std::uint32_t>(num_groups) * static_cast<std::uint32_t>(num_experts);
  l.group_tokens = c.take<std::int64_t>(static_cast<std::size_t>(num_groups));
  l.cap = c.take<std::int64_t>(segments);
  l.limit = c.take<std::int64_t>(segments);
  l.load = c.take<std::int64_t>(segments);
  l.state = c.take<std::uint8_t>(static_cast<std::size_t>(slots));
  l.target = c.take<std::int32_t>(static_cast<std::size_t>(slots));
  l.rank.carve(ex, c, static_cast<int>(slots), segments);
  l.bytes = c.bytes();
  return l;
}

// Workspace bytes of admit for these shapes (0 for dropless policies).
template <class Exec, class Policy>
std::size_t admit_bytes(const Exec& ex, std::int64_t num_tokens, int top_k, int num_experts, int num_groups) {
  if constexpr (Policy::is_dropless) return 0;
  else return make_admit_layout(ex, nullptr, num_tokens, top_k, num_experts, num_groups).bytes;
}

// The arguments are validated; `needed` is the queried workspace size.
template <class Exec, class Router, class Policy, class S>
void launch_admit(const Exec& ex, const Router& r, const Policy& p, const admission_inputs<S>& in,
                  const admission_outputs& out, void* workspace, std::size_t workspace_bytes, std::size_t needed) {
  using G = typename Router::gating_type;
  const std::int64_t n_tokens = in.num_tokens;
  const int k = r.top_k;
  const std::int64_t slots = n_tokens * k;
  if constexpr (Policy::is_dropless) {
    if (slots > 0)
      ex.for_each(slots,
                  copy_through_step{in.routed_indices, in.routed_gates, in.token_mask, k, out.indices, out.gates,
                                    out.status},
                  "admission copy_through");
    if (out.report != nullptr) {
      ex.fill(out.report, 0, sizeof(admission_report), "report");
      ex.for_each_warp(token_warps(n_tokens), 0, dropless_report_agent{in.token_mask, n_tokens, k, out.report},
                       "admission report");
    }
  } else {
    if (n_tokens == 0) {
      if (out.report != nullptr) ex.fill(out.report, 0, sizeof(admission_report), "report");
      return;
    }
    check_workspace(workspace, workspace_bytes, needed, "cuda::admit");
    admit_layout l = make_admit_layout(ex, align_workspace(workspace), n_tokens, k, in.num_experts, in.num_groups);
    const std::uint32_t segments = static_cast<std::uint32_t>(in.num_groups) * static_cast<std::uint32_t>(in.num_experts);

    admit_params<S> prm{};
    prm.logits = in.logits;
    prm.num_tokens = n_tokens;
    prm.num_experts = in.num_experts;
    prm.top_k = k;
    prm.routed = in.routed_indices;
    prm.routed_gates = in.routed_gates;
    prm.hidden_norms = in.hidden_norms;
    prm.weight_norms = in.weight_norms;
    prm.group_ids = in.group_ids;
    prm.num_groups = in.num_groups;
    prm.capacity = in.capacity;
    prm.token_mask = in.token_mask;
    prm.capacity_factor = p.capacity_factor;
    prm.min_capacity = p.min_capacity;
    if constexpr (Policy::reroutes) prm.fill_factor = p.overflow.fill_factor;
    else prm.fill_factor = 0.0;
    prm.threshold = p.threshold;
    prm.sentinel = segments;
    prm.group_tokens = l.group_tokens;
    prm.cap = l.cap;
    prm.limit = l.limit;
    prm.load = l.load;
    prm.state = l.state;
    prm.target = l.target;
    ranking& rank = l.rank;
    const ranking_items items{rank.keys[0], rank.items[0], rank.segs[0]};

    group_sizes(ex, in.group_ids, in.token_mask, n_tokens, in.num_groups, l.group_tokens);
    ex.fill(l.load, 0, sizeof(std::int64_t) * segments, "loads");
    ex.for_each(segments, limits_step<S>{prm}, "admission limits");

    // 1-2. Strict pass.
    ex.for_each_warp(n_tokens, 0, strict_items_agent<G, Policy, S>{prm, items}, "admission strict_items");
    rank.sort(ex);
    ex.for_each(rank.n, strict_decide_step<Policy, S>{prm, rank.sorted}, "admission strict_decide");

    // 3. Reroute rounds.
    if constexpr (Policy::reroutes) {
      const int rounds = p.overflow.max_rounds < 0 ? k : p.overflow.max_rounds;
      using propose = propose_agent<G, Policy, S>;
      for (int round = 0; round < rounds; ++round) {
        ex.for_each_warp(n_tokens, propose::words(in.num_experts), propose{prm, items}, "admission propose");
        rank.sort(ex);
        ex.for_each(rank.n, accept_step<S>{prm, rank.sorted}, "admission accept");
        ex.for_each(rank.n, update_loads_step<S>{prm, rank.sorted}, "admission update_loads");
      }
    }

    // 4. Outputs.
    ex.for_each_warp(n_tokens, 0,
                     outputs_agent<Router, S>{r, prm, admission::renormalizes(p), out.indices, out.gates, out.status},
                     "admission outputs");

    // 5. Report.
    if (out.report != nullptr) {
      ex.fill(out.report, 0, sizeof(admission_report), "report");
      ex.for_each_warp(token_warps(n_tokens), 0, report_agent{l.state, in.token_mask, n_tokens, k, out.report},
                       "admission report");
    }
  }
}

}  // namespace moe_route::cuda::admission_detail
