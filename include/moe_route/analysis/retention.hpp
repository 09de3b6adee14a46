// moe_route: routing-retention statistics of a post-trained router against its
// base router (docs/policies.md section 6; RPB section 2 and App. C-D). Host only,
// no dependencies beyond the standard library.
//
//   utilisation(indices, N, S, E)            u_e = share of all executed selections
//   total_variation(u, v)                    TVD = 1/2 sum_e |u_e - v_e|
//   jensen_shannon(u, v)                     JSD with the natural log, in [0, ln 2]
//   topk_overlap(base, post, N, K)           mean over tokens of |S_base(t) ∩ S_post(t)| / K
//   routing_sharpness(p)                     ||p - U||_1 (U uniform over E experts)
//   cross_domain_divergence(p_a, p_b)        ||p_a - p_b||_1
//   effective_expert_fraction(u)             exp(H(u)) / E, H in nats
//   centroid_cosine(p_a, p_b)                cosine of two domain centroids
//   mean_distribution(probs, N, E)           p̄ = mean over tokens of a routing distribution
//   domain_utilisation(indices, N, S, E, domains, D)   u per domain
//
// Traces are index arrays [N x S] as the backends write them (route: S = K;
// admit: -1 = dropped; expert_choice: S = E, -1 = unused); -1 entries are not
// selections. Multi-layer traces [L x N x S] are L such arrays back to back;
// the per-layer helpers take one layer, and layer means are unweighted.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <moe_route/types.hpp>

