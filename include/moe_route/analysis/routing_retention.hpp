// moe_route: the full routing-retention comparison of a post-trained router
// against its base router on the same probe tokens, per layer and as
// unweighted layer means (docs/policies.md section 6; RPB section 2, App. B-D,
// F.8-F.10). Needs igraph (target moe_route::analysis) through communities.hpp.
//
//   compare_routing(base, post, shape, options) -> retention_result
//
// base and post are index traces [L x N x K] (L = 1 for one layer), -1 =
// dropped. Per layer:
//   utilisation u_base, u_post; TVD; JSD (nats); top-k overlap;
//   co-activation graphs thresholded at rho, their kept edges and isolated
//   experts (no kept edge: a singleton community whatever the detector);
//   communities (Louvain or Leiden,
//   seeded, gamma = 1); Q_base, Q_post, Delta Q = Q_post - Q_base; community
//   NMI(base partition, post partition);
//   routing sharpness ||u - U||_1 and effective expert fraction of both;
//   the null model (null_model.hpp): `nulls` traces resampled from u_post
//   (N tokens, K experts each), thresholded and partitioned the same way;
//   null Q and null NMI (against the base partition) are averaged, the
//   margins are Q_post - mean null Q and NMI - mean null NMI, and the layer
//   "beats the null" when Q_post exceeds the Q of every resample;
//   with domain labels: per-domain utilisation of base and post, and for every
//   pair of domains the cross-domain divergence ||u_a - u_b||_1 and the
//   centroid cosine.
// Null resample r of layer l uses the seed splitmix64(seed ^ splitmix64(l *
// 2^32 + r)) for its trace; every detector call uses `seed` itself.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <moe_route/analysis/coactivation.hpp>
#include <moe_route/analysis/communities.hpp>
#include <moe_route/analysis/null_model.hpp>
#include <moe_route/analysis/retention.hpp>

