// moe_route: expert-choice selection on the CPU (selection/expert_choice.hpp).
//
//   cpu::expert_choice(policy, expert_choice_inputs, expert_choice_outputs, execution)
//   cpu::expert_choice_backward(expert_choice_inputs, indices, grad_gates, grad_logits, execution)
//
// The reference cuda::expert_choice matches bit for bit: scores from the
// canonical softmax, every expert's candidates ranked by the 64-bit key
// (s_{t,e} desc, token asc), the top C_e kept.
#pragma once

#include <cstdint>

#include <moe_route/admission/detail/validate.hpp>
#include <moe_route/backend/cpu/detail/expert_choice.hpp>
#include <moe_route/backend/cpu/execution.hpp>
#include <moe_route/selection/expert_choice.hpp>

namespace moe_route::cpu {

// Each expert keeps its C_e best tokens (selection/expert_choice.hpp). Throws
// moe_route::error, writing nothing, if an argument is invalid.
template <class T>
expert_choice_report expert_choice(const selection::expert_choice& p, const expert_choice_inputs<T>& in,
                                   const expert_choice_outputs& out, execution ex = {}) {
  admission::detail::validate_expert_choice(p, in, out);
  admission::detail::validate_expert_choice_data(in);
  return admission_detail::expert_choice(p, in, out, ex);
}

// dL/dz [N x E] (overwritten) from dL/dgates [N x E] of an expert_choice
// result: dz_t = s_t * (ds - <ds, s_t>), ds = the gate gradients at the
// chosen experts (entries with index -1 are ignored), the dot in the canonical
// lane order; cuda::expert_choice_backward gives the same bits.
template <class T>
void expert_choice_backward(const expert_choice_inputs<T>& in, const std::int32_t* indices, const float* grad_gates,
                            float* grad_logits, execution ex = {}) {
  admission::detail::validate_expert_choice_backward(in, indices, grad_gates, grad_logits);
  if (in.num_tokens > 0) admission::detail::validate_expert_choice_backward_data(indices, in.num_tokens, in.num_experts,
                                                                                 in.token_mask);
  admission_detail::expert_choice_backward(in, indices, grad_gates, grad_logits, ex);
}

}  // namespace moe_route::cpu
