// moe_route: the CPU backend. Deterministic: the same inputs give the same bits
// for any thread count, and the same bits as the CUDA backend, because every
// row reduction runs in the canonical 32-lane order and every score comes from
// the shared bit-reproducible math in detail/numerics.hpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "../../config.hpp"
#include "../../detail/numerics.hpp"
#include "../../router.hpp"
#include "../../types.hpp"
#include "../../validate.hpp"

namespace moe_route::cpu {

// How a CPU call runs. threads == 1 is the sequential reference path; more
// threads split the tokens into contiguous blocks and give identical results.
// threads <= 0 uses std::thread::hardware_concurrency().
struct execution {
  int threads = 1;
};

namespace detail {

using moe_route::detail::float_max;

// Per-worker row buffers, sized for the general path (E <= 4096).
struct row_scratch {
  float v[max_experts];               // sanitised logits
  float t[max_experts];               // softmax terms exp(v - max), or scores
  std::uint64_t keys[max_experts];    // packed selection keys
};

// Sum of x[0..n) in the canonical order a CUDA warp uses (see numerics.hpp).
inline float lane_sum(const float* x, int n) {
  float lanes[moe_route::detail::reduction_lanes] = {};
  int base = 0;
  for (; base + 32 <= n; base += 32)
    for (int l = 0; l < 32; ++l) lanes[l] += x[base + l];
  for (int l = 0; base + l < n; ++l) lanes[l] += x[base + l];
  for (int offset = 16; offset > 0; offset >>= 1)
    for (int l = 0; l < offset; ++l) lanes[l] = lanes[l] + lanes[l + offset];
  return lanes[0];
}

inline float row_max(const float* v, int n) {
  float m = -float_max;  // a row of NaNs (all -inf) keeps a finite maximum
  for (int e = 0; e < n; ++e) m = moe_route::detail::max(m, v[e]);
  return m;
}

// Insert a packed key into best[0..k), kept in descending order.
inline void insert_top(std::uint64_t* best, int k, std::uint64_t key) {
  if (key <= best[k - 1]) return;
  int j = k - 1;
  for (; j > 0 && best[j - 1] < key; --j) best[j] = best[j - 1];
  best[j] = key;
}

// The largest k packed keys of keys[0..n), descending.
inline void top_keys(const std::uint64_t* keys, int n, int k, std::uint64_t* best) {
  for (int j = 0; j < k; ++j) best[j] = 0;
  for (int e = 0; e < n; ++e) insert_top(best, k, keys[e]);
}

// Group-limited selection: zero the keys of every expert outside the
// top_groups best groups (group score = sum of its per_group_k best keys,
// added in descending order).
template <class Grouped>
void mask_groups(const Grouped& g, std::uint64_t* keys, int num_experts) {
  const int size = num_experts / g.groups;
  std::uint64_t group_keys[moe_route::detail::reduction_lanes];
  std::uint64_t best[max_experts];
  for (int grp = 0; grp < g.groups; ++grp) {
    top_keys(keys + grp * size, size, g.per_group_k, best);
    float score = 0.0f;
    for (int j = 0; j < g.per_group_k; ++j) score += moe_route::detail::packed_value(best[j]);
    group_keys[grp] = moe_route::detail::pack_key(score, grp);
  }
  std::uint64_t kept[moe_route::detail::reduction_lanes];
  top_keys(group_keys, g.groups, g.top_groups, kept);
  bool keep[moe_route::detail::reduction_lanes] = {};
  for (int j = 0; j < g.top_groups; ++j) keep[moe_route::detail::packed_expert(kept[j])] = true;
  for (int e = 0; e < num_experts; ++e)
    if (!keep[e / size]) keys[e] = 0;
}

// Row state shared by forward and backward: sanitised logits, and for
// row_softmax the terms and their canonical sum.
template <class Router, class T>
struct row_state {
  using G = typename Router::gating_type;
  row_scratch& s;
  int num_experts;
  float sum = 0.0f;
  bool nonfinite = false;

