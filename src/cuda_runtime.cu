// The CUDA calls of runtime/cuda.hpp: the run-time gating choice over the
// per-gating instances (cuda_runtime_<gating>.cu), and the policies whose code
// does not depend on the gating (dispatch metadata, expert choice, Router-L2)
// or is small (the prior builder). Compiled once into moe_route::cuda_runtime,
// when MOE_ROUTE_BUILD_CUDA_RUNTIME is on (src/README.md).
#include <moe_route/backend/cuda/dispatch.cuh>
#include <moe_route/backend/cuda/expert_choice.cuh>
#include <moe_route/backend/cuda/prior_build.cuh>
#include <moe_route/backend/cuda/router_l2.cuh>
#include <moe_route/runtime/cuda.hpp>
#include <moe_route/runtime/detail/cuda_instantiate.cuh>

namespace moe_route::runtime::cuda {

void route(const router_config& c, const route_inputs<float>& in, const route_outputs& out, void* scratch,
           std::size_t scratch_bytes, stream_t stream) {
  runtime::detail::by_gating(c.gating,
                             [&](auto g) { route_with<decltype(g)>(c, in, out, scratch, scratch_bytes, stream); });
}

void backward(const router_config& c, const route_inputs<float>& in, const backward_args& args, void* scratch,
              std::size_t scratch_bytes, stream_t stream) {
  runtime::detail::by_gating(c.gating,
                             [&](auto g) { backward_with<decltype(g)>(c, in, args, scratch, scratch_bytes, stream); });
}

std::size_t admit_workspace_bytes(const router_config& c, const admission_config& a, std::int64_t num_tokens,
                                  int num_experts, int num_groups) {
  return runtime::detail::by_gating(c.gating, [&](auto g) {
    return admit_workspace_bytes_with<decltype(g)>(c, a, num_tokens, num_experts, num_groups);
  });
}

void admit(const router_config& c, const admission_config& a, const admission_inputs<float>& in,
           const admission_outputs& out, void* workspace, std::size_t workspace_bytes, stream_t stream) {
  runtime::detail::by_gating(c.gating,
                             [&](auto g) { admit_with<decltype(g)>(c, a, in, out, workspace, workspace_bytes, stream); });
}

std::size_t dispatch_workspace_bytes(std::int64_t num_tokens, int slots_per_token, int num_experts) {
  return moe_route::cuda::dispatch_workspace_bytes(num_tokens, slots_per_token, num_experts);
}

void dispatch(const dispatch_inputs& in, const dispatch_outputs& out, void* workspace, std::size_t workspace_bytes,
              stream_t stream) {
  moe_route::cuda::dispatch(in, out, workspace, workspace_bytes, stream);
}

std::size_t expert_choice_workspace_bytes(const selection::expert_choice& p, std::int64_t num_tokens,
                                          int num_experts, int num_groups) {
  return moe_route::cuda::expert_choice_workspace_bytes(p, num_tokens, num_experts, num_groups);
}

void expert_choice(const selection::expert_choice& p, const expert_choice_inputs<float>& in,
                   const expert_choice_outputs& out, void* workspace, std::size_t workspace_bytes, stream_t stream) {
  moe_route::cuda::expert_choice(p, in, out, workspace, workspace_bytes, stream);
}

void expert_choice_backward(const expert_choice_inputs<float>& in, const std::int32_t* indices,
                            const float* grad_gates, float* grad_logits, stream_t stream) {
  moe_route::cuda::expert_choice_backward(in, indices, grad_gates, grad_logits, stream);
}

void update_expert_bias(const selection::expert_bias& policy, float* bias, const double* loads, int num_experts,
                        stream_t stream) {
  moe_route::cuda::update_expert_bias(policy, bias, loads, num_experts, stream);
}

std::size_t router_l2_workspace_bytes(const penalty::router_weights* layers, int num_layers) {
  return moe_route::cuda::router_l2_workspace_bytes(layers, num_layers);
}

void router_l2(const penalty::router_l2& policy, const penalty::router_weights* layers, int num_layers,
               double* value, void* workspace, std::size_t workspace_bytes, stream_t stream) {
  moe_route::cuda::router_l2_apply(policy, layers, num_layers, value, workspace, workspace_bytes, stream);
}

std::size_t prior_build_workspace_bytes(std::int64_t num_rows, int num_experts) {
  return moe_route::cuda::prior::build_workspace_bytes(num_rows, num_experts);
}

void prior_build(gating_kind g, const route_inputs<float>& base, const std::int32_t* rows, std::int64_t num_rows,
                 float* prior, std::int64_t* row_tokens, void* workspace, std::size_t workspace_bytes,
                 stream_t stream) {
  runtime::detail::by_gating(g, [&](auto gating) {
    moe_route::cuda::prior::build<decltype(gating)>(base, rows, num_rows, prior, row_tokens, workspace,
                                                    workspace_bytes, stream);
  });
}

}  // namespace moe_route::runtime::cuda
