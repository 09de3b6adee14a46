// moe_lm: what the driver measures on routing traces (no LibTorch here):
// retention of a post-trained router against its base (the library's
// analysis::compare_routing, igraph), the base communities the shuffled-prior
// controls permute within, and the workload of executed assignments.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config.hpp"

namespace moe_lm {

// Routing indices of every MoE layer on the same probe tokens.
struct routing_trace {
  std::int64_t layers = 0, tokens = 0;
  int k = 0, experts = 0;
  std::vector<std::int32_t> indices;  // [L x N x K], -1 = dropped
  std::vector<std::int32_t> domains;  // [N]
  std::vector<std::int32_t> spans;    // [N] 0: BOS and prompt (Q), 1: SEP and answer (A)
};

// TVD, JSD, top-k overlap, community NMI, Q and Delta Q per layer and as layer
// means (the RPB Table 15 columns), from moe_route::analysis::compare_routing,
// with the graphs' kept edges and isolated experts, the base and post routing
// sharpness, and the null model's means and margins (RPB Table 9). Under
// "sweep": NMI, Delta Q, kept edges and isolated experts at every detector
// seed of {0, 1, 2, 42}, rho of {0.05, 0.1, 0.2} and both detectors (no null
// model), so a difference between methods can be set against the spread the
// diagnostic's own settings cause.
nlohmann::json retention(const routing_trace& base, const routing_trace& post, const retention_settings& s);

// How a router's routing is structured on a probe that mixes domains (RPB
// Tables 11 and 12): over the layer-averaged top-k activation frequency p,
// the sharpness ||p - U||_1 and effective expert fraction on all tokens and on
// each domain's, and for every pair of domains the divergence ||p_a - p_b||_1
// and the centroid cosine, on all tokens and on the prompt (Q) and answer (A)
// spans alone.
nlohmann::json routing_structure(const routing_trace& t, const std::vector<std::string>& domain_names);

// prior::validate_shuffle of each layer's shuffled table against the original
// (RPB Table 13: top-k overlap, change rate, 90th percentile of |beta delta b|,
// upper-clamp fraction), per layer and as layer means.
nlohmann::json shuffle_validation(const std::vector<std::vector<float>>& pi,
                                  const std::vector<std::vector<float>>& shuffled, int experts, int k, float beta);

// The base router's communities of each layer (labels per expert).
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
