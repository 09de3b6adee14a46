// moe_route: the marginal-preserving null model of co-activation graphs
// (docs/policies.md section 6; RPB App. B.1). Host only, no dependencies.
//
//   inclusion_probabilities(u, K) -> pi, sum pi = K, 0 <= pi_e <= 1, pi ∝ u where possible
//   null_model_trace(u, N, K, seed) -> indices [N x K]: each token draws K
//       distinct experts with P(e in S(t)) = pi_e, independently across tokens.
//
// Sampling procedure (fixed, so a seed gives the same trace with every
// compiler and standard library; std:: distributions are not used because
// their algorithms are implementation-defined):
//   1. pi_e = K u_e; while some pi_e > 1, set those to 1 and rescale the
//      others so that sum pi = K (the usual capping of inclusion
//      probabilities). With u taken from a trace whose tokens select K distinct
//      experts and drop nothing, K u_e <= 1 already and pi = K u exactly.
//   2. One std::mt19937_64 engine seeded with `seed` serves all tokens in
//      token order. Per token: (a) a Fisher-Yates shuffle of the expert order
//      0..E-1 (for i = E-1 down to 1, j = uniform in [0, i] by rejection from
//      the engine's 64-bit output, swap i and j); (b) one start U = (x >> 11)
//      * 2^-53 from the next output x; (c) walk the shuffled order with the
//      running sum c of pi and select expert e when some point U + m
//      (m = 0..K-1) lies in [c, c + pi_e) (randomised systematic sampling).
//      Because pi_e <= 1 every expert is selected at most once, and each
//      expert's inclusion probability is exactly pi_e: the marginal
//      utilisation is preserved in expectation, while the per-token shuffle
//      removes any pairwise structure tied to the expert numbering. Slots are
//      written in selection order. (Drawing K times ∝ u without replacement
//      would not preserve the marginals of skewed u, so that is not used.)
//   3. If floating rounding leaves a token with fewer than K experts, the
//      first unselected experts with pi_e > 0 in the shuffled order fill it.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <moe_route/analysis/retention.hpp>

namespace moe_route::analysis {

// pi from u (any non-negative weights with a positive sum), capped at 1,
// summing to K. Requires at least K experts with u_e > 0.
inline std::vector<double> inclusion_probabilities(const std::vector<double>& u, int k) {
  const int e_count = static_cast<int>(u.size());
  if (e_count < 1) detail::fail("inclusion_probabilities", "u is empty");
  if (k < 1 || k > e_count)
    detail::fail("inclusion_probabilities", "k (= " + std::to_string(k) + ") must be in [1, E = " +
                                                std::to_string(e_count) + "]");
  int support = 0;
  for (double x : u) {
    if (!(x >= 0.0) || !std::isfinite(x)) detail::fail("inclusion_probabilities", "u must be finite and >= 0");
    support += x > 0.0;
  }
  if (support < k)
    detail::fail("inclusion_probabilities", "only " + std::to_string(support) + " experts have u > 0; K = " +
                                                std::to_string(k) + " distinct experts cannot be drawn");
  std::vector<double> pi(u.size(), 0.0);
  std::vector<bool> capped(u.size(), false);
  int n_capped = 0;
  for (;;) {
    double free_mass = 0.0;
    for (int e = 0; e < e_count; ++e)
      if (!capped[e]) free_mass += u[e];
    const double scale = (k - n_capped) / free_mass;
    bool changed = false;
    for (int e = 0; e < e_count; ++e) {
      if (capped[e]) continue;
      pi[e] = u[e] * scale;
      if (pi[e] > 1.0) {
        capped[e] = true;
        pi[e] = 1.0;
        ++n_capped;
        changed = true;
      }
    }
    if (!changed) break;
  }
  return pi;
}

namespace detail {

// Uniform integer in [0, bound] from a 64-bit engine, by rejection.
inline std::uint64_t uniform_at_most(std::mt19937_64& rng, std::uint64_t bound) {
  if (bound == ~0ull) return rng();
  const std::uint64_t range = bound + 1;
  const std::uint64_t limit = ~0ull - (~0ull % range);
  std::uint64_t x;
  do x = rng(); while (x >= limit);
  return x % range;
}

}  // namespace detail

// A null trace [N x K] from utilisation u (see the procedure above).
inline std::vector<std::int32_t> null_model_trace(const std::vector<double>& u, std::int64_t num_tokens, int k,
                                                  std::uint64_t seed) {
  if (num_tokens < 0) detail::fail("null_model_trace", "num_tokens must be >= 0");
  const std::vector<double> pi = inclusion_probabilities(u, k);
  const int e_count = static_cast<int>(u.size());
  std::mt19937_64 rng(seed);
  std::vector<std::int32_t> out(static_cast<std::size_t>(num_tokens) * k, -1);
  std::vector<int> order(static_cast<std::size_t>(e_count));
  std::vector<bool> chosen(static_cast<std::size_t>(e_count));
  for (std::int64_t t = 0; t < num_tokens; ++t) {
    for (int e = 0; e < e_count; ++e) order[e] = e;
    for (int i = e_count - 1; i > 0; --i)
      std::swap(order[i], order[detail::uniform_at_most(rng, static_cast<std::uint64_t>(i))]);
    const double start = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    std::int32_t* row = out.data() + t * k;
    int filled = 0;
    double c = 0.0;
    double next_point = start;  // the smallest U + m not yet passed
    std::fill(chosen.begin(), chosen.end(), false);
    for (int idx = 0; idx < e_count && filled < k; ++idx) {
      const int e = order[idx];
      const double c_next = c + pi[e];
      if (pi[e] > 0.0 && next_point >= c && next_point < c_next) {
        row[filled++] = e;
        chosen[e] = true;
        next_point += 1.0;
      }
      c = c_next;
    }
    for (int idx = 0; idx < e_count && filled < k; ++idx) {
      const int e = order[idx];
      if (!chosen[e] && pi[e] > 0.0) {
        row[filled++] = e;
        chosen[e] = true;
      }
    }
  }
  return out;
}

}  // namespace moe_route::analysis
