// moe_route CUDA backend: co-activation counts of a routing trace on the GPU
// (docs/policies.md section 6), so large probe sets need not leave the device.
//
//   cuda::coactivation_counts(indices, N, S, E, counts, stream)
//
// counts [E x E] (device, unsigned long long) is zeroed on `stream` and then
// receives counts[i, j] = #{t : i, j in S(t)}, i != j: the same integers as
// analysis::coactivation (analysis/coactivation.hpp) computes on the host.
// One thread per token adds 1 to both (i, j) and (j, i) for every pair of its
// valid slots with atomicAdd on 64-bit integers; integer addition is
// associative, so the result does not depend on the order of the atomics and
// is run-to-run deterministic. Entries outside [0, E) (-1 = dropped) and a
// repeated expert within a token are skipped on the device (the host version
// rejects repeats; every backend writes distinct experts). No allocation, no
// device synchronisation; W = counts / N.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include <moe_route/backend/cuda/detail/error.cuh>
#include <moe_route/config.hpp>
#include <moe_route/types.hpp>

namespace moe_route::cuda {

namespace detail {

MOE_ROUTE_KERNEL void coactivation_kernel(const std::int32_t* __restrict__ indices, std::int64_t num_tokens,
                                          int slots, int num_experts, unsigned long long* __restrict__ counts) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < num_tokens; t += stride) {
    const std::int32_t* row = indices + t * slots;
    for (int a = 0; a < slots; ++a) {
      const int i = row[a];
      if (i < 0 || i >= num_experts) continue;
      bool repeated = false;
      for (int c = 0; c < a; ++c) repeated = repeated || row[c] == i;
      if (repeated) continue;
      for (int b = a + 1; b < slots; ++b) {
        const int j = row[b];
        if (j < 0 || j >= num_experts || j == i) continue;
        bool seen = false;
        for (int c = a + 1; c < b; ++c) seen = seen || row[c] == j;
        if (seen) continue;
        atomicAdd(counts + static_cast<std::size_t>(i) * num_experts + j, 1ull);
        atomicAdd(counts + static_cast<std::size_t>(j) * num_experts + i, 1ull);
      }
    }
  }
}

}  // namespace detail

// Throws moe_route::error for invalid arguments (before anything is launched)
// and cuda_error when the memset or the launch fails.
inline void coactivation_counts(const std::int32_t* indices, std::int64_t num_tokens, int slots_per_token,
                                int num_experts, unsigned long long* counts, cudaStream_t stream = nullptr) {
  if (num_tokens < 0) throw error("moe_route: cuda::coactivation_counts: num_tokens (= " + std::to_string(num_tokens) + ") must be >= 0");
  if (slots_per_token < 1)
    throw error("moe_route: cuda::coactivation_counts: slots_per_token (= " + std::to_string(slots_per_token) + ") must be >= 1");
  if (num_experts < 1 || num_experts > max_experts)
    throw error("moe_route: cuda::coactivation_counts: num_experts (= " + std::to_string(num_experts) + ") must be in [1, 4096]");
  if (counts == nullptr) throw error("moe_route: cuda::coactivation_counts: counts is null");
  if (num_tokens > 0 && indices == nullptr) throw error("moe_route: cuda::coactivation_counts: indices is null");
  const std::size_t bytes = static_cast<std::size_t>(num_experts) * num_experts * sizeof(unsigned long long);
  const cudaError_t code = cudaMemsetAsync(counts, 0, bytes, stream);
  if (code != cudaSuccess) throw cuda_error("cudaMemsetAsync (coactivation counts)", code);
  if (num_tokens == 0) return;
  constexpr int threads = 256;
  const std::int64_t blocks_needed = (num_tokens + threads - 1) / threads;
  const int blocks = static_cast<int>(blocks_needed < 65535 * 8 ? blocks_needed : 65535 * 8);
  detail::coactivation_kernel<<<blocks, threads, 0, stream>>>(indices, num_tokens, slots_per_token, num_experts, counts);
  detail::check_launch("coactivation_kernel");
}

}  // namespace moe_route::cuda
