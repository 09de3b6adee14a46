// moe_route::analysis against independent references written here, on small
// hand-built cases (docs/policies.md section 6).
#include <doctest/doctest.h>

#include <moe_route/analysis/routing_retention.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <vector>

namespace an = moe_route::analysis;

namespace {

// Reference JSD as H(m) - (H(p) + H(q)) / 2, natural log.
double ref_entropy(const std::vector<double>& p) {
  double h = 0.0;
  for (double x : p)
    if (x > 0) h -= x * std::log(x);
  return h;
}
double ref_jsd(const std::vector<double>& p, const std::vector<double>& q) {
  std::vector<double> m(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) m[i] = 0.5 * (p[i] + q[i]);
  return ref_entropy(m) - 0.5 * (ref_entropy(p) + ref_entropy(q));
}

// Reference NMI from the contingency table: 2 I / (H(a) + H(b)).
double ref_nmi(const std::vector<int>& a, const std::vector<int>& b) {
  const double n = static_cast<double>(a.size());
  std::map<int, double> pa, pb;
  std::map<std::pair<int, int>, double> pab;
  for (std::size_t i = 0; i < a.size(); ++i) {
    pa[a[i]] += 1 / n;
    pb[b[i]] += 1 / n;
    pab[{a[i], b[i]}] += 1 / n;
  }
  double ha = 0, hb = 0, mi = 0;
  for (auto& [k, v] : pa) ha -= v * std::log(v);
  for (auto& [k, v] : pb) hb -= v * std::log(v);
  for (auto& [k, v] : pab) mi += v * std::log(v / (pa[k.first] * pb[k.second]));
  if (ha + hb == 0) return 1.0;
  return 2 * mi / (ha + hb);
}

// Reference weighted modularity from the dense adjacency matrix:
// Q = 1/(2m) sum_ij [A_ij - k_i k_j / (2m)] delta(c_i, c_j).
double ref_modularity(int n, const std::vector<an::edge>& edges, const std::vector<int>& c) {
  std::vector<double> a(static_cast<std::size_t>(n) * n, 0.0), k(n, 0.0);
  double two_m = 0;
  for (const auto& e : edges) {
    a[e.i * n + e.j] += e.weight;
    a[e.j * n + e.i] += e.weight;
    k[e.i] += e.weight;
    k[e.j] += e.weight;
    two_m += 2 * e.weight;
  }
  double q = 0;
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j)
      if (c[i] == c[j]) q += a[i * n + j] - k[i] * k[j] / two_m;
  return q / two_m;
}

// Two disjoint cliques of size s (experts 0..s-1 and s..2s-1), unit weights.
std::vector<an::edge> two_cliques(int s) {
  std::vector<an::edge> e;
  for (int c = 0; c < 2; ++c)
    for (int i = 0; i < s; ++i)
      for (int j = i + 1; j < s; ++j) e.push_back({c * s + i, c * s + j, 1.0});
  return e;
}

// A trace [N x K] whose tokens pick K experts inside one of `groups` blocks of
// E / groups experts: clear community structure.
std::vector<std::int32_t> block_trace(std::int64_t n, int k, int e, int groups, unsigned seed) {
  std::mt19937 gen(seed);
  const int size = e / groups;
  std::vector<std::int32_t> t(static_cast<std::size_t>(n) * k);
  for (std::int64_t i = 0; i < n; ++i) {
    const int g = static_cast<int>(gen() % groups);
    std::vector<int> members(size);
    for (int j = 0; j < size; ++j) members[j] = g * size + j;
    for (int j = 0; j < k; ++j) {
      const int pick = j + static_cast<int>(gen() % (size - j));
      std::swap(members[j], members[pick]);
      t[i * k + j] = members[j];
    }
  }
  return t;
}

}  // namespace

