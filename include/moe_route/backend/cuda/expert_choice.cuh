// moe_route CUDA backend: expert-choice selection (selection/expert_choice.hpp).
//
//   std::size_t cuda::expert_choice_workspace_bytes(policy, num_tokens, num_experts, num_groups = 1)
//   void cuda::expert_choice(policy, expert_choice_inputs, expert_choice_outputs, workspace, bytes, stream)
//   void cuda::expert_choice_backward(expert_choice_inputs, indices, grad_gates, grad_logits, stream)
//
// Same bits as cpu::expert_choice: canonical softmax scores, every (group,
// expert) ranks all its tokens by rank_key(s_{t,e}, t) through the stable
// radix sorts of detail/admission_common.cuh, and keeps the first C_e. The output
// rows are compacted in ascending expert order with warp ballots. The
// workspace holds N * E ranking items (about 33 bytes each). Tokens with a
// group id outside [0, num_groups) are never picked and are counted in
// report->invalid. Padding tokens (in.token_mask) are picked by no expert,
// are not in N_g and are in no report field. out.report, if set, is a device
// pointer, overwritten.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include <moe_route/admission/detail/validate.hpp>
#include <moe_route/backend/cuda/detail/executor.cuh>
#include <moe_route/backend/cuda/detail/expert_choice_launch.cuh>
#include <moe_route/backend/cuda/detail/storage.cuh>
#include <moe_route/selection/expert_choice.hpp>

namespace moe_route::cuda {

// Device workspace bytes of expert_choice for these shapes (host; no device work).
inline std::size_t expert_choice_workspace_bytes(const selection::expert_choice& p, std::int64_t num_tokens,
                                                int num_experts, int num_groups = 1) {
  expert_choice_inputs<float> shape;
  shape.num_tokens = num_tokens;
  shape.num_experts = num_experts;
  shape.num_groups = num_groups;
  float dummy = 0.0f;
  std::int32_t dummy_index = 0;
  shape.logits = &dummy;
  admission::detail::validate_expert_choice(p, shape, expert_choice_outputs{&dummy_index, &dummy});
  return admission_detail::make_ec_layout(detail::device_executor{}, nullptr, num_tokens, num_experts, num_groups).bytes;
}

// Expert-choice selection on the device; see the top of this file.
template <class T>
void expert_choice(const selection::expert_choice& p, const expert_choice_inputs<T>& in,
                   const expert_choice_outputs& out, void* workspace, std::size_t workspace_bytes,
                   cudaStream_t stream = 0) {
  admission::detail::validate_expert_choice(p, in, out);
  admission_detail::launch_expert_choice(detail::device_executor{stream}, p, detail::storage_inputs(in), out, workspace,
                                         workspace_bytes);
}

// dL/dz [N x E] (overwritten) from dL/dgates [N x E] of an expert_choice result:
// the bits of cpu::expert_choice_backward (a padding token's row is 0).
// Device pointers; one kernel on `stream`.
template <class T>
void expert_choice_backward(const expert_choice_inputs<T>& in, const std::int32_t* indices, const float* grad_gates,
                            float* grad_logits, cudaStream_t stream = 0) {
  admission::detail::validate_expert_choice_backward(in, indices, grad_gates, grad_logits);
  admission_detail::launch_expert_choice_backward(detail::device_executor{stream}, detail::storage_inputs(in), indices,
                                                  grad_gates, grad_logits);
}

}  // namespace moe_route::cuda
