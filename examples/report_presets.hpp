// The presets the report routes, shared by its CPU and CUDA halves.
#pragma once

#include <moe_route/moe_route.hpp>

#include <cstdint>
#include <string>

namespace report {

namespace mr = moe_route;

// Calls f(name, router, num_experts) for every model preset.
template <class F>
void for_each_preset(F&& f) {
  f("deepseek_v2_lite", mr::presets::deepseek_v2_lite(), mr::presets::deepseek_v2_lite_experts);
  f("moonlight", mr::presets::moonlight(), mr::presets::moonlight_experts);
  f("deepseek_v3", mr::presets::deepseek_v3(), mr::presets::deepseek_v3_experts);
  f("qwen3", mr::presets::qwen3(), mr::presets::qwen3_experts);
  f("mixtral", mr::presets::mixtral(), mr::presets::mixtral_experts);
  f("deepseek_v4", mr::presets::deepseek_v4(), mr::presets::deepseek_v4_experts);
}

// What the GPU half reports for one preset.
struct gpu_outcome {
  bool ran = false;
  std::string note;            // why it did not run, or the device name
  double forward_ms = 0.0;     // one forward, after a warm-up
  bool indices_equal = false;  // bit-equal to the CPU backend
  bool gates_equal = false;    // bit-equal to the CPU backend
};

// Implemented in route_report_cuda.cu when the CUDA backend is compiled.
gpu_outcome run_on_gpu(const std::string& preset, const float* logits, std::int64_t tokens, int experts,
                       const float* bias, const std::int32_t* cpu_indices, const float* cpu_gates);

}  // namespace report