namespace moe_route::analysis {

namespace detail {

[[noreturn]] inline void fail(const char* function, const std::string& what) {
  throw error(std::string("moe_route: analysis::") + function + ": " + what);
}

inline void check_trace(const char* function, const std::int32_t* indices, std::int64_t num_tokens,
                        int slots_per_token, int num_experts) {
  if (num_tokens < 0) fail(function, "num_tokens (= " + std::to_string(num_tokens) + ") must be >= 0");
  if (slots_per_token < 1) fail(function, "slots_per_token (= " + std::to_string(slots_per_token) + ") must be >= 1");
  if (num_experts < 1) fail(function, "num_experts (= " + std::to_string(num_experts) + ") must be >= 1");
  if (num_tokens > 0 && indices == nullptr) fail(function, "indices is null");
  const std::int64_t n = num_tokens * slots_per_token;
  for (std::int64_t i = 0; i < n; ++i)
    if (indices[i] < -1 || indices[i] >= num_experts)
      fail(function, "indices[" + std::to_string(i) + "] (= " + std::to_string(indices[i]) +
                         ") must be -1 or an expert in [0, " + std::to_string(num_experts) + ")");
}

inline void check_same_size(const char* function, const std::vector<double>& p, const std::vector<double>& q) {
  if (p.size() != q.size())
    fail(function, "distributions have different sizes (" + std::to_string(p.size()) + " and " +
                       std::to_string(q.size()) + ")");
  if (p.empty()) fail(function, "distributions are empty");
}

}  // namespace detail

// u_e = (number of entries equal to e) / (number of entries >= 0). A trace
// without any selection gives all zeros.
inline std::vector<double> utilisation(const std::int32_t* indices, std::int64_t num_tokens, int slots_per_token,
                                       int num_experts) {
  detail::check_trace("utilisation", indices, num_tokens, slots_per_token, num_experts);
  std::vector<std::int64_t> load(static_cast<std::size_t>(num_experts), 0);
  std::int64_t total = 0;
  for (std::int64_t i = 0; i < num_tokens * slots_per_token; ++i)
    if (indices[i] >= 0) {
      ++load[indices[i]];
      ++total;
    }
  std::vector<double> u(static_cast<std::size_t>(num_experts), 0.0);
  if (total > 0)
    for (int e = 0; e < num_experts; ++e) u[e] = static_cast<double>(load[e]) / static_cast<double>(total);
  return u;
}

// Utilisation of each domain's tokens: domains[t] in [0, num_domains) or -1
// (token left out). Returns num_domains vectors of size E.
inline std::vector<std::vector<double>> domain_utilisation(const std::int32_t* indices, std::int64_t num_tokens,
                                                           int slots_per_token, int num_experts,
                                                           const std::int32_t* domains, int num_domains) {
  detail::check_trace("domain_utilisation", indices, num_tokens, slots_per_token, num_experts);
  if (num_domains < 1) detail::fail("domain_utilisation", "num_domains must be >= 1");
  if (num_tokens > 0 && domains == nullptr) detail::fail("domain_utilisation", "domains is null");
  std::vector<std::vector<double>> u(static_cast<std::size_t>(num_domains),
                                     std::vector<double>(static_cast<std::size_t>(num_experts), 0.0));
  std::vector<double> total(static_cast<std::size_t>(num_domains), 0.0);
  for (std::int64_t t = 0; t < num_tokens; ++t) {
    const std::int32_t d = domains[t];
    if (d < -1 || d >= num_domains)
      detail::fail("domain_utilisation", "domains[" + std::to_string(t) + "] (= " + std::to_string(d) +
                                             ") must be -1 or in [0, " + std::to_string(num_domains) + ")");
    if (d < 0) continue;
    for (int j = 0; j < slots_per_token; ++j) {
      const std::int32_t e = indices[t * slots_per_token + j];
      if (e >= 0) {
        u[d][e] += 1.0;
        total[d] += 1.0;
      }
    }
  }
  for (int d = 0; d < num_domains; ++d)
    if (total[d] > 0.0)
      for (double& x : u[d]) x /= total[d];
  return u;
}

// p̄_e = (1/N) sum_t probs[t, e], accumulated in double in token order.
inline std::vector<double> mean_distribution(const float* probs, std::int64_t num_tokens, int num_experts) {
  if (num_tokens < 1) detail::fail("mean_distribution", "num_tokens must be >= 1");
  if (num_experts < 1) detail::fail("mean_distribution", "num_experts must be >= 1");
  if (probs == nullptr) detail::fail("mean_distribution", "probs is null");
  std::vector<double> p(static_cast<std::size_t>(num_experts), 0.0);
  for (std::int64_t t = 0; t < num_tokens; ++t)
    for (int e = 0; e < num_experts; ++e) p[e] += probs[t * num_experts + e];
  for (double& x : p) x /= static_cast<double>(num_tokens);
  return p;
}

// TVD = 1/2 sum_e |p_e - q_e|.
inline double total_variation(const std::vector<double>& p, const std::vector<double>& q) {
  detail::check_same_size("total_variation", p, q);
  double s = 0.0;
  for (std::size_t e = 0; e < p.size(); ++e) s += std::fabs(p[e] - q[e]);
  return 0.5 * s;
}

// ||p - q||_1.
inline double l1_distance(const std::vector<double>& p, const std::vector<double>& q) {
  detail::check_same_size("l1_distance", p, q);
  double s = 0.0;
  for (std::size_t e = 0; e < p.size(); ++e) s += std::fabs(p[e] - q[e]);
  return s;
}

// JSD(p, q) = 1/2 KL(p || m) + 1/2 KL(q || m), m = (p + q) / 2, natural log,
// 0 log 0 = 0. In [0, ln 2] for probability vectors.
inline double jensen_shannon(const std::vector<double>& p, const std::vector<double>& q) {
  detail::check_same_size("jensen_shannon", p, q);
  double s = 0.0;
  for (std::size_t e = 0; e < p.size(); ++e) {
    const double m = 0.5 * (p[e] + q[e]);
    if (p[e] > 0.0) s += 0.5 * p[e] * std::log(p[e] / m);
    if (q[e] > 0.0) s += 0.5 * q[e] * std::log(q[e] / m);
  }
  return s < 0.0 ? 0.0 : s;
}

// Mean over tokens of |S_base(t) ∩ S_post(t)| / K; -1 entries are in no set.
// Both traces are [N x K] over the same probe tokens.
inline double topk_overlap(const std::int32_t* base, const std::int32_t* post, std::int64_t num_tokens, int k) {
  if (num_tokens < 1) detail::fail("topk_overlap", "num_tokens must be >= 1");
  if (k < 1) detail::fail("topk_overlap", "k must be >= 1");
  if (base == nullptr || post == nullptr) detail::fail("topk_overlap", "a trace is null");
  double sum = 0.0;
  for (std::int64_t t = 0; t < num_tokens; ++t) {
    const std::int32_t* a = base + t * k;
    const std::int32_t* b = post + t * k;
    int common = 0;
    for (int i = 0; i < k; ++i) {
      if (a[i] < 0) continue;
      for (int j = 0; j < k; ++j)
        if (b[j] == a[i]) {
          ++common;
          break;
        }
    }
    sum += static_cast<double>(common) / k;
  }
  return sum / static_cast<double>(num_tokens);
}

// Routing sharpness ||p - U||_1 (RPB App. D.2), U_e = 1/E.
inline double routing_sharpness(const std::vector<double>& p) {
  if (p.empty()) detail::fail("routing_sharpness", "distribution is empty");
  const double uniform = 1.0 / static_cast<double>(p.size());
  double s = 0.0;
  for (double x : p) s += std::fabs(x - uniform);
  return s;
}

// Cross-domain divergence ||p_a - p_b||_1 (RPB App. D.2).
inline double cross_domain_divergence(const std::vector<double>& p_a, const std::vector<double>& p_b) {
  detail::check_same_size("cross_domain_divergence", p_a, p_b);
  return l1_distance(p_a, p_b);
}

// Effective expert fraction exp(H(u)) / E, H = -sum u log u in nats (RPB App. C).
inline double effective_expert_fraction(const std::vector<double>& u) {
  if (u.empty()) detail::fail("effective_expert_fraction", "distribution is empty");
  double h = 0.0;
  for (double x : u)
    if (x > 0.0) h -= x * std::log(x);
  return std::exp(h) / static_cast<double>(u.size());
}

// Cosine similarity of two domain centroids (RPB App. C, Table 11); 0 if
// either is all zeros.
inline double centroid_cosine(const std::vector<double>& p_a, const std::vector<double>& p_b) {
  detail::check_same_size("centroid_cosine", p_a, p_b);
  double dot = 0.0, na = 0.0, nb = 0.0;
  for (std::size_t e = 0; e < p_a.size(); ++e) {
    dot += p_a[e] * p_b[e];
    na += p_a[e] * p_a[e];
    nb += p_b[e] * p_b[e];
  }
  return na > 0.0 && nb > 0.0 ? dot / std::sqrt(na * nb) : 0.0;
}

}  // namespace moe_route::analysis
