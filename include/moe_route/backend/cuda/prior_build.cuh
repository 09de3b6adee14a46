// moe_route CUDA backend: the RPB prior builder on the device,
//   cuda::prior::build<Gating>(base_inputs, rows, S, prior, row_tokens, workspace, bytes, stream)
// the same bits as moe_route::prior::build on the host (fixed-point row sums,
// agent_prior.cuh). All pointers are device pointers; `workspace` holds the
// S x E fixed-point sums (build_workspace_bytes). row_tokens[S] receives the
// number of tokens of each row: rows with 0 are empty (written as zeros, as on
// the host, where prior::prepare rejects them). No allocation, no
// synchronisation; rows outside [-1, S) act as -1 on the device.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include <moe_route/backend/cuda/detail/agent_prior.cuh>
#include <moe_route/backend/cuda/detail/error.cuh>
#include <moe_route/backend/cuda/detail/kernels.cuh>
#include <moe_route/backend/cuda/detail/tuning.cuh>
#include <moe_route/backend/cuda/detail/warp.cuh>
#include <moe_route/backend/cuda/route.cuh>
#include <moe_route/detail/validate.hpp>
#include <moe_route/gating/gating.hpp>
#include <moe_route/training/workspace.hpp>
#include <moe_route/types.hpp>

namespace moe_route::cuda {

namespace detail {

template <class Gating, class T>
MOE_ROUTE_KERNEL void __launch_bounds__(tuning::max_block_threads)
    prior_build_kernel(const prior_build_params<T> p) {
  for (std::int64_t token = warp_first_token(); token < p.num_tokens; token += warp_stride())
    build_prior_row<cuda_warp, Gating>(p, token);
}

MOE_ROUTE_KERNEL void prior_mean_kernel(const std::int64_t* sums, const std::int64_t* row_tokens,
                                        std::int64_t num_rows, int num_experts, float* prior) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_rows * num_experts) return;
  prior[i] = moe_route::penalty::fixed_point_mean(sums[i], row_tokens[i / num_experts]);
}

}  // namespace detail

namespace prior {

inline std::size_t build_workspace_bytes(std::int64_t num_rows, int num_experts) {
  return static_cast<std::size_t>(num_rows) * static_cast<std::size_t>(num_experts) * sizeof(std::int64_t);
}

template <class Gating, class T>
void build(const route_inputs<T>& base, const std::int32_t* rows, std::int64_t num_rows, float* prior,
           std::int64_t* row_tokens, void* workspace, std::size_t workspace_bytes, cudaStream_t stream = 0) {
  static_assert(gating::is_gating<Gating>, "cuda::prior::build<Gating>: Gating must be a policy from moe_route::gating");
  using moe_route::detail::fail;
  const std::int64_t n = base.num_tokens;
  const int E = base.num_experts;
  if (n < 0) fail("num_tokens (= " + std::to_string(n) + ") must be >= 0");
  if (E < 1 || E > max_experts) fail("num_experts (= " + std::to_string(E) + ") must be in [1, 4096]");
  if (num_rows < 1) fail("prior rows S (= " + std::to_string(num_rows) + ") must be >= 1");
  if (prior == nullptr) fail("prior (output) is null");
  if (row_tokens == nullptr) fail("row_tokens (output) is null");
  if (n > 0 && base.logits == nullptr) fail("logits is null");
  if (n > 0 && rows == nullptr) fail("prior_rows is null");
  if (workspace == nullptr || workspace_bytes < build_workspace_bytes(num_rows, E))
    fail("workspace must hold build_workspace_bytes(S, E) (= " + std::to_string(build_workspace_bytes(num_rows, E)) +
         ") bytes");
  using S = detail::storage_t<T>;
  auto* sums = static_cast<std::int64_t*>(workspace);
  detail::check_launch(cudaMemsetAsync(sums, 0, build_workspace_bytes(num_rows, E), stream),
                       "moe_route::cuda::prior::build: zeroing the workspace");
  detail::check_launch(cudaMemsetAsync(row_tokens, 0, sizeof(std::int64_t) * num_rows, stream),
                       "moe_route::cuda::prior::build: zeroing row_tokens");
  if (n > 0) {
    const detail::prior_build_params<S> p{detail::storage_pointer(base.logits), n, E, rows, num_rows, sums, row_tokens};
    constexpr tuning::launch_policy policy = tuning::route_general;
    detail::prior_build_kernel<Gating, S>
        <<<static_cast<unsigned>(policy.blocks_for(n)), policy.block_threads(), 0, stream>>>(p);
    detail::check_launch("moe_route::cuda::prior::build: launch of the builder kernel");
  }
  const std::int64_t entries = num_rows * E;
  detail::prior_mean_kernel<<<static_cast<unsigned>((entries + 255) / 256), 256, 0, stream>>>(sums, row_tokens,
                                                                                               num_rows, E, prior);
  detail::check_launch("moe_route::cuda::prior::build: launch of the mean kernel");
}

}  // namespace prior
}  // namespace moe_route::cuda
