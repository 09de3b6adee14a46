// moe_route: the RPB prior builder (RPB eq. 2). docs/policies.md section 3.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <moe_route/backend/cpu/detail/prior_build.hpp>
#include <moe_route/backend/cpu/execution.hpp>
#include <moe_route/detail/validate.hpp>
#include <moe_route/gating/gating.hpp>
#include <moe_route/types.hpp>

namespace moe_route::prior {

struct build_report {
  std::int64_t tokens_used = 0;             // tokens with a prior row (r(t) >= 0)
  std::vector<std::int64_t> empty_rows;     // rows no token mapped to; written as zeros
  std::vector<std::int64_t> row_tokens;     // [S]: the number of tokens of each row
};

// pi[r, e] = mean over tokens t with rows[t] == r of p_base(z_t)_e, where
// p_base is the routing distribution of the frozen base router's gating
// (softmax for the RPB paper's models). rows[t] = -1 leaves token t out
// (padding, system tokens). Rows that receive no token are written as zeros
// and listed in the report; prior::prepare rejects them, so an empty row can
// never silently become a uniform prior. Each row's sum is accumulated in
// 64-bit fixed point (units of 2^-32, as the penalties' sums), so the order of
// the tokens does not matter: any ex.threads and the CUDA builder
// (cuda::prior::build) give the same bits. The mean is taken in double and
// stored as float. Invalid arguments throw moe_route::error before anything
// is written.
template <class Gating, class T>
build_report build(const route_inputs<T>& base, const std::int32_t* rows, std::int64_t num_rows, float* prior,
                   const cpu::execution& ex = {}) {
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
  const cpu::detail::tokens_by_row grouped = cpu::detail::group_by_row(rows, n, num_rows);
  cpu::detail::build_prior_rows<Gating>(base, grouped, prior, ex);
  build_report report;
  report.tokens_used = static_cast<std::int64_t>(grouped.token_order.size());
  report.row_tokens.resize(static_cast<std::size_t>(num_rows));
  for (std::int64_t r = 0; r < num_rows; ++r) {
    report.row_tokens[r] = grouped.row_begin[r + 1] - grouped.row_begin[r];
    if (report.row_tokens[r] > 0) continue;
    report.empty_rows.push_back(r);
    std::fill(prior + r * e_count, prior + (r + 1) * e_count, 0.0f);
  }
  return report;
}

}  // namespace moe_route::prior
