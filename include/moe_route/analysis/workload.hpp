// moe_route: workload statistics of a routing result (docs/policies.md section 6,
// last bullet; CIPHER App. A.1, Figure 7). Host only, no dependencies.
//
//   analysis::workload(indices, N, S, E) -> workload_stats
//
// indices [N x S]: route's (S = K), admit's (S = K, -1 = dropped) or
// expert_choice's (S = E, -1 = unused) output. Every entry >= 0 is one
// executed assignment; the entries of a token are assumed distinct (as every
// backend writes them).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <moe_route/config.hpp>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/types.hpp>

namespace moe_route::analysis {

struct workload_stats {
  std::int64_t tokens = 0;                   // N
  std::int64_t slots = 0;                    // N * S offered slots
  std::int64_t executed = 0;                 // executed assignments = sum of loads
  std::int64_t dropped = 0;                  // slots - executed
  double dropped_rate = 0.0;                 // dropped / slots (0 if no slots)
  std::vector<std::int64_t> loads;           // [E] assignments per expert
  std::int64_t max_load = 0;
  double top1_share = 0.0;                   // max_e load_e / sum load (0 if nothing executed)
  double peak_to_mean = 0.0;                 // max_e load_e / (sum load / E) (0 if nothing executed)
  double load_entropy = 0.0;                 // -sum_e u_e log u_e, u = load / sum load (nats)
  double normalized_load_entropy = 0.0;      // load_entropy / log E (0 for E = 1)
  double experts_per_token = 0.0;            // mean activated experts per token = executed / N
  std::vector<std::int64_t> experts_per_token_histogram;  // [S + 1]: tokens with c activated experts
  std::int64_t tokens_without_experts = 0;   // histogram[0]
};

// Statistics of indices [num_tokens x slots_per_token] over num_experts
// experts. Throws moe_route::error for an entry outside [-1, E) or bad shapes.
inline workload_stats workload(const std::int32_t* indices, std::int64_t num_tokens, int slots_per_token,
                               int num_experts) {
  if (num_tokens < 0) throw error("moe_route: workload: num_tokens (= " + std::to_string(num_tokens) + ") must be >= 0");
  if (slots_per_token < 1)
    throw error("moe_route: workload: slots_per_token (= " + std::to_string(slots_per_token) + ") must be >= 1");
  if (num_experts < 1)
    throw error("moe_route: workload: num_experts (= " + std::to_string(num_experts) + ") must be >= 1");
  if (num_tokens > 0 && indices == nullptr) throw error("moe_route: workload: indices is null");
  workload_stats w;
  w.tokens = num_tokens;
  w.slots = num_tokens * slots_per_token;
  w.loads.assign(static_cast<std::size_t>(num_experts), 0);
  w.experts_per_token_histogram.assign(static_cast<std::size_t>(slots_per_token) + 1, 0);
  for (std::int64_t t = 0; t < num_tokens; ++t) {
    int active = 0;
    for (int j = 0; j < slots_per_token; ++j) {
      const std::int32_t e = indices[t * slots_per_token + j];
      if (e < -1 || e >= num_experts)
        throw error("moe_route: workload: indices[" + std::to_string(t * slots_per_token + j) + "] (= " +
                    std::to_string(e) + ") must be -1 or an expert in [0, num_experts)");
      if (e >= 0) {
        ++w.loads[e];
        ++active;
      }
    }
    ++w.experts_per_token_histogram[active];
    w.executed += active;
  }
  w.dropped = w.slots - w.executed;
  w.dropped_rate = w.slots > 0 ? static_cast<double>(w.dropped) / static_cast<double>(w.slots) : 0.0;
  w.tokens_without_experts = w.experts_per_token_histogram[0];
  w.experts_per_token = num_tokens > 0 ? static_cast<double>(w.executed) / static_cast<double>(num_tokens) : 0.0;
  w.max_load = *std::max_element(w.loads.begin(), w.loads.end());
  if (w.executed > 0) {
    const double total = static_cast<double>(w.executed);
    w.top1_share = static_cast<double>(w.max_load) / total;
    w.peak_to_mean = static_cast<double>(w.max_load) * num_experts / total;
    double h = 0.0;
    for (std::int64_t l : w.loads)
      if (l > 0) {
        const double u = static_cast<double>(l) / total;
        h = moe_route::detail::fma(-u, std::log(u), h);  // explicit: the same bits whether or not a*b+c contracts
      }
    w.load_entropy = h;
    w.normalized_load_entropy = num_experts > 1 ? h / std::log(static_cast<double>(num_experts)) : 0.0;
  }
  return w;
}

}  // namespace moe_route::analysis
