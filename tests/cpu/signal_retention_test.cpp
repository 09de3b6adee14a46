// analysis::signal_retention (docs/policies.md section 7.1): a hand-computed
// case, and random batches against an oracle that runs the library's own
// admissions (cpu::admit with capacity_position for natural order, CIPHER-strict
// for the affinity-ranked case) and decides retention with its own loops, plus
// edge cases and argument errors.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <moe_route/admission/admission.hpp>
#include <moe_route/admission/scores.hpp>
#include <moe_route/analysis/signal_retention.hpp>
#include <moe_route/backend/cpu/admit.hpp>
#include <moe_route/backend/cpu/route.hpp>
#include <moe_route/moe_route.hpp>

#include "admission_cases.hpp"

namespace signal_retention_test {

namespace mr = moe_route;
namespace ad = moe_route::admission;
namespace an = moe_route::analysis;

TEST_CASE("signal_retention: a hand-computed case") {
  // E = 2, K = 1, one group of 6 tokens, capacity factor 0.5: C = ceil(3 * 0.5) = 2.
  // Expert 0 gets tokens 0..3 (affinities .1 .2 .9 .8), expert 1 tokens 4, 5 (.95 .1); margin .5.
  const std::vector<std::int32_t> routed{0, 0, 0, 0, 1, 1};
  const std::vector<std::int32_t> executed{-1, -1, 0, 0, 1, 1};  // the two best of each pool
  const std::vector<float> a{0.1f, 0.2f, 0.9f, 0.8f, 0.95f, 0.1f};
  an::signal_retention_inputs in;
  in.routed_indices = routed.data();
  in.executed_indices = executed.data();
  in.affinities = a.data();
  in.num_tokens = 6;
  in.top_k = 1;
  in.num_experts = 2;
  an::signal_retention_options o;
  o.margin = 0.5f;
  o.capacity_factor = 0.5;
  const an::signal_retention_stats s = an::signal_retention(in, o);
  CHECK(s.pools == 2);
  CHECK(s.available == 2);
  CHECK(s.retained == 2);
  // Expert 0's first discriminative token is third in token order, past C = 2; expert 1's is first.
  CHECK(s.natural_retained == 1);
  CHECK(s.natural_capacity == 3 + 1);
  // Eq. 19 with pi = 2/4, C = 2, N = 4: (1 - 1/4) / (1 - 1/16) = 0.8; expert 1: C >= N gives 1.
  CHECK(s.natural_predicted == doctest::Approx(1.8).epsilon(1e-15));
  // B_e (mu = 0, eps .1, eta .01) = min(N_e, 3): 3 > C for expert 0, 2 <= C for expert 1.
  CHECK(s.at_budget == 1);
  CHECK(s.retained_at_budget == 1);
  CHECK(s.discriminative == 3);
  CHECK(s.discriminative_kept == 3);

  // Adding two batches adds their counts.
  an::signal_retention_stats twice = s;
  twice += s;
  CHECK(twice.pools == 4);
  CHECK(twice.natural_predicted == doctest::Approx(3.6));
  CHECK(twice.retained_at_budget == 2);
}

// The admission tests' batches (a hot quarter of experts, a NaN row, +-inf, an
// empty last group), and the cosine affinity of every routed slot, exactly as
// admission computes it.
using admission_cases::batch;

template <class Router>
std::vector<float> routed_affinities(const Router& r, const batch& b) {
  std::vector<float> a(b.N * b.K);
  for (std::int64_t t = 0; t < b.N; ++t)
    for (int j = 0; j < b.K; ++j) {
      const int e = b.routed[t * b.K + j];
      a[t * b.K + j] = ad::affinity_of<ad::cosine>(r, b.z.data() + t * b.E, b.E, e, b.xn[t], b.wn[e]);
    }
  return a;
}

template <class Router, class Policy>
std::vector<std::int32_t> admitted(const Router& r, const Policy& p, const batch& b) {
  std::vector<std::int32_t> idx(b.N * b.K);
  std::vector<float> gates(b.N * b.K);
  std::vector<std::int8_t> status(b.N * b.K);
  mr::cpu::admit(r, p, admission_cases::admission_inputs_of(b, b.z.data()),
                 mr::admission_outputs{idx.data(), gates.data(), status.data()});
  return idx;
}

an::signal_retention_inputs inputs_of(const batch& b, const std::vector<std::int32_t>& executed,
                                      const std::vector<float>& affinity) {
  an::signal_retention_inputs in;
  in.routed_indices = b.routed.data();
  in.executed_indices = executed.data();
  in.affinities = affinity.data();
  in.num_tokens = b.N;
  in.top_k = b.K;
  in.num_experts = b.E;
  in.group_ids = b.groups.empty() ? nullptr : b.groups.data();
  in.num_groups = b.G;
  return in;
}

// The oracle: (group, expert) -> the tokens routed there with whether each is
// discriminative, gathered expert by expert.
using pool_map = std::map<std::pair<int, int>, std::vector<std::pair<std::int64_t, bool>>>;

pool_map pools_of(const batch& b, const std::vector<float>& affinity, float margin) {
  pool_map pools;
  for (int e = 0; e < b.E; ++e)
    for (std::int64_t t = 0; t < b.N; ++t)
      for (int j = 0; j < b.K; ++j)
        if (b.routed[t * b.K + j] == e)
          pools[{b.groups.empty() ? 0 : b.groups[t], e}].push_back({t, affinity[t * b.K + j] >= margin});
  return pools;
}

bool runs_on(const batch& b, const std::vector<std::int32_t>& executed, std::int64_t t, int e) {
  for (int j = 0; j < b.K; ++j)
    if (executed[t * b.K + j] == e) return true;
  return false;
}

template <class Router>
an::signal_retention_stats check_against_oracle(const Router& r, std::uint32_t seed, std::int64_t N, int E, int G, double cf, float margin,
                          float tau) {
  CAPTURE(seed);
  CAPTURE(N);
  CAPTURE(E);
  CAPTURE(G);
  CAPTURE(cf);
  CAPTURE(margin);
  CAPTURE(tau);
  const batch b = admission_cases::make_batch(r, seed, N, E, 0, G, false);
  const std::vector<float> affinity = routed_affinities(r, b);
  const auto strict = admitted(r, ad::cipher_strict(tau, cf), b);
  const auto natural = admitted(r, ad::capacity_position(cf), b);
  an::signal_retention_options o;
  o.margin = margin;
  o.capacity_factor = cf;
  const an::signal_retention_stats s = an::signal_retention(inputs_of(b, strict, affinity), o);

  std::int64_t pools = 0, available = 0, retained = 0, natural_retained = 0, discriminative = 0, kept = 0,
               natural_capacity = 0, at_budget = 0, retained_at_budget = 0;
  double predicted = 0.0;
  std::map<int, std::int64_t> group_size;
  for (std::int64_t t = 0; t < b.N; ++t) ++group_size[b.groups.empty() ? 0 : b.groups[t]];
  for (const auto& [key, pool] : pools_of(b, affinity, margin)) {
    ++pools;
    std::int64_t d = 0, first = 0;
    bool kept_one = false, natural_one = false;
    for (std::size_t i = 0; i < pool.size(); ++i) {
      if (!pool[i].second) continue;
      if (d++ == 0) first = static_cast<std::int64_t>(i) + 1;
      const bool k = runs_on(b, strict, pool[i].first, key.second);
      kept += k;
      kept_one = kept_one || k;
      natural_one = natural_one || runs_on(b, natural, pool[i].first, key.second);
    }
    discriminative += d;
    if (d == 0) continue;
    ++available;
    retained += kept_one;
    natural_retained += natural_one;
    natural_capacity += first;
    // Eq. 19 written as a sum over the position of the first discriminative token.
    const double pi = static_cast<double>(d) / static_cast<double>(pool.size());
    const auto n = static_cast<std::int64_t>(pool.size());
    const std::int64_t c = static_cast<std::int64_t>(std::ceil(static_cast<double>(group_size[key.first] * b.K) / b.E * cf));
    double num = 0.0;
    for (std::int64_t i = 0; i < std::min(c, n); ++i) num += pi * std::pow(1.0 - pi, static_cast<double>(i));
    double den = 0.0;
    for (std::int64_t i = 0; i < n; ++i) den += pi * std::pow(1.0 - pi, static_cast<double>(i));
    predicted += num / den;
    const std::int64_t budget = std::min<std::int64_t>(n, 3);  // mu = 0, eps .1, eta .01: ceil(1 + 2 ell / 3) = 3
    if (c >= budget) {
      ++at_budget;
      retained_at_budget += kept_one;
    }
  }
  CHECK(s.pools == pools);
  CHECK(s.available == available);
  CHECK(s.retained == retained);
  CHECK(s.natural_retained == natural_retained);
  CHECK(s.natural_capacity == natural_capacity);
  CHECK(s.natural_predicted == doctest::Approx(predicted).epsilon(1e-12));
  CHECK(s.at_budget == at_budget);
  CHECK(s.retained_at_budget == retained_at_budget);
  CHECK(s.discriminative == discriminative);
  CHECK(s.discriminative_kept == kept);
  // Theorem 1 with exact ranking (mu = 0): CIPHER-strict with tau <= margin and C_e >= 1 keeps the
  // most affine candidate of every pool, which is discriminative whenever any is.
  if (tau <= margin && cf > 0.0) CHECK(s.retained == s.available);
  CHECK(s.retained >= s.retained_at_budget);
  CHECK(s.natural_retained <= s.available);
  return s;
}

using softmax_router = mr::router<mr::gating::softmax, mr::selection::top_k, 8>;

TEST_CASE("signal_retention: random batches against the library's own admissions") {
  softmax_router r;
  r.top_k = 2;
  for (std::uint32_t seed : {1u, 2u, 3u}) {
    check_against_oracle(r, seed, 200, 16, 1, 1.0, 0.3f, 0.0f);
    // E not a multiple of 32, groups; the hot experts' capacity binds, so natural order misses signals.
    // (Affinities here are logits over synthetic norms in [0.5, 2]; a margin of 4 makes signals rare.)
    const auto tight = check_against_oracle(r, seed, 300, 33, 3, 0.5, 4.0f, 0.1f);
    CHECK(tight.natural_retained < tight.available);
    // tau above the margin filters discriminative candidates: retention fails somewhere.
    const auto filtered = check_against_oracle(r, seed, 300, 33, 3, 0.5, 3.0f, 5.0f);
    CHECK(filtered.retained < filtered.available);
    const auto loose = check_against_oracle(r, seed, 120, 8, 2, 8.0, 0.5f, -1.0f);  // a capacity that never binds
    CHECK(loose.natural_retained == loose.available);
    CHECK(loose.natural_predicted == doctest::Approx(static_cast<double>(loose.available)));
    const auto none = check_against_oracle(r, seed, 64, 8, 1, 0.0, 0.2f, 0.0f);  // capacity 0: nothing retained
    CHECK(none.available > 0);
    CHECK(none.retained == 0);
  }
  auto k_equals_e = r;
  k_equals_e.top_k = 8;
  check_against_oracle(k_equals_e, 4, 50, 8, 2, 1.0, 0.3f, 0.0f);  // K = E
}

TEST_CASE("signal_retention: edge cases") {
  an::signal_retention_inputs in;
  in.top_k = 2;
  in.num_experts = 4;
  SUBCASE("N = 0") {
    const auto s = an::signal_retention(in);
    CHECK(s.pools == 0);
    CHECK(s.available == 0);
    CHECK(s.natural_predicted == 0.0);
  }
  SUBCASE("padding rows (-1), a NaN affinity and an empty group") {
    const std::vector<std::int32_t> routed{-1, -1, 2, 3, 2, 1};
    const std::vector<std::int32_t> executed{-1, -1, 2, -1, -1, 1};
    const std::vector<float> a{0.9f, 0.9f, std::numeric_limits<float>::quiet_NaN(), 0.9f, 0.9f, 0.1f};
    const std::vector<std::int32_t> groups{0, 0, 0};  // group 1 is empty
    in.routed_indices = routed.data();
    in.executed_indices = executed.data();
    in.affinities = a.data();
    in.num_tokens = 3;
    in.group_ids = groups.data();
    in.num_groups = 2;
    an::signal_retention_options o;
    o.margin = 0.5f;
    const auto s = an::signal_retention(in, o);
    // Token 0 routes nowhere. Expert 2 holds token 1 (NaN: not discriminative, run) and token 2 (.9,
    // dropped); expert 3 token 1 (.9, dropped); expert 1 token 2 (.1, run).
    CHECK(s.pools == 3);
    CHECK(s.available == 2);
    CHECK(s.discriminative == 2);
    CHECK(s.retained == 0);
    CHECK(s.discriminative_kept == 0);
  }
}

TEST_CASE("signal_retention: argument errors name the argument") {
  const std::vector<std::int32_t> routed{0, 1}, executed{0, 1}, groups{0};
  const std::vector<float> a{0.5f, 0.5f};
  an::signal_retention_inputs in;
  in.routed_indices = routed.data();
  in.executed_indices = executed.data();
  in.affinities = a.data();
  in.num_tokens = 1;
  in.top_k = 2;
  in.num_experts = 2;
  const auto fails = [](an::signal_retention_inputs i, an::signal_retention_options o, const std::string& name) {
    CAPTURE(name);
    try {
      an::signal_retention(i, o);
      FAIL("no error");
    } catch (const mr::error& e) {
      CHECK(std::string(e.what()).find(name) != std::string::npos);
    }
  };
  an::signal_retention_options o;
  auto i = in;
  i.num_tokens = -1;
  fails(i, o, "num_tokens");
  i = in;
  i.top_k = 0;
  fails(i, o, "top_k");
  i = in;
  i.num_experts = 0;
  fails(i, o, "num_experts");
  i = in;
  i.affinities = nullptr;
  fails(i, o, "affinities");
  i = in;
  i.executed_indices = nullptr;
  fails(i, o, "executed_indices");
  i = in;
  i.num_groups = 2;
  fails(i, o, "group_ids");
  i.group_ids = groups.data();
  i.num_groups = 0;
  fails(i, o, "num_groups");
  const std::vector<std::int32_t> bad_group{5};
  i.group_ids = bad_group.data();
  i.num_groups = 2;
  fails(i, o, "group_ids[0]");
  const std::vector<std::int32_t> out_of_range{0, 2};
  i = in;
  i.routed_indices = out_of_range.data();
  fails(i, o, "routed_indices[1]");
  i = in;
  i.executed_indices = out_of_range.data();
  fails(i, o, "executed_indices[1]");
  auto p = o;
  p.margin = std::numeric_limits<float>::quiet_NaN();
  fails(in, p, "margin");
  p = o;
  p.capacity_factor = -1.0;
  fails(in, p, "capacity_factor");
  p = o;
  p.capacity_factor = std::numeric_limits<double>::infinity();
  fails(in, p, "capacity_factor");
  p = o;
  p.min_capacity = -1;
  fails(in, p, "min_capacity");
  p = o;
  p.eta = 0.2;
  fails(in, p, "eta");
}

}  // namespace signal_retention_test
