#include "analysis.hpp"

#include <algorithm>
#include <stdexcept>

#include <moe_route/analysis/routing_retention.hpp>
#include <moe_route/analysis/workload.hpp>
#include <moe_route/prior/shuffle.hpp>
#include <moe_route/prior/shuffle_validation.hpp>

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

an::detector method_of(community_detector d) {
  return d == community_detector::louvain ? an::detector::louvain : an::detector::leiden;
}

an::retention_options options_of(const retention_settings& s, int nulls) {
  an::retention_options o;
  o.rho = s.rho;
  o.seed = s.seed;
  o.nulls = nulls;
  o.method = method_of(s.detector);
  return o;
}

// The layer-averaged top-k activation frequency of the tokens `keep` admits.
template <class Keep>
std::vector<double> layer_averaged(const routing_trace& t, Keep keep) {
  std::vector<double> p(static_cast<std::size_t>(t.experts), 0.0);
  for (std::int64_t l = 0; l < t.layers; ++l) {
    std::vector<std::int32_t> kept;
    for (std::int64_t i = 0; i < t.tokens; ++i)
      if (keep(i)) {
        const auto* row = t.indices.data() + (l * t.tokens + i) * t.k;
        kept.insert(kept.end(), row, row + t.k);
      }
    if (kept.empty()) return {};
    const std::vector<double> u = an::utilisation(kept.data(), static_cast<std::int64_t>(kept.size()) / t.k, t.k,
                                                  t.experts);
    for (std::size_t e = 0; e < p.size(); ++e) p[e] += u[e] / static_cast<double>(t.layers);
  }
  return p;
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
                      {"edges_base", l.edges_base},
                      {"edges_post", l.edges_post},
                      {"isolated_base", l.isolated_base},
                      {"isolated_post", l.isolated_post},
                      {"communities_base", l.communities_base.membership},
                      {"communities_post", l.communities_post.membership},
                      {"null_q_mean", l.null_q_mean},
                      {"null_nmi_mean", l.null_nmi_mean},
                      {"nmi_margin", l.nmi_margin},
                      {"q_margin", l.q_margin},
                      {"beats_null", l.beats_null},
                      {"sharpness_base", l.sharpness_base},
                      {"sharpness_post", l.sharpness_post},
                      {"utilisation_base", l.utilisation_base},
                      {"utilisation_post", l.utilisation_post}});
  nlohmann::json sweep = nlohmann::json::array();
  for (community_detector d : {community_detector::louvain, community_detector::leiden})
    for (double rho : {0.05, 0.10, 0.20})
      for (std::uint64_t seed : {0, 1, 2, 42}) {
        const retention_settings at{rho, 0, seed, d};
        const an::retention_means m =
            an::compare_routing(base.indices.data(), post.indices.data(), shape_of(base), options_of(at, 0)).mean;
        sweep.push_back({{"detector", detector_name(d)}, {"rho", rho}, {"seed", seed}, {"nmi", m.nmi},
                         {"delta_q", m.delta_q}, {"q_post", m.q_post}, {"edges_base", m.edges_base},
                         {"isolated_base", m.isolated_base}, {"isolated_post", m.isolated_post}});
      }
  const auto& m = r.mean;
  return {{"rho", s.rho},
          {"nulls", s.nulls},
          {"seed", s.seed},
          {"detector", detector_name(s.detector)},
          {"tvd", m.tvd},
          {"jsd", m.jsd},
          {"topk_overlap", m.topk_overlap},
          {"nmi", m.nmi},
          {"q_base", m.q_base},
          {"q_post", m.q_post},
          {"delta_q", m.delta_q},
          {"edges_base", m.edges_base},
          {"edges_post", m.edges_post},
          {"isolated_base", m.isolated_base},
          {"isolated_post", m.isolated_post},
          {"null_q_mean", m.null_q_mean},
          {"null_nmi_mean", m.null_nmi_mean},
          {"nmi_margin", m.nmi_margin},
          {"q_margin", m.q_margin},
          {"beats_null_share", m.beats_null_share},
          {"sharpness_base", m.sharpness_base},
          {"sharpness_post", m.sharpness_post},
          {"sweep", sweep},
          {"layers", layers}};
}

