// moe_route CUDA backend: the public API (namespace moe_route::cuda).
//
//   cuda::route(router, inputs, outputs, stream)       forward: indices and gates
//   cuda::backward(router, inputs, args, stream)       fused backward: dL/dz
//   cuda::update_expert_bias(policy, bias, loads, E, stream)
//
// Same arguments and the same bits as moe_route::cpu (backend/cpu/route.hpp, backward.hpp);
// all pointers are device pointers. Every call validates its arguments on the
// host first (moe_route::error, nothing launched), then launches on `stream`:
// no allocation, no synchronisation, no hidden state. A launch that fails
// throws cuda_error. Results are deterministic run to run.
//
// Logits may be float, moe_route::bfloat16, moe_route::float16, or CUDA's
// __nv_bfloat16 / __half: those have the same layout as the library's storage
// types, so route_inputs<__nv_bfloat16> is accepted and its pointer is read as
// moe_route::bfloat16 (and __half as moe_route::float16).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <moe_route/backend/cuda/detail/agent_common.cuh>
#include <moe_route/backend/cuda/detail/error.cuh>
#include <moe_route/backend/cuda/detail/kernels.cuh>
#include <moe_route/backend/cuda/detail/launch.cuh>
#include <moe_route/backend/cuda/detail/storage.cuh>
#include <moe_route/backend/cuda/detail/training.cuh>
#include <moe_route/backend/cuda/detail/tuning.cuh>
#include <moe_route/detail/validate.hpp>
#include <moe_route/router.hpp>
#include <moe_route/selection/expert_bias.hpp>
#include <moe_route/types.hpp>

namespace moe_route::cuda {

// Forward: out.indices[N x K] (descending key order, ties to the lower expert)
// and out.gates[N x K]; if out.nonfinite_rows is set, the number of rows with a
// NaN or +-inf logit is added to that device counter. Padding tokens
// (in.token_mask) get indices -1 and gates 0 and are in no penalty. With
// in.replay_indices each token takes the caller's experts (docs/policies.md
// §2.9); an entry outside [0, E) cannot be checked on the host and is written
// as -1 with the gate of a -inf logit (the CPU backend rejects it). Routers with a prior
// policy or penalties run the training kernels in mode::train (training.cuh):
// out.penalty_values is a device array, out.workspace device memory.
template <class Router, class T>
void route(const Router& r, const route_inputs<T>& in, const route_outputs& out, cudaStream_t stream = 0) {
  static_assert(is_router<Router>, "cuda::route: the first argument must be a moe_route::router");
  moe_route::detail::validate_route(r, in, out);
  if constexpr (Router::has_penalties) {
    if (in.num_tokens == 0 || in.mode != mode::train) {
      detail::check_launch(cudaMemsetAsync(out.penalty_values, 0, sizeof(double) * Router::num_penalties, stream),
                           "moe_route::cuda::route: zeroing the penalty values");
    }
  }
  if (in.num_tokens == 0) return;
  using S = detail::storage_t<T>;
  if constexpr (Router::has_prior || Router::has_penalties) {
    if (in.mode == mode::train) {
      detail::route_training(r, in, detail::storage_pointer(in.logits), out, stream);
      return;
    }
  }
  detail::route_params<S> p{detail::storage_pointer(in.logits), in.num_tokens, in.num_experts, in.expert_bias,
                            out.indices, out.gates, detail::make_group_layout(r, in.num_experts), in.token_mask,
                            in.replay_indices};
  detail::launch_route(r, p, out.nonfinite_rows, stream);
}

// Fused backward: args.grad_logits[N x E] (overwritten) from args.grad_gates
// [N x K] and the forward's args.indices; with args.admitted_indices, the
// gradient of admitted gates (admission/gates.hpp), as cpu::backward. Entries
// of indices outside [0, E) are ignored on the device (agent_backward.cuh);
// the CPU backend rejects them. Padding tokens (in.token_mask) get a zero row.
template <class Router, class T>
void backward(const Router& r, const route_inputs<T>& in, const backward_args& args, cudaStream_t stream = 0) {
  static_assert(is_router<Router>, "cuda::backward: the first argument must be a moe_route::router");
  moe_route::detail::validate_backward(r, in, args);
  if (in.num_tokens == 0) return;
  using S = detail::storage_t<T>;
  // Admitted gates, and training calls of routers with a prior or penalties,
  // take the training kernels (training.cuh).
  if (args.admitted_indices != nullptr || ((Router::has_prior || Router::has_penalties) && in.mode == mode::train)) {
    detail::backward_training(r, in, detail::storage_pointer(in.logits), args, stream);
    return;
  }
  detail::backward_params<S> p{detail::storage_pointer(in.logits), in.num_tokens, in.num_experts,
                               args.indices, args.grad_gates, args.grad_logits, in.token_mask};
  detail::launch_backward(detail::backward_router(r), p, stream);
}

// selection::expert_bias::update on the device: bias[e] += u * sign(mean - loads[e])
// with the mean summed in double in expert order, as on the host, so the two
// agree bit for bit. One single-block kernel on `stream`; Load is any
// arithmetic type (counts or load measures, all-reduced by the caller).
template <class Load>
void update_expert_bias(const selection::expert_bias& policy, float* bias, const Load* loads, int num_experts,
                        cudaStream_t stream = 0) {
  static_assert(std::is_arithmetic_v<Load>, "cuda::update_expert_bias: loads must be an arithmetic type");
  if (num_experts <= 0) moe_route::detail::fail("cuda::update_expert_bias: num_experts must be positive");
  if (bias == nullptr) moe_route::detail::fail("cuda::update_expert_bias: bias is null");
  if (loads == nullptr) moe_route::detail::fail("cuda::update_expert_bias: loads is null");
  detail::expert_bias_update_kernel<Load>
      <<<1, tuning::bias_update_threads, 0, stream>>>(bias, loads, num_experts, policy.update_rate);
  detail::check_launch("moe_route::cuda::update_expert_bias: launch of the update kernel");
}

}  // namespace moe_route::cuda
