// moe_route CPU backend: the machinery of cpu::expert_choice and its backward
// (backend/cpu/expert_choice.hpp), after their argument checks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include <moe_route/admission/admission.hpp>
#include <moe_route/admission/scores.hpp>
#include <moe_route/backend/cpu/detail/admission.hpp>
#include <moe_route/backend/cpu/execution.hpp>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/gating/softmax.hpp>
#include <moe_route/selection/expert_choice.hpp>

namespace moe_route::cpu::admission_detail {

template <class T>
expert_choice_report expert_choice(const selection::expert_choice& p, const expert_choice_inputs<T>& in,
                                   const expert_choice_outputs& out, execution ex) {
  namespace num = moe_route::detail;
  const std::int64_t n_tokens = in.num_tokens;
  const int e_count = in.num_experts;
  const std::int64_t pairs = n_tokens * e_count;
  expert_choice_report rep;
  if (n_tokens == 0) {
    if (out.report != nullptr) *out.report = rep;
    return rep;
  }
  const int groups = in.num_groups;
  auto group_of = [&](std::int64_t t) { return in.group_ids != nullptr ? in.group_ids[t] : 0; };
  auto masked = [&](std::int64_t t) { return num::token_masked(in.token_mask, t); };

  // Scores s_{t,e}.
  std::vector<float> score(static_cast<std::size_t>(pairs));
  const block_plan plan = plan_token_blocks(ex, n_tokens, 256);
  parallel_blocks(n_tokens, plan, [&](std::int64_t begin, std::int64_t end, int) {
    row_buffers buf(e_count);
    for (std::int64_t t = begin; t < end; ++t) {
      if (masked(t)) continue;
      sanitized_row(in.logits + t * e_count, e_count, buf.v.data());
      const row_stats st = softmax_row_stats(buf.v.data(), e_count, buf.t.data());
      for (int e = 0; e < e_count; ++e) score[t * e_count + e] = softmax_score_from_term(buf.t[e], st);
    }
  });

  // The valid tokens of every group, in token order.
  std::vector<std::int64_t> group_start(static_cast<std::size_t>(groups) + 1, 0);
  for (std::int64_t t = 0; t < n_tokens; ++t)
    if (!masked(t)) ++group_start[group_of(t) + 1];
  for (int g = 0; g < groups; ++g) group_start[g + 1] += group_start[g];
  const std::int64_t n_members = group_start[groups];
  std::vector<std::int32_t> members(static_cast<std::size_t>(n_members));
  {
    std::vector<std::int64_t> cursor(group_start.begin(), group_start.end() - 1);
    for (std::int64_t t = 0; t < n_tokens; ++t)
      if (!masked(t)) members[cursor[group_of(t)]++] = static_cast<std::int32_t>(t);
  }

  // Every (group, expert) keeps its top C_e tokens by rank_key. The scores of
  // 16 experts at a time are copied into expert-major columns in group order
  // (reading each token's row once), so an expert's candidates are contiguous.
  // A histogram of the keys' top 12 bits (the score's sign, exponent and 3
  // mantissa bits) finds the bucket that holds the C-th largest key: every
  // candidate in a higher bucket is kept, and only that bucket is ranked, by
  // nth_element on the full keys (a group of at most 4096 tokens is ranked
  // whole). The kept set is exactly the top C by key.
  std::vector<unsigned char> chosen(static_cast<std::size_t>(pairs), 0);
  constexpr int chunk = 16;
  const std::int64_t chunks = (e_count + chunk - 1) / chunk;
  parallel_blocks(chunks, plan_blocks(ex, chunks, 1), [&](std::int64_t begin, std::int64_t end, int) {
    std::vector<float> column(static_cast<std::size_t>(n_members) * chunk);
    std::vector<std::int32_t> histogram(4096);
    std::vector<std::uint64_t> boundary;
    for (std::int64_t c = begin; c < end; ++c) {
      const int e0 = static_cast<int>(c) * chunk, e1 = std::min(e_count, e0 + chunk);
      for (std::int64_t i = 0; i < n_members; ++i) {
        const float* row = score.data() + static_cast<std::int64_t>(members[i]) * e_count;
        for (int e = e0; e < e1; ++e) column[static_cast<std::size_t>((e - e0) * n_members + i)] = row[e];
      }
      for (int e = e0; e < e1; ++e) {
        const float* col = column.data() + static_cast<std::int64_t>(e - e0) * n_members;
        auto take = [&](std::int64_t t) { chosen[t * e_count + e] = 1; };
        for (int g = 0; g < groups; ++g) {
          const std::int64_t first = group_start[g], size = group_start[g + 1] - first;
          if (size == 0) continue;
          const std::int64_t cap = std::min(
              size, in.capacity != nullptr ? in.capacity[e]
                                           : capacity_from_factor(p.capacity_factor, p.min_capacity, size, p.top_k, e_count));
          if (cap <= 0) continue;
          const std::int32_t* who = members.data() + first;
          const float* s = col + first;
          if (cap == size) {
            for (std::int64_t i = 0; i < size; ++i) take(who[i]);
            continue;
          }
          boundary.clear();
          std::int64_t above = 0;  // candidates kept without ranking
          if (size <= static_cast<std::int64_t>(histogram.size())) {  // small group: rank every candidate
            for (std::int64_t i = 0; i < size; ++i) boundary.push_back(rank_key(s[i], who[i]));
          } else {
            std::fill(histogram.begin(), histogram.end(), 0);
            for (std::int64_t i = 0; i < size; ++i) ++histogram[rank_key(s[i], 0) >> 52];
            int bucket = 4095;
            while (above + histogram[bucket] < cap) above += histogram[bucket--];
            for (std::int64_t i = 0; i < size; ++i) {
              const std::uint64_t key = rank_key(s[i], who[i]);
              const int b = static_cast<int>(key >> 52);
              if (b > bucket) take(who[i]);
              else if (b == bucket) boundary.push_back(key);
            }
          }
          const auto rest = static_cast<std::ptrdiff_t>(cap - above);  // in [1, boundary.size()]
          std::nth_element(boundary.begin(), boundary.begin() + rest - 1, boundary.end(), std::greater<std::uint64_t>());
          for (std::ptrdiff_t j = 0; j < rest; ++j) take(num::packed_expert(boundary[j]));
        }
      }
    }
  });

  // Token-major output, ascending expert order.
  std::vector<std::int64_t> per_token(static_cast<std::size_t>(n_tokens));
  parallel_blocks(n_tokens, plan, [&](std::int64_t begin, std::int64_t end, int) {
    for (std::int64_t t = begin; t < end; ++t) {
      int c = 0;
      for (int e = 0; e < e_count; ++e)
        if (chosen[t * e_count + e]) {
          out.indices[t * e_count + c] = e;
          out.gates[t * e_count + c] = score[t * e_count + e];
          ++c;
        }
      for (int j = c; j < e_count; ++j) {
        out.indices[t * e_count + j] = -1;
        out.gates[t * e_count + j] = 0.0f;
      }
      if (out.experts_per_token != nullptr) out.experts_per_token[t] = c;
      per_token[t] = c;
    }
  });
  for (std::int64_t t = 0; t < n_tokens; ++t) {
    if (masked(t)) continue;
    rep.assignments += per_token[t];
    rep.tokens_without_experts += per_token[t] == 0;
    rep.max_experts_per_token = std::max(rep.max_experts_per_token, per_token[t]);
  }
  if (out.report != nullptr) *out.report = rep;
  return rep;
}

template <class T>
void expert_choice_backward(const expert_choice_inputs<T>& in, const std::int32_t* indices, const float* grad_gates,
                            float* grad_logits, execution ex) {
  if (in.num_tokens == 0) return;
  const int e_count = in.num_experts;
  parallel_blocks(in.num_tokens, plan_token_blocks(ex, in.num_tokens, 256), [&](std::int64_t begin, std::int64_t end, int) {
    row_buffers buf(e_count);
    for (std::int64_t t = begin; t < end; ++t) {
      float* dz = grad_logits + t * e_count;
      if (num::token_masked(in.token_mask, t)) {
        std::fill_n(dz, e_count, 0.0f);
        continue;
      }
      sanitized_row(in.logits + t * e_count, e_count, buf.v.data());
      const row_stats st = softmax_row_stats(buf.v.data(), e_count, buf.t.data());
      const std::int32_t* idx = indices + t * e_count;
      const float* dg = grad_gates + t * e_count;
      // <ds, s> in the canonical lane order (slot j in lane j mod 32), as a CUDA warp computes it.
      float lanes[num::reduction_lanes] = {};
      for (int j = 0; j < e_count; ++j)
        if (idx[j] >= 0)
          lanes[j % num::reduction_lanes] =
              num::fma(dg[j], gate_input<gating::softmax>(buf.v[idx[j]], st), lanes[j % num::reduction_lanes]);
      for (int offset = num::reduction_lanes / 2; offset > 0; offset >>= 1)
        for (int l = 0; l < offset; ++l) lanes[l] = lanes[l] + lanes[l + offset];
      const float dot = lanes[0];
      for (int e = 0; e < e_count; ++e) dz[e] = gate_input<gating::softmax>(buf.v[e], st) * -dot;
      for (int j = 0; j < e_count; ++j)
        if (idx[j] >= 0) dz[idx[j]] = gate_input<gating::softmax>(buf.v[idx[j]], st) * (dg[j] - dot);
    }
  });
}

}  // namespace moe_route::cpu::admission_detail
