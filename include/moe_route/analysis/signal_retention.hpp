// moe_route: the signal retention an admission achieved, measured against
// CIPHER-MoE's Theorem 1 (docs/policies.md section 7.1). Host only.
//
//   analysis::signal_retention(inputs, options) -> signal_retention_stats
//
// For each admission group g and expert e the candidate pool is the tokens of
// g routed to e, in token order (N_e of them). A candidate is discriminative
// when its affinity is at least the margin delta: with the cosine affinity
// this is the paper's signal event <u_e, X> >= delta. A pool with a
// discriminative candidate is available (the paper's A_e); it retains the
// signal when the admission still runs one of them on e. Beside what the
// admission did, the statistics give what natural-order admission (the
// `position` affinity) would have kept at the same capacity C_e, measured and
// as eq. 19 predicts it, and the pools whose capacity reaches the sufficient
// CIPHER budget B_e of eq. 7 (mu = 0: ranking by the exact affinity puts no
// competitor ahead of the best discriminative candidate).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <moe_route/admission/admission.hpp>
#include <moe_route/analysis/capacity_bounds.hpp>
#include <moe_route/types.hpp>

namespace moe_route::analysis {

struct signal_retention_inputs {
  const std::int32_t* routed_indices = nullptr;    // [N x K] the router's selection (-1: none)
  const std::int32_t* executed_indices = nullptr;  // [N x K] after admission (-1: not executed)
  const float* affinities = nullptr;               // [N x K] a(t, routed[t, k]); NaN is never discriminative
  std::int64_t num_tokens = 0;
  int top_k = 0;
  int num_experts = 0;
  const std::int32_t* group_ids = nullptr;  // [N] in [0, num_groups), or null: one group
  int num_groups = 1;
};

struct signal_retention_options {
  float margin = 0.0f;            // delta: a candidate with affinity >= margin is discriminative
  double capacity_factor = 8.0;   // C_e by the admission's rule (admission::capacity_from_factor)
  std::int64_t min_capacity = 0;
  double eps = 0.1;               // Theorem 1's failure target and recall failure, for B_e
  double eta = 0.01;
};

// Counts over (group, expert) pools; += adds the counts of further batches.
struct signal_retention_stats {
  std::int64_t pools = 0;                // pools with N_e >= 1
  std::int64_t available = 0;            // pools with a discriminative candidate (A_e)
  std::int64_t retained = 0;             // available pools that still run one on e
  std::int64_t natural_retained = 0;     // available pools whose first discriminative candidate is within C_e
  double natural_predicted = 0.0;        // sum over available pools of eq. 19 with pi_e = D_e / N_e
  std::int64_t natural_capacity = 0;     // sum over available pools of that candidate's 1-based position
  std::int64_t at_budget = 0;            // available pools with C_e >= B_e
  std::int64_t retained_at_budget = 0;   // ... that retained
  std::int64_t discriminative = 0;       // discriminative candidates (t, e)
  std::int64_t discriminative_kept = 0;  // ... still run on e

