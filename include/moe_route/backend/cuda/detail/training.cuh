// moe_route CUDA backend: kernels and host launch code of the training path
// (routers with a prior policy or penalties, in mode::train). route.cuh calls
// route_training / backward_training; their arguments are validated there.
//
// Forward: zero the workspace's sums (cudaMemsetAsync), one training route
// kernel (agent_training.cuh), then, with penalties, the chunk totals of the
// per-token values (one thread per chunk and column, token order) and the
// values (one thread: penalty::values, the host's arithmetic).
// Backward: with distribution-space penalties, one block computes the shared
// dL/dp into the workspace; then the fused training backward kernel.
// No allocation, no synchronisation.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

#include <moe_route/backend/cuda/detail/agent_training.cuh>
#include <moe_route/backend/cuda/detail/error.cuh>
#include <moe_route/backend/cuda/detail/kernels.cuh>
#include <moe_route/backend/cuda/detail/tuning.cuh>
#include <moe_route/backend/cuda/detail/warp.cuh>
#include <moe_route/router.hpp>
#include <moe_route/training/finalize.hpp>
#include <moe_route/training/workspace.hpp>
#include <moe_route/types.hpp>

namespace moe_route::cuda::detail {

// Dynamic shared memory of the training route kernel: per warp E keys and E
// fixed-point sums; per block E selection counts and two token counters.
inline std::size_t training_shared_bytes(int warps, int num_experts) {
  return static_cast<std::size_t>(warps) * num_experts * 16 + static_cast<std::size_t>(num_experts) * 4 + 16;
}

template <class Router, class T>
MOE_ROUTE_KERNEL void __launch_bounds__(tuning::max_block_threads)
    route_training_kernel(const Router r, const training_params<T> p, std::int64_t* nonfinite_rows) {
  extern __shared__ std::uint64_t training_shared[];
  const int warps = static_cast<int>(blockDim.x) / warp_threads;
  const int warp = static_cast<int>(threadIdx.x) / warp_threads;
  const int E = p.num_experts;
  std::uint64_t* keys = training_shared + static_cast<std::int64_t>(warp) * E;
  std::int64_t* sums = reinterpret_cast<std::int64_t*>(training_shared + static_cast<std::int64_t>(warps) * E);
  std::int64_t* tokens = sums + static_cast<std::int64_t>(warps) * E;
  int* counts = reinterpret_cast<int*>(tokens + 2);
  std::int64_t* my_sums = sums + static_cast<std::int64_t>(warp) * E;
  for (int i = static_cast<int>(threadIdx.x); i < warps * E; i += static_cast<int>(blockDim.x)) sums[i] = 0;
  for (int i = static_cast<int>(threadIdx.x); i < E; i += static_cast<int>(blockDim.x)) counts[i] = 0;
  if (threadIdx.x < 2) tokens[threadIdx.x] = 0;
  __syncthreads();

  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * warps + warp;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * warps;
  std::int64_t bad = 0;
  for (std::int64_t token = first; token < p.num_tokens; token += stride)
    bad += route_training_row<cuda_warp>(r, p, token, keys, my_sums, counts, tokens) ? 1 : 0;
  add_nonfinite(nonfinite_rows, bad);

  if constexpr (Router::has_penalties) {
    __syncthreads();
    if (!p.on.any()) return;
    for (int e = static_cast<int>(threadIdx.x); e < E; e += static_cast<int>(blockDim.x)) {
      if (p.on.distribution) {
        std::int64_t total = 0;
        for (int w = 0; w < warps; ++w) total += sums[static_cast<std::int64_t>(w) * E + e];
        if (total != 0) cuda_warp::atomic_add(p.distribution_sums + e, total);
        if (p.counting && counts[e] != 0) cuda_warp::atomic_add(p.counts + e, static_cast<std::int64_t>(counts[e]));
      }
    }
    if (threadIdx.x == 0) {
      if (tokens[0] != 0) cuda_warp::atomic_add(p.valid_tokens, tokens[0]);
      if (tokens[1] != 0) cuda_warp::atomic_add(p.prior_tokens, tokens[1]);
    }
  }
}

// Chunk totals of the per-token values: thread i sums chunk i / columns,
// column i % columns, in token order (cpu::detail::chunk_totals).
MOE_ROUTE_KERNEL void chunk_totals_kernel(const double* token_values, std::int64_t num_tokens, int columns,
                                          double* chunk_values) {
  const std::int64_t chunks = (num_tokens + penalty::value_chunk - 1) / penalty::value_chunk;
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= chunks * columns) return;
  const std::int64_t chunk = i / columns;
  const int c = static_cast<int>(i % columns);
  const std::int64_t base = chunk * penalty::value_chunk;
  const std::int64_t end = base + penalty::value_chunk < num_tokens ? base + penalty::value_chunk : num_tokens;
  double total = 0.0;
  for (std::int64_t t = base; t < end; ++t) total += token_values[t * columns + c];
  chunk_values[chunk * columns + c] = total;
}

