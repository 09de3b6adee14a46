// moe_route: load fractions f for load_balance over a global batch or after
// admission. docs/policies.md section 5.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <moe_route/types.hpp>

namespace moe_route::penalty {

// f_e = (assignments to e) / (all assignments) over indices[N x K]; entries of
// -1 (assignments dropped by admission) count for nothing. All-reduce the
// counts over data-parallel ranks first for a global batch: pass the summed
// indices' counts through the overload below. An all-dropped batch gives f = 0.
inline void load_fractions(const std::int32_t* indices, std::int64_t num_tokens, int top_k, int num_experts,
                           float* fractions) {
  if (num_tokens < 0) moe_route::detail::fail("load_fractions: num_tokens must be >= 0");
  if (top_k < 1) moe_route::detail::fail("load_fractions: top_k must be >= 1");
  if (num_experts < 1) moe_route::detail::fail("load_fractions: num_experts must be >= 1");
  if (fractions == nullptr) moe_route::detail::fail("load_fractions: fractions (output) is null");
  if (num_tokens > 0 && indices == nullptr) moe_route::detail::fail("load_fractions: indices is null");
  std::vector<std::int64_t> counts(num_experts, 0);
  std::int64_t total = 0;
  for (std::int64_t i = 0; i < num_tokens * top_k; ++i) {
    const std::int32_t e = indices[i];
    if (e == -1) continue;
    if (e < 0 || e >= num_experts)
      moe_route::detail::fail("load_fractions: indices[" + std::to_string(i) + "] (= " + std::to_string(e) +
                              ") is neither -1 nor an expert");
    ++counts[e];
    ++total;
  }
  for (int e = 0; e < num_experts; ++e)
    fractions[e] = total > 0 ? static_cast<float>(static_cast<double>(counts[e]) / static_cast<double>(total)) : 0.0f;
}

// f from per-expert counts (e.g. all-reduced over ranks).
inline void load_fractions(const std::int64_t* counts, int num_experts, float* fractions) {
  if (num_experts < 1) moe_route::detail::fail("load_fractions: num_experts must be >= 1");
  if (counts == nullptr || fractions == nullptr) moe_route::detail::fail("load_fractions: counts or fractions is null");
  std::int64_t total = 0;
  for (int e = 0; e < num_experts; ++e) {
    if (counts[e] < 0) moe_route::detail::fail("load_fractions: counts[" + std::to_string(e) + "] is negative");
    total += counts[e];
  }
  for (int e = 0; e < num_experts; ++e)
    fractions[e] = total > 0 ? static_cast<float>(static_cast<double>(counts[e]) / static_cast<double>(total)) : 0.0f;
}

}  // namespace moe_route::penalty
