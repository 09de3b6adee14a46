// moe_route: the load-balancing loss (Switch Transformer / GShard). docs/policies.md section 5.
#pragma once

#include <moe_route/penalty/penalty.hpp>

namespace moe_route::penalty {

// L = alpha * E * sum_e f_e * P_e, with P_e = (1/N) sum_t p(z_t)_e and f_e the
// share of the N*K selections that went to expert e (a constant: no gradient
// flows through the counts). dL/dp(z_t)_e = alpha * E * f_e / N.
struct load_balance {
  enum class scope {
    batch,         // f and P over the tokens of the call
    sequence,      // f and P per sequence (route_inputs::sequence_ids), averaged over the sequences
    global_batch,  // f supplied by the caller (route_inputs::load_fractions), P over the call
  };
  // Which experts f counts (batch and sequence scopes; global_batch takes f
  // from the caller): the ones the router selected, or the K largest unbiased
  // logits of each token, ties to the lower expert, whatever the selection
  // (expert bias, groups, prior, replay): Megatron-Core's aux-loss counts.
  enum class count {
    selected,
    top_k,
  };
  // The length that normalises a sequence's f and P (sequence scope): its own
  // valid tokens, or the batch's mean valid length, every sequence counted in
  // the average. They differ only when the sequences' valid lengths differ
  // (padding); batch_mean is Megatron-Core's seq_aux_loss under a padding mask.
  enum class length {
    own,
    batch_mean,
  };
  static constexpr penalty::space space = penalty::space::distribution;
  static constexpr const char* name = "load_balance";

  float coefficient = 1e-3f;  // alpha
  scope over = scope::batch;
  count counts = count::selected;
  length sequence_length = length::own;
  // global_batch takes f from the caller: counts all-reduced over data-parallel
  // ranks, or counts *after admission* (penalty::load_fractions skips dropped
  // assignments), which is how the balance is measured after capacity drops.
};

template <>
inline constexpr bool is_penalty<load_balance> = true;

}  // namespace moe_route::penalty