TEST_CASE("utilisation, TVD and JSD on hand-built traces") {
  // 3 tokens, K = 2, E = 3; base uses {0,1} x3, post uses {1,2} x3.
  const std::vector<std::int32_t> base{0, 1, 1, 0, 0, 1}, post{1, 2, 2, 1, 1, 2};
  const auto u = an::utilisation(base.data(), 3, 2, 3), v = an::utilisation(post.data(), 3, 2, 3);
  CHECK(u == std::vector<double>{0.5, 0.5, 0.0});
  CHECK(v == std::vector<double>{0.0, 0.5, 0.5});
  CHECK(an::total_variation(u, v) == doctest::Approx(0.5));
  CHECK(an::jensen_shannon(u, v) == doctest::Approx(0.5 * std::log(2.0)));
  CHECK(an::jensen_shannon(u, u) == 0.0);
  // Disjoint supports reach the bound ln 2.
  CHECK(an::jensen_shannon({1, 0}, {0, 1}) == doctest::Approx(std::log(2.0)));
  // Dropped slots (-1) are not selections.
  const std::vector<std::int32_t> dropped{0, -1, -1, -1};
  CHECK(an::utilisation(dropped.data(), 2, 2, 2) == std::vector<double>{1.0, 0.0});
  CHECK_THROWS_AS(an::utilisation(std::vector<std::int32_t>{3}.data(), 1, 1, 3), moe_route::error);
}

TEST_CASE("JSD bounds and agreement with H(m) - mean H on random distributions") {
  std::mt19937 gen(7);
  std::uniform_real_distribution<double> d(0.0, 1.0);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<double> p(9), q(9);
    double sp = 0, sq = 0;
    for (int i = 0; i < 9; ++i) {
      p[i] = (i % 3 == trial % 3) ? 0.0 : d(gen);
      q[i] = d(gen);
      sp += p[i];
      sq += q[i];
    }
    for (int i = 0; i < 9; ++i) p[i] /= sp, q[i] /= sq;
    const double j = an::jensen_shannon(p, q);
    CHECK(j >= 0.0);
    CHECK(j <= std::log(2.0) + 1e-15);
    CHECK(j == doctest::Approx(ref_jsd(p, q)).epsilon(1e-12));
    CHECK(an::total_variation(p, q) == doctest::Approx(0.5 * an::l1_distance(p, q)));
  }
}

TEST_CASE("top-k overlap") {
  const std::vector<std::int32_t> a{0, 1, 2, 3, 4, 5}, b{1, 0, 2, 4, -1, -1};
  CHECK(an::topk_overlap(a.data(), a.data(), 3, 2) == 1.0);
  // tokens: {0,1} vs {1,0} = 1; {2,3} vs {2,4} = 1/2; {4,5} vs {} = 0.
  CHECK(an::topk_overlap(a.data(), b.data(), 3, 2) == doctest::Approx(0.5));
  // A dropped slot matches nothing, not even another dropped slot.
  const std::vector<std::int32_t> c{0, -1}, d{0, -1};
  CHECK(an::topk_overlap(c.data(), d.data(), 1, 2) == doctest::Approx(0.5));
}

TEST_CASE("sharpness, effective expert fraction, cross-domain divergence, centroid cosine") {
  CHECK(an::routing_sharpness({0.25, 0.25, 0.25, 0.25}) == 0.0);
  CHECK(an::routing_sharpness({1, 0, 0, 0}) == doctest::Approx(1.5));
  CHECK(an::effective_expert_fraction({0.25, 0.25, 0.25, 0.25}) == doctest::Approx(1.0));
  CHECK(an::effective_expert_fraction({0.5, 0.5, 0, 0}) == doctest::Approx(0.5));
  CHECK(an::cross_domain_divergence({0.5, 0.5, 0}, {0, 0.5, 0.5}) == doctest::Approx(1.0));
  CHECK(an::centroid_cosine({1, 0}, {0, 1}) == 0.0);
  CHECK(an::centroid_cosine({1, 1}, {2, 2}) == doctest::Approx(1.0));
  CHECK(an::centroid_cosine({1, 2, 0}, {2, 1, 2}) == doctest::Approx(4.0 / (std::sqrt(5.0) * 3.0)));
  const std::vector<float> probs{0.5f, 0.5f, 1.0f, 0.0f};
  CHECK(an::mean_distribution(probs.data(), 2, 2) == std::vector<double>{0.75, 0.25});
  // Per-domain utilisation: token 0 in domain 0, token 1 in domain 1, token 2 left out.
  const std::vector<std::int32_t> idx{0, 1, 2, 3, 0, 3}, dom{0, 1, -1};
  const auto du = an::domain_utilisation(idx.data(), 3, 2, 4, dom.data(), 2);
  CHECK(du[0] == std::vector<double>{0.5, 0.5, 0, 0});
  CHECK(du[1] == std::vector<double>{0, 0, 0.5, 0.5});
}