  row_state(row_scratch& scratch, const T* z, int e_count) : s(scratch), num_experts(e_count) {
    bool bad = false;
    for (int e = 0; e < num_experts; ++e) {
      const float raw = moe_route::detail::to_float(z[e]);
      bad |= !moe_route::detail::is_finite(raw);
      s.v[e] = moe_route::detail::sanitize(raw);
    }
    nonfinite = bad;
    if constexpr (G::shape == gating::kind::row_softmax) {
      const float m = row_max(s.v, num_experts);
      for (int e = 0; e < num_experts; ++e) s.t[e] = G::term(s.v[e], m);
      sum = lane_sum(s.t, num_experts);
    }
  }

  // The gating score of expert e (the logit itself for selected_softmax).
  float score(int e) const {
    if constexpr (G::shape == gating::kind::row_softmax)
      return sum > 0.0f ? moe_route::detail::div(s.t[e], sum) : 0.0f;
    else if constexpr (G::shape == gating::kind::elementwise)
      return G::score(s.v[e]);
    else
      return s.v[e];
  }
};

template <class Router, class T>
bool route_row(const Router& r, const T* z, int num_experts, std::int64_t token, const float* bias,
               row_scratch& scratch, std::int32_t* indices, float* gates) {
  using S = typename Router::selection_type;
  const int k = r.top_k;
  row_state<Router, T> row(scratch, z, num_experts);

  int chosen[Router::max_k];
  if constexpr (S::shape == selection::kind::fixed) {
    for (int j = 0; j < k; ++j) chosen[j] = S::expert(token, j, k, num_experts);
  } else {
    const float neg_inf = -moe_route::detail::infinity();
    for (int e = 0; e < num_experts; ++e) {
      const float v = scratch.v[e];
      float key = neg_inf;  // a NaN logit (v = -inf) ranks below every number
      if (v != neg_inf) {
        const float s = S::needs_scores ? row.score(e) : 0.0f;
        const float b = S::needs_expert_bias ? bias[e] : 0.0f;
        key = S::key(v, s, b);
      }
      scratch.keys[e] = moe_route::detail::pack_key(key, e);
    }
    if constexpr (S::shape == selection::kind::grouped) mask_groups(r.selection, scratch.keys, num_experts);
    std::uint64_t best[Router::max_k];
    top_keys(scratch.keys, num_experts, k, best);
    for (int j = 0; j < k; ++j) chosen[j] = moe_route::detail::packed_expert(best[j]);
  }

  float selected[Router::max_k];
  for (int j = 0; j < k; ++j) {
    selected[j] = row.score(chosen[j]);
    indices[j] = chosen[j];
  }
  moe_route::detail::gate_weights(r, selected, gates, k);
  return row.nonfinite;
}

template <class Router, class T>
void backward_row(const Router& r, const T* z, int num_experts, const std::int32_t* indices, const float* dw,
                  row_scratch& scratch, float* dz) {
  using G = typename Router::gating_type;
  const int k = r.top_k;
  row_state<Router, T> row(scratch, z, num_experts);
  float selected[Router::max_k];
  float dsel[Router::max_k];
  for (int j = 0; j < k; ++j) selected[j] = row.score(indices[j]);
  moe_route::detail::gate_weights_vjp(r, selected, dw, dsel, k);

  if constexpr (G::shape == gating::kind::row_softmax) {
    float dot = 0.0f;  // <ds, s>, nonzero terms only at the selected experts
    for (int j = 0; j < k; ++j) dot = moe_route::detail::fma(dsel[j], selected[j], dot);
    for (int e = 0; e < num_experts; ++e) dz[e] = row.score(e) * -dot;
    for (int j = 0; j < k; ++j) dz[indices[j]] = selected[j] * (dsel[j] - dot);
  } else {
    for (int e = 0; e < num_experts; ++e) dz[e] = 0.0f;
    for (int j = 0; j < k; ++j) {
      if constexpr (G::shape == gating::kind::elementwise)
        dz[indices[j]] = dsel[j] * G::derivative(scratch.v[indices[j]], selected[j]);
      else
        dz[indices[j]] = dsel[j];
    }
  }
}

// Runs body(begin, end, worker) over contiguous token blocks on up to
// `threads` threads (the caller's thread included), with one scratch each.
template <class Body>
void for_token_blocks(std::int64_t num_tokens, const execution& ex, Body body) {
  if (num_tokens == 0) return;
  int threads = ex.threads > 0 ? ex.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  constexpr std::int64_t min_tokens_per_thread = 256;  // below this a thread costs more than it saves
  threads = static_cast<int>(std::min<std::int64_t>(threads, (num_tokens + min_tokens_per_thread - 1) / min_tokens_per_thread));
  threads = std::max(threads, 1);
  const std::int64_t block = (num_tokens + threads - 1) / threads;
  std::vector<std::unique_ptr<row_scratch>> scratch(threads);
  for (auto& s : scratch) s = std::make_unique<row_scratch>();
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int w = 1; w < threads; ++w) {
    const std::int64_t begin = w * block, end = std::min(num_tokens, begin + block);
    if (begin < end) pool.emplace_back([&, w, begin, end] { body(begin, end, w, *scratch[w]); });
  }
  body(0, std::min(num_tokens, block), 0, *scratch[0]);
  for (auto& t : pool) t.join();
}

}  // namespace detail

