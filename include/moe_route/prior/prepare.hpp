// moe_route: RPB prior preparation (RPB eq. 3, App. F.7). docs/policies.md section 3.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include <moe_route/detail/validate.hpp>
#include <moe_route/types.hpp>

namespace moe_route::prior {

// The clamp of a prior row: every probability is held in [epsilon/E, cap/E].
struct clamp_bounds {
  float epsilon = 0.05f;  // lower bound epsilon / E keeps the log finite
  float cap = 5.0f;       // upper bound cap / E limits any one expert's pull
};

struct prepare_report {
  std::int64_t upper_clamped = 0;  // entries held at cap / E
  std::int64_t lower_clamped = 0;  // entries raised to epsilon / E
};

namespace detail {

inline void check_bounds(const clamp_bounds& b) {
  if (!(b.epsilon > 0.0f) || !std::isfinite(b.epsilon)) moe_route::detail::fail("prior epsilon must be positive and finite");
  if (!(b.cap >= b.epsilon) || !std::isfinite(b.cap)) moe_route::detail::fail("prior cap must be finite and >= epsilon");
}

// Rejects rows that are not probability-like: every entry finite and >= 0, and
// a positive sum (an all-zero row is an empty prior row, see prior::build).
inline void check_rows(const float* pi, std::int64_t rows, int num_experts) {
  for (std::int64_t r = 0; r < rows; ++r) {
    double sum = 0.0;
    for (int e = 0; e < num_experts; ++e) {
      const float p = pi[r * num_experts + e];
      if (!std::isfinite(p) || p < 0.0f)
        moe_route::detail::fail("prior row " + std::to_string(r) + " has a negative or non-finite entry at expert " +
                                std::to_string(e));
      sum += p;
    }
    if (!(sum > 0.0)) moe_route::detail::fail("prior row " + std::to_string(r) + " is all zeros (an empty prior row)");
  }
}

}  // namespace detail

// Prepares a prior table pi[S x E] once per table:
//   c = clamp(pi, epsilon/E, cap/E), c /= sum(c), bias = log c - mean_e log c.
// bias[S x E] receives the centred log-prior b of RPB eq. 3 (zero mean per row
// up to float rounding); probs[S x E], if not null, receives the clamped,
// renormalised prior that kl_to_base and logit_l2 compare against. Each row is
// computed in double in expert order, so the result is deterministic.
inline prepare_report prepare(const float* pi, std::int64_t rows, int num_experts, float* bias, float* probs = nullptr,
                              clamp_bounds bounds = {}) {
  if (rows < 0) moe_route::detail::fail("prior rows (= " + std::to_string(rows) + ") must be >= 0");
  if (num_experts < 1 || num_experts > max_experts)
    moe_route::detail::fail("num_experts (= " + std::to_string(num_experts) + ") must be in [1, 4096]");
  detail::check_bounds(bounds);
  if (rows > 0 && pi == nullptr) moe_route::detail::fail("prior is null");
  if (rows > 0 && bias == nullptr) moe_route::detail::fail("bias (output) is null");
  detail::check_rows(pi, rows, num_experts);

  const double lo = static_cast<double>(bounds.epsilon) / num_experts;
  const double hi = static_cast<double>(bounds.cap) / num_experts;
  const auto clamp = [lo, hi](double p) { return p < lo ? lo : (p > hi ? hi : p); };
  prepare_report report;
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* row = pi + r * num_experts;
    double sum = 0.0;
    for (int e = 0; e < num_experts; ++e) {
      if (row[e] >= hi) ++report.upper_clamped;
      else if (row[e] <= lo) ++report.lower_clamped;
      sum += clamp(row[e]);
    }
    double mean_log = 0.0;
    for (int e = 0; e < num_experts; ++e) mean_log += std::log(clamp(row[e]) / sum);
    mean_log /= num_experts;
    for (int e = 0; e < num_experts; ++e) {
      const double c = clamp(row[e]) / sum;
      bias[r * num_experts + e] = static_cast<float>(std::log(c) - mean_log);
      if (probs != nullptr) probs[r * num_experts + e] = static_cast<float>(c);
    }
  }
  return report;
}

}  // namespace moe_route::prior
