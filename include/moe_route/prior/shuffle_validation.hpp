// moe_route: prior-side validation of a shuffled prior (RPB App. E, Table 13).
// docs/policies.md section 3.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <moe_route/detail/numerics.hpp>
#include <moe_route/prior/prepare.hpp>

namespace moe_route::prior {

struct shuffle_validation {
  double topk_overlap = 0.0;          // mean over rows of |top_k(pi) ∩ top_k(pi')| / K
  double change_rate = 0.0;           // 1 - topk_overlap
  double p90_abs_bias_change = 0.0;   // 90th percentile of |beta b' - beta b| over all elements
  double upper_clamp_fraction = 0.0;  // fraction of entries of pi held at the upper bound cap / E
};

namespace detail {

// The K largest entries of a row; ties to the lower expert index.
inline std::vector<int> top_experts(const float* row, int num_experts, int k) {
  std::vector<int> order(num_experts);
  for (int e = 0; e < num_experts; ++e) order[e] = e;
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [row](int a, int b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
  order.resize(k);
  return order;
}

}  // namespace detail

// Compares an original prior table with its shuffled version (same shape), as
// the prior-side statistics of RPB Table 13: top-K overlap and change rate, the
// 90th percentile (linear interpolation between order statistics) of the
// change of the effective bias beta * b actually added to the logits, and the
// upper-clamp fraction of the original table.
inline shuffle_validation validate_shuffle(const float* pi, const float* shuffled, std::int64_t rows, int num_experts,
                                           int k, float beta = 1.0f, clamp_bounds bounds = {}) {
  if (rows < 1) moe_route::detail::fail("prior rows (= " + std::to_string(rows) + ") must be >= 1");
  if (k < 1 || k > num_experts)
    moe_route::detail::fail("top_k (= " + std::to_string(k) + ") must be in [1, num_experts = " +
                            std::to_string(num_experts) + "]");
  if (pi == nullptr || shuffled == nullptr) moe_route::detail::fail("prior or shuffled prior is null");
  const std::size_t size = static_cast<std::size_t>(rows) * num_experts;
  std::vector<float> b(size), b_shuffled(size);
  const prepare_report rep = prepare(pi, rows, num_experts, b.data(), nullptr, bounds);
  prepare(shuffled, rows, num_experts, b_shuffled.data(), nullptr, bounds);

  shuffle_validation out;
  double overlap = 0.0;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::vector<int> a = detail::top_experts(pi + r * num_experts, num_experts, k);
    const std::vector<int> c = detail::top_experts(shuffled + r * num_experts, num_experts, k);
    int common = 0;
    for (int x : a) common += static_cast<int>(std::count(c.begin(), c.end(), x));
    overlap += static_cast<double>(common) / k;
  }
  out.topk_overlap = overlap / rows;
  out.change_rate = 1.0 - out.topk_overlap;

  std::vector<double> delta(size);
  for (std::size_t i = 0; i < size; ++i)
    // one product, no a*b - c*d for a compiler to contract into an fma or not
    delta[i] = std::fabs(static_cast<double>(beta) * (static_cast<double>(b_shuffled[i]) - b[i]));
  std::sort(delta.begin(), delta.end());
  const double position = 0.9 * static_cast<double>(size - 1);
  const std::size_t below = static_cast<std::size_t>(position);
  const double frac = position - static_cast<double>(below);
  out.p90_abs_bias_change =
      below + 1 < size ? moe_route::detail::fma(frac, delta[below + 1] - delta[below], delta[below]) : delta[below];
  out.upper_clamp_fraction = static_cast<double>(rep.upper_clamped) / static_cast<double>(size);
  return out;
}

}  // namespace moe_route::prior
