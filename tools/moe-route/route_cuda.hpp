// moe-route route --backend cuda: the interface between route.cpp (host C++)
// and route_cuda.cu (the one CUDA translation unit, compiled only when the
// project is configured with CUDA: MOE_ROUTE_HAS_CUDA, which defines
// MOE_ROUTE_CLI_CUDA for the CLI).
#pragma once

#include <moe_route/moe_route.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moe_route_cli {

// Everything a routing call needs, in host memory (route_cuda.cu uploads it).
struct cuda_route_args {
  int k = 0;
  std::string gating;
  bool normalize_set = false, normalize = false;
  float scaling = 1.0f;
  int groups = 0, top_groups = 0, per_group_k = 2;
  std::string admission;
  std::optional<float> tau;
  std::optional<double> capacity_factor;
  std::int64_t min_capacity = 0;
  double fill_factor = 4.0;
  enum class prior { none, soft, hard } prior_mode = prior::none;
  float beta = 1.0f;
  const float* prior_bias = nullptr;  // [S x E] from prior::prepare
  std::int64_t prior_rows = 0;        // S
  const std::int32_t* token_prior_row = nullptr;  // [N]
  const float* logits = nullptr;                  // [N x E] the router's input
  const float* admission_logits = nullptr;        // [N x E] what admission ranks by (logits, or z' in soft mode)
  std::int64_t n = 0;
  int e = 0;
  const float* expert_bias = nullptr;   // [E] or null
  const float* hidden_norms = nullptr;  // [N] or null
  const float* weight_norms = nullptr;  // [E] or null
};

struct cuda_route_result {
  std::vector<std::int32_t> indices;
  std::vector<float> gates;
  int slots = 0;
  std::int64_t nonfinite_rows = 0;
  bool expert_choice = false;
  moe_route::admission_report admission{};
  moe_route::expert_choice_report expert_choice_report{};
};

// Empty when a CUDA device can be used; otherwise the problem, in words.
std::string cuda_device_problem();

// The routing, admission (or expert_choice) on the device; throws on a CUDA or
// library error.
cuda_route_result route_cuda(const cuda_route_args& a);

}  // namespace moe_route_cli