template <class Router>
MOE_ROUTE_KERNEL void penalty_values_kernel(const Router r, const penalty::training_state s, double* out) {
  if (blockIdx.x == 0 && threadIdx.x == 0) penalty::values(r, s, out);
}

// The upstream gradients of the penalty values, read from device memory
// (backward_args::penalty_grads; null: 1 each).
template <class Router>
__device__ penalty::upstream_grads upstream_of(const float* penalty_grads) {
  penalty::upstream_grads up;
  if (penalty_grads != nullptr)
    for (int j = 0; j < Router::num_penalties; ++j) up.value[j] = penalty_grads[j];
  return up;
}

// The shared dL/dp of the distribution-space penalties (one block).
template <class Router>
MOE_ROUTE_KERNEL void distribution_grads_kernel(const Router r, const penalty::training_state s,
                                                const float* penalty_grads, float* expert_grad,
                                                float* sequence_grad) {
  const penalty::upstream_grads up = upstream_of<Router>(penalty_grads);
  __shared__ int local;
  __shared__ std::int64_t sequences;
  if (threadIdx.x == 0) {
    local = penalty::penalty_traits<Router>::locality ? penalty::detail::local_experts(s) : 0;
    sequences = sequence_grad != nullptr ? penalty::averaged_sequences(r, s) : 0;
  }
  __syncthreads();
  const int E = s.num_experts;
  for (int e = static_cast<int>(threadIdx.x); e < E; e += static_cast<int>(blockDim.x))
    expert_grad[e] = penalty::expert_grad(r, s, up, local, e);
  if constexpr (penalty::penalty_traits<Router>::load_balance) {
    if (sequence_grad == nullptr) return;
    const std::int64_t entries = static_cast<std::int64_t>(s.num_sequences) * E;
    for (std::int64_t i = threadIdx.x; i < entries; i += blockDim.x)
      sequence_grad[i] = penalty::sequence_grad(r, s, up, sequences, static_cast<std::int32_t>(i / E),
                                                static_cast<int>(i % E));
  }
}

template <class Router, class T>
MOE_ROUTE_KERNEL void __launch_bounds__(tuning::max_block_threads)
    backward_training_kernel(const Router r, training_params<T> p, const penalty::workspace_header* header,
                             const float* penalty_grads) {
  if constexpr (Router::has_penalties)
    if (p.on.any()) p.weights = penalty::weights(r, *header, upstream_of<Router>(penalty_grads));
  for (std::int64_t token = warp_first_token(); token < p.num_tokens; token += warp_stride())
    backward_training_row<cuda_warp>(r, p, token);
}

