// moe_route: routers configured at run time (runtime.hpp) on the CUDA backend.
//
//   std::size_t runtime::cuda::neutral_bytes(config, inputs)
//   void runtime::cuda::route(config, inputs, outputs, scratch, scratch_bytes, stream)
//   void runtime::cuda::backward(config, inputs, backward_args, scratch, scratch_bytes, stream)
//   std::size_t runtime::cuda::admit_workspace_bytes(config, admission, num_tokens, num_experts, num_groups)
//   void runtime::cuda::admit(config, admission, inputs, outputs, workspace, workspace_bytes, stream)
//
// The same calls as runtime::route / backward / admit, with device pointers
// and a stream; they compute what cuda::route / backward / admit compute for
// the router or policy the configuration describes, bit for bit what the CPU
// calls give. A runtime router carries every penalty, so the policy inputs a
// call leaves null get neutral values (runtime::detail::find_missing) written
// into caller-owned device scratch of neutral_bytes() bytes, stream-ordered
// (memsets and one fill), so a framework allocates it with its own allocator
// as it does the training and admission workspaces. backward writes them
// again: give it scratch of the same size. Errors in the configuration or the
// arguments throw moe_route::error on the host before anything is launched.
//
// This header has the per-gating calls route_with / backward_with /
// admit_with / admit_workspace_bytes_with<Gating>; route, backward, admit and
// admit_workspace_bytes, which choose the gating at run time and so
// instantiate every router of every gating (minutes of nvcc), come with
// runtime_instantiate.cuh, which declares those instantiations extern.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime.h>
#include <thrust/execution_policy.h>
#include <thrust/fill.h>

#include "../../runtime.hpp"
#include "admission.cuh"
#include "route.cuh"

namespace moe_route::runtime::cuda {

namespace detail {

// The neutral inputs' places in the scratch: each region 256-byte aligned,
// present only when find_missing asks for it (an offset of -1 otherwise).
struct neutral_layout {
  std::ptrdiff_t token_prior_row = -1, sequence_ids = -1, prior_bias = -1, prior_probs = -1, load_fractions = -1,
                 expert_rank = -1;
  std::size_t bytes = 0;
};

inline neutral_layout layout_of(const runtime::detail::missing_inputs& m, std::int64_t num_tokens, int num_experts) {
  neutral_layout l;
  const auto n = static_cast<std::size_t>(num_tokens > 0 ? num_tokens : 0);
  const auto e = static_cast<std::size_t>(num_experts > 0 ? num_experts : 0);
  const auto rows = static_cast<std::size_t>(m.prior_rows > 0 ? m.prior_rows : 0);
  auto take = [&](bool wanted, std::size_t size) -> std::ptrdiff_t {
    if (!wanted) return -1;
    const auto at = static_cast<std::ptrdiff_t>(l.bytes);
    l.bytes += (size + 255) / 256 * 256;
    return at;
  };
  l.token_prior_row = take(m.token_prior_row, n * sizeof(std::int32_t));
  l.sequence_ids = take(m.sequence_ids, n * sizeof(std::int32_t));
  l.prior_bias = take(m.prior_bias, rows * e * sizeof(float));
  l.prior_probs = take(m.prior_probs, rows * e * sizeof(float));
  l.load_fractions = take(m.load_fractions, e * sizeof(float));
  l.expert_rank = take(m.expert_rank, e * sizeof(std::int32_t));
  return l;
}

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

// Device scratch bytes route/backward need for the neutral values of the
// inputs `in` leaves null (0 when it gives every input the router reads).
inline std::size_t neutral_bytes(const router_config& c, const route_inputs<float>& in) {
  return detail::layout_of(runtime::detail::find_missing(c, in), in.num_tokens, in.num_experts).bytes;
}

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
