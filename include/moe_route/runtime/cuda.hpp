// moe_route: the CUDA calls of the routers configured at run time (runtime/config.hpp),
// declared for host code that is compiled without nvcc: a g++ LibTorch
// extension, a C++ engine. They are defined once, in the compiled
// instances (src/cuda_runtime*.cu, CMake target moe_route::cuda_runtime,
// built with -DMOE_ROUTE_BUILD_CUDA_RUNTIME=ON); link that library, or compile
// those files into your own project (src/README.md).
//
//   std::size_t runtime::cuda::neutral_bytes(config, inputs)
//   void runtime::cuda::route(config, inputs, outputs, scratch, scratch_bytes, stream)
//   void runtime::cuda::backward(config, inputs, backward_args, scratch, scratch_bytes, stream)
//   std::size_t runtime::cuda::admit_workspace_bytes(config, admission, num_tokens, num_experts, num_groups)
//   void runtime::cuda::admit(config, admission, inputs, outputs, workspace, workspace_bytes, stream)
//   and the dispatch metadata, expert choice, the expert-bias update, Router-L2 and the prior builder.
//
// Every pointer in the argument structs is a device pointer unless a comment
// says otherwise, and every call is stream-ordered: nothing is allocated and
// nothing synchronises. They compute what the CPU calls compute, bit for bit.
// Errors in the configuration or the arguments throw moe_route::error on the
// host before anything is launched; a failed launch throws too.
//
// The gating and the policies are chosen at run time, so each call reaches
// every router the configuration can describe: the per-gating templates
// (route_with<Gating>, ... in runtime/detail/cuda.cuh) are the nvcc side.
#pragma once

#include <cstddef>
#include <cstdint>

#include <moe_route/admission/dispatch.hpp>
#include <moe_route/penalty/router_l2.hpp>
#include <moe_route/runtime/config.hpp>
#include <moe_route/runtime/detail/neutral.hpp>
#include <moe_route/selection/expert_bias.hpp>
#include <moe_route/selection/expert_choice.hpp>

// cudaStream_t is `CUstream_st*`; declared here so that this header needs no CUDA header.
struct CUstream_st;

namespace moe_route::runtime::cuda {

using stream_t = CUstream_st*;  // a cudaStream_t; nullptr is the legacy default stream

// Device scratch bytes route/backward need for the neutral values of the
// inputs `in` leaves null (0 when it gives every input the router reads). A
// runtime router carries every penalty, so those inputs get neutral values
// (runtime::detail::find_missing) written into the scratch, stream-ordered.
inline std::size_t neutral_bytes(const router_config& c, const route_inputs<float>& in) {
  return runtime::detail::layout_of(runtime::detail::find_missing(c, in), in.num_tokens, in.num_experts).bytes;
}

// runtime::route on the device. out.penalty_values: num_penalties device
// doubles (penalty_names order); out.workspace: runtime::workspace_bytes(c, ...)
// device bytes; out.nonfinite_rows, when set, a device counter the call adds to.
void route(const router_config& c, const route_inputs<float>& in, const route_outputs& out, void* scratch,
           std::size_t scratch_bytes, stream_t stream = nullptr);

// runtime::backward on the device, for the inputs of route(); it writes the
// neutral inputs again, so give it scratch of the same size.
void backward(const router_config& c, const route_inputs<float>& in, const backward_args& args, void* scratch,
              std::size_t scratch_bytes, stream_t stream = nullptr);

// Device workspace bytes of admit() for these shapes.
std::size_t admit_workspace_bytes(const router_config& c, const admission_config& a, std::int64_t num_tokens,
                                  int num_experts, int num_groups = 1);

// runtime::admit on the device; out.report, when set, is a device admission_report.
void admit(const router_config& c, const admission_config& a, const admission_inputs<float>& in,
           const admission_outputs& out, void* workspace, std::size_t workspace_bytes, stream_t stream = nullptr);

// cpu::dispatch on the device (the metadata of admission/dispatch.hpp).
std::size_t dispatch_workspace_bytes(std::int64_t num_tokens, int slots_per_token, int num_experts);
void dispatch(const dispatch_inputs& in, const dispatch_outputs& out, void* workspace, std::size_t workspace_bytes,
              stream_t stream = nullptr);

// cpu::expert_choice / expert_choice_backward on the device; out.report, when
// set, is a device expert_choice_report.
std::size_t expert_choice_workspace_bytes(const selection::expert_choice& p, std::int64_t num_tokens,
                                          int num_experts, int num_groups = 1);
void expert_choice(const selection::expert_choice& p, const expert_choice_inputs<float>& in,
                   const expert_choice_outputs& out, void* workspace, std::size_t workspace_bytes,
                   stream_t stream = nullptr);
void expert_choice_backward(const expert_choice_inputs<float>& in, const std::int32_t* indices,
                            const float* grad_gates, float* grad_logits, stream_t stream = nullptr);

// selection::expert_bias::update on the device (cuda::update_expert_bias):
// bias [E] float and loads [E] double are device pointers; the host update's bits.
void update_expert_bias(const selection::expert_bias& policy, float* bias, const double* loads, int num_experts,
                        stream_t stream = nullptr);

// penalty::router_l2::apply on the device: `layers` is a host array of device
// pointers (each gradient is added to), `value` one device double.
std::size_t router_l2_workspace_bytes(const penalty::router_weights* layers, int num_layers);
void router_l2(const penalty::router_l2& policy, const penalty::router_weights* layers, int num_layers,
               double* value, void* workspace, std::size_t workspace_bytes, stream_t stream = nullptr);

// prior::build on the device with the gating `g` (the base router's):
// prior [S x E] and row_tokens [S] (tokens per row; 0 marks an empty row).
std::size_t prior_build_workspace_bytes(std::int64_t num_rows, int num_experts);
void prior_build(gating_kind g, const route_inputs<float>& base, const std::int32_t* rows, std::int64_t num_rows,
                 float* prior, std::int64_t* row_tokens, void* workspace, std::size_t workspace_bytes,
                 stream_t stream = nullptr);

}  // namespace moe_route::runtime::cuda