TEST_CASE("co-activation graph matches a brute-force count") {
  const int e = 6, k = 3;
  const std::int64_t n = 50;
  const auto t = block_trace(n, k, e, 2, 3);
  const an::coactivation_graph g = an::coactivation(t.data(), n, k, e);
  for (int i = 0; i < e; ++i)
    for (int j = 0; j < e; ++j) {
      int c = 0;
      if (i != j)
        for (std::int64_t s = 0; s < n; ++s) {
          const auto* row = t.data() + s * k;
          c += (std::count(row, row + k, i) > 0 && std::count(row, row + k, j) > 0);
        }
      CHECK(g.count(i, j) == c);
      CHECK(g.weight(i, j) == doctest::Approx(c / 50.0));
    }
  const std::vector<std::int32_t> twice{1, 1};
  CHECK_THROWS_AS(an::coactivation(twice.data(), 1, 2, 3), moe_route::error);
}

TEST_CASE("edge-fraction thresholding keeps the top rho fraction, ties by (weight desc, i, j)") {
  // K = 2 tokens, one pair each: (0,1) x3, (2,3) x2, (0,2) x2, (1,3) x2, (0,3) x1 -> 5 nonzero edges.
  std::vector<std::int32_t> t;
  auto add = [&](int a, int b, int times) {
    for (int i = 0; i < times; ++i) t.insert(t.end(), {a, b});
  };
  add(0, 1, 3);
  add(3, 2, 2);
  add(2, 0, 2);
  add(1, 3, 2);
  add(0, 3, 1);
  const auto g = an::coactivation(t.data(), static_cast<std::int64_t>(t.size() / 2), 2, 4);
  auto pairs = [](const std::vector<an::edge>& es) {
    std::vector<std::pair<int, int>> p;
    for (const auto& e : es) p.emplace_back(e.i, e.j);
    return p;
  };
  using P = std::vector<std::pair<int, int>>;
  CHECK(pairs(an::threshold_edges(g, 0.4)) == P{{0, 1}, {0, 2}});
  CHECK(pairs(an::threshold_edges(g, 0.6)) == P{{0, 1}, {0, 2}, {1, 3}});
  CHECK(pairs(an::threshold_edges(g, 0.1)) == P{{0, 1}});  // ceil(0.5) = 1
  CHECK(pairs(an::threshold_edges(g, 1.0)) == P{{0, 1}, {0, 2}, {1, 3}, {2, 3}, {0, 3}});
  CHECK(an::threshold_edges(g, 0.4)[0].weight == doctest::Approx(3.0 / 10.0));
  CHECK(an::kept_edge_count(30, 0.1) == 3);  // 0.1 * 30 is 3.0000000000000004 in double
  CHECK_THROWS_AS(an::threshold_edges(g, 0.0), moe_route::error);
  CHECK_THROWS_AS(an::threshold_edges(g, 1.5), moe_route::error);
}

