// moe_route: the RPB prior builder (RPB eq. 2). docs/policies.md section 3.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <moe_route/backend/cpu/detail/distribution.hpp>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/detail/validate.hpp>
#include <moe_route/gating/gating.hpp>
#include <moe_route/training/workspace.hpp>
#include <moe_route/types.hpp>

namespace moe_route::prior {

struct build_report {
  std::int64_t tokens_used = 0;             // tokens with a prior row (r(t) >= 0)
  std::vector<std::int64_t> empty_rows;     // rows no token mapped to; written as zeros
};

// pi[r, e] = mean over tokens t with rows[t] == r of p_base(z_t)_e, where
// p_base is the routing distribution of the frozen base router's gating
// (softmax for the RPB paper's models). rows[t] = -1 leaves token t out
// (padding, system tokens). Rows that receive no token are written as zeros
// and listed in the report; prior::prepare rejects them, so an empty row can
// never silently become a uniform prior. Each row's sum is accumulated in
// 64-bit fixed point (units of 2^-32, as the penalties' sums), so the order of
// the tokens does not matter and the CUDA builder (cuda::prior::build) gives
// the same bits; the mean is taken in double and stored as float.
template <class Gating, class T>
build_report build(const route_inputs<T>& base, const std::int32_t* rows, std::int64_t num_rows, float* prior) {
  static_assert(gating::is_gating<Gating>, "prior::build<Gating>: Gating must be a policy from moe_route::gating");
  const std::int64_t n = base.num_tokens;
  const int e_count = base.num_experts;
  if (n < 0) moe_route::detail::fail("num_tokens (= " + std::to_string(n) + ") must be >= 0");
  if (e_count < 1 || e_count > max_experts)
    moe_route::detail::fail("num_experts (= " + std::to_string(e_count) + ") must be in [1, 4096]");
  if (num_rows < 1) moe_route::detail::fail("prior rows S (= " + std::to_string(num_rows) + ") must be >= 1");
  if (prior == nullptr) moe_route::detail::fail("prior (output) is null");
  if (n > 0 && base.logits == nullptr) moe_route::detail::fail("logits is null");
  if (n > 0 && rows == nullptr) moe_route::detail::fail("prior_rows is null");
  for (std::int64_t t = 0; t < n; ++t)
    if (rows[t] < -1 || rows[t] >= num_rows)
      moe_route::detail::fail("prior_rows[" + std::to_string(t) + "] (= " + std::to_string(rows[t]) +
                              ") must be -1 or in [0, S = " + std::to_string(num_rows) + ")");

  std::vector<std::int64_t> sums(static_cast<std::size_t>(num_rows) * e_count, 0);
  std::vector<std::int64_t> counts(num_rows, 0);
  std::vector<float> v(e_count), p(e_count);
  build_report report;
  for (std::int64_t t = 0; t < n; ++t) {
    const std::int32_t r = rows[t];
    if (r < 0) continue;
    for (int e = 0; e < e_count; ++e)
      v[e] = moe_route::detail::sanitize(moe_route::detail::to_float(base.logits[t * e_count + e]));
    cpu::detail::distribution<Gating>(v.data(), e_count, p.data());
    std::int64_t* acc = sums.data() + static_cast<std::size_t>(r) * e_count;
    for (int e = 0; e < e_count; ++e) acc[e] += penalty::to_fixed_point(p[e]);
    ++counts[r];
    ++report.tokens_used;
  }
  for (std::int64_t r = 0; r < num_rows; ++r) {
    if (counts[r] == 0) report.empty_rows.push_back(r);
    for (int e = 0; e < e_count; ++e)
      prior[r * e_count + e] = penalty::fixed_point_mean(sums[r * e_count + e], counts[r]);
  }
  return report;
}

}  // namespace moe_route::prior
