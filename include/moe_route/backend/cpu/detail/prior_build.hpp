// moe_route CPU backend: the RPB prior builder's loops (docs/policies.md
// section 3.2; the public entry point is prior/build.hpp). The tokens are
// grouped by prior row first, so each row's fixed-point sums stay in one small
// buffer while its tokens are added, its mean is written once, and a thread
// owns whole rows: no per-thread tables to merge, and the same bits for any
// thread count because fixed-point sums do not depend on their order.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <moe_route/backend/cpu/detail/rows.hpp>
#include <moe_route/backend/cpu/detail/threads.hpp>
#include <moe_route/backend/cpu/detail/training.hpp>
#include <moe_route/backend/cpu/execution.hpp>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/detail/validate.hpp>
#include <moe_route/gating/gating.hpp>
#include <moe_route/gating/softmax.hpp>
#include <moe_route/training/workspace.hpp>
#include <moe_route/types.hpp>

namespace moe_route::cpu::detail {

// The tokens of prior row r are token_order[row_begin[r] .. row_begin[r + 1]),
// in token order; tokens with row -1 are left out.
struct tokens_by_row {
  std::vector<std::int64_t> row_begin;
  std::vector<std::int64_t> token_order;
};

// A counting sort of the tokens by row. Throws, naming the first token whose
// row is outside [-1, num_rows), before anything is written.
inline tokens_by_row group_by_row(const std::int32_t* rows, std::int64_t num_tokens, std::int64_t num_rows) {
  tokens_by_row g;
  g.row_begin.assign(static_cast<std::size_t>(num_rows) + 1, 0);
  for (std::int64_t t = 0; t < num_tokens; ++t) {
    const std::int32_t r = rows[t];
    if (r < -1 || r >= num_rows)
      moe_route::detail::fail("prior_rows[" + std::to_string(t) + "] (= " + std::to_string(r) +
                              ") must be -1 or in [0, S = " + std::to_string(num_rows) + ")");
    if (r >= 0) ++g.row_begin[r + 1];
  }
  for (std::int64_t r = 0; r < num_rows; ++r) g.row_begin[r + 1] += g.row_begin[r];
  g.token_order.resize(static_cast<std::size_t>(g.row_begin[num_rows]));
  std::vector<std::int64_t> next(g.row_begin.begin(), g.row_begin.end() - 1);
  for (std::int64_t t = 0; t < num_tokens; ++t)
    if (rows[t] >= 0) g.token_order[next[rows[t]]++] = t;
  return g;
}

// Tokens per batch. The steps of one token's distribution wait for each other
// (maximum, terms, sum, quotients, fixed point) and each ends in a reduction's
// latency; interleaving the same step of a few tokens keeps the core busy.
inline constexpr int prior_batch_tokens = 4;

// Per-worker buffers: the sanitised logits and the terms of a batch.
struct prior_scratch {
  std::vector<float> v, t;
  bool x86_64_v3 = false;
  explicit prior_scratch(int num_experts)
      : v(static_cast<std::size_t>(prior_batch_tokens) * num_experts),
        t(static_cast<std::size_t>(prior_batch_tokens) * num_experts) {}
};

// Asks for a token's logits ahead of use: the rows are read once, and a
// stream prefetcher stops at page boundaries (every four rows at E = 256).
template <class T>
void prefetch_logits(const T* z, int num_experts) {
  const char* p = reinterpret_cast<const char*>(z);
  for (std::size_t at = 0; at < sizeof(T) * static_cast<std::size_t>(num_experts); at += 64) __builtin_prefetch(p + at);
}

// acc += the fixed-point image of p_base(z_b) for the `count` tokens z[b]:
// the gating's routing distribution (docs/policies.md section 1;
// softmax_after_topk: the full softmax) of the sanitised logits. A token whose
// scores sum to 0 adds nothing.
template <class Gating, class T>
void add_base_distributions(const T* const* z, int count, int num_experts, prior_scratch& s, std::int64_t* acc) {
  const float* v[prior_batch_tokens];
  float* t[prior_batch_tokens];
  for (int b = 0; b < count; ++b) {
    bool nonfinite = false;
    v[b] = load_row(z[b], num_experts, s.v.data() + b * num_experts, nonfinite);
    t[b] = s.t.data() + b * num_experts;
  }
  if constexpr (Gating::shape == gating::kind::elementwise) {
    for (int b = 0; b < count; ++b)
      for (int e = 0; e < num_experts; ++e) t[b][e] = Gating::score(v[b][e]);
  } else {
    float m[prior_batch_tokens];
    for (int b = 0; b < count; ++b) m[b] = row_max(v[b], num_experts, s.x86_64_v3);
    for (int b = 0; b < count; ++b)
      for (int e = 0; e < num_experts; ++e) t[b][e] = gating::softmax::row_term(v[b][e], m[b]);
  }
  float sum[prior_batch_tokens];
  for (int b = 0; b < count; ++b) sum[b] = lane_sum(t[b], num_experts, s.x86_64_v3);
  for (int b = 0; b < count; ++b) {
    if (!(sum[b] > 0.0f)) continue;
    for (int e = 0; e < num_experts; ++e) t[b][e] = moe_route::detail::div(t[b][e], sum[b]);
    add_fixed_point(t[b], num_experts, acc, s.x86_64_v3);
  }
}

// prior[r] = the mean of the rows' distributions for every row with a token;
// the rows without one are left for the caller. Threads split the grouped
// tokens into contiguous blocks and each takes the rows that start in its block.
template <class Gating, class T>
void build_prior_rows(const route_inputs<T>& base, const tokens_by_row& g, float* prior, const execution& ex) {
  const int num_experts = base.num_experts;
  const auto used = static_cast<std::int64_t>(g.token_order.size());
  const std::int64_t num_rows = static_cast<std::int64_t>(g.row_begin.size()) - 1;
  const block_plan plan = plan_token_blocks(ex, used, 256);
  std::vector<prior_scratch> scratch(plan.threads, prior_scratch(num_experts));
  std::vector<std::vector<std::int64_t>> sums(plan.threads, std::vector<std::int64_t>(num_experts));
  for (auto& s : scratch) s.x86_64_v3 = plan.isa == instruction_set::x86_64_v3;
  parallel_blocks(used, plan, [&](std::int64_t begin, std::int64_t end, int w) {
    std::int64_t* acc = sums[w].data();
    std::int64_t r = std::lower_bound(g.row_begin.begin(), g.row_begin.end() - 1, begin) - g.row_begin.begin();
    for (; r < num_rows && g.row_begin[r] < end; ++r) {
      const std::int64_t first = g.row_begin[r], last = g.row_begin[r + 1];
      if (first == last) continue;
      std::fill(acc, acc + num_experts, std::int64_t{0});
      for (std::int64_t i = first; i < last; i += prior_batch_tokens) {
        const int count = static_cast<int>(std::min<std::int64_t>(prior_batch_tokens, last - i));
        const T* z[prior_batch_tokens];
        for (int b = 0; b < count; ++b) z[b] = base.logits + g.token_order[i + b] * num_experts;
        for (std::int64_t j = i + prior_batch_tokens; j < std::min(i + 2 * prior_batch_tokens, used); ++j)
          prefetch_logits(base.logits + g.token_order[j] * num_experts, num_experts);
        add_base_distributions<Gating>(z, count, num_experts, scratch[w], acc);
      }
      float* out = prior + r * num_experts;
      for (int e = 0; e < num_experts; ++e) out[e] = penalty::fixed_point_mean(acc[e], last - first);
    }
  });
}

}  // namespace moe_route::cpu::detail
