// moe_route: the training workspace of a router with penalties, its layout and
// the fixed-point format of its sums. Both backends use the same layout.
//
// The forward fills it with what the backward needs (counts, the distribution
// sums, the numbers of tokens) and what the values need (one double per token
// and scalar penalty); the backward reads it. It lives in the backend's memory
// space; the caller allocates training_workspace_bytes() and passes the same
// buffer to the forward and to the backward of one step.
//
// Determinism: the per-expert sums of p(z_t) are accumulated in 64-bit fixed
// point (2^-32 units), so their order does not matter and the CPU threads and
// CUDA atomics give the same integers. The per-token values are summed in
// fixed chunks of `value_chunk` tokens, each in token order, then the chunks in
// order, in double, on both backends.
#pragma once

#include <cstddef>
#include <cstdint>

#include <moe_route/config.hpp>
#include <moe_route/penalty/kl_to_base.hpp>
#include <moe_route/penalty/load_balance.hpp>
#include <moe_route/penalty/locality.hpp>
#include <moe_route/penalty/logit_l2.hpp>
#include <moe_route/penalty/z_loss.hpp>
#include <moe_route/router.hpp>

namespace moe_route::penalty {

// Tokens per chunk of the per-token value sums.
inline constexpr std::int64_t value_chunk = 1024;

// One unit of the fixed-point distribution sums: p is stored as round(p * 2^32).
inline constexpr double fixed_point_scale = 4294967296.0;

MOE_ROUTE_HD std::int64_t to_fixed_point(float p) {
  // p in [0, 1]: p * 2^32 is exact in double and the +0.5 floor rounds half up.
  return static_cast<std::int64_t>(static_cast<double>(p) * fixed_point_scale + 0.5);
}

// The mean of `count` fixed-point terms as float (0 for no terms).
MOE_ROUTE_HD float fixed_point_mean(std::int64_t sum, std::int64_t count) {
  return count > 0 ? static_cast<float>(static_cast<double>(sum) / fixed_point_scale / static_cast<double>(count))
                   : 0.0f;
}

// The workspace counters, at the start of the workspace.
struct workspace_header {
  std::int64_t valid_tokens;  // rows with finite logits and a distribution
  std::int64_t prior_tokens;  // valid rows with a prior row (|T|)
};

// Byte offsets of each region (0 size = absent); every region is 8-byte aligned.
struct workspace_layout {
  std::size_t distribution_sums = 0;  // int64 [E]: sum_t p(z_t)_e in fixed point
  std::size_t counts = 0;             // int64 [E]: selections per expert (load_balance batch)
  std::size_t sequence_sums = 0;      // int64 [num_sequences x E] (load_balance sequence)
  std::size_t sequence_counts = 0;    // int64 [num_sequences x E]
  std::size_t sequence_tokens = 0;    // int64 [num_sequences]
  std::size_t token_values = 0;       // double [N x scalar_penalties]
  std::size_t chunk_values = 0;       // double [chunks x scalar_penalties]
  std::size_t expert_grad = 0;        // float [E]: dL/dp shared by all tokens (backward)
  std::size_t sequence_grad = 0;      // float [num_sequences x E] (backward)
  std::size_t bytes = 0;
};

template <class Router>
struct penalty_traits;

template <class G, class S, int K, class... Ps>
struct penalty_traits<router<G, S, K, Ps...>> {
  static constexpr bool load_balance = detail::contains<penalty::load_balance, Ps...>;
  static constexpr bool locality = detail::contains<penalty::locality, Ps...>;
  static constexpr bool z_loss = detail::contains<penalty::z_loss, Ps...>;
  static constexpr bool kl_to_base = detail::contains<penalty::kl_to_base, Ps...>;
  static constexpr bool logit_l2 = detail::contains<penalty::logit_l2, Ps...>;
  // Penalties whose value is a sum of one double per token, and their column.
  static constexpr int scalar_penalties = int(z_loss) + int(kl_to_base) + int(logit_l2);
  static constexpr int z_loss_column = 0;
  static constexpr int kl_to_base_column = int(z_loss);
  static constexpr int logit_l2_column = int(z_loss) + int(kl_to_base);
  static constexpr bool distribution_space = load_balance || locality;
};

template <class Router>
workspace_layout training_layout(std::int64_t num_tokens, int num_experts, std::int32_t num_sequences) {
  using traits = penalty_traits<Router>;
  workspace_layout l;
  std::size_t at = sizeof(workspace_header);
  const auto region = [&at](std::size_t& offset, std::size_t bytes) {
    offset = bytes == 0 ? 0 : at;
    at += (bytes + 7) / 8 * 8;
  };
  const std::size_t E = static_cast<std::size_t>(num_experts);
  const std::size_t N = static_cast<std::size_t>(num_tokens);
  const std::size_t seqs = traits::load_balance && num_sequences > 0 ? static_cast<std::size_t>(num_sequences) : 0;
  const std::size_t chunks = (N + value_chunk - 1) / value_chunk;
  region(l.distribution_sums, traits::distribution_space ? E * 8 : 0);
  region(l.counts, traits::load_balance ? E * 8 : 0);
  region(l.sequence_sums, seqs * E * 8);
  region(l.sequence_counts, seqs * E * 8);
  region(l.sequence_tokens, seqs * 8);
  region(l.token_values, N * traits::scalar_penalties * 8);
  region(l.chunk_values, chunks * traits::scalar_penalties * 8);
  region(l.expert_grad, traits::distribution_space ? E * 4 : 0);
  region(l.sequence_grad, seqs * E * 4);
  l.bytes = at;
  return l;
}

// The bytes of workspace a call of Router needs (0 when it has no penalties).
// num_sequences matters only for load_balance with scope::sequence.
template <class Router>
std::size_t training_workspace_bytes(std::int64_t num_tokens, int num_experts, std::int32_t num_sequences = 0) {
  if constexpr (!Router::has_penalties) {
    return 0;
  } else {
    return training_layout<Router>(num_tokens, num_experts, num_sequences).bytes;
  }
}

template <class Router>
std::size_t training_workspace_bytes(const Router&, std::int64_t num_tokens, int num_experts,
                                     std::int32_t num_sequences = 0) {
  return training_workspace_bytes<Router>(num_tokens, num_experts, num_sequences);
}

}  // namespace moe_route::penalty