// Forward: indices and gate weights of every token (POLICIES.md sections 1-2).
// Throws moe_route::error, writing nothing, if an argument is invalid.
template <class Router, class T>
route_report route(const Router& r, const route_inputs<T>& in, const route_outputs& out, execution ex = {}) {
  static_assert(is_router<Router>, "cpu::route: the first argument must be a moe_route::router");
  moe_route::detail::validate_route(r, in, out);
  const int num_experts = in.num_experts;
  const int k = r.top_k;
  std::vector<std::int64_t> nonfinite(ex.threads > 0 ? ex.threads : std::max(1u, std::thread::hardware_concurrency()), 0);
  detail::for_token_blocks(in.num_tokens, ex, [&](std::int64_t begin, std::int64_t end, int worker,
                                                   detail::row_scratch& scratch) {
    std::int64_t bad = 0;
    for (std::int64_t t = begin; t < end; ++t)
      bad += detail::route_row(r, in.logits + t * num_experts, num_experts, t, in.expert_bias, scratch,
                               out.indices + t * k, out.gates + t * k);
    nonfinite[worker] = bad;
  });
  route_report report;
  for (std::int64_t n : nonfinite) report.nonfinite_rows += n;
  if (out.nonfinite_rows != nullptr) *out.nonfinite_rows += report.nonfinite_rows;
  return report;
}

// Fused backward: dL/dz [N x E] from dL/dgates [N x K] in one pass over the
// logits. The indices must be those the forward wrote for the same inputs.
template <class Router, class T>
void backward(const Router& r, const route_inputs<T>& in, const backward_args& args, execution ex = {}) {
  static_assert(is_router<Router>, "cpu::backward: the first argument must be a moe_route::router");
  moe_route::detail::validate_backward(r, in, args);
  const int num_experts = in.num_experts;
  const int k = r.top_k;
  const std::int64_t entries = in.num_tokens * k;
  for (std::int64_t i = 0; i < entries; ++i)
    if (args.indices[i] < 0 || args.indices[i] >= num_experts)
      moe_route::detail::fail("indices[" + std::to_string(i) + "] (= " + std::to_string(args.indices[i]) +
                              ") is not an expert in [0, num_experts)");
  detail::for_token_blocks(in.num_tokens, ex, [&](std::int64_t begin, std::int64_t end, int,
                                                   detail::row_scratch& scratch) {
    for (std::int64_t t = begin; t < end; ++t)
      detail::backward_row(r, in.logits + t * num_experts, num_experts, args.indices + t * k,
                           args.grad_gates + t * k, scratch, args.grad_logits + t * num_experts);
  });
}

}  // namespace moe_route::cpu
