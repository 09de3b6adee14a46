// moe_route: the per-gating CUDA calls of the routers configured at run time
// (runtime/config.hpp), the nvcc side of runtime/cuda.hpp:
//
//   void runtime::cuda::route_with<Gating>(config, inputs, outputs, scratch, scratch_bytes, stream)
//   void runtime::cuda::backward_with<Gating>(config, inputs, backward_args, scratch, scratch_bytes, stream)
//   std::size_t runtime::cuda::admit_workspace_bytes_with<Gating>(config, admission, num_tokens, num_experts, num_groups)
//   void runtime::cuda::admit_with<Gating>(config, admission, inputs, outputs, workspace, workspace_bytes, stream)
//
// The same calls as runtime::route / backward / admit, with device pointers
// and a stream, for the router or policy the configuration describes, with
// the gating fixed at compile time; they give the CPU calls' bits. A runtime
// router carries every penalty, so the policy inputs a call leaves null get
// neutral values (runtime::detail::find_missing) written into caller-owned
// device scratch of runtime::cuda::neutral_bytes() bytes, stream-ordered
// (memsets and one fill), so a framework allocates it with its own allocator
// as it does the training and admission workspaces. backward writes them
// again: give it scratch of the same size. Errors in the configuration or the
// arguments throw moe_route::error on the host before anything is launched.
//
// The calls that choose the gating at run time (runtime::cuda::route, ...,
// runtime/cuda.hpp) instantiate every router of every gating, minutes of
// nvcc: they are compiled once, in src/cuda_runtime*.cu (runtime/detail/cuda_instantiate.cuh).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime.h>
#include <thrust/execution_policy.h>
#include <thrust/fill.h>

#include <moe_route/backend/cuda/admit.cuh>
#include <moe_route/backend/cuda/detail/error.cuh>
#include <moe_route/backend/cuda/route.cuh>
#include <moe_route/runtime/config.hpp>
#include <moe_route/runtime/cuda.hpp>

namespace moe_route::runtime::cuda {

namespace detail {

// The neutral inputs in device scratch, written on `stream` (memsets and fills).
struct device_fill {
  cudaStream_t stream;
  void bytes(void* p, unsigned char value, std::size_t count, const char* what) const {
    moe_route::cuda::detail::check_launch(cudaMemsetAsync(p, value, count, stream), what);
  }
  void floats(float* p, float value, std::size_t count) const {  // thrust throws on a failed launch
    thrust::fill_n(thrust::cuda::par_nosync.on(stream), p, count, value);
  }
};

// `in` with its missing policy inputs pointing at neutral values written into
// `scratch` on `stream`.
inline route_inputs<float> complete(const router_config& c, const route_inputs<float>& in, void* scratch,
                                    std::size_t scratch_bytes, cudaStream_t stream) {
  const runtime::detail::missing_inputs m = runtime::detail::find_missing(c, in);
  const runtime::detail::neutral_layout l = runtime::detail::layout_of(m, in.num_tokens, in.num_experts);
  if (l.bytes > 0 && (scratch == nullptr || scratch_bytes < l.bytes))
    throw error("moe_route::runtime::cuda: scratch_bytes (= " + std::to_string(scratch == nullptr ? 0 : scratch_bytes) +
                ") is less than neutral_bytes (= " + std::to_string(l.bytes) + ")");
  return runtime::detail::fill_neutral(m, l, in, static_cast<unsigned char*>(scratch), device_fill{stream});
}

}  // namespace detail

// cuda::route with the router of `c`. out.penalty_values is a device array
// of num_penalties doubles (penalty_names order), out.workspace device memory
// of runtime::workspace_bytes(c, ...) bytes.
template <class Gating>
void route_with(const router_config& c, const route_inputs<float>& in, const route_outputs& out, void* scratch,
                std::size_t scratch_bytes, cudaStream_t stream = 0) {
  const route_inputs<float> full = detail::complete(c, in, scratch, scratch_bytes, stream);
  visit_router_with<Gating>(c, [&](const auto& r) { moe_route::cuda::route(r, full, out, stream); });
}

// cuda::backward with the router of `c`, for the same inputs as route().
template <class Gating>
void backward_with(const router_config& c, const route_inputs<float>& in, const backward_args& args, void* scratch,
                   std::size_t scratch_bytes, cudaStream_t stream = 0) {
  const route_inputs<float> full = detail::complete(c, in, scratch, scratch_bytes, stream);
  visit_router_with<Gating>(c, [&](const auto& r) { moe_route::cuda::backward(r, full, args, stream); });
}

// Device workspace bytes admit_with needs for these shapes.
template <class Gating>
std::size_t admit_workspace_bytes_with(const router_config& c, const admission_config& a, std::int64_t num_tokens,
                                       int num_experts, int num_groups = 1) {
  const auto r = admission_router<Gating>(c);
  return visit_admission(a, [&](const auto& p) {
    return moe_route::cuda::admit_workspace_bytes(r, p, num_tokens, num_experts, num_groups);
  });
}

// cuda::admit with the policy of `a` (on runtime::admission_router); out.report, when set, is a device pointer.
template <class Gating>
void admit_with(const router_config& c, const admission_config& a, const admission_inputs<float>& in,
                const admission_outputs& out, void* workspace, std::size_t workspace_bytes, cudaStream_t stream = 0) {
  const auto r = admission_router<Gating>(c);
  visit_admission(a, [&](const auto& p) { moe_route::cuda::admit(r, p, in, out, workspace, workspace_bytes, stream); });
}

}  // namespace moe_route::runtime::cuda
