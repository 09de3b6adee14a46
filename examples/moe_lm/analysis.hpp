// moe_lm: what the driver measures on routing traces (no LibTorch here):
// retention of a post-trained router against its base (the library's
// analysis::compare_routing, igraph), the base communities the shuffled-prior
// controls permute within, and the workload of executed assignments.
#pragma once

#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

namespace moe_lm {

// Routing indices of every MoE layer on the same probe tokens.
struct routing_trace {
  std::int64_t layers = 0, tokens = 0;
  int k = 0, experts = 0;
  std::vector<std::int32_t> indices;  // [L x N x K], -1 = dropped
  std::vector<std::int32_t> domains;  // [N]
};

struct retention_settings {
  double rho = 0.10;  // kept edge fraction of the co-activation graph
  int nulls = 20;     // null-model resamples per layer
  std::uint64_t seed = 0;
};

// TVD, JSD, top-k overlap, community NMI, Q and Delta Q per layer and as layer
// means (the RPB Table 15 columns), from moe_route::analysis::compare_routing.
nlohmann::json retention(const routing_trace& base, const routing_trace& post, const retention_settings& s);

// The base router's Louvain communities of each layer (labels per expert).
std::vector<std::vector<int>> communities(const routing_trace& base, const retention_settings& s);

// Permutes the expert axis of each layer's prior table [S x E] in place:
// inside communities[l] (within-community shuffle) or, with no communities,
// over all experts (global shuffle). Seeded (prior::*_permutation).
void shuffle_prior(std::vector<std::vector<float>>& pi, int experts, const std::vector<std::vector<int>>* communities,
                   std::uint64_t seed);

// analysis::workload of executed indices [N x K] of one layer: loads, top-1
// share, peak-to-mean, dropped rate.
nlohmann::json workload(const std::vector<std::int32_t>& indices, std::int64_t tokens, int k, int experts);

}  // namespace moe_lm
