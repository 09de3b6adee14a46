// moe_route: the per-gating CUDA calls of the routers configured at run time
// (runtime.hpp), the nvcc side of runtime_cuda.hpp:
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
// runtime_cuda.hpp) instantiate every router of every gating, minutes of
// nvcc: they are compiled once, in instances/cuda_*.cu (runtime_instantiate.cuh).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime.h>
#include <thrust/execution_policy.h>
#include <thrust/fill.h>

#include "../../runtime.hpp"
#include "../../runtime_cuda.hpp"
#include "admission.cuh"
#include "route.cuh"

namespace moe_route::runtime::cuda {

namespace detail {

inline void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw error(std::string("moe_route::runtime::cuda: ") + what + ": " + cudaGetErrorString(status));
}

// `in` with its missing policy inputs pointing at neutral values written into
// `scratch` on `stream`.
inline route_inputs<float> complete(const router_config& c, route_inputs<float> in, void* scratch,
                                    std::size_t scratch_bytes, cudaStream_t stream) {
  const runtime::detail::missing_inputs m = runtime::detail::find_missing(c, in);
  const neutral_layout l = layout_of(m, in.num_tokens, in.num_experts);
  if (l.bytes == 0) return in;
  if (scratch == nullptr || scratch_bytes < l.bytes)
    throw error("moe_route::runtime::cuda: scratch_bytes (= " + std::to_string(scratch == nullptr ? 0 : scratch_bytes) +
                ") is less than neutral_bytes (= " + std::to_string(l.bytes) + ")");
  auto* base = static_cast<unsigned char*>(scratch);
  const auto n = static_cast<std::size_t>(in.num_tokens > 0 ? in.num_tokens : 0);
  const auto e = static_cast<std::size_t>(in.num_experts);
  const float one_over_e = 1.0f / static_cast<float>(in.num_experts);
  auto uniform = [&](std::ptrdiff_t at, std::size_t count) {  // thrust throws on a failed launch
    auto* p = reinterpret_cast<float*>(base + at);
    thrust::fill_n(thrust::cuda::par_nosync.on(stream), p, count, one_over_e);
    return p;
  };
  if (l.token_prior_row >= 0) {  // -1: every byte 0xff
    check(cudaMemsetAsync(base + l.token_prior_row, 0xff, n * sizeof(std::int32_t), stream), "neutral token_prior_row");
    in.token_prior_row = reinterpret_cast<const std::int32_t*>(base + l.token_prior_row);
  }
  if (l.sequence_ids >= 0) {
    check(cudaMemsetAsync(base + l.sequence_ids, 0, n * sizeof(std::int32_t), stream), "neutral sequence_ids");
    in.sequence_ids = reinterpret_cast<const std::int32_t*>(base + l.sequence_ids);
    in.num_sequences = 1;
  }
  if (m.prior_bias || m.prior_probs) in.prior_rows = m.prior_rows;
  const std::size_t table = static_cast<std::size_t>(m.prior_rows) * e;
  if (l.prior_bias >= 0) {
    check(cudaMemsetAsync(base + l.prior_bias, 0, table * sizeof(float), stream), "neutral prior_bias");
    in.prior_bias = reinterpret_cast<const float*>(base + l.prior_bias);
  }
  if (l.prior_probs >= 0) in.prior_probs = uniform(l.prior_probs, table);
  if (l.load_fractions >= 0) in.load_fractions = uniform(l.load_fractions, e);
  if (l.expert_rank >= 0) {
    check(cudaMemsetAsync(base + l.expert_rank, 0, e * sizeof(std::int32_t), stream), "neutral expert_rank");
    in.expert_rank = reinterpret_cast<const std::int32_t*>(base + l.expert_rank);
    in.rank = 0;
  }
  return in;
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
    return moe_route::cuda::admit_workspace_size(r, p, num_tokens, num_experts, num_groups);
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