namespace moe_route::analysis {

struct trace_shape {
  std::int64_t layers = 1;  // L >= 1
  std::int64_t tokens = 0;  // N >= 1, the same probe tokens in base and post
  int k = 1;                // K >= 1 slots per token
  int experts = 1;          // E >= 1
};

struct retention_options {
  double rho = 0.10;                 // retained edge fraction
  detector method = detector::louvain;
  std::uint64_t seed = 0;            // detector and null-model seed
  int nulls = 100;                   // null resamples per layer (0: no null model)
  double resolution = 1.0;           // gamma
  const std::int32_t* domains = nullptr;  // [N] optional domain label per token, -1 = none
  int num_domains = 0;
};

struct domain_pair {
  int a = 0, b = 0;
  double divergence_base = 0.0, divergence_post = 0.0;  // ||u_a - u_b||_1
  double cosine_base = 0.0, cosine_post = 0.0;          // centroid cosine
};

struct layer_retention {
  std::vector<double> utilisation_base, utilisation_post;
  double tvd = 0.0, jsd = 0.0, topk_overlap = 0.0;
  partition communities_base, communities_post;
  std::int64_t edges_base = 0, edges_post = 0;        // kept edges after thresholding
  std::int64_t isolated_base = 0, isolated_post = 0;  // experts without a kept edge
  double q_base = 0.0, q_post = 0.0, delta_q = 0.0, nmi = 0.0;
  double sharpness_base = 0.0, sharpness_post = 0.0;
  double effective_fraction_base = 0.0, effective_fraction_post = 0.0;
  // Null model (when nulls > 0).
  double null_q_mean = 0.0, null_nmi_mean = 0.0;
  double q_margin = 0.0, nmi_margin = 0.0;
  bool beats_null = false;
  std::vector<domain_pair> domain_pairs;
};

struct retention_means {  // unweighted means over layers
  double tvd = 0.0, jsd = 0.0, topk_overlap = 0.0, nmi = 0.0, q_base = 0.0, q_post = 0.0, delta_q = 0.0;
  double sharpness_base = 0.0, sharpness_post = 0.0, effective_fraction_base = 0.0, effective_fraction_post = 0.0;
  double edges_base = 0.0, edges_post = 0.0, isolated_base = 0.0, isolated_post = 0.0;
  double null_q_mean = 0.0, null_nmi_mean = 0.0, q_margin = 0.0, nmi_margin = 0.0;
  double beats_null_share = 0.0;  // share of layers that beat the null
  std::vector<domain_pair> domain_pairs;
};

struct retention_result {
  trace_shape shape;
  retention_options options;
  std::vector<layer_retention> layers;
  retention_means mean;
};

namespace detail {

inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace detail

// Experts that are an end of no edge.
inline std::int64_t isolated_experts(const std::vector<edge>& edges, int experts) {
  std::vector<char> linked(static_cast<std::size_t>(experts), 0);
  for (const edge& x : edges) linked[x.i] = linked[x.j] = 1;
  return static_cast<std::int64_t>(std::count(linked.begin(), linked.end(), 0));
}

inline std::uint64_t null_seed(std::uint64_t seed, std::int64_t layer, int resample) {
  return detail::splitmix64(seed ^ detail::splitmix64((static_cast<std::uint64_t>(layer) << 32) +
                                                      static_cast<std::uint64_t>(resample)));
}

inline retention_result compare_routing(const std::int32_t* base, const std::int32_t* post, const trace_shape& s,
                                        const retention_options& o = {}) {
  if (s.layers < 1 || s.tokens < 1 || s.k < 1 || s.experts < 1)
    detail::fail("compare_routing", "layers, tokens, k and experts must all be >= 1");
  if (s.k > s.experts) detail::fail("compare_routing", "k must be <= experts");
  if (o.nulls < 0) detail::fail("compare_routing", "nulls must be >= 0");
  if (o.domains != nullptr && o.num_domains < 1) detail::fail("compare_routing", "num_domains must be >= 1");
  const std::int64_t per_layer = s.tokens * s.k;
  detail::check_trace("compare_routing", base, s.tokens * s.layers, s.k, s.experts);
  detail::check_trace("compare_routing", post, s.tokens * s.layers, s.k, s.experts);

  retention_result res;
  res.shape = s;
  res.options = o;
  res.layers.resize(static_cast<std::size_t>(s.layers));
  for (std::int64_t l = 0; l < s.layers; ++l) {
    const std::int32_t* b = base + l * per_layer;
    const std::int32_t* p = post + l * per_layer;
    layer_retention& r = res.layers[l];
    r.utilisation_base = utilisation(b, s.tokens, s.k, s.experts);
    r.utilisation_post = utilisation(p, s.tokens, s.k, s.experts);
    r.tvd = total_variation(r.utilisation_base, r.utilisation_post);
    r.jsd = jensen_shannon(r.utilisation_base, r.utilisation_post);
    r.topk_overlap = topk_overlap(b, p, s.tokens, s.k);
    r.sharpness_base = routing_sharpness(r.utilisation_base);
    r.sharpness_post = routing_sharpness(r.utilisation_post);
    r.effective_fraction_base = effective_expert_fraction(r.utilisation_base);
    r.effective_fraction_post = effective_expert_fraction(r.utilisation_post);

    const std::vector<edge> eb = threshold_edges(coactivation(b, s.tokens, s.k, s.experts), o.rho);
    const std::vector<edge> ep = threshold_edges(coactivation(p, s.tokens, s.k, s.experts), o.rho);
    r.edges_base = static_cast<std::int64_t>(eb.size());
    r.edges_post = static_cast<std::int64_t>(ep.size());
    r.isolated_base = isolated_experts(eb, s.experts);
    r.isolated_post = isolated_experts(ep, s.experts);
    r.communities_base = detect_communities(s.experts, eb, o.method, o.seed, o.resolution);
    r.communities_post = detect_communities(s.experts, ep, o.method, o.seed, o.resolution);
    r.q_base = r.communities_base.modularity;
    r.q_post = r.communities_post.modularity;
    r.delta_q = r.q_post - r.q_base;
    r.nmi = community_nmi(r.communities_base.membership, r.communities_post.membership);

    if (o.nulls > 0) {
      double q_sum = 0.0, nmi_sum = 0.0, q_max = -1.0e300;
      for (int n = 0; n < o.nulls; ++n) {
        const std::vector<std::int32_t> t = null_model_trace(r.utilisation_post, s.tokens, s.k, null_seed(o.seed, l, n));
        const std::vector<edge> en = threshold_edges(coactivation(t.data(), s.tokens, s.k, s.experts), o.rho);
        const partition pn = detect_communities(s.experts, en, o.method, o.seed, o.resolution);
        q_sum += pn.modularity;
        q_max = pn.modularity > q_max ? pn.modularity : q_max;
        nmi_sum += community_nmi(r.communities_base.membership, pn.membership);
      }
      r.null_q_mean = q_sum / o.nulls;
      r.null_nmi_mean = nmi_sum / o.nulls;
      r.q_margin = r.q_post - r.null_q_mean;
      r.nmi_margin = r.nmi - r.null_nmi_mean;
      r.beats_null = r.q_post > q_max;
    }

    if (o.domains != nullptr) {
      const auto ub = domain_utilisation(b, s.tokens, s.k, s.experts, o.domains, o.num_domains);
      const auto up = domain_utilisation(p, s.tokens, s.k, s.experts, o.domains, o.num_domains);
      for (int a = 0; a < o.num_domains; ++a)
        for (int c = a + 1; c < o.num_domains; ++c)
          r.domain_pairs.push_back({a, c, cross_domain_divergence(ub[a], ub[c]), cross_domain_divergence(up[a], up[c]),
                                    centroid_cosine(ub[a], ub[c]), centroid_cosine(up[a], up[c])});
    }
  }

  // Unweighted layer means.
  retention_means& m = res.mean;
  const double inv = 1.0 / static_cast<double>(s.layers);
  m.domain_pairs = res.layers[0].domain_pairs;
  for (auto& d : m.domain_pairs) d.divergence_base = d.divergence_post = d.cosine_base = d.cosine_post = 0.0;
  for (const layer_retention& r : res.layers) {
    m.tvd += r.tvd * inv;
    m.jsd += r.jsd * inv;
    m.topk_overlap += r.topk_overlap * inv;
    m.nmi += r.nmi * inv;
    m.q_base += r.q_base * inv;
    m.q_post += r.q_post * inv;
    m.delta_q += r.delta_q * inv;
    m.sharpness_base += r.sharpness_base * inv;
    m.sharpness_post += r.sharpness_post * inv;
    m.effective_fraction_base += r.effective_fraction_base * inv;
    m.effective_fraction_post += r.effective_fraction_post * inv;
    m.edges_base += static_cast<double>(r.edges_base) * inv;
    m.edges_post += static_cast<double>(r.edges_post) * inv;
    m.isolated_base += static_cast<double>(r.isolated_base) * inv;
    m.isolated_post += static_cast<double>(r.isolated_post) * inv;
    m.null_q_mean += r.null_q_mean * inv;
    m.null_nmi_mean += r.null_nmi_mean * inv;
    m.q_margin += r.q_margin * inv;
    m.nmi_margin += r.nmi_margin * inv;
    m.beats_null_share += (r.beats_null ? 1.0 : 0.0) * inv;
    for (std::size_t i = 0; i < m.domain_pairs.size(); ++i) {
      m.domain_pairs[i].divergence_base += r.domain_pairs[i].divergence_base * inv;
      m.domain_pairs[i].divergence_post += r.domain_pairs[i].divergence_post * inv;
      m.domain_pairs[i].cosine_base += r.domain_pairs[i].cosine_base * inv;
      m.domain_pairs[i].cosine_post += r.domain_pairs[i].cosine_post * inv;
    }
  }
  return res;
}

}  // namespace moe_route::analysis
