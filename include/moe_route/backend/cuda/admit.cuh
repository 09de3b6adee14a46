// moe_route CUDA backend: admission (docs/policies.md section 4).
//
//   std::size_t cuda::admit_workspace_bytes(router, policy, num_tokens, num_experts, num_groups = 1)
//   void cuda::admit(router, policy, admission_inputs, admission_outputs, workspace, workspace_bytes, stream)
//
// Same arguments and the same bits as cpu::admit (backend/cpu/admit.hpp):
// indices, gates, status and report. Two-phase: query the workspace size,
// then call with a caller-owned device workspace of at least that many bytes;
// everything runs on `stream` with no allocation and no synchronisation.
// Arguments are validated on the host (moe_route::error); array contents are
// not read on the host: slots with a routed index outside [0, E), a group id
// outside [0, num_groups) or (cosine) a norm that is not finite and > 0 are
// dropped and counted in report->invalid (the CPU backend throws instead).
// Padding tokens (in.token_mask) are read nowhere: their slots are dropped,
// counted in no report field, and they are not in N_g.
// out.report, if set, is a device pointer and is overwritten.
//
// Pipeline (every order from stable radix sorts of exact keys):
//   1. warp per token: affinity of each routed slot (exact fp32, admission/
//      scores.hpp), threshold; key = rank_key(affinity, token), segment =
//      group * E + expert (or a sentinel)
//   2. rank the slots of each (group, expert) (detail/admission_common.cuh); the
//      first C_e stay, the rest are rejected; loads = min(C_e, |pool|)
//   3. reroute rounds (policy<..., reroute>): warp per token proposes, rank
//      the proposals per (group, expert), accept up to the room left, update
//      the loads
//   4. warp per token: admitted indices, status, gates (admission/gates.hpp)
//   5. report (integer sums)
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include <moe_route/admission/admission.hpp>
#include <moe_route/admission/detail/validate.hpp>
#include <moe_route/backend/cuda/detail/admission_launch.cuh>
#include <moe_route/backend/cuda/detail/executor.cuh>
#include <moe_route/backend/cuda/detail/storage.cuh>
#include <moe_route/router.hpp>
#include <moe_route/types.hpp>

namespace moe_route::cuda {

// Device workspace bytes that admit needs for these shapes (host; no device
// work). The policy and router only matter through their type.
template <class Router, class Policy>
std::size_t admit_workspace_bytes(const Router& r, const Policy& p, std::int64_t num_tokens, int num_experts,
                                 int num_groups = 1) {
  static_assert(is_router<Router>, "cuda::admit_workspace_bytes: the first argument must be a moe_route::router");
  admission::detail::validate_policy(p);
  moe_route::detail::validate_router(r, num_experts);
  admission::detail::validate_groups(num_groups, num_experts);
  if (num_tokens < 0) moe_route::detail::fail("num_tokens must be >= 0");
  if (admission::detail::reaches_sort_limit(num_tokens, r.top_k))
    moe_route::detail::fail("num_tokens (= " + std::to_string(num_tokens) + ") * top_k (= " + std::to_string(r.top_k) +
                            ") must be < 2^31 - 1 for admission");
  return admission_detail::admit_bytes<detail::device_executor, Policy>(detail::device_executor{}, num_tokens, r.top_k,
                                                                        num_experts, num_groups);
}

// Admission on the device; see the top of this file.
template <class Router, class Policy, class T>
void admit(const Router& r, const Policy& p, const admission_inputs<T>& in, const admission_outputs& out,
           void* workspace, std::size_t workspace_bytes, cudaStream_t stream = 0) {
  admission::detail::validate_admission(r, p, in, out);
  const std::size_t needed = admit_workspace_bytes(r, p, in.num_tokens, in.num_experts, in.num_groups);
  admission_detail::launch_admit(detail::device_executor{stream}, r, p, detail::storage_inputs(in), out, workspace,
                                 workspace_bytes, needed);
}

}  // namespace moe_route::cuda
