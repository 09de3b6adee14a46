// moe_route: host-side argument validation shared by every backend. A call
// that fails validation throws moe_route::error before writing any output.
#pragma once

#include <cmath>
#include <string>

#include <moe_route/config.hpp>
#include <moe_route/router.hpp>
#include <moe_route/training/workspace.hpp>
#include <moe_route/types.hpp>

namespace moe_route::detail {

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

// The training inputs the router's policies need, as pointers and sizes (both
// backends). Nothing is needed in mode::eval.
template <class Router, class T>
void validate_training_inputs(const Router& r, const route_inputs<T>& in) {
  using traits = penalty::penalty_traits<Router>;
  if (in.mode != mode::train || in.num_tokens == 0) return;
  constexpr bool needs_prior_rows = Router::has_prior || traits::kl_to_base || traits::logit_l2;
  if constexpr (needs_prior_rows) {
    if (in.prior_rows < 1)
      fail("prior_rows (= " + std::to_string(in.prior_rows) +
           ") must be >= 1: the router has a prior policy or a prior-space penalty");
    if (in.token_prior_row == nullptr) fail("token_prior_row is null, but the router's policies need the prior");
  }
  if constexpr (Router::has_prior || traits::logit_l2) {
    if (in.prior_bias == nullptr) fail("prior_bias is null, but the router's policies need it (prior::prepare)");
  }
  if constexpr (traits::kl_to_base) {
    if (in.prior_probs == nullptr) fail("prior_probs is null, but kl_to_base needs it (prior::prepare's probs)");
  }
  if constexpr (traits::load_balance) {
    const auto& lb = get<penalty::load_balance>(r);
    if (!std::isfinite(lb.coefficient)) fail("load_balance.coefficient must be finite");
    if (lb.over == penalty::load_balance::scope::sequence) {
      if (in.num_sequences < 1)
        fail("num_sequences (= " + std::to_string(in.num_sequences) + ") must be >= 1 for load_balance over sequences");
      if (in.sequence_ids == nullptr) fail("sequence_ids is null, but load_balance over sequences needs it");
    }
    if (lb.over == penalty::load_balance::scope::global_batch && in.load_fractions == nullptr)
      fail("load_fractions is null, but load_balance over the global batch needs it");
    if (lb.over == penalty::load_balance::scope::global_batch && lb.counts == penalty::load_balance::count::top_k)
      fail("load_balance.counts = top_k counts nothing over the global batch (f comes from load_fractions); "
           "use counts = selected");
    if (lb.over != penalty::load_balance::scope::sequence &&
        lb.sequence_length != penalty::load_balance::length::own)
      fail("load_balance.sequence_length = batch_mean normalises sequences, but load_balance's scope is not sequence");
  }
  if constexpr (traits::locality) {
    const auto& loc = get<penalty::locality>(r);
    if (!std::isfinite(loc.coefficient)) fail("locality.coefficient must be finite");
    if (!(loc.epsilon > 0.0f && loc.epsilon < 1.0f)) fail("locality.epsilon must be in (0, 1)");
    if (in.expert_rank == nullptr) fail("expert_rank is null, but the locality penalty needs it");
  }
  if constexpr (Router::template has<prior::log_prior_bias>) {
    if (!std::isfinite(get<prior::log_prior_bias>(r).beta)) fail("log_prior_bias.beta must be finite");
  }
  if constexpr (traits::z_loss) {
    if (!std::isfinite(get<penalty::z_loss>(r).coefficient)) fail("z_loss.coefficient must be finite");
  }
  if constexpr (traits::kl_to_base) {
    if (!std::isfinite(get<penalty::kl_to_base>(r).coefficient)) fail("kl_to_base.coefficient must be finite");
  }
  if constexpr (traits::logit_l2) {
    if (!std::isfinite(get<penalty::logit_l2>(r).coefficient)) fail("logit_l2.coefficient must be finite");
  }
}

template <class Router, class T>
void validate_workspace(const route_inputs<T>& in, const void* workspace, std::size_t bytes) {
  if constexpr (Router::has_penalties) {
    const std::size_t needed = penalty::training_workspace_bytes<Router>(in.num_tokens, in.num_experts, in.num_sequences);
    if (workspace == nullptr) fail("workspace is null, but the router has penalties (training_workspace_bytes)");
    if (bytes < needed)
      fail("workspace_bytes (= " + std::to_string(bytes) + ") is less than training_workspace_bytes (= " +
           std::to_string(needed) + ")");
  }
}

// The contents of the training inputs, on the host (the CPU backend; the CUDA
// backend cannot read device memory before launch and documents what its
// kernels do with out-of-range values instead).
template <class Router, class T>
void validate_training_values(const Router& r, const route_inputs<T>& in) {
  using traits = penalty::penalty_traits<Router>;
  if (in.mode != mode::train || in.num_tokens == 0) return;
  const int E = in.num_experts;
  if constexpr (Router::has_prior || traits::kl_to_base || traits::logit_l2) {
    for (std::int64_t t = 0; t < in.num_tokens; ++t) {
      if (token_masked(in.token_mask, t)) continue;
      const std::int32_t row = in.token_prior_row[t];
      if (row < -1 || row >= in.prior_rows)
        fail("token_prior_row[" + std::to_string(t) + "] (= " + std::to_string(row) + ") must be -1 or in [0, prior_rows = " +
             std::to_string(in.prior_rows) + ")");
    }
  }
  if constexpr (Router::has_prior || traits::logit_l2) {
    for (std::int64_t i = 0; i < in.prior_rows * E; ++i)
      if (!std::isfinite(in.prior_bias[i]))
        fail("prior_bias row " + std::to_string(i / E) + " has a non-finite entry at expert " + std::to_string(i % E));
  }
  if constexpr (traits::kl_to_base) {
    for (std::int64_t i = 0; i < in.prior_rows * E; ++i)
      if (!(in.prior_probs[i] > 0.0f) || !std::isfinite(in.prior_probs[i]))
        fail("prior_probs row " + std::to_string(i / E) + " has a zero, negative or non-finite entry at expert " +
             std::to_string(i % E) + " (pass prior::prepare's clamped probs)");
  }
  if constexpr (traits::load_balance) {
    const auto& lb = get<penalty::load_balance>(r);
    if (lb.over == penalty::load_balance::scope::sequence)
      for (std::int64_t t = 0; t < in.num_tokens; ++t)
        if (!token_masked(in.token_mask, t) && (in.sequence_ids[t] < 0 || in.sequence_ids[t] >= in.num_sequences))
          fail("sequence_ids[" + std::to_string(t) + "] (= " + std::to_string(in.sequence_ids[t]) +
               ") must be in [0, num_sequences = " + std::to_string(in.num_sequences) + ")");
    if (lb.over == penalty::load_balance::scope::global_batch)
      for (int e = 0; e < E; ++e)
        if (!(in.load_fractions[e] >= 0.0f) || !std::isfinite(in.load_fractions[e]))
          fail("load_fractions[" + std::to_string(e) + "] must be finite and >= 0");
  }
  if constexpr (traits::locality) {
    int local = 0;
    for (int e = 0; e < E; ++e) local += in.expert_rank[e] == in.rank ? 1 : 0;
    if (local == 0) fail("expert_rank hosts no expert on rank (= " + std::to_string(in.rank) + "): locality has no target");
  }
}

// The replayed experts, on the host (the CPU backend): K distinct experts in
// [0, E) for every valid token.
template <class T>
void validate_replay_data(const route_inputs<T>& in, int k) {
  for (std::int64_t t = 0; t < in.num_tokens; ++t) {
    if (token_masked(in.token_mask, t)) continue;
    const std::int32_t* row = in.replay_indices + t * k;
    for (int j = 0; j < k; ++j) {
      if (row[j] < 0 || row[j] >= in.num_experts)
        fail("replay_indices[" + std::to_string(t * k + j) + "] (= " + std::to_string(row[j]) +
             ") is not an expert in [0, num_experts = " + std::to_string(in.num_experts) + ")");
      for (int i = 0; i < j; ++i)
        if (row[i] == row[j])
          fail("replay_indices: token " + std::to_string(t) + " replays expert " + std::to_string(row[j]) + " twice");
    }
  }
}

template <class Router, class T>
void validate_route(const Router& r, const route_inputs<T>& in, const route_outputs& out) {
  validate_inputs(r, in);
  validate_training_inputs(r, in);
  if constexpr (Router::has_penalties) {
    if (out.penalty_values == nullptr) fail("penalty_values (output) is null, but the router has penalties");
    if (in.mode == mode::train && in.num_tokens > 0) validate_workspace<Router>(in, out.workspace, out.workspace_bytes);
  }
  if (in.num_tokens > 0 && out.indices == nullptr) fail("indices (output) is null");
  if (in.num_tokens > 0 && out.gates == nullptr) fail("gates (output) is null");
}

template <class Router, class T>
void validate_backward(const Router& r, const route_inputs<T>& in, const backward_args& b) {
  validate_inputs(r, in);
  validate_training_inputs(r, in);
  if (in.num_tokens == 0) return;
  if constexpr (Router::has_penalties) {
    if (in.mode == mode::train) validate_workspace<Router>(in, b.workspace, b.workspace_bytes);
  }
  if (b.indices == nullptr) fail("indices is null");
  if (b.grad_gates == nullptr) fail("grad_gates is null");
  if (b.grad_logits == nullptr) fail("grad_logits (output) is null");
}

}  // namespace moe_route::detail