TEST_CASE("modularity of two disjoint cliques, and against a dense reference") {
  const auto edges = two_cliques(4);
  std::vector<int> truth{0, 0, 0, 0, 1, 1, 1, 1};
  CHECK(an::modularity(8, edges, truth) == doctest::Approx(0.5));
  CHECK(an::modularity(8, edges, std::vector<int>(8, 0)) == doctest::Approx(0.0));
  for (auto d : {an::detector::louvain, an::detector::leiden}) {
    CAPTURE(an::detector_name(d));
    const an::partition p = an::detect_communities(8, edges, d, 0);
    CHECK(p.communities == 2);
    CHECK(p.membership == truth);
    CHECK(p.modularity == doctest::Approx(0.5));
  }
  // Random weighted graphs and random partitions: igraph's Q equals the dense formula.
  std::mt19937 gen(11);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<an::edge> es;
    for (int i = 0; i < 10; ++i)
      for (int j = i + 1; j < 10; ++j)
        if (gen() % 3 == 0) es.push_back({i, j, 0.1 + (gen() % 100) / 50.0});
    if (es.empty()) continue;
    std::vector<int> c(10);
    for (int& x : c) x = static_cast<int>(gen() % 3);
    CHECK(an::modularity(10, es, c) == doctest::Approx(ref_modularity(10, es, c)).epsilon(1e-12));
    const an::partition p = an::detect_communities(10, es, an::detector::louvain, 1);
    CHECK(p.modularity == doctest::Approx(ref_modularity(10, es, p.membership)).epsilon(1e-12));
      CHECK(p.modularity >= ref_modularity(10, es, c) - 1e-12);
  }
  // An edgeless graph: every expert alone, Q = 0.
  const an::partition lone = an::detect_communities(3, {}, an::detector::louvain, 0);
  CHECK(lone.membership == std::vector<int>{0, 1, 2});
  CHECK(lone.modularity == 0.0);
}

TEST_CASE("community NMI: identical partitions give 1, independent ones about 0") {
  const std::vector<int> a{0, 0, 1, 1, 2, 2}, relabelled{5, 5, 3, 3, 0, 0};
  CHECK(an::community_nmi(a, a) == doctest::Approx(1.0));
  CHECK(an::community_nmi(a, relabelled) == doctest::Approx(1.0));
  // Exactly independent: a = i mod 2, b = (i / 2) mod 2 -> I = 0.
  std::vector<int> x(1000), y(1000), r1(4000), r2(4000);
  for (int i = 0; i < 1000; ++i) x[i] = i % 2, y[i] = (i / 2) % 2;
  CHECK(an::community_nmi(x, y) == doctest::Approx(0.0).epsilon(1e-12));
  std::mt19937 gen(5);
  for (int i = 0; i < 4000; ++i) r1[i] = static_cast<int>(gen() % 4), r2[i] = static_cast<int>(gen() % 4);
  CHECK(an::community_nmi(r1, r2) < 0.01);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<int> p(30), q(30);
    for (int i = 0; i < 30; ++i) p[i] = static_cast<int>(gen() % 4), q[i] = (p[i] + (gen() % 3 == 0)) % 5;
    CHECK(an::community_nmi(p, q) == doctest::Approx(ref_nmi(p, q)).epsilon(1e-10));
  }
}

TEST_CASE("null model: K distinct experts per token, marginals preserved within sampling error") {
  const std::vector<double> u{0.3, 0.2, 0.15, 0.1, 0.1, 0.05, 0.05, 0.05};  // K u <= 1 for K = 3
  const int k = 3;
  const std::int64_t n = 40000;
  const auto t = an::null_model_trace(u, n, k, 123);
  std::vector<double> freq(8, 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    const auto* row = t.data() + i * k;
    for (int j = 0; j < k; ++j) {
      REQUIRE(row[j] >= 0);
      REQUIRE(std::count(row, row + k, row[j]) == 1);
      freq[row[j]] += 1.0 / n;
    }
  }
  for (int e = 0; e < 8; ++e) {
    const double pi = k * u[e], sigma = std::sqrt(pi * (1 - pi) / n);
    CHECK(std::fabs(freq[e] - pi) < 5 * sigma);
  }
  // The resampled utilisation matches u (TVD small), and the seed fixes the trace.
  CHECK(an::total_variation(an::utilisation(t.data(), n, k, 8), u) < 0.01);
  CHECK(an::null_model_trace(u, 100, k, 123) == std::vector<std::int32_t>(t.begin(), t.begin() + 300));
  CHECK(an::null_model_trace(u, 100, k, 124) != an::null_model_trace(u, 100, k, 123));
  // Capping: u = (0.9, 0.05, 0.05), K = 2 -> pi = (1, 0.5, 0.5).
  const auto pi = an::inclusion_probabilities({0.9, 0.05, 0.05}, 2);
  CHECK(pi[0] == doctest::Approx(1.0));
  CHECK(pi[1] == doctest::Approx(0.5));
  CHECK(pi[2] == doctest::Approx(0.5));
  CHECK_THROWS_AS(an::inclusion_probabilities({1.0, 0.0, 0.0}, 2), moe_route::error);
}

