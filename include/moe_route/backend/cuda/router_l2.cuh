// moe_route CUDA backend: Router-L2 (RPB eq. 5) on device weights,
//   cuda::router_l2_apply(policy, layers, L, value, workspace, bytes, stream)
// the same value and gradient bits as penalty::router_l2::apply on the host:
// one thread per chunk of penalty::l2_chunk elements sums in element order,
// then one thread per layer adds the chunks in order, layer after layer, on
// the stream. `layers` is a host array whose pointers are device pointers;
// `value` is a device double. No allocation, no synchronisation.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include <moe_route/backend/cuda/detail/error.cuh>
#include <moe_route/penalty/router_l2.hpp>

namespace moe_route::cuda {

namespace detail {

MOE_ROUTE_KERNEL void l2_chunk_kernel(const float* w, const float* w0, std::int64_t size, double* chunk_sums) {
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t base = c * penalty::l2_chunk;
  if (base >= size) return;
  const std::int64_t end = base + penalty::l2_chunk < size ? base + penalty::l2_chunk : size;
  double sum = 0.0;
  for (std::int64_t i = base; i < end; ++i) sum = penalty::l2_term(w[i], w0[i], sum);
  chunk_sums[c] = sum;
}

MOE_ROUTE_KERNEL void l2_grad_kernel(const float* w, const float* w0, std::int64_t size, float grad_scale,
                                     float* grad) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < size;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    grad[i] = penalty::l2_grad(w[i], w0[i], grad_scale, grad[i]);
}

// total (+)= sum of the layer's chunks in order; the first layer starts it at 0.
MOE_ROUTE_KERNEL void l2_layer_kernel(const double* chunk_sums, std::int64_t chunks, bool first, double* total) {
  double sum = 0.0;
  for (std::int64_t c = 0; c < chunks; ++c) sum += chunk_sums[c];
  *total = first ? 0.0 + sum : *total + sum;
}

MOE_ROUTE_KERNEL void l2_value_kernel(const double* total, double scale, double* value) { *value = scale * *total; }

inline std::int64_t l2_chunks(std::int64_t size) { return (size + penalty::l2_chunk - 1) / penalty::l2_chunk; }

}  // namespace detail

// Workspace bytes of router_l2_apply for these layers.
inline std::size_t router_l2_workspace_bytes(const penalty::router_weights* layers, int num_layers) {
  std::size_t chunks = 1;  // the running total
  for (int l = 0; l < num_layers; ++l) chunks += static_cast<std::size_t>(detail::l2_chunks(layers[l].size));
  return chunks * sizeof(double);
}

inline void router_l2_apply(const penalty::router_l2& policy, const penalty::router_weights* layers, int num_layers,
                            double* value, void* workspace, std::size_t workspace_bytes, cudaStream_t stream = 0) {
  using moe_route::detail::fail;
  if (num_layers < 1) fail("router_l2: num_layers (= " + std::to_string(num_layers) + ") must be >= 1");
  if (layers == nullptr) fail("router_l2: layers is null");
  if (value == nullptr) fail("router_l2: value (output) is null");
  for (int l = 0; l < num_layers; ++l) {
    const penalty::router_weights& w = layers[l];
    const std::string at = "router_l2: layers[" + std::to_string(l) + "].";
    if (w.size < 0) fail(at + "size must be >= 0");
    if (w.size > 0 && (w.weights == nullptr || w.base == nullptr)) fail(at + (w.weights == nullptr ? "weights" : "base") + " is null");
  }
  if (workspace == nullptr || workspace_bytes < router_l2_workspace_bytes(layers, num_layers))
    fail("router_l2: workspace must hold router_l2_workspace_bytes(layers, L) bytes");
  const double scale = static_cast<double>(policy.coefficient) / num_layers;
  const float grad_scale = static_cast<float>(2.0 * scale);
  double* total = static_cast<double*>(workspace);
  double* chunk_sums = total + 1;
  for (int l = 0; l < num_layers; ++l) {
    const penalty::router_weights& w = layers[l];
    const std::int64_t chunks = detail::l2_chunks(w.size);
    if (chunks > 0) {
      detail::l2_chunk_kernel<<<static_cast<unsigned>((chunks + 127) / 128), 128, 0, stream>>>(w.weights, w.base, w.size,
                                                                                             chunk_sums);
      detail::check_launch("moe_route::cuda::router_l2_apply: launch of the chunk kernel");
      if (w.grad != nullptr) {
        const std::int64_t blocks = (w.size + 255) / 256;
        detail::l2_grad_kernel<<<static_cast<unsigned>(blocks < 65536 ? blocks : 65536), 256, 0, stream>>>(
            w.weights, w.base, w.size, grad_scale, w.grad);
        detail::check_launch("moe_route::cuda::router_l2_apply: launch of the gradient kernel");
      }
    }
    detail::l2_layer_kernel<<<1, 1, 0, stream>>>(chunk_sums, chunks, l == 0, total);
    detail::check_launch("moe_route::cuda::router_l2_apply: launch of the layer kernel");
    chunk_sums += chunks;
  }
  detail::l2_value_kernel<<<1, 1, 0, stream>>>(total, scale, value);
  detail::check_launch("moe_route::cuda::router_l2_apply: launch of the value kernel");
}

}  // namespace moe_route::cuda