template <class Router, class S, class T>
void route_training(const Router& r, const route_inputs<T>& in, const S* logits, const route_outputs& out,
                    cudaStream_t stream) {
  const penalty::switches on = Router::has_penalties ? penalty::active(r, in) : penalty::switches{};
  const auto layout = penalty::training_layout<Router>(in.num_tokens, in.num_experts, in.num_sequences);
  const bool penalties = Router::has_penalties && on.any();
  std::optional<penalty::workspace_view> ws;
  if (penalties) {
    ws.emplace(out.workspace, layout);
    const std::size_t zeroed = layout.token_values != 0 ? layout.token_values : layout.bytes;
    check_launch(cudaMemsetAsync(out.workspace, 0, zeroed, stream), "moe_route::cuda::route: zeroing the workspace");
  }
  training_params<S> p = make_training_params(r, in, logits, on, ws ? &*ws : nullptr);
  p.indices = out.indices;
  p.gates = out.gates;

  // Warps per block within the shared-memory budget (opting in above 48 KiB).
  constexpr int max_warps = tuning::route_general.warps_per_block;
  int warps = max_warps;
  while (warps > 1 && training_shared_bytes(warps, in.num_experts) > tuning::training_shared_bytes) --warps;
  const std::size_t shared = training_shared_bytes(warps, in.num_experts);
  if (shared > 48 * 1024)
    check_launch(cudaFuncSetAttribute(route_training_kernel<Router, S>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(shared)),
                 "moe_route::cuda::route: shared memory of the training kernel");
  tuning::launch_policy policy{warps, tuning::training_max_blocks};
  route_training_kernel<Router, S>
      <<<static_cast<unsigned>(policy.blocks_for(in.num_tokens)), policy.block_threads(), shared, stream>>>(
          r, p, out.nonfinite_rows);
  check_launch("moe_route::cuda::route: launch of the training kernel");

  if constexpr (Router::has_penalties) {
    if (!penalties) {
      check_launch(cudaMemsetAsync(out.penalty_values, 0, sizeof(double) * Router::num_penalties, stream),
                   "moe_route::cuda::route: zeroing the penalty values");
      return;
    }
    constexpr int columns = penalty::penalty_traits<Router>::scalar_penalties;
    if (columns > 0) {
      const std::int64_t items = (in.num_tokens + penalty::value_chunk - 1) / penalty::value_chunk * columns;
      chunk_totals_kernel<<<static_cast<unsigned>((items + 127) / 128), 128, 0, stream>>>(
          ws->token_values, in.num_tokens, columns, ws->chunk_values);
      check_launch("moe_route::cuda::route: launch of the chunk-total kernel");
    }
    penalty_values_kernel<Router><<<1, 1, 0, stream>>>(r, ws->state(r, in), out.penalty_values);
    check_launch("moe_route::cuda::route: launch of the penalty-value kernel");
  }
}

template <class Router, class S, class T>
void backward_training(const Router& r, const route_inputs<T>& in, const S* logits, const backward_args& args,
                       cudaStream_t stream) {
  const penalty::switches on = Router::has_penalties ? penalty::active(r, in) : penalty::switches{};
  const bool penalties = Router::has_penalties && on.any();
  std::optional<penalty::workspace_view> ws;
  static_assert(Router::num_penalties <= 8, "at most 8 penalties");
  if (penalties) {
    ws.emplace(args.workspace, penalty::training_layout<Router>(in.num_tokens, in.num_experts, in.num_sequences));
    if (on.distribution) {
      float* sequence_grad = penalty::over_sequences(r) ? ws->sequence_grad : nullptr;
      distribution_grads_kernel<Router>
          <<<1, 256, 0, stream>>>(r, ws->state(r, in), args.penalty_grads, ws->expert_grad, sequence_grad);
      check_launch("moe_route::cuda::backward: launch of the shared-gradient kernel");
    }
  }
  training_params<S> p = make_training_params(r, in, logits, on, ws ? &*ws : nullptr);
  p.admitted_indices = args.admitted_indices;
  p.renormalize = args.renormalize;
  p.grad_indices = args.indices;
  p.grad_gates = args.grad_gates;
  p.grad_logits = args.grad_logits;
  constexpr tuning::launch_policy policy = tuning::backward_general;
  backward_training_kernel<Router, S>
      <<<static_cast<unsigned>(policy.blocks_for(in.num_tokens)), policy.block_threads(), 0, stream>>>(
          r, p, ws ? ws->header : nullptr, args.penalty_grads);
  check_launch("moe_route::cuda::backward: launch of the training kernel");
}

}  // namespace moe_route::cuda::detail