TEST_CASE("compare_routing: kept edges and isolated experts, counted by hand") {
  // E = 6, K = 2. Base: tokens pair (0,1) three times and (2,3) once; experts 4 and 5 are never chosen.
  // Post: (0,1), (0,2), (4,5) once each; expert 3 is never chosen.
  const std::vector<std::int32_t> base{0, 1, 1, 0, 0, 1, 2, 3}, post{0, 1, 0, 2, 4, 5, 1, 0};
  an::retention_options o;
  o.nulls = 0;
  o.rho = 1.0;  // every nonzero edge kept
  const an::trace_shape s{1, 4, 2, 6};
  const auto all = an::compare_routing(base.data(), post.data(), s, o);
  REQUIRE(all.layers.size() == 1);
  CHECK(all.layers[0].edges_base == 2);
  CHECK(all.layers[0].isolated_base == 2);  // 4, 5
  CHECK(all.layers[0].edges_post == 3);
  CHECK(all.layers[0].isolated_post == 1);  // 3
  CHECK(all.mean.edges_post == 3.0);
  CHECK(all.mean.isolated_base == 2.0);
  o.rho = 0.1;  // ceil(0.1 * 2) = 1 kept base edge, the heavier (0,1): 2, 3, 4, 5 isolated
  const auto top = an::compare_routing(base.data(), post.data(), s, o);
  CHECK(top.layers[0].edges_base == 1);
  CHECK(top.layers[0].isolated_base == 4);
  CHECK(top.layers[0].edges_post == 1);
  CHECK(top.layers[0].isolated_post == 4);
}

TEST_CASE("compare_routing: identical traces retain everything; deterministic for a fixed seed") {
  const int e = 16, k = 2;
  const std::int64_t n = 400, layers = 2;
  std::vector<std::int32_t> base = block_trace(n, k, e, 4, 1), post = block_trace(n, k, e, 4, 2);
  const auto l2 = block_trace(n, k, e, 2, 9);
  base.insert(base.end(), l2.begin(), l2.end());
  const auto p2 = block_trace(n, k, e, 4, 10);
  post.insert(post.end(), p2.begin(), p2.end());
  an::retention_options o;
  o.rho = 1.0;  // every block edge kept: the 4 blocks are exactly the communities
  o.nulls = 5;
  o.seed = 0;
  const an::trace_shape s{layers, n, k, e};
  const auto same = an::compare_routing(base.data(), base.data(), s, o);
  for (const auto& l : same.layers) {
    CHECK(l.tvd == 0.0);
    CHECK(l.jsd == 0.0);
    CHECK(l.topk_overlap == 1.0);
    CHECK(l.nmi == doctest::Approx(1.0));
    CHECK(l.delta_q == 0.0);
    CHECK(l.beats_null);  // block structure beats a marginal-only null
    CHECK(l.q_margin > 0.1);
  }
  const auto a = an::compare_routing(base.data(), post.data(), s, o);
  const auto b = an::compare_routing(base.data(), post.data(), s, o);
  REQUIRE(a.layers.size() == 2);
  for (std::size_t i = 0; i < 2; ++i) {
    CHECK(a.layers[i].communities_post.membership == b.layers[i].communities_post.membership);
    CHECK(a.layers[i].nmi == b.layers[i].nmi);
    CHECK(a.layers[i].null_q_mean == b.layers[i].null_q_mean);
    CHECK(a.layers[i].null_nmi_mean == b.layers[i].null_nmi_mean);
  }
  CHECK(a.mean.nmi == b.mean.nmi);
  CHECK(a.mean.nmi == doctest::Approx(0.5 * (a.layers[0].nmi + a.layers[1].nmi)));
  CHECK(a.mean.tvd == doctest::Approx(0.5 * (a.layers[0].tvd + a.layers[1].tvd)));
  // Layer 0: both traces use the same 4 blocks, so the communities agree.
  CHECK(a.layers[0].nmi == doctest::Approx(1.0));
  CHECK(a.layers[1].nmi < 1.0);  // layer 1 base has 2 blocks, post has 4
}
