// moe_route CUDA backend: the launch sequences of cuda::expert_choice and its
// backward (backend/cuda/expert_choice.cuh), written over an executor
// (executor.cuh) so the host warp emulator runs the same steps. The inputs'
// logits are of a library storage type (float, bfloat16, float16).
#pragma once

#include <cstddef>
#include <cstdint>

#include <moe_route/backend/cuda/detail/admission_common.cuh>
#include <moe_route/backend/cuda/detail/agent_expert_choice.cuh>
#include <moe_route/selection/expert_choice.hpp>

namespace moe_route::cuda::admission_detail {

struct ec_layout {
  std::int64_t* group_tokens = nullptr;
  admission::row_stats* stats = nullptr;
  unsigned char* chosen = nullptr;
  ranking rank;
  std::size_t bytes = 0;
};

template <class Exec>
ec_layout make_ec_layout(const Exec& ex, void* base, std::int64_t num_tokens, int num_experts, int num_groups) {
  carver c(base);
  ec_layout l;
  const std::uint32_t segments = static_cast<std::uint32_t>(num_groups) * static_cast<std::uint32_t>(num_experts);
  l.group_tokens = c.take<std::int64_t>(static_cast<std::size_t>(num_groups));
  l.stats = c.take<admission::row_stats>(static_cast<std::size_t>(num_tokens));
  l.chosen = c.take<unsigned char>(static_cast<std::size_t>(num_tokens * num_experts));
  l.rank.carve(ex, c, static_cast<int>(num_tokens * num_experts), segments);
  l.bytes = c.bytes();
  return l;
}

// The arguments are validated.
template <class Exec, class S>
void launch_expert_choice(const Exec& ex, const selection::expert_choice& p, const expert_choice_inputs<S>& in,
                          const expert_choice_outputs& out, void* workspace, std::size_t workspace_bytes) {
  const std::int64_t n_tokens = in.num_tokens;
  if (out.report != nullptr) ex.fill(out.report, 0, sizeof(expert_choice_report), "report");
  if (n_tokens == 0) return;
  const std::size_t needed = make_ec_layout(ex, nullptr, n_tokens, in.num_experts, in.num_groups).bytes;
  check_workspace(workspace, workspace_bytes, needed, "cuda::expert_choice");
  ec_layout l = make_ec_layout(ex, align_workspace(workspace), n_tokens, in.num_experts, in.num_groups);
  const std::uint32_t segments = static_cast<std::uint32_t>(in.num_groups) * static_cast<std::uint32_t>(in.num_experts);
  ec_params<S> prm{};
  prm.logits = in.logits;
  prm.num_tokens = n_tokens;
  prm.num_experts = in.num_experts;
  prm.group_ids = in.group_ids;
  prm.num_groups = in.num_groups;
  prm.capacity = in.capacity;
  prm.token_mask = in.token_mask;
  prm.top_k = p.top_k;
  prm.capacity_factor = p.capacity_factor;
  prm.min_capacity = p.min_capacity;
  prm.sentinel = segments;
  prm.group_tokens = l.group_tokens;
  prm.stats = l.stats;
  prm.chosen = l.chosen;
  ranking& rank = l.rank;

  group_sizes(ex, in.group_ids, in.token_mask, n_tokens, in.num_groups, l.group_tokens);
  ex.fill(l.chosen, 0, static_cast<std::size_t>(n_tokens) * in.num_experts, "chosen");
  ex.for_each_warp(n_tokens, 0, ec_stats_agent<S>{prm}, "expert_choice stats");
  ex.for_each(rank.n, ec_items_step<S>{prm, rank.keys[0], rank.items[0], rank.segs[0]}, "expert_choice items");
  rank.sort(ex);
  ex.for_each(rank.n, ec_decide_step<S>{prm, rank.sorted}, "expert_choice decide");
  ex.for_each_warp(n_tokens, 0, ec_outputs_agent<S>{prm, out.indices, out.gates, out.experts_per_token},
                   "expert_choice outputs");
  if (out.report != nullptr)
    ex.for_each_warp(token_warps(n_tokens), 0,
                     ec_report_agent{out.indices, in.group_ids, in.token_mask, n_tokens, in.num_experts, in.num_groups,
                                     out.report},
                     "expert_choice report");
}

template <class Exec, class S>
void launch_expert_choice_backward(const Exec& ex, const expert_choice_inputs<S>& in, const std::int32_t* indices,
                                   const float* grad_gates, float* grad_logits) {
  ex.for_each_warp(in.num_tokens, 0,
                   ec_backward_agent<S>{in.logits, in.num_experts, in.token_mask, indices, grad_gates, grad_logits},
                   "expert_choice_backward");
}

}  // namespace moe_route::cuda::admission_detail
