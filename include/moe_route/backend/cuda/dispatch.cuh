// moe_route CUDA backend: dispatch metadata (layout: admission/dispatch.hpp).
//
//   std::size_t cuda::dispatch_workspace_bytes(num_tokens, slots_per_token, num_experts)
//   void cuda::dispatch(dispatch_inputs, dispatch_outputs, workspace, bytes, stream)
//
// Same bits as cpu::dispatch. The slots are sorted by expert with a stable
// radix sort (slot ids as values, so each expert's slots stay in slot =
// (token, slot) order), segment boundaries give the counts, an exclusive scan
// of the padded counts gives the offsets, and one scatter writes the
// permutation and its inverse. No atomic decides an order. Entries of indices
// outside [-1, E) are treated as -1 and expert_rank entries outside [0, R)
// are not counted, and under a fixed capacity an expert's slots past the
// first `capacity` are not executed (the CPU backend throws). One call handles fewer than 2^31
// slots; offsets, rows and slot ids are written as int64. No allocation, no
// synchronisation.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include <moe_route/admission/detail/validate.hpp>
#include <moe_route/admission/dispatch.hpp>
#include <moe_route/backend/cuda/detail/dispatch_launch.cuh>
#include <moe_route/backend/cuda/detail/executor.cuh>

namespace moe_route::cuda {

inline std::size_t dispatch_workspace_bytes(std::int64_t num_tokens, int slots_per_token, int num_experts) {
  dispatch_inputs shape;
  shape.num_tokens = num_tokens;
  shape.slots_per_token = slots_per_token;
  shape.num_experts = num_experts;
  admission::detail::validate_dispatch_shape(shape);
  admission_detail::validate_device_dispatch(num_tokens, slots_per_token);
  return admission_detail::make_dispatch_layout(detail::device_executor{}, nullptr,
                                                static_cast<int>(num_tokens * slots_per_token), num_experts)
      .bytes;
}

inline void dispatch(const dispatch_inputs& in, const dispatch_outputs& out, void* workspace,
                     std::size_t workspace_bytes, cudaStream_t stream = 0) {
  admission::detail::validate_dispatch(in, out);
  admission_detail::validate_device_dispatch(in.num_tokens, in.slots_per_token);
  const std::size_t needed = dispatch_workspace_bytes(in.num_tokens, in.slots_per_token, in.num_experts);
  admission_detail::launch_dispatch(detail::device_executor{stream}, in, out, workspace, workspace_bytes, needed);
}

}  // namespace moe_route::cuda