nlohmann::json routing_structure(const routing_trace& t, const std::vector<std::string>& domain_names) {
  if (t.tokens < 1) throw std::invalid_argument("routing_structure: an empty probe");
  const auto summary = [&](const std::vector<double>& p) -> nlohmann::json {
    if (p.empty()) return nullptr;
    return {{"sharpness", an::routing_sharpness(p)}, {"effective_fraction", an::effective_expert_fraction(p)}};
  };
  nlohmann::json out = summary(layer_averaged(t, [](std::int64_t) { return true; }));
  const int domains = static_cast<int>(domain_names.size());
  // p per domain on all tokens, Q spans and A spans.
  std::vector<std::vector<std::vector<double>>> per(3);
  nlohmann::json by_domain = nlohmann::json::object();
  for (int d = 0; d < domains; ++d) {
    per[0].push_back(layer_averaged(t, [&](std::int64_t i) { return t.domains[i] == d; }));
    for (int span = 0; span < 2; ++span)
      per[1 + span].push_back(
          layer_averaged(t, [&](std::int64_t i) { return t.domains[i] == d && t.spans[i] == span; }));
    by_domain[domain_names[d]] = summary(per[0][d]);
  }
  out["domains"] = by_domain;
  nlohmann::json pairs = nlohmann::json::array();
  for (int a = 0; a < domains; ++a)
    for (int b = a + 1; b < domains; ++b) {
      if (per[0][a].empty() || per[0][b].empty()) continue;
      nlohmann::json pair = {{"a", domain_names[a]},
                             {"b", domain_names[b]},
                             {"divergence", an::cross_domain_divergence(per[0][a], per[0][b])},
                             {"cosine", an::centroid_cosine(per[0][a], per[0][b])}};
      for (int span = 0; span < 2; ++span) {
        const auto& pa = per[1 + span][a];
        const auto& pb = per[1 + span][b];
        pair[span == 0 ? "cosine_q" : "cosine_a"] =
            pa.empty() || pb.empty() ? nlohmann::json(nullptr) : nlohmann::json(an::centroid_cosine(pa, pb));
      }
      pairs.push_back(pair);
    }
  out["domain_pairs"] = pairs;
  return out;
}

nlohmann::json shuffle_validation(const std::vector<std::vector<float>>& pi,
                                  const std::vector<std::vector<float>>& shuffled, int experts, int k, float beta) {
  if (pi.size() != shuffled.size()) throw std::invalid_argument("shuffle_validation: one shuffled table per layer");
  nlohmann::json layers = nlohmann::json::array();
  double overlap = 0.0, p90 = 0.0, clamp = 0.0;
  for (std::size_t l = 0; l < pi.size(); ++l) {
    const auto v = moe_route::prior::validate_shuffle(pi[l].data(), shuffled[l].data(),
                                                      static_cast<std::int64_t>(pi[l].size()) / experts, experts, k,
                                                      beta);
    layers.push_back({{"topk_overlap", v.topk_overlap}, {"change_rate", v.change_rate},
                      {"p90_abs_bias_change", v.p90_abs_bias_change}, {"upper_clamp_fraction", v.upper_clamp_fraction}});
    overlap += v.topk_overlap;
    p90 += v.p90_abs_bias_change;
    clamp += v.upper_clamp_fraction;
  }
  const double n = static_cast<double>(std::max<std::size_t>(pi.size(), 1));
  return {{"topk_overlap", overlap / n}, {"change_rate", 1.0 - overlap / n}, {"p90_abs_bias_change", p90 / n},
          {"upper_clamp_fraction", clamp / n}, {"beta", beta}, {"layers", layers}};
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
