#include "analysis.hpp"

#include <algorithm>
#include <stdexcept>

#include <moe_route/analysis/routing_retention.hpp>
#include <moe_route/analysis/workload.hpp>
#include <moe_route/prior/shuffle.hpp>

namespace moe_lm {

namespace {

namespace an = moe_route::analysis;

an::trace_shape shape_of(const routing_trace& t) {
  an::trace_shape s;
  s.layers = t.layers;
  s.tokens = t.tokens;
  s.k = t.k;
  s.experts = t.experts;
  return s;
}

an::retention_options options_of(const retention_settings& s, int nulls) {
  an::retention_options o;
  o.rho = s.rho;
  o.seed = s.seed;
  o.nulls = nulls;
  return o;
}

}  // namespace

nlohmann::json retention(const routing_trace& base, const routing_trace& post, const retention_settings& s) {
  if (base.layers != post.layers || base.tokens != post.tokens || base.k != post.k || base.experts != post.experts)
    throw std::invalid_argument("retention: base and post traces must cover the same probe tokens and shapes");
  an::retention_options o = options_of(s, s.nulls);
  // Cross-domain statistics only when the probe mixes domains.
  int domains = 0;
  bool mixed = false;
  for (std::int32_t d : base.domains) {
    domains = std::max(domains, d + 1);
    mixed = mixed || d != base.domains.front();
  }
  if (mixed) {
    o.domains = base.domains.data();
    o.num_domains = domains;
  }
  const an::retention_result r = an::compare_routing(base.indices.data(), post.indices.data(), shape_of(base), o);
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& l : r.layers)
    layers.push_back({{"tvd", l.tvd},
                      {"jsd", l.jsd},
                      {"topk_overlap", l.topk_overlap},
                      {"nmi", l.nmi},
                      {"q_base", l.q_base},
                      {"q_post", l.q_post},
                      {"delta_q", l.delta_q},
                      {"communities_base", l.communities_base.membership},
                      {"communities_post", l.communities_post.membership},
                      {"nmi_margin", l.nmi_margin},
                      {"q_margin", l.q_margin},
                      {"utilisation_base", l.utilisation_base},
                      {"utilisation_post", l.utilisation_post}});
  const auto& m = r.mean;
  return {{"rho", s.rho},
          {"nulls", s.nulls},
          {"seed", s.seed},
          {"tvd", m.tvd},
          {"jsd", m.jsd},
          {"topk_overlap", m.topk_overlap},
          {"nmi", m.nmi},
          {"q_base", m.q_base},
          {"q_post", m.q_post},
          {"delta_q", m.delta_q},
          {"nmi_margin", m.nmi_margin},
          {"q_margin", m.q_margin},
          {"sharpness_base", m.sharpness_base},
          {"sharpness_post", m.sharpness_post},
          {"layers", layers}};
}

std::vector<std::vector<int>> communities(const routing_trace& base, const retention_settings& s) {
  const an::retention_result r = an::compare_routing(base.indices.data(), base.indices.data(), shape_of(base),
                                                     options_of(s, 0));
  std::vector<std::vector<int>> out;
  for (const auto& l : r.layers) out.push_back(l.communities_base.membership);
  return out;
}

void shuffle_prior(std::vector<std::vector<float>>& pi, int experts, const std::vector<std::vector<int>>* communities,
                   std::uint64_t seed) {
  if (communities && communities->size() != pi.size())
    throw std::invalid_argument("shuffle_prior: one community vector per layer");
  for (std::size_t l = 0; l < pi.size(); ++l) {
    const std::uint64_t layer_seed = an::detail::splitmix64(seed ^ an::detail::splitmix64(l));
    const std::vector<int> sigma =
        communities ? moe_route::prior::within_community_permutation((*communities)[l].data(), experts, layer_seed)
                    : moe_route::prior::global_permutation(experts, layer_seed);
    std::vector<float> shuffled(pi[l].size());
    moe_route::prior::apply_permutation(pi[l].data(), static_cast<std::int64_t>(pi[l].size()) / experts, experts,
                                        sigma, shuffled.data());
    pi[l] = std::move(shuffled);
  }
}

nlohmann::json workload(const std::vector<std::int32_t>& indices, std::int64_t tokens, int k, int experts) {
  const an::workload_stats w = an::workload(indices.data(), tokens, k, experts);
  return {{"loads", w.loads},
          {"top1_share", w.top1_share},
          {"peak_to_mean", w.peak_to_mean},
          {"dropped_rate", w.dropped_rate},
          {"normalized_load_entropy", w.normalized_load_entropy},
          {"experts_per_token", w.experts_per_token}};
}

}  // namespace moe_lm
