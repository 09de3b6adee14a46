// moe_route: the training policies on the CPU backend: the prior policies'
// row transforms and the penalties' forward sums, values and fused gradients
// (docs/policies.md sections 3 and 5; the layout is training/workspace.hpp).
//
// Per token the penalties see the unbiased logits. The row math is float with
// the shared bit-reproducible functions, every row sum in the canonical
// 32-lane order (float for gradients, double for values), so the CUDA backend
// can reproduce it bit for bit; cross-token sums are fixed point (order-free)
// or chunked in a fixed order.
#pragma once

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

#include <moe_route/backend/cpu/detail/simd.hpp>
#include <moe_route/config.hpp>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/detail/validate.hpp>
#include <moe_route/gating/gating.hpp>
#include <moe_route/router.hpp>
#include <moe_route/training/finalize.hpp>
#include <moe_route/training/workspace.hpp>
#include <moe_route/types.hpp>

namespace moe_route::cpu::detail {

namespace num = moe_route::detail;

// Whether the router's prior policy acts on token t of this call.
template <class Router, class T>
bool prior_active(const Router& r, const route_inputs<T>& in, std::int64_t t) {
  if constexpr (!Router::has_prior) {
    return false;
  } else {
    if (in.mode != mode::train || in.token_prior_row[t] < 0) return false;
    if constexpr (Router::template has<prior::log_prior_bias>)
      return get<prior::log_prior_bias>(r).beta != 0.0f;  // beta = 0 is plain routing, bit for bit
    return true;
  }
}

// z' = z + beta * b[r(t)] into out (not sanitised); returns whether z held a
// NaN or +-inf (the row's non-finite status is that of the logits, not of z').
template <class T>
bool biased_row(const T* z, const float* b, float beta, int num_experts, float* out) {
  int bad = 0;
  for (int e = 0; e < num_experts; ++e) {
    const float x = num::to_float(z[e]);
    bad |= !num::is_finite(x);
    out[e] = num::fma(beta, b[e], x);
  }
  return bad != 0;
}

#if MOE_ROUTE_CPU_AVX2_KERNELS
// add_fixed_point four doubles at a time. AVX2 has no double -> int64
// conversion, so the truncated value (an integer below 2^33) is added to 2^52,
// where the low bits of the double's encoding are the integer itself. p * 2^32
// is exact, so the fma rounds p * 2^32 + 0.5 once, as the scalar form does.
MOE_ROUTE_CPU_AVX2_TARGET inline void add_fixed_point4_avx2(__m128 p, std::int64_t* acc) {
  const __m256d two52 = _mm256_set1_pd(4503599627370496.0);
  const __m256d y = _mm256_round_pd(
      _mm256_fmadd_pd(_mm256_cvtps_pd(p), _mm256_set1_pd(penalty::fixed_point_scale), _mm256_set1_pd(0.5)),
      _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m256i fixed = _mm256_sub_epi64(_mm256_castpd_si256(_mm256_add_pd(y, two52)), _mm256_castpd_si256(two52));
  __m256i* out = reinterpret_cast<__m256i*>(acc);
  _mm256_storeu_si256(out, _mm256_add_epi64(_mm256_loadu_si256(out), fixed));
}

MOE_ROUTE_CPU_AVX2_TARGET inline void add_fixed_point_avx2(const float* p, int n, std::int64_t* acc) {
  int e = 0;
  for (; e + 8 <= n; e += 8) {
    const __m256 p8 = _mm256_loadu_ps(p + e);
    add_fixed_point4_avx2(_mm256_castps256_ps128(p8), acc + e);
    add_fixed_point4_avx2(_mm256_extractf128_ps(p8, 1), acc + e + 4);
  }
  for (; e < n; ++e) acc[e] += penalty::to_fixed_point(p[e]);
}
#endif

// acc[e] += to_fixed_point(p[e]) for e < n (p in [0, 1]): the order-free
// per-expert sums of a distribution (training/workspace.hpp).
inline void add_fixed_point(const float* p, int n, std::int64_t* acc, [[maybe_unused]] bool x86_64_v3) {
#if MOE_ROUTE_CPU_AVX2_KERNELS
  if (use_avx2(x86_64_v3)) return add_fixed_point_avx2(p, n, acc);
#endif
  for (int e = 0; e < n; ++e) acc[e] += penalty::to_fixed_point(p[e]);
}

// A reduction over e < n in the canonical lane order: lane l folds in e = l,
// l + 32, ... (lane = fold(lane, e), from 0), then the lanes add by the
// butterfly 16, 8, 4, 2, 1. Written by blocks of 32 so that the lanes vectorise.
template <class Acc, class Fold>
Acc lane_fold(int n, Fold fold) {
  Acc lanes[num::reduction_lanes] = {};
  int base = 0;
  for (; base + num::reduction_lanes <= n; base += num::reduction_lanes)
    for (int l = 0; l < num::reduction_lanes; ++l) lanes[l] = fold(lanes[l], base + l);
  for (int l = 0; base + l < n; ++l) lanes[l] = fold(lanes[l], base + l);
  for (int offset = num::reduction_lanes / 2; offset > 0; offset >>= 1)
    for (int l = 0; l < offset; ++l) lanes[l] = lanes[l] + lanes[l + offset];
  return lanes[0];
}

// Double sum of term(e) over e < n in the canonical lane order.
template <class Term>
double lane_sum_double(int n, Term term) {
  return lane_fold<double>(n, [&](double lane, int e) { return lane + term(e); });
}

// <g, p> in float, canonical lane order, each product fused into its lane.
inline float lane_dot(const float* g, const float* p, int n) {
  return lane_fold<float>(n, [&](float lane, int e) { return num::fma(g[e], p[e], lane); });
}

struct penalty_scratch {
  float v[max_experts];  // the unbiased logits, converted to float
  float s[max_experts];  // scores (elementwise gating) or softmax terms
  float p[max_experts];  // the routing distribution
  float q[max_experts];  // the softmax terms of z for z_loss when the gating is not a softmax
  float g[max_experts];  // dL/dp of the distribution-space penalties
  float d[max_experts];  // kl_to_base: log pi - log p
};

// What the router's own pass over a token's logits left in its row buffer,
// for the penalties to reuse instead of computing it again: the pass's
// sanitised logits, and per gating the softmax terms exp(v - max) with their
// maximum and canonical sum, the softmax distribution itself (the terms
// divided by the sum), or the elementwise scores. `source` is the row the pass
// read: the penalties reuse it only for the token's own logits (not for z + beta b).
struct router_row {
  enum class holds { nothing, terms, distribution, scores };
  const void* source = nullptr;
  const float* v = nullptr;
  const float* buffer = nullptr;
  holds what = holds::nothing;
  bool nonfinite = false;
  float max = 0.0f, sum = 0.0f;
};

// One token's unbiased statistics: the distribution p = s / norm, the softmax
// log-normaliser lse when z_loss needs it.
template <class Router>
struct penalty_row {
  using G = typename Router::gating_type;
  using holds = router_row::holds;
  static constexpr bool softmax_like = G::shape != gating::kind::elementwise;
  penalty_scratch& sc;
  int n;
  const float* v = nullptr;  // the unbiased logits (finite when valid)
  const float* s = nullptr;  // elementwise: the scores
  const float* p = nullptr;  // the distribution
  float row_max = 0.0f, norm = 0.0f, lse = 0.0f;
  float q_sum = 0.0f;  // elementwise gating with z_loss: the sum of the softmax terms in sc.q
  bool valid = false;

  // The row is valid when its logits are finite and its scores do not all
  // vanish: every score is increasing in the logit, so the sum of the scores
  // is positive iff the largest logit's score is (a softmax row always is).
  // The distribution is computed only when a penalty needs it (the
  // distribution-space penalties, kl_to_base; z_loss under a softmax gating),
  // from what the router's pass over the same logits left where it can (the
  // same functions on the same values: the same bits).
  template <class T>
  MOE_ROUTE_ALWAYS_INLINE penalty_row(penalty_scratch& scratch, const T* z, int num_experts, const router_row& routed,
                                      bool need_distribution, bool need_lse, bool x86_64_v3)
      : sc(scratch), n(num_experts) {
    const bool reuse = routed.source == static_cast<const void*>(z);
    if (reuse) {
      if (routed.nonfinite) return;
      v = routed.v;
    } else {
      if constexpr (std::is_same_v<T, float>) {
        v = z;
      } else {
        for (int e = 0; e < n; ++e) sc.v[e] = num::to_float(z[e]);
        v = sc.v;
      }
      if (any_nonfinite(v, n)) return;
    }
    const holds left = reuse ? routed.what : holds::nothing;
    row_max = left == holds::terms || left == holds::distribution ? routed.max : cpu::detail::row_max(v, n, x86_64_v3);
    if constexpr (!softmax_like) {
      if (!(G::score(row_max) > 0.0f)) return;
    }
    valid = true;
    if (need_distribution || (softmax_like && need_lse)) {
      if (left == holds::distribution) {
        norm = routed.sum;
        p = routed.buffer;
      } else {
        const float* terms = sc.s;
        if (left == holds::terms || left == holds::scores) {
          terms = routed.buffer;
        } else if constexpr (softmax_like) {
          for (int e = 0; e < n; ++e) sc.s[e] = num::exp_nonpositive(v[e] - row_max);
        } else {
          for (int e = 0; e < n; ++e) sc.s[e] = G::score(v[e]);
        }
        s = terms;
        norm = left == holds::terms ? routed.sum : lane_sum(terms, n, x86_64_v3);
        for (int e = 0; e < n; ++e) sc.p[e] = num::div(terms[e], norm);
        p = sc.p;
      }
    }
    if (need_lse) {
      if constexpr (softmax_like) {
        lse = row_max + num::log(norm);
      } else {
        for (int e = 0; e < n; ++e) sc.q[e] = num::exp_nonpositive(v[e] - row_max);
        q_sum = lane_sum(sc.q, n, x86_64_v3);
        lse = row_max + num::log(q_sum);
      }
    }
  }

  float log_p(int e, float log_norm) const {
    if constexpr (softmax_like)
      return (v[e] - row_max) - log_norm;
    else
      return G::log_score(v[e]) - log_norm;
  }

  // KL(pi || p) in double (canonical lane order). The float differences
  // first, then the double sum: two loops that vectorise.
  double kl(const float* pi) const {
    const float log_norm = num::log(norm);
    for (int e = 0; e < n; ++e) sc.d[e] = num::log(pi[e]) - log_p(e, log_norm);
    return lane_sum_double(n, [&](int e) {
      return static_cast<double>(pi[e]) * static_cast<double>(sc.d[e]);  // exact in double
    });
  }

  // The centred difference delta = center(z - b) in double: mean, then entries.
  double delta_mean(const float* b) const {
    return lane_sum_double(n, [&](int e) { return static_cast<double>(v[e] - b[e]); }) / n;
  }
  double delta_squared(const float* b, double mean) const {
    return lane_fold<double>(n, [&](double lane, int e) {
      const double c = static_cast<double>(v[e] - b[e]) - mean;
      return num::fma(c, c, lane);
    });
  }

  // dz += VJP of p at g (dL/dp): softmax p (g - <g,p>); elementwise
  // (g - <g,p>) / norm * ds/dz.
  void add_distribution_grad(const float* g, float* dz) const {
    const float dot = lane_dot(g, p, n);
    for (int e = 0; e < n; ++e) {
      if constexpr (softmax_like)
        dz[e] = num::fma(p[e], g[e] - dot, dz[e]);
      else
        dz[e] = num::fma(num::div(g[e] - dot, norm), G::derivative(v[e], s[e]), dz[e]);
    }
  }

  // dz += w * dKL(pi || p)/dz: softmax w (p - pi); elementwise
  // w (ds/dz / norm - pi d(log s)/dz).
  void add_kl_grad(const float* pi, float w, float* dz) const {
    for (int e = 0; e < n; ++e) {
      if constexpr (softmax_like) {
        dz[e] = num::fma(w, p[e] - pi[e], dz[e]);
      } else {
        const float term = num::fma(-pi[e], G::log_derivative(v[e]), num::div(G::derivative(v[e], s[e]), norm));
        dz[e] = num::fma(w, term, dz[e]);
      }
    }
  }

  void add_logit_l2_grad(const float* b, double mean, float w, float* dz) const {
    for (int e = 0; e < n; ++e) {
      const float c = static_cast<float>(static_cast<double>(v[e] - b[e]) - mean);
      dz[e] = num::fma(w, c, dz[e]);
    }
  }

  // dz += w lse softmax(z); under an elementwise gating softmax(z) is its own
  // terms over their sum, divided here: the forward needs only lse.
  void add_z_loss_grad(float w, float* dz) const {
    const float wl = w * lse;
    for (int e = 0; e < n; ++e) {
      if constexpr (softmax_like)
        dz[e] = num::fma(wl, p[e], dz[e]);
      else
        dz[e] = num::fma(wl, num::div(sc.q[e], q_sum), dz[e]);
    }
  }
};

// What one worker accumulates in the forward; summed over workers afterwards
// (integers: the result does not depend on the split).
struct penalty_partials {
  std::int64_t valid_tokens = 0, prior_tokens = 0;
  std::vector<std::int64_t> distribution_sums, counts, sequence_sums, sequence_counts, sequence_tokens;
};

using penalty::workspace_view;

template <class Router>
bool counts_selections(const Router& r) {
  if constexpr (Router::template has<penalty::load_balance>)
    return get<penalty::load_balance>(r).over != penalty::load_balance::scope::global_batch;
  return false;
}

// Sizes a worker's partial sums.
template <class Router, class T>
void prepare_partials(const Router& r, const route_inputs<T>& in, penalty_partials& part) {
  const std::size_t E = static_cast<std::size_t>(in.num_experts);
  if constexpr (penalty::penalty_traits<Router>::distribution_space) {
    part.distribution_sums.assign(E, 0);
    part.counts.assign(E, 0);
    if (penalty::over_sequences(r)) {
      const std::size_t seqs = static_cast<std::size_t>(in.num_sequences);
      part.sequence_sums.assign(seqs * E, 0);
      part.sequence_counts.assign(seqs * E, 0);
      part.sequence_tokens.assign(seqs, 0);
    }
  }
}

// Zeroes token t's per-token penalty values (a row outside every sum).
template <class Router>
void clear_token_values(const workspace_view& ws, std::int64_t t) {
  constexpr int columns = penalty::penalty_traits<Router>::scalar_penalties;
  std::fill_n(ws.token_values + t * columns, columns, 0.0);
}

// The forward of the penalties for token t: its per-token values into the
// workspace, its sums into `part`; `counted` holds the K experts its
// load-balance counts take, `routed` what the router's pass left.
template <class Router, class T>
MOE_ROUTE_FLATTEN void penalty_forward_row(const Router& r, const route_inputs<T>& in,
                                           const penalty::switches& on, const std::int32_t* counted, std::int64_t t,
                                           const router_row& routed, penalty_scratch& sc, bool x86_64_v3,
                                           penalty_partials& part, const workspace_view& ws) {
  using traits = penalty::penalty_traits<Router>;
  const int E = in.num_experts, k = r.top_k;
  clear_token_values<Router>(ws, t);
  double* values = ws.token_values + t * traits::scalar_penalties;
  penalty_row<Router> row(sc, in.logits + t * E, E, routed, on.distribution || on.kl_to_base,
                          traits::z_loss && on.z_loss, x86_64_v3);
  if (!row.valid) return;
  ++part.valid_tokens;
  if (traits::distribution_space && on.distribution) {
    add_fixed_point(row.p, E, part.distribution_sums.data(), x86_64_v3);
    if (penalty::over_sequences(r)) {
      const std::int64_t s = in.sequence_ids[t];
      ++part.sequence_tokens[s];
      add_fixed_point(row.p, E, part.sequence_sums.data() + s * E, x86_64_v3);
      for (int j = 0; j < k; ++j) ++part.sequence_counts[s * E + counted[j]];
    } else if (counts_selections(r)) {
      for (int j = 0; j < k; ++j) ++part.counts[counted[j]];
    }
  }
  if constexpr (traits::z_loss)
    if (on.z_loss) values[traits::z_loss_column] = static_cast<double>(row.lse) * row.lse;
  if constexpr (traits::kl_to_base || traits::logit_l2) {
    const std::int32_t pr = in.token_prior_row[t];
    if (pr < 0) return;
    ++part.prior_tokens;
    if constexpr (traits::kl_to_base)
      if (on.kl_to_base) values[traits::kl_to_base_column] = row.kl(in.prior_probs + std::int64_t{pr} * E);
    if constexpr (traits::logit_l2) {
      if (on.logit_l2) {
        const float* b = in.prior_bias + std::int64_t{pr} * E;
        values[traits::logit_l2_column] = row.delta_squared(b, row.delta_mean(b));
      }
    }
  }
}

// The workers' sums into the workspace (integer sums: any order gives the same).
inline void reduce_partials(const std::vector<penalty_partials>& partials, const workspace_view& ws,
                            const penalty::workspace_layout& layout, int num_experts, std::int32_t num_sequences) {
  ws.header->valid_tokens = 0;
  ws.header->prior_tokens = 0;
  const auto add = [](std::int64_t* into, const std::vector<std::int64_t>& from, std::size_t n) {
    if (into == nullptr) return;
    for (std::size_t i = 0; i < n && i < from.size(); ++i) into[i] += from[i];
  };
  const std::size_t E = static_cast<std::size_t>(num_experts);
  const std::size_t seqs = layout.sequence_tokens != 0 ? static_cast<std::size_t>(num_sequences) : 0;
  for (std::int64_t* region : {ws.distribution_sums, ws.counts})
    if (region != nullptr) std::fill(region, region + E, 0);
  if (seqs > 0) {
    std::fill(ws.sequence_sums, ws.sequence_sums + seqs * E, 0);
    std::fill(ws.sequence_counts, ws.sequence_counts + seqs * E, 0);
    std::fill(ws.sequence_tokens, ws.sequence_tokens + seqs, 0);
  }
  for (const penalty_partials& part : partials) {
    ws.header->valid_tokens += part.valid_tokens;
    ws.header->prior_tokens += part.prior_tokens;
    add(ws.distribution_sums, part.distribution_sums, E);
    add(ws.counts, part.counts, E);
    if (seqs > 0) {
      add(ws.sequence_sums, part.sequence_sums, seqs * E);
      add(ws.sequence_counts, part.sequence_counts, seqs * E);
      add(ws.sequence_tokens, part.sequence_tokens, seqs);
    }
  }
}

// The chunk totals of the per-token values (chunks of value_chunk tokens, each
// summed in token order), as the CUDA backend computes them.
template <class Router>
void chunk_totals(const workspace_view& ws, std::int64_t num_tokens) {
  constexpr int columns = penalty::penalty_traits<Router>::scalar_penalties;
  for (std::int64_t base = 0, chunk = 0; base < num_tokens; base += penalty::value_chunk, ++chunk) {
    const std::int64_t end = std::min(num_tokens, base + penalty::value_chunk);
    for (int c = 0; c < columns; ++c) {
      double total = 0.0;
      for (std::int64_t t = base; t < end; ++t) total += ws.token_values[t * columns + c];
      ws.chunk_values[chunk * columns + c] = total;
    }
  }
}

template <class Router>
penalty::upstream_grads upstream_of(const backward_args& args) {
  static_assert(Router::num_penalties <= 8, "at most 8 penalties");
  penalty::upstream_grads up;
  if (args.penalty_grads != nullptr)
    for (int j = 0; j < Router::num_penalties; ++j) up.value[j] = args.penalty_grads[j];
  return up;
}

// dL/dp shared by every token (and per sequence), from the forward's sums.
template <class Router, class T>
void distribution_grads(const Router& r, const route_inputs<T>& in, const penalty::upstream_grads& up,
                        const workspace_view& ws) {
  const penalty::training_state s = ws.state(r, in);
  const int E = in.num_experts;
  const int local = penalty::penalty_traits<Router>::locality ? penalty::detail::local_experts(s) : 0;
  for (int e = 0; e < E; ++e) ws.expert_grad[e] = penalty::expert_grad(r, s, up, local, e);
  if constexpr (penalty::penalty_traits<Router>::load_balance) {
    if (!penalty::over_sequences(r)) return;
    const std::int64_t sequences = penalty::averaged_sequences(r, s);
    for (std::int32_t q = 0; q < in.num_sequences; ++q)
      for (int e = 0; e < E; ++e)
        ws.sequence_grad[std::int64_t{q} * E + e] = penalty::sequence_grad(r, s, up, sequences, q, e);
  }
}

// Adds the penalties' gradients of token t to dz (its gate gradient). Order:
// distribution-space (load_balance and locality together), kl_to_base,
// logit_l2, z_loss. `routed` is what the router's backward pass left.
template <class Router, class T>
MOE_ROUTE_FLATTEN void penalty_backward_row(const Router& r, const route_inputs<T>& in,
                                            const penalty::switches& on, const penalty::token_weights& w,
                                            const workspace_view& ws, std::int64_t t, const router_row& routed,
                                            penalty_scratch& sc, bool x86_64_v3, float* dz) {
  using traits = penalty::penalty_traits<Router>;
  const int E = in.num_experts;
  penalty_row<Router> row(sc, in.logits + t * E, E, routed, on.distribution || on.kl_to_base,
                          traits::z_loss && on.z_loss, x86_64_v3);
  if (!row.valid) return;
  if (traits::distribution_space && on.distribution) {
    const float* g = ws.expert_grad;
    if (penalty::over_sequences(r)) {
      const float* gs = ws.sequence_grad + std::int64_t{in.sequence_ids[t]} * E;
      for (int e = 0; e < E; ++e) sc.g[e] = gs[e] + g[e];
      g = sc.g;
    }
    row.add_distribution_grad(g, dz);
  }
  if constexpr (traits::kl_to_base || traits::logit_l2) {
    const std::int32_t pr = in.token_prior_row[t];
    if (pr >= 0) {
      if constexpr (traits::kl_to_base)
        if (on.kl_to_base) row.add_kl_grad(in.prior_probs + std::int64_t{pr} * E, w.kl_to_base, dz);
      if constexpr (traits::logit_l2) {
        if (on.logit_l2) {
          const float* b = in.prior_bias + std::int64_t{pr} * E;
          row.add_logit_l2_grad(b, row.delta_mean(b), w.logit_l2, dz);
        }
      }
    }
  }
  if constexpr (traits::z_loss)
    if (on.z_loss) row.add_z_loss_grad(w.z_loss, dz);
}

}  // namespace moe_route::cpu::detail
