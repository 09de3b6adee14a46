// moe_route: community detection on co-activation graphs, modularity and
// community NMI via igraph (docs/policies.md section 6; RPB section 2, App. B.2,
// F.9, F.10). Needs igraph (CMake target moe_route::analysis, Debian
// libigraph-dev >= 0.10); nothing else in the library includes this header.
//
//   detect_communities(E, edges, detector, seed, resolution = 1.0) -> partition
//       Louvain (igraph_community_multilevel) or Leiden
//       (igraph_community_leiden with the modularity objective), weighted by
//       the edges' W_ij, on all E experts (an expert without a kept edge is a
//       community of its own). igraph's default RNG is seeded with `seed`
//       before the call, so the result is reproducible.
//   modularity(E, edges, membership, resolution = 1.0) -> Q (igraph_modularity)
//   community_nmi(a, b) -> 2 I(X;Y) / (H(X) + H(Y)) (igraph_compare_communities,
//       IGRAPH_COMMCMP_NMI)
//
// igraph errors become moe_route::error (the igraph error handler is replaced
// by a non-aborting one for the duration of each call). igraph's RNG is
// process-global: do not call detect_communities from several threads at once.
#pragma once

#include <igraph.h>

#include <cstdint>
#include <string>
#include <vector>

#include <moe_route/analysis/coactivation.hpp>

namespace moe_route::analysis {

enum class detector { louvain, leiden };

inline const char* detector_name(detector d) { return d == detector::louvain ? "louvain" : "leiden"; }

struct partition {
  std::vector<int> membership;  // [E] community label of each expert, labels 0..communities-1
  int communities = 0;
  double modularity = 0.0;      // Q of the membership on the weighted graph (0 for a graph without edges)
};

namespace detail {

// Replaces igraph's (aborting) error handler while alive; checks return codes.
class igraph_scope {
 public:
  igraph_scope() : previous_(igraph_set_error_handler(igraph_error_handler_ignore)) {}
  ~igraph_scope() { igraph_set_error_handler(previous_); }
  igraph_scope(const igraph_scope&) = delete;
  igraph_scope& operator=(const igraph_scope&) = delete;
  static void check(igraph_error_t code, const char* call) {
    if (code != IGRAPH_SUCCESS)
      throw error(std::string("moe_route: analysis: igraph ") + call + " failed: " + igraph_strerror(code));
  }