  signal_retention_stats& operator+=(const signal_retention_stats& o) {
    pools += o.pools;
    available += o.available;
    retained += o.retained;
    natural_retained += o.natural_retained;
    natural_predicted += o.natural_predicted;
    natural_capacity += o.natural_capacity;
    at_budget += o.at_budget;
    retained_at_budget += o.retained_at_budget;
    discriminative += o.discriminative;
    discriminative_kept += o.discriminative_kept;
    return *this;
  }
};

namespace detail {

[[noreturn]] inline void retention_error(const std::string& what) {
  throw error("moe_route: signal_retention: " + what);
}

// P_natural(C | A_e) of eq. 19: the chance that natural order at capacity C
// keeps a discriminative token of a pool of n with discriminative share pi.
inline double natural_retention_probability(double pi, std::int64_t capacity, std::int64_t n) {
  if (capacity >= n) return 1.0;
  const double q = 1.0 - pi;
  return (1.0 - std::pow(q, static_cast<double>(capacity))) / (1.0 - std::pow(q, static_cast<double>(n)));
}

}  // namespace detail

// Throws moe_route::error naming the argument for null arrays, bad shapes, an
// index or group id out of range, a NaN margin or a capacity factor or
// eps / eta that the admission or eq. 7 refuse. Nothing is written on error.
inline signal_retention_stats signal_retention(const signal_retention_inputs& in,
                                               const signal_retention_options& o = {}) {
  const std::int64_t n = in.num_tokens;
  const int k = in.top_k, e_count = in.num_experts, g_count = in.num_groups;
  if (n < 0) detail::retention_error("num_tokens (= " + std::to_string(n) + ") must be >= 0");
  if (k < 1) detail::retention_error("top_k (= " + std::to_string(k) + ") must be >= 1");
  if (e_count < 1) detail::retention_error("num_experts (= " + std::to_string(e_count) + ") must be >= 1");
  if (g_count < 1) detail::retention_error("num_groups (= " + std::to_string(g_count) + ") must be >= 1");
  if (n > 0 && (in.routed_indices == nullptr || in.executed_indices == nullptr || in.affinities == nullptr))
    detail::retention_error(std::string(in.routed_indices == nullptr     ? "routed_indices"
                                        : in.executed_indices == nullptr ? "executed_indices"
                                                                         : "affinities") +
                            " is null");
  if (g_count > 1 && n > 0 && in.group_ids == nullptr)
    detail::retention_error("group_ids is null with num_groups > 1");
  if (std::isnan(o.margin)) detail::retention_error("margin is NaN");
  if (!std::isfinite(o.capacity_factor) || o.capacity_factor < 0.0)
    detail::retention_error("capacity_factor (= " + std::to_string(o.capacity_factor) + ") must be finite and >= 0");
  if (o.min_capacity < 0)
    detail::retention_error("min_capacity (= " + std::to_string(o.min_capacity) + ") must be >= 0");
  capacity_bounds::ell(o.eps, o.eta);  // checks eps and eta before any work

  // Candidates per (group, expert) in token order, and the tokens per group.
  struct candidate {
    std::int64_t token;
    bool discriminative, kept;
  };
  const auto pool_count = static_cast<std::size_t>(g_count) * static_cast<std::size_t>(e_count);
  std::vector<std::vector<candidate>> pools(pool_count);
  std::vector<std::int64_t> group_tokens(static_cast<std::size_t>(g_count), 0);
  for (std::int64_t t = 0; t < n; ++t) {
    const std::int32_t g = in.group_ids != nullptr ? in.group_ids[t] : 0;
    if (g < 0 || g >= g_count)
      detail::retention_error("group_ids[" + std::to_string(t) + "] (= " + std::to_string(g) +
                              ") must be in [0, num_groups)");
    ++group_tokens[static_cast<std::size_t>(g)];
    const std::int32_t* routed = in.routed_indices + t * k;
    const std::int32_t* executed = in.executed_indices + t * k;
    for (int j = 0; j < k; ++j) {
      const auto check = [&](const char* name, std::int32_t v) {
        if (v < -1 || v >= e_count)
          detail::retention_error(std::string(name) + "[" + std::to_string(t * k + j) + "] (= " + std::to_string(v) +
                                  ") must be -1 or in [0, num_experts)");
      };
      check("executed_indices", executed[j]);
      const std::int32_t e = routed[j];
      check("routed_indices", e);
      if (e < 0) continue;
      bool kept = false;
      for (int i = 0; i < k; ++i) kept = kept || executed[i] == e;
      pools[static_cast<std::size_t>(g) * e_count + e].push_back({t, in.affinities[t * k + j] >= o.margin, kept});
    }
  }

  signal_retention_stats s;
  for (int g = 0; g < g_count; ++g)
    for (int e = 0; e < e_count; ++e) {
      const auto& pool = pools[static_cast<std::size_t>(g) * e_count + e];
      if (pool.empty()) continue;
      ++s.pools;
      const auto size = static_cast<std::int64_t>(pool.size());
      std::int64_t found = 0, first = 0;
      bool retained = false;
      for (std::int64_t i = 0; i < size; ++i) {
        const candidate& c = pool[static_cast<std::size_t>(i)];
        if (!c.discriminative) continue;
        if (found++ == 0) first = i + 1;
        retained = retained || c.kept;
        s.discriminative_kept += c.kept ? 1 : 0;
      }
      s.discriminative += found;
      if (found == 0) continue;
      const std::int64_t capacity = admission::capacity_from_factor(
          o.capacity_factor, o.min_capacity, group_tokens[static_cast<std::size_t>(g)], k, e_count);
      ++s.available;
      s.retained += retained ? 1 : 0;
      s.natural_retained += first <= capacity ? 1 : 0;
      s.natural_capacity += first;
      s.natural_predicted += detail::natural_retention_probability(
          static_cast<double>(found) / static_cast<double>(size), capacity, size);
      if (capacity >= capacity_bounds::cipher_budget(size, 0.0, o.eps, o.eta)) {
        ++s.at_budget;
        s.retained_at_budget += retained ? 1 : 0;
      }
    }
  return s;
}

}  // namespace moe_route::analysis
