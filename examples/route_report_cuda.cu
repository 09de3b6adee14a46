// The GPU half of route_report: routes the same batch with moe_route::cuda and
// compares indices and gates with the CPU backend's, bit for bit.
#include <moe_route/moe_route.cuh>

#include <cstring>
#include <vector>

#include "report_presets.hpp"

namespace report {

namespace {

template <class T>
struct device_buffer {
  T* ptr = nullptr;
  explicit device_buffer(std::size_t n) {
    if (cudaMalloc(&ptr, n * sizeof(T) + 1) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
  }
  ~device_buffer() { cudaFree(ptr); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
};

template <class Router>
gpu_outcome run(const Router& router, const float* logits, std::int64_t tokens, int experts, const float* bias,
                const std::int32_t* cpu_indices, const float* cpu_gates) {
  const std::size_t nk = static_cast<std::size_t>(tokens) * router.top_k;
  device_buffer<float> z(static_cast<std::size_t>(tokens) * experts), b(experts), w(nk);
  device_buffer<std::int32_t> idx(nk);
  cudaMemcpy(z.ptr, logits, sizeof(float) * tokens * experts, cudaMemcpyHostToDevice);
  cudaMemcpy(b.ptr, bias, sizeof(float) * experts, cudaMemcpyHostToDevice);
  const moe_route::route_inputs<float> in{z.ptr, tokens, experts, b.ptr};
  const moe_route::route_outputs out{idx.ptr, w.ptr};
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  moe_route::cuda::route(router, in, out, nullptr);  // warm-up
  cudaEventRecord(start);
  moe_route::cuda::route(router, in, out, nullptr);
  cudaEventRecord(stop);
  cudaEventSynchronize(stop);
  float ms = 0.0f;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::vector<std::int32_t> gpu_indices(nk);
  std::vector<float> gpu_gates(nk);
  cudaMemcpy(gpu_indices.data(), idx.ptr, nk * sizeof(std::int32_t), cudaMemcpyDeviceToHost);
  cudaMemcpy(gpu_gates.data(), w.ptr, nk * sizeof(float), cudaMemcpyDeviceToHost);
  gpu_outcome o;
  o.ran = true;
  o.forward_ms = ms;
  o.indices_equal = std::memcmp(gpu_indices.data(), cpu_indices, nk * sizeof(std::int32_t)) == 0;
  o.gates_equal = std::memcmp(gpu_gates.data(), cpu_gates, nk * sizeof(float)) == 0;
  return o;
}

}  // namespace

gpu_outcome run_on_gpu(const std::string& preset, const float* logits, std::int64_t tokens, int experts,
                       const float* bias, const std::int32_t* cpu_indices, const float* cpu_gates) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)
    return {false, "CUDA backend compiled; no CUDA device present"};
  gpu_outcome result;
  for_each_preset([&](const char* name, const auto& router, int) {
    if (preset == name) result = run(router, logits, tokens, experts, bias, cpu_indices, cpu_gates);
  });
  return result;
}

}  // namespace report