 private:
  igraph_error_handler_t* previous_;
};

// RAII holders of igraph objects.
struct ig_graph {
  igraph_t g;
  bool live = false;
  ~ig_graph() {
    if (live) igraph_destroy(&g);
  }
};
struct ig_vector {
  igraph_vector_t v;
  explicit ig_vector(igraph_integer_t n) { igraph_scope::check(igraph_vector_init(&v, n), "vector_init"); }
  ~ig_vector() { igraph_vector_destroy(&v); }
};
struct ig_vector_int {
  igraph_vector_int_t v;
  explicit ig_vector_int(igraph_integer_t n) { igraph_scope::check(igraph_vector_int_init(&v, n), "vector_int_init"); }
  ~ig_vector_int() { igraph_vector_int_destroy(&v); }
};

inline void check_edges(const char* function, int num_experts, const std::vector<edge>& edges) {
  if (num_experts < 1) fail(function, "num_experts must be >= 1");
  for (const edge& e : edges)
    if (e.i < 0 || e.j < 0 || e.i >= num_experts || e.j >= num_experts || e.i == e.j || !(e.weight > 0.0))
      fail(function, "edge (" + std::to_string(e.i) + ", " + std::to_string(e.j) +
                         ") must join two different experts in [0, E) with a positive weight");
}

// Builds the undirected weighted graph; weights go into w.
inline void make_graph(int num_experts, const std::vector<edge>& edges, ig_graph& g, ig_vector& w) {
  ig_vector_int ends(static_cast<igraph_integer_t>(2 * edges.size()));
  for (std::size_t k = 0; k < edges.size(); ++k) {
    VECTOR(ends.v)[2 * k] = edges[k].i;
    VECTOR(ends.v)[2 * k + 1] = edges[k].j;
    VECTOR(w.v)[k] = edges[k].weight;
  }
  igraph_scope::check(igraph_create(&g.g, &ends.v, num_experts, IGRAPH_UNDIRECTED), "create");
  g.live = true;
}

inline double modularity_of(const ig_graph& g, const ig_vector& w, const ig_vector_int& membership, double resolution,
                            bool has_edges) {
  if (!has_edges) return 0.0;
  igraph_real_t q = 0.0;
  igraph_scope::check(igraph_modularity(&g.g, &membership.v, &w.v, resolution, false, &q), "modularity");
  return q;
}

}  // namespace detail

// Q of `membership` ([E], any integer labels >= 0) on the weighted graph.
inline double modularity(int num_experts, const std::vector<edge>& edges, const std::vector<int>& membership,
                         double resolution = 1.0) {
  detail::check_edges("modularity", num_experts, edges);
  if (static_cast<int>(membership.size()) != num_experts) detail::fail("modularity", "membership must have E entries");
  for (int m : membership)
    if (m < 0) detail::fail("modularity", "membership labels must be >= 0");
  detail::igraph_scope scope;
  detail::ig_graph g;
  detail::ig_vector w(static_cast<igraph_integer_t>(edges.size()));
  detail::make_graph(num_experts, edges, g, w);
  detail::ig_vector_int mem(num_experts);
  for (int e = 0; e < num_experts; ++e) VECTOR(mem.v)[e] = membership[e];
  return detail::modularity_of(g, w, mem, resolution, !edges.empty());
}

// Louvain or Leiden communities of the weighted graph, seeded.
inline partition detect_communities(int num_experts, const std::vector<edge>& edges, detector d, std::uint64_t seed,
                                    double resolution = 1.0) {
  detail::check_edges("detect_communities", num_experts, edges);
  if (!(resolution > 0.0)) detail::fail("detect_communities", "resolution must be > 0");
  partition p;
  p.membership.resize(static_cast<std::size_t>(num_experts));
  if (edges.empty()) {  // every expert alone; modularity of an edgeless graph is taken as 0
    for (int e = 0; e < num_experts; ++e) p.membership[e] = e;
    p.communities = num_experts;
    return p;
  }
  detail::igraph_scope scope;
  detail::ig_graph g;
  detail::ig_vector w(static_cast<igraph_integer_t>(edges.size()));
  detail::make_graph(num_experts, edges, g, w);
  detail::ig_vector_int mem(num_experts);
  detail::igraph_scope::check(igraph_rng_seed(igraph_rng_default(), static_cast<igraph_uint_t>(seed)), "rng_seed");
  if (d == detector::louvain) {
    detail::igraph_scope::check(igraph_community_multilevel(&g.g, &w.v, resolution, &mem.v, nullptr, nullptr),
                                "community_multilevel");
  } else {
    // The modularity objective of Leiden: node weights = strengths, resolution gamma / (2 m).
    detail::ig_vector strength(num_experts);
    double total = 0.0;
    for (const edge& e : edges) {
      VECTOR(strength.v)[e.i] += e.weight;
      VECTOR(strength.v)[e.j] += e.weight;
      total += e.weight;
    }
    igraph_integer_t clusters = 0;
    igraph_real_t quality = 0.0;
    detail::igraph_scope::check(igraph_community_leiden(&g.g, &w.v, &strength.v, resolution / (2.0 * total),
                                                        /*beta*/ 0.01, /*start*/ false, /*n_iterations*/ -1, &mem.v,
                                                        &clusters, &quality),
                                "community_leiden");
  }
  // Relabel in order of first appearance so labels are 0..c-1 and canonical.
  std::vector<int> relabel(static_cast<std::size_t>(num_experts), -1);
  int next = 0;
  for (int e = 0; e < num_experts; ++e) {
    const auto label = static_cast<std::size_t>(VECTOR(mem.v)[e]);
    if (relabel[label] < 0) relabel[label] = next++;
    p.membership[e] = relabel[label];
    VECTOR(mem.v)[e] = p.membership[e];
  }
  p.communities = next;
  p.modularity = detail::modularity_of(g, w, mem, resolution, true);
  return p;
}

// Community NMI 2 I(X;Y) / (H(X) + H(Y)) of two partitions of the same experts
// (igraph returns 1 when both partitions are a single community).
inline double community_nmi(const std::vector<int>& a, const std::vector<int>& b) {
  if (a.size() != b.size() || a.empty()) detail::fail("community_nmi", "partitions must be non-empty and of equal size");
  detail::igraph_scope scope;
  detail::ig_vector_int va(static_cast<igraph_integer_t>(a.size())), vb(static_cast<igraph_integer_t>(b.size()));
  for (std::size_t e = 0; e < a.size(); ++e) {
    if (a[e] < 0 || b[e] < 0) detail::fail("community_nmi", "labels must be >= 0");
    VECTOR(va.v)[e] = a[e];
    VECTOR(vb.v)[e] = b[e];
  }
  igraph_real_t nmi = 0.0;
  detail::igraph_scope::check(igraph_compare_communities(&va.v, &vb.v, &nmi, IGRAPH_COMMCMP_NMI),
                              "compare_communities");
  return nmi;
}

}  // namespace moe_route::analysis
