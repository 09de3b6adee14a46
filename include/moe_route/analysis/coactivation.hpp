// moe_route: expert co-activation graphs and edge-fraction thresholding
// (docs/policies.md section 6; RPB eq. 1 and App. F.9). Host only, no dependencies.
//
//   coactivation(indices, N, S, E) -> coactivation_graph
//       counts[i, j] = #{t : i, j in S(t)}, i != j, symmetric, zero diagonal;
//       W_ij = counts[i, j] / N (raw frequencies, no row normalisation).
//   threshold_edges(graph, rho) -> the top rho fraction of the graph's edges
//
// The counts are exact integers, so the graph (and the CUDA accumulation of
// backend/cuda/coactivation.cuh) does not depend on summation order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <moe_route/analysis/retention.hpp>

namespace moe_route::analysis {

struct coactivation_graph {
  int num_experts = 0;                 // E
  std::int64_t tokens = 0;             // N, the divisor of W
  std::vector<std::int64_t> counts;    // [E x E] co-selection counts, symmetric, zero diagonal

  std::int64_t count(int i, int j) const { return counts[static_cast<std::size_t>(i) * num_experts + j]; }
  // W_ij = counts[i, j] / N (0 for N = 0).
  double weight(int i, int j) const {
    return tokens > 0 ? static_cast<double>(count(i, j)) / static_cast<double>(tokens) : 0.0;
  }
};

// One undirected edge i < j of a thresholded graph, with W_ij.
struct edge {
  int i = 0;
  int j = 0;
  double weight = 0.0;
};

// The co-activation graph of one layer: indices [N x S], -1 entries skipped.
// The experts of a token must be distinct (as every backend writes them);
// a repeated expert is an error.
inline coactivation_graph coactivation(const std::int32_t* indices, std::int64_t num_tokens, int slots_per_token,
                                       int num_experts) {
  detail::check_trace("coactivation", indices, num_tokens, slots_per_token, num_experts);
  coactivation_graph g;
  g.num_experts = num_experts;
  g.tokens = num_tokens;
  g.counts.assign(static_cast<std::size_t>(num_experts) * num_experts, 0);
  std::vector<std::int32_t> sel;
  for (std::int64_t t = 0; t < num_tokens; ++t) {
    sel.clear();
    for (int j = 0; j < slots_per_token; ++j) {
      const std::int32_t e = indices[t * slots_per_token + j];
      if (e < 0) continue;
      if (std::find(sel.begin(), sel.end(), e) != sel.end())
        detail::fail("coactivation", "token " + std::to_string(t) + " selects expert " + std::to_string(e) + " twice");
      sel.push_back(e);
    }
    for (std::size_t a = 0; a < sel.size(); ++a)
      for (std::size_t b = a + 1; b < sel.size(); ++b) {
        ++g.counts[static_cast<std::size_t>(sel[a]) * num_experts + sel[b]];
        ++g.counts[static_cast<std::size_t>(sel[b]) * num_experts + sel[a]];
      }
  }
  return g;
}

// The number of edges kept from m nonzero edges at fraction rho:
// ceil(rho * m), at least 1 when m > 0 (rho in (0, 1]).
inline std::int64_t kept_edge_count(std::int64_t nonzero_edges, double rho) {
  if (!(rho > 0.0 && rho <= 1.0)) detail::fail("threshold_edges", "rho (= " + std::to_string(rho) + ") must be in (0, 1]");
  if (nonzero_edges <= 0) return 0;
  // Guard the ceiling against a last-ulp overshoot (0.1 * 30 = 3.0000000000000004).
  const double x = rho * static_cast<double>(nonzero_edges);
  const double r = std::round(x);
  std::int64_t keep = std::fabs(x - r) <= 1e-9 * std::max(1.0, x) ? static_cast<std::int64_t>(r)
                                                                 : static_cast<std::int64_t>(std::ceil(x));
  if (keep < 1) keep = 1;
  return keep < nonzero_edges ? keep : nonzero_edges;
}

// Keeps the top rho fraction of the graph's nonzero edges (pairs i < j with
// W_ij > 0): sorted by (weight desc, i asc, j asc), the first
// kept_edge_count(m, rho) edges, returned in that order. Ties at the cut are
// thus broken by the lower (i, j); the comparison uses the exact integer
// counts, so it is the same on every machine.
inline std::vector<edge> threshold_edges(const coactivation_graph& g, double rho) {
  struct candidate {
    std::int64_t count;
    int i, j;
  };
  std::vector<candidate> all;
  for (int i = 0; i < g.num_experts; ++i)
    for (int j = i + 1; j < g.num_experts; ++j)
      if (g.count(i, j) > 0) all.push_back({g.count(i, j), i, j});
  const std::int64_t keep = kept_edge_count(static_cast<std::int64_t>(all.size()), rho);
  const auto before = [](const candidate& a, const candidate& b) {
    if (a.count != b.count) return a.count > b.count;
    if (a.i != b.i) return a.i < b.i;
    return a.j < b.j;
  };
  std::partial_sort(all.begin(), all.begin() + keep, all.end(), before);
  std::vector<edge> out(static_cast<std::size_t>(keep));
  for (std::int64_t k = 0; k < keep; ++k) out[k] = {all[k].i, all[k].j, g.weight(all[k].i, all[k].j)};
  return out;
}

}  // namespace moe_route::analysis
