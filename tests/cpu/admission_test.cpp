// Admission (docs/policies.md section 4): cpu::admit against brute-force, sort-based
// references written here from the specification, the reroute guarantees
// (CIPHER eq. 27), edge cases, argument errors, the gate rule after admission
// and a finite-difference check of its backward.
//
// The references share only the exact fp32 affinity values with the library
// (for the probability affinity through admission::affinity_of, which is itself
// checked against a double-precision softmax); every decision (pools, sorting,
// capacities, reroute rounds) is recomputed here.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <moe_route/admission/admission.hpp>
#include <moe_route/admission/gates.hpp>
#include <moe_route/backend/cpu/admit.hpp>
#include <moe_route/moe_route.hpp>

#include "admission_cases.hpp"

namespace admission_test {

namespace mr = moe_route;
namespace ad = moe_route::admission;

constexpr float finf = std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------
// Inputs.

// The batch type and its admission inputs are the CUDA parity tests'
// (tests/admission_cases.hpp); this file makes its own batches.
using admission_cases::batch;

// Logits: normal(0, 2); with `levels` > 0 they are rounded to multiples of
// 1/levels so affinities tie often; every 7th row repeats its predecessor.
inline std::vector<float> make_logits(std::mt19937& rng, std::int64_t N, int E, int levels) {
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> z(static_cast<std::size_t>(N * E));
  for (auto& x : z) {
    x = nd(rng);
    if (levels > 0) x = std::round(x * levels) / levels;
  }
  for (std::int64_t t = 1; t < N; ++t)
    if (t % 7 == 0) std::copy(z.begin() + (t - 1) * E, z.begin() + t * E, z.begin() + t * E);
  return z;
}

// skew > 0 adds skew to the logits of the first quarter of the experts, which
// then overflow while the others have room (reroute has work to do).
template <class Router>
batch make_batch(const Router& r, std::uint32_t seed, std::int64_t N, int E, int levels = 0, int G = 1,
                 float skew = 0.0f) {
  std::mt19937 rng(seed);
  batch b;
  b.N = N;
  b.E = E;
  b.K = r.top_k;
  b.z = make_logits(rng, N, E, levels);
  for (std::int64_t t = 0; t < N; ++t)
    for (int e = 0; e < (E + 3) / 4; ++e) b.z[t * E + e] += skew;
  b.bias.assign(E, 0.0f);
  std::uniform_real_distribution<float> u(0.5f, 2.0f);
  b.xn.resize(N);
  b.wn.resize(E);
  for (auto& x : b.xn) x = levels > 0 ? 1.0f : u(rng);
  for (auto& x : b.wn) x = levels > 0 ? 1.0f : u(rng);
  b.G = G;
  if (G > 1) {
    b.groups.resize(N);
    std::uniform_int_distribution<int> gd(0, G - 1);
    for (auto& g : b.groups) g = gd(rng);
  }
  b.routed.resize(N * b.K);
  b.gates.resize(N * b.K);
  if (N > 0) {
    mr::route_inputs<float> in{b.z.data(), N, E, b.bias.data()};
    mr::cpu::route(r, in, mr::route_outputs{b.routed.data(), b.gates.data()});
  }
  return b;
}


struct result {
  std::vector<std::int32_t> idx;
  std::vector<float> gates;
  std::vector<std::int8_t> status;
  mr::admission_report rep;
};

template <class Router, class Policy>
result run_admit(const Router& r, const Policy& p, const batch& b, int threads = 1) {
  result res;
  res.idx.assign(b.N * b.K, -7);
  res.gates.assign(b.N * b.K, -7.0f);
  res.status.assign(b.N * b.K, -7);
  mr::admission_outputs out{res.idx.data(), res.gates.data(), res.status.data(), nullptr};
  res.rep = mr::cpu::admit(r, p, admission_cases::admission_inputs_of(b, b.z.data()), out, mr::cpu::execution{threads, mr::cpu::instruction_set::best, 1});
  return res;
}

// ---------------------------------------------------------------------------
// The reference.

inline float sanitize(float z) {
  if (std::isnan(z)) return -finf;
  if (z > std::numeric_limits<float>::max()) return std::numeric_limits<float>::max();
  if (z < -std::numeric_limits<float>::max()) return -std::numeric_limits<float>::max();
  return z;
}

template <class Policy, class Router>
float ref_affinity(const Router& r, const batch& b, std::int64_t t, int e) {
  using A = typename Policy::affinity_type;
  const float v = sanitize(b.z[t * b.E + e]);
  if constexpr (A::kind == ad::affinity_kind::position) return 0.0f;
  else if constexpr (A::kind == ad::affinity_kind::gate) {
    for (int j = 0; j < b.K; ++j)  // the gate of t's slot that holds e
      if (b.routed[t * b.K + j] == e) return sanitize(b.gates[t * b.K + j]);
    return -finf;
  } else if constexpr (A::kind == ad::affinity_kind::logit) return v;
  else if constexpr (A::kind == ad::affinity_kind::cosine) return v / (b.xn[t] * b.wn[e]);
  else return ad::affinity_of<ad::probability>(r, b.z.data() + t * b.E, b.E, e);
}

struct ref_result {
  std::vector<std::int32_t> idx;
  std::vector<std::int8_t> status;
  std::vector<bool> strict_kept;
  std::int64_t below = 0, over = 0;
};

inline std::int64_t ref_capacity(double cf, std::int64_t min_cap, std::int64_t tokens, int K, int E) {
  const std::int64_t c = static_cast<std::int64_t>(std::ceil(static_cast<double>(tokens * K) / E * cf));
  return std::max(c, min_cap);
}

// Candidate order of an expert: affinity descending, then token ascending.
struct cand {
  float a;
  std::int64_t t;
  std::int64_t slot;
};
inline bool before(const cand& x, const cand& y) { return x.a > y.a || (x.a == y.a && x.t < y.t); }

template <class Router, class Policy>
ref_result reference(const Router& r, const Policy& p, const batch& b) {
  const std::int64_t N = b.N;
  const int E = b.E, K = b.K;
  ref_result out;
  out.idx = b.routed;
  out.status.assign(N * K, 0);
  out.strict_kept.assign(N * K, true);
  if constexpr (Policy::is_dropless) {
    return out;
  } else {
    auto group = [&](std::int64_t t) { return b.groups.empty() ? 0 : b.groups[t]; };
    std::vector<std::int64_t> gsize(b.G, 0);
    for (std::int64_t t = 0; t < N; ++t) ++gsize[group(t)];
    auto cap = [&](int g, int e) {
      return b.capacity.empty() ? ref_capacity(p.capacity_factor, p.min_capacity, gsize[g], K, E) : b.capacity[e];
    };
    std::vector<bool> pending(N * K, false);
    std::map<std::pair<int, int>, std::int64_t> load;
    for (int g = 0; g < b.G; ++g)
      for (int e = 0; e < E; ++e) {
        std::vector<cand> pool;
        for (std::int64_t t = 0; t < N; ++t)
          for (int j = 0; j < K; ++j)
            if (group(t) == g && b.routed[t * K + j] == e) {
              const float a = ref_affinity<Policy>(r, b, t, e);
              if (a >= p.threshold) pool.push_back({a, t, t * K + j});
              else {
                pending[t * K + j] = true;
                ++out.below;
              }
            }
        std::sort(pool.begin(), pool.end(), before);
        const std::int64_t c = cap(g, e);
        for (std::size_t i = 0; i < pool.size(); ++i)
          if (static_cast<std::int64_t>(i) >= c) {
            pending[pool[i].slot] = true;
            ++out.over;
          }
        load[{g, e}] = std::min<std::int64_t>(c, static_cast<std::int64_t>(pool.size()));
      }
    for (std::int64_t s = 0; s < N * K; ++s)
      if (pending[s]) {
        out.strict_kept[s] = false;
        out.idx[s] = -1;
        out.status[s] = 1;
      }
    if constexpr (Policy::reroutes) {
      const int rounds = p.overflow.max_rounds < 0 ? K : p.overflow.max_rounds;
      auto limit = [&](int g, int e) {
        return std::min(ref_capacity(p.overflow.fill_factor, 0, gsize[g], K, E), cap(g, e));
      };
      for (int round = 0; round < rounds; ++round) {
        // (slot, expert, affinity)
        std::vector<std::tuple<std::int64_t, int, float>> proposals;
        for (std::int64_t t = 0; t < N; ++t) {
          std::set<int> used;
          for (int j = 0; j < K; ++j)
            if (out.idx[t * K + j] >= 0) used.insert(out.idx[t * K + j]);
          for (int j = 0; j < K; ++j) {
            const std::int64_t s = t * K + j;
            if (!pending[s]) continue;
            int best = -1;
            float best_a = 0.0f;
            for (int e = 0; e < E; ++e) {
              if (used.count(e) || load[{group(t), e}] >= limit(group(t), e)) continue;
              const float a = ref_affinity<Policy>(r, b, t, e);
              if (!(a >= p.threshold)) continue;
              if (best < 0 || a > best_a) {
                best = e;
                best_a = a;
              }
            }
            if (best >= 0) {
              proposals.emplace_back(s, best, best_a);
              used.insert(best);
            }
          }
        }
        if (proposals.empty()) break;
        std::map<std::pair<int, int>, std::vector<cand>> by_expert;
        for (auto& [s, e, a] : proposals) by_expert[{group(s / K), e}].push_back({a, s / K, s});
        for (auto& [ge, list] : by_expert) {
          std::sort(list.begin(), list.end(), before);
          const std::int64_t room = std::max<std::int64_t>(0, limit(ge.first, ge.second) - load[ge]);
          for (std::size_t i = 0; i < list.size() && static_cast<std::int64_t>(i) < room; ++i) {
            out.idx[list[i].slot] = ge.second;
            out.status[list[i].slot] = 2;
            pending[list[i].slot] = false;
            ++load[ge];
          }
        }
      }
    }
    return out;
  }
}

// ---------------------------------------------------------------------------
// Checks.

template <class Router, class Policy>
void check_against_reference(const Router& r, const Policy& p, const batch& b, const char* what) {
  CAPTURE(what);
  const result got = run_admit(r, p, b);
  const ref_result want = reference(r, p, b);
  REQUIRE(got.idx.size() == want.idx.size());
  std::int64_t mismatches = 0;
  for (std::size_t s = 0; s < got.idx.size(); ++s) mismatches += got.idx[s] != want.idx[s] || got.status[s] != want.status[s];
  CHECK(mismatches == 0);
  std::int64_t kept = 0, rerouted = 0, dropped = 0, none = 0;
  for (std::int64_t t = 0; t < b.N; ++t) {
    int alive = 0;
    for (int j = 0; j < b.K; ++j) {
      const auto st = want.status[t * b.K + j];
      kept += st == 0;
      rerouted += st == 2;
      dropped += st == 1;
      alive += st != 1;
    }
    none += alive == 0;
  }
  CHECK(got.rep.offered == b.N * b.K);
  CHECK(got.rep.kept == kept);
  CHECK(got.rep.rerouted == rerouted);
  CHECK(got.rep.dropped == dropped);
  CHECK(got.rep.tokens_without_experts == none);
  if constexpr (!Policy::is_dropless) {
    CHECK(got.rep.below_threshold == want.below);
    CHECK(got.rep.over_capacity == want.over);
  }
  CHECK(got.rep.invalid == 0);
  // Gates: kept slots copy the routed gate; dropped slots are 0 (no renormalisation here).
  if (!ad::renormalizes(p))
    for (std::size_t s = 0; s < got.idx.size(); ++s) {
      if (got.status[s] == 0) CHECK(std::memcmp(&got.gates[s], &b.gates[s], sizeof(float)) == 0);
      if (got.status[s] == 1) CHECK(got.gates[s] == 0.0f);
    }
}

// The reroute guarantees of docs/policies.md §4 / CIPHER eq. 27.
template <class Router, class Policy>
void check_reroute_guarantees(const Router& r, const Policy& p, const batch& b) {
  auto strict = ad::policy<typename Policy::affinity_type, ad::drop>{};
  strict.threshold = p.threshold;
  strict.capacity_factor = p.capacity_factor;
  strict.min_capacity = p.min_capacity;
  const result s = run_admit(r, strict, b);
  const result rr = run_admit(r, p, b);
  const result again = run_admit(r, p, b, 3);
  CHECK(rr.idx == again.idx);
  CHECK(std::memcmp(rr.gates.data(), again.gates.data(), rr.gates.size() * sizeof(float)) == 0);
  CHECK(rr.status == again.status);
  // T_e^S subset of T_e^R.
  for (std::size_t i = 0; i < s.idx.size(); ++i)
    if (s.idx[i] >= 0) CHECK(rr.idx[i] == s.idx[i]);
  // |T_e^R| <= C_e per group, and no token holds an expert twice.
  auto group = [&](std::int64_t t) { return b.groups.empty() ? 0 : b.groups[t]; };
  std::vector<std::int64_t> gsize(b.G, 0);
  for (std::int64_t t = 0; t < b.N; ++t) ++gsize[group(t)];
  std::map<std::pair<int, int>, std::int64_t> load;
  for (std::int64_t t = 0; t < b.N; ++t) {
    std::set<int> seen;
    for (int j = 0; j < b.K; ++j) {
      const int e = rr.idx[t * b.K + j];
      if (e < 0) continue;
      CHECK(seen.insert(e).second);
      ++load[{group(t), e}];
      if (rr.status[t * b.K + j] == 2) {
        CHECK(ref_affinity<Policy>(r, b, t, e) >= p.threshold);
      }
    }
  }
  for (auto& [ge, l] : load) {
    const std::int64_t c = b.capacity.empty()
                               ? ref_capacity(p.capacity_factor, p.min_capacity, gsize[ge.first], b.K, b.E)
                               : b.capacity[ge.second];
    CHECK(l <= c);
  }
  CHECK(rr.rep.kept == s.rep.kept);
  CHECK(rr.rep.dropped + rr.rep.rerouted == s.rep.dropped);
}

template <class Router>
Router with_k(Router r, int k) {
  r.top_k = k;
  return r;
}

using softmax_router = mr::router<mr::gating::softmax, mr::selection::top_k, 8>;
using sigmoid_router = mr::router<mr::gating::sigmoid, mr::selection::top_k, 8>;
using softplus_router = mr::router<mr::gating::sqrt_softplus, mr::selection::expert_bias, 8>;
using mixtral_router = mr::router<mr::gating::softmax_after_topk, mr::selection::top_k, 8>;

template <class Router>
void all_presets(const Router& r, std::uint32_t seed, std::int64_t N, int E, int levels, int G, float skew = 1.5f) {
  const batch b = make_batch(r, seed, N, E, levels, G, skew);
  check_against_reference(r, ad::cipher_strict(0.05f, 1.0f), b, "cipher_strict");
  check_against_reference(r, ad::cipher_strict(-finf, 0.75f), b, "cipher_strict, no tau");
  check_against_reference(r, ad::cipher_reroute(0.05f, 1.25f, 1.0f), b, "cipher_reroute");
  check_against_reference(r, ad::cipher_reroute(-0.5f, 1.0f, 0.75f), b, "cipher_reroute, loose tau");
  check_against_reference(r, ad::locmoe(1.0f), b, "locmoe");
  check_against_reference(r, ad::capacity_position(0.8f), b, "capacity_position");
  check_against_reference(r, ad::capacity_position(0.5f, 3), b, "capacity_position, min_capacity");
  check_against_reference(r, ad::capacity_probs(0.8f), b, "capacity_probs");
  check_against_reference(r, ad::capacity_gate(0.8f), b, "capacity_gate");
  auto gate_threshold = ad::capacity_gate(1.0f);
  gate_threshold.threshold = 0.3f;
  check_against_reference(r, gate_threshold, b, "capacity_gate, threshold");
  check_against_reference(r, ad::dropless(), b, "dropless");
  auto logit_drop = ad::policy<ad::logit, ad::drop>{};
  logit_drop.threshold = 0.5f;
  logit_drop.capacity_factor = 0.9f;
  check_against_reference(r, logit_drop, b, "logit, drop");
  auto prob_reroute = ad::policy<ad::probability, ad::reroute>{};
  prob_reroute.capacity_factor = 0.75f;
  prob_reroute.overflow.fill_factor = 1.5f;
  prob_reroute.overflow.max_rounds = 2;
  check_against_reference(r, prob_reroute, b, "probability, reroute, 2 rounds");
  auto logit_reroute = ad::policy<ad::logit, ad::reroute>{};
  logit_reroute.threshold = -1.0f;
  logit_reroute.capacity_factor = 0.6f;
  logit_reroute.overflow.fill_factor = 2.0f;
  check_against_reference(r, logit_reroute, b, "logit, reroute");
  check_against_reference(r, ad::cipher_reroute(0.0f, 1.0, 1.0), b, "cipher_reroute, fill = capacity");
  check_against_reference(r, ad::cipher_reroute(-finf, 1.5, 4.0), b, "cipher_reroute, fill > capacity");
  check_reroute_guarantees(r, ad::cipher_reroute(0.05f, 1.25f, 1.0f), b);
  check_reroute_guarantees(r, ad::cipher_reroute(0.0f, 1.0, 1.0), b);
  check_reroute_guarantees(r, prob_reroute, b);
  check_reroute_guarantees(r, logit_reroute, b);
  // The inputs make reroute do real work.
  if (skew > 0.0f && b.E > b.K) CHECK(run_admit(r, ad::cipher_reroute(-finf, 1.5, 4.0), b).rep.rerouted > 0);
}

}  // namespace admission_test

using namespace admission_test;

TEST_CASE("admission: every preset and policy matches the brute-force reference") {
  for (std::uint32_t seed : {1u, 2u}) {
    all_presets(with_k(softmax_router{}, 4), seed, 150, 16, 0, 1, 0.0f);
    all_presets(with_k(softmax_router{}, 4), seed, 150, 16, 0, 1);
    all_presets(with_k(sigmoid_router{}, 3), seed, 120, 12, 0, 3);
  }
  auto v4 = mr::presets::deepseek_v4();
  all_presets(v4, 3, 100, 32, 0, 2);
  all_presets(with_k(mixtral_router{}, 2), 4, 90, 8, 0, 1);
  auto qwen = mr::presets::qwen3();
  all_presets(qwen, 5, 64, 40, 0, 1);
}

TEST_CASE("admission: ties on affinity break toward the lower token index") {
  // Quantised logits and repeated rows: many exact ties, on every affinity.
  for (std::uint32_t seed : {11u, 12u, 13u}) {
    all_presets(with_k(softmax_router{}, 3), seed, 140, 10, 1, 1);
    all_presets(with_k(sigmoid_router{}, 2), seed, 100, 6, 2, 2);
  }
  // All logits equal: every expert keeps its earliest C tokens.
  auto r = with_k(softmax_router{}, 2);
  batch b = make_batch(r, 7, 40, 4);
  std::fill(b.z.begin(), b.z.end(), 0.25f);
  mr::cpu::route(r, mr::route_inputs<float>{b.z.data(), b.N, b.E}, mr::route_outputs{b.routed.data(), b.gates.data()});
  const auto p = ad::capacity_probs(0.5f);  // C = ceil(0.5 * 40 * 2 / 4) = 10
  const result got = run_admit(r, p, b);
  for (std::int64_t t = 0; t < b.N; ++t)
    for (int j = 0; j < 2; ++j) CHECK((got.idx[t * 2 + j] >= 0) == (t < 10));
  check_against_reference(r, p, b, "all equal");
}

TEST_CASE("admission: threshold above every affinity drops everything") {
  auto r = with_k(softmax_router{}, 3);
  const batch b = make_batch(r, 21, 80, 9);
  for (float tau : {1.0e30f, finf}) {
    const result got = run_admit(r, ad::cipher_strict(tau, 100.0f), b);
    CHECK(std::all_of(got.idx.begin(), got.idx.end(), [](int e) { return e == -1; }));
    CHECK(std::all_of(got.gates.begin(), got.gates.end(), [](float g) { return g == 0.0f; }));
    CHECK(got.rep.below_threshold == b.N * 3);
    CHECK(got.rep.dropped == b.N * 3);
    CHECK(got.rep.tokens_without_experts == b.N);
    const result rr = run_admit(r, ad::cipher_reroute(tau, 100.0f, 100.0f), b);
    CHECK(rr.idx == got.idx);
    CHECK(rr.rep.rerouted == 0);
  }
  // tau just above the best cosine of one expert only drops that expert's pool.
  auto probs = ad::policy<ad::probability, ad::drop>{};
  probs.capacity_factor = 100.0f;
  probs.threshold = 2.0f;  // probabilities are <= 1
  const result all = run_admit(r, probs, b);
  CHECK(all.rep.below_threshold == b.N * 3);
}

TEST_CASE("admission: capacity 0 and capacity >= N") {
  auto r = with_k(sigmoid_router{}, 3);
  batch b = make_batch(r, 31, 60, 8, 0, 2);
  // capacity 0 through the factor and through the array; reroute cannot help.
  for (const bool array : {false, true}) {
    b.capacity = array ? std::vector<std::int64_t>(b.E, 0) : std::vector<std::int64_t>{};
    for (const result& got : {run_admit(r, ad::capacity_position(0.0f), b), run_admit(r, ad::cipher_strict(-finf, 0.0f), b),
                              run_admit(r, ad::cipher_reroute(-finf, 0.0f, 8.0f), b)}) {
      CHECK(got.rep.dropped == b.N * 3);
      CHECK(got.rep.over_capacity == b.N * 3);
      CHECK(got.rep.rerouted == 0);
    }
  }
  // capacity >= N: nothing is over capacity; without tau nothing changes at all.
  b.capacity.assign(b.E, b.N);
  for (const result& got : {run_admit(r, ad::capacity_position(1.0f), b), run_admit(r, ad::capacity_probs(1.0f), b),
                            run_admit(r, ad::cipher_reroute(-finf), b)}) {
    CHECK(got.idx == b.routed);
    CHECK(std::memcmp(got.gates.data(), b.gates.data(), b.gates.size() * sizeof(float)) == 0);
    CHECK(got.rep.kept == b.N * 3);
  }
  b.capacity.clear();
  const result big = run_admit(r, ad::capacity_position(1000.0f), b);
  CHECK(big.idx == b.routed);
  // Mixed per-expert capacities.
  b.capacity = {0, 1, 2, 3, 5, 8, 13, 100};
  check_against_reference(r, ad::capacity_probs(1.0f), b, "capacity array");
  check_against_reference(r, ad::cipher_reroute(0.0f, 1.0f, 100.0f), b, "capacity array, reroute");
  check_reroute_guarantees(r, ad::cipher_reroute(0.0f, 1.0f, 100.0f), b);
}

TEST_CASE("admission: E = 1, K = E and empty groups") {
  {  // E = 1: one expert, K = 1.
    auto r = with_k(sigmoid_router{}, 1);
    const batch b = make_batch(r, 41, 50, 1);
    check_against_reference(r, ad::capacity_probs(0.3f), b, "E = 1 probs");
    check_against_reference(r, ad::cipher_strict(0.0f, 0.5f), b, "E = 1 cosine");
    check_against_reference(r, ad::cipher_reroute(0.0f, 0.5f, 0.5f), b, "E = 1 reroute");
    const result got = run_admit(r, ad::capacity_position(0.3), b);  // C = ceil(50 * 0.3) = 15, as in Python
    for (std::int64_t t = 0; t < b.N; ++t) CHECK((got.idx[t] == 0) == (t < 15));
  }
  {  // K = E: no expert is left to reroute to.
    auto r = with_k(softmax_router{}, 6);
    const batch b = make_batch(r, 42, 70, 6);
    check_against_reference(r, ad::cipher_strict(0.0f, 0.7f), b, "K = E strict");
    check_against_reference(r, ad::cipher_reroute(0.0f, 0.7f, 4.0f), b, "K = E reroute");
    const result s = run_admit(r, ad::cipher_strict(0.0f, 0.7f), b);
    const result rr = run_admit(r, ad::cipher_reroute(0.0f, 0.7f, 4.0f), b);
    CHECK(rr.rep.rerouted == 0);
    CHECK(rr.idx == s.idx);
  }
  {  // Empty groups: ids only in {0, 3} of 5 groups.
    auto r = with_k(softmax_router{}, 2);
    batch b = make_batch(r, 43, 90, 8);
    b.G = 5;
    b.groups.resize(b.N);
    for (std::int64_t t = 0; t < b.N; ++t) b.groups[t] = (t % 3 == 0) ? 3 : 0;
    check_against_reference(r, ad::capacity_position(0.5f), b, "empty groups position");
    check_against_reference(r, ad::cipher_reroute(0.0f, 0.5f, 0.75f), b, "empty groups reroute");
    check_reroute_guarantees(r, ad::cipher_reroute(0.0f, 0.5f, 0.75f), b);
    // Groups are independent: group 3 alone gives the same decisions.
    batch only3 = b;
    std::vector<std::int64_t> tokens;
    for (std::int64_t t = 0; t < b.N; ++t)
      if (b.groups[t] == 3) tokens.push_back(t);
    only3.N = static_cast<std::int64_t>(tokens.size());
    only3.z.clear(), only3.routed.clear(), only3.gates.clear(), only3.xn.clear(), only3.groups.clear();
    only3.G = 1;
    for (std::int64_t t : tokens) {
      only3.z.insert(only3.z.end(), b.z.begin() + t * b.E, b.z.begin() + (t + 1) * b.E);
      only3.routed.insert(only3.routed.end(), b.routed.begin() + t * 2, b.routed.begin() + (t + 1) * 2);
      only3.gates.insert(only3.gates.end(), b.gates.begin() + t * 2, b.gates.begin() + (t + 1) * 2);
      only3.xn.push_back(b.xn[t]);
    }
    const auto p = ad::capacity_position(0.5f);
    const result whole = run_admit(r, p, b), part = run_admit(r, p, only3);
    for (std::size_t i = 0; i < tokens.size(); ++i)
      for (int j = 0; j < 2; ++j) CHECK(whole.idx[tokens[i] * 2 + j] == part.idx[i * 2 + j]);
  }
  {  // N = 0.
    auto r = with_k(softmax_router{}, 2);
    const batch b = make_batch(r, 44, 0, 8);
    const result got = run_admit(r, ad::cipher_reroute(0.0f), b);
    CHECK(got.rep.offered == 0);
    CHECK(got.rep.dropped == 0);
  }
}

TEST_CASE("admission: argument errors name the argument") {
  auto r = with_k(softmax_router{}, 2);
  batch b = make_batch(r, 51, 20, 8);
  std::vector<std::int32_t> idx(b.N * 2);
  std::vector<float> gates(b.N * 2);
  const mr::admission_outputs out{idx.data(), gates.data()};
  auto expect_error = [&](auto policy, const mr::admission_inputs<float>& in, const std::string& needle) {
    CAPTURE(needle);
    try {
      mr::cpu::admit(r, policy, in, out);
      FAIL("no error");
    } catch (const mr::error& e) {
      CHECK(std::string(e.what()).find(needle) != std::string::npos);
    }
  };
  auto in = admission_cases::admission_inputs_of(b, b.z.data());
  {  // cosine with zero or non-finite norms is rejected with a clear error.
    auto xn = b.xn;
    xn[3] = 0.0f;
    auto bad = in;
    bad.hidden_norms = xn.data();
    expect_error(ad::cipher_strict(0.0f), bad, "hidden_norms[3] (= 0.000000) must be finite and > 0");
    auto wn = b.wn;
    wn[5] = std::numeric_limits<float>::quiet_NaN();
    bad = in;
    bad.weight_norms = wn.data();
    expect_error(ad::cipher_reroute(0.0f), bad, "weight_norms[5]");
    wn[5] = -1.0f;
    expect_error(ad::locmoe(1.0f), bad, "weight_norms[5]");
    bad = in;
    bad.hidden_norms = nullptr;
    expect_error(ad::cipher_strict(0.0f), bad, "hidden_norms is null");
    // Norms are not needed (nor read) by the other affinities.
    bad.weight_norms = nullptr;
    CHECK_NOTHROW(mr::cpu::admit(r, ad::capacity_probs(1.0f), bad, out));
  }
  auto p = ad::capacity_probs(1.0f);
  p.threshold = std::numeric_limits<float>::quiet_NaN();
  expect_error(p, in, "threshold is NaN");
  expect_error(ad::capacity_probs(-1.0f), in, "capacity_factor (= -1.000000) must be finite and >= 0");
  expect_error(ad::capacity_probs(finf), in, "capacity_factor");
  expect_error(ad::capacity_position(1.0f, -2), in, "min_capacity (= -2)");
  auto pos = ad::capacity_position(1.0f);
  pos.threshold = 0.5f;
  expect_error(pos, in, "must be -inf with position affinity");
  auto rr = ad::cipher_reroute(0.0f);
  rr.overflow.fill_factor = -1.0f;
  expect_error(rr, in, "overflow.fill_factor");
  rr = ad::cipher_reroute(0.0f);
  rr.overflow.max_rounds = -3;
  expect_error(rr, in, "overflow.max_rounds");
  {
    auto bad = in;
    auto routed = b.routed;
    routed[7] = 8;
    bad.routed_indices = routed.data();
    expect_error(ad::capacity_probs(1.0f), bad, "routed_indices[7] (= 8) is not an expert");
    routed[7] = routed[6];
    expect_error(ad::capacity_probs(1.0f), bad, "selects expert");
  }
  {
    auto bad = in;
    std::vector<std::int32_t> groups(b.N, 0);
    groups[4] = 2;
    bad.group_ids = groups.data();
    bad.num_groups = 2;
    expect_error(ad::capacity_probs(1.0f), bad, "group_ids[4] (= 2) is outside [0, num_groups = 2)");
    bad.num_groups = 0;
    expect_error(ad::capacity_probs(1.0f), bad, "num_groups (= 0) must be >= 1");
  }
  {
    auto bad = in;
    std::vector<std::int64_t> cap(b.E, 1);
    cap[2] = -1;
    bad.capacity = cap.data();
    expect_error(ad::capacity_probs(1.0f), bad, "capacity[2] (= -1) must be >= 0");
  }
  {
    auto bad = in;
    bad.routed_gates = nullptr;
    expect_error(ad::capacity_probs(1.0f), bad, "routed_gates is null");
    bad = in;
    bad.num_experts = 1;  // top_k = 2 > E
    expect_error(ad::capacity_probs(1.0f), bad, "top_k");
  }
  CHECK_THROWS_AS(mr::cpu::admit(r, ad::capacity_probs(1.0f), in, mr::admission_outputs{nullptr, gates.data()}), mr::error);
}

TEST_CASE("admission: the probability and cosine affinities are the documented values") {
  std::mt19937 rng(61);
  const int E = 37;
  const std::vector<float> z = make_logits(rng, 1, E, 0);
  double m = -1e300, sum = 0.0;
  for (float x : z) m = std::max<double>(m, x);
  for (float x : z) sum += std::exp(x - m);
  for (int e = 0; e < E; ++e) {
    const double s = std::exp(z[e] - m) / sum;
    CHECK(ad::affinity_of<ad::probability>(softmax_router{}, z.data(), E, e) == doctest::Approx(s).epsilon(2e-6));
    CHECK(ad::affinity_of<ad::probability>(mixtral_router{}, z.data(), E, e) == doctest::Approx(s).epsilon(2e-6));
    CHECK(ad::affinity_of<ad::probability>(sigmoid_router{}, z.data(), E, e) ==
          doctest::Approx(1.0 / (1.0 + std::exp(-static_cast<double>(z[e])))).epsilon(2e-6));
    CHECK(ad::affinity_of<ad::cosine>(softmax_router{}, z.data(), E, e, 2.0f, 0.5f) == z[e] / (2.0f * 0.5f));
    CHECK(ad::affinity_of<ad::logit>(softmax_router{}, z.data(), E, e) == z[e]);
    CHECK(ad::affinity_of<ad::position>(softmax_router{}, z.data(), E, e) == 0.0f);
  }
  CHECK(ad::capacity_from_factor(1.25, 0, 100, 6, 64) == 12);  // ceil(11.71875)
  CHECK(ad::capacity_from_factor(0.3, 0, 50, 1, 1) == 15);      // 50 * 0.3 rounds to 15.0 in double
  CHECK(ad::capacity_from_factor(1.1, 0, 70, 1, 7) == 11);      // 10 * 1.1 = 11.0 in double, as in Python
  CHECK(ad::capacity_from_factor(1.0f, 0, 64, 8, 64) == 8);     // exact: no rounding up
  CHECK(ad::capacity_from_factor(0.0f, 4, 64, 8, 64) == 4);
  CHECK(ad::capacity_from_factor(8.0f, 0, 0, 8, 64) == 0);
}

TEST_CASE("admission: results do not depend on the thread count") {
  auto r = mr::presets::qwen3();
  const batch b = make_batch(r, 71, 1500, 128, 0, 3);
  auto check = [&](auto p) {
    const result one = run_admit(r, p, b, 1), three = run_admit(r, p, b, 3);
    CHECK(one.idx == three.idx);
    CHECK(one.status == three.status);
    CHECK(std::memcmp(one.gates.data(), three.gates.data(), one.gates.size() * sizeof(float)) == 0);
  };
  check(ad::cipher_strict(0.02f, 1.0f));
  check(ad::cipher_reroute(0.0f, 1.0f, 1.0f));
  auto renorm = ad::capacity_probs(0.8f);
  renorm.overflow.renormalize = true;
  check(renorm);
}

// ---------------------------------------------------------------------------
// The gate rule (admission/gates.hpp) in double precision, and its gradient.

namespace admission_test {

enum class gk { softmax, sigmoid, sqrt_softplus, selected_softmax };

struct gate_spec {
  gk kind;
  bool normalize;
  double scale;
};

inline double score_of(gk kind, const std::vector<double>& z, int e) {
  switch (kind) {
    case gk::softmax: {
      double m = -1e300, s = 0.0;
      for (double x : z) m = std::max(m, x);
      for (double x : z) s += std::exp(x - m);
      return std::exp(z[e] - m) / s;
    }
    case gk::sigmoid: return 1.0 / (1.0 + std::exp(-z[e]));
    case gk::sqrt_softplus: return std::sqrt(std::max(z[e], 0.0) + std::log1p(std::exp(-std::fabs(z[e]))));
    default: return z[e];
  }
}

// g(z) for fixed routed / admitted indices (the rule of admission/gates.hpp).
inline std::vector<double> ref_gates(const gate_spec& sp, const std::vector<double>& z, const std::vector<int>& routed,
                                     const std::vector<int>& admitted, bool renorm) {
  const int K = static_cast<int>(routed.size());
  std::vector<double> sigma(K), phi(K, 0.0);
  for (int j = 0; j < K; ++j) {
    sigma[j] = score_of(sp.kind, z, routed[j]);
    if (admitted[j] >= 0) phi[j] = score_of(sp.kind, z, admitted[j]);
  }
  std::function<double(double)> y;
  if (sp.kind == gk::selected_softmax) {
    double m = -1e300, d = 0.0;
    for (double s : sigma) m = std::max(m, s);
    for (double s : sigma) d += std::exp(s - m);
    y = [=](double x) { return std::exp(x - m) / d * sp.scale; };
  } else if (sp.normalize) {
    double s = 1e-20;
    for (double x : sigma) s += x;
    y = [=](double x) { return x / s * sp.scale; };
  } else {
    y = [=](double x) { return x * sp.scale; };
  }
  std::vector<double> g(K);
  double total = 0.0, survived = 0.0;
  bool any_drop = false;
  for (int j = 0; j < K; ++j) {
    total += y(sigma[j]);
    g[j] = admitted[j] < 0 ? 0.0 : y(admitted[j] == routed[j] ? sigma[j] : phi[j]);
    survived += g[j];
    any_drop |= admitted[j] < 0;
  }
  if (renorm && any_drop && survived != 0.0)
    for (double& x : g) x *= total / survived;
  return g;
}

template <class Router, class Policy>
void check_gates_and_gradient(const Router& r, const Policy& p, gate_spec sp, std::uint32_t seed, int E, int N) {
  CAPTURE(seed);
  batch b = make_batch(r, seed, N, E, 0, 1, 1.0f);
  const int K = r.top_k;
  const result got = run_admit(r, p, b);
  const bool renorm = ad::renormalizes(p);
  // Forward: the library's gates against the double rule.
  int rerouted = 0, dropped = 0;
  for (std::int64_t t = 0; t < b.N; ++t) {
    std::vector<double> z(b.z.begin() + t * E, b.z.begin() + (t + 1) * E);
    std::vector<int> routed(b.routed.begin() + t * K, b.routed.begin() + (t + 1) * K);
    std::vector<int> admitted(got.idx.begin() + t * K, got.idx.begin() + (t + 1) * K);
    const std::vector<double> want = ref_gates(sp, z, routed, admitted, renorm);
    for (int j = 0; j < K; ++j) {
      CHECK(got.gates[t * K + j] == doctest::Approx(want[j]).epsilon(1e-5).scale(1e-6));
      rerouted += got.status[t * K + j] == 2;
      dropped += got.status[t * K + j] == 1;
    }
  }
  CHECK((Policy::reroutes ? rerouted : dropped) > 0);  // the inputs exercise the rule
  // Backward: cpu::admission_backward against central differences of the double rule.
  std::mt19937 rng(seed + 1000);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> dg(b.N * K), dz(b.N * E);
  for (auto& x : dg) x = u(rng);
  mr::route_inputs<float> rin{b.z.data(), b.N, E, b.bias.data()};
  mr::cpu::admission_backward(r, p, rin, mr::admission_backward_args{b.routed.data(), got.idx.data(), dg.data(), dz.data()});
  double worst = 0.0;
  for (std::int64_t t = 0; t < b.N; ++t) {
    std::vector<double> z(b.z.begin() + t * E, b.z.begin() + (t + 1) * E);
    std::vector<int> routed(b.routed.begin() + t * K, b.routed.begin() + (t + 1) * K);
    std::vector<int> admitted(got.idx.begin() + t * K, got.idx.begin() + (t + 1) * K);
    for (int e = 0; e < E; ++e) {
      const double h = 1e-6 * std::max(1.0, std::fabs(z[e]));
      auto zp = z, zm = z;
      zp[e] += h;
      zm[e] -= h;
      const auto gp = ref_gates(sp, zp, routed, admitted, renorm), gm = ref_gates(sp, zm, routed, admitted, renorm);
      double fd = 0.0;
      for (int j = 0; j < K; ++j) fd += dg[t * K + j] * (gp[j] - gm[j]) / (2 * h);
      const double err = std::fabs(dz[t * E + e] - fd) / (1e-3 + std::fabs(fd));
      worst = std::max(worst, err);
    }
  }
  CHECK(worst < 2e-3);
}

}  // namespace admission_test

TEST_CASE("admission: gates after drop / drop + renormalise / reroute, and their finite-difference gradient") {
  for (std::uint32_t seed : {81u, 82u}) {
    {
      auto r = with_k(softmax_router{}, 4);  // softmax, no normalisation
      const gate_spec sp{gk::softmax, false, 1.0};
      check_gates_and_gradient(r, ad::capacity_probs(0.6f), sp, seed, 12, 60);
      auto renorm = ad::capacity_probs(0.6f);
      renorm.overflow.renormalize = true;
      check_gates_and_gradient(r, renorm, sp, seed, 12, 60);
      check_gates_and_gradient(r, ad::cipher_reroute(-0.2f, 1.0, 1.5), sp, seed, 12, 60);
    }
    {
      auto r = mr::presets::qwen3();  // softmax, normalised
      r.scaling_factor = 1.7f;
      const gate_spec sp{gk::softmax, true, 1.7};
      auto renorm = ad::cipher_strict(0.0f, 0.7f);
      renorm.overflow.renormalize = true;
      check_gates_and_gradient(r, renorm, sp, seed, 24, 50);
      check_gates_and_gradient(r, ad::cipher_reroute(0.0f, 1.0, 1.5), sp, seed, 24, 50);
    }
    {
      auto r = with_k(sigmoid_router{}, 3);
      r.normalize = true;
      r.scaling_factor = 2.5f;
      const gate_spec sp{gk::sigmoid, true, 2.5};
      auto renorm = ad::capacity_probs(0.5f);
      renorm.overflow.renormalize = true;
      check_gates_and_gradient(r, renorm, sp, seed, 10, 60);
      auto rr = ad::policy<ad::logit, ad::reroute>{};
      rr.capacity_factor = 1.0;
      rr.overflow.fill_factor = 1.5;
      check_gates_and_gradient(r, rr, sp, seed, 10, 60);
    }
    {
      auto r = mr::presets::deepseek_v4();
      const gate_spec sp{gk::sqrt_softplus, true, 1.5};
      check_gates_and_gradient(r, ad::cipher_reroute(0.0f, 1.0, 1.5), sp, seed, 16, 50);
      auto renorm = ad::capacity_probs(0.6f);
      renorm.overflow.renormalize = true;
      check_gates_and_gradient(r, renorm, sp, seed, 16, 50);
    }
    {
      auto r = with_k(mixtral_router{}, 3);
      r.scaling_factor = 0.8f;
      const gate_spec sp{gk::selected_softmax, false, 0.8};
      check_gates_and_gradient(r, ad::cipher_reroute(-0.5f, 1.0, 1.5), sp, seed, 9, 60);
      auto renorm = ad::capacity_position(0.5f);
      renorm.overflow.renormalize = true;
      check_gates_and_gradient(r, renorm, sp, seed, 9, 60);
    }
  }
}

TEST_CASE("admission: renormalised survivors keep the token's gate sum; untouched tokens keep their bits") {
  auto r = mr::presets::qwen3();
  const batch b = make_batch(r, 91, 200, 32);
  auto p = ad::capacity_probs(0.7f);
  p.overflow.renormalize = true;
  const result got = run_admit(r, p, b);
  int renormalised = 0;
  for (std::int64_t t = 0; t < b.N; ++t) {
    double before = 0.0, after = 0.0;
    bool lost = false, any = false;
    for (int j = 0; j < 8; ++j) {
      before += b.gates[t * 8 + j];
      after += got.gates[t * 8 + j];
      lost |= got.idx[t * 8 + j] < 0;
      any |= got.idx[t * 8 + j] >= 0;
    }
    if (!lost) {
      CHECK(std::memcmp(&got.gates[t * 8], &b.gates[t * 8], 8 * sizeof(float)) == 0);
    } else if (any) {
      CHECK(after == doctest::Approx(before).epsilon(1e-6));
      ++renormalised;
    } else {
      CHECK(after == 0.0);
    }
  }
  CHECK(renormalised > 0);
}

TEST_CASE("admission: the backward of an untouched result is cpu::backward, bit for bit") {
  auto check = [](auto r, std::uint32_t seed) {
    const batch b = make_batch(r, seed, 64, 24);
    const int K = r.top_k;
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> dg(b.N * K), dz1(b.N * 24), dz2(b.N * 24);
    for (auto& x : dg) x = u(rng);
    mr::route_inputs<float> in{b.z.data(), b.N, 24, b.bias.data()};
    mr::cpu::backward(r, in, mr::backward_args{b.routed.data(), dg.data(), dz1.data()});
    auto p = ad::capacity_probs(100.0f);
    p.overflow.renormalize = true;
    const result got = run_admit(r, p, b);
    REQUIRE(got.idx == b.routed);
    mr::cpu::admission_backward(r, p, in, mr::admission_backward_args{b.routed.data(), got.idx.data(), dg.data(), dz2.data()});
    CHECK(std::memcmp(dz1.data(), dz2.data(), dz1.size() * sizeof(float)) == 0);
  };
  check(mr::presets::qwen3(), 101);
  check(mr::presets::deepseek_v2_lite(), 102);
  check(mr::presets::deepseek_v4(), 103);
  check(with_k(mixtral_router{}, 2), 104);
  check(with_k(sigmoid_router{}, 5), 105);
}

TEST_CASE("admission: a slot rerouted away from routed scores of 0 has a finite gradient (the limit)") {
  // Every routed gate input is 0 (beside a +inf logit, or at -inf logits: a prior override or a replay
  // can route there), so S = 1e-20 and the exact dL/dsigma overflows fp32; it must not turn into
  // 0 * inf = NaN in dL/dz. Regression for a NaN the random Python cases found.
  const std::vector<std::int32_t> routed = {0, 3}, admitted = {2, 3};  // slot 0 rerouted to expert 2
  const std::vector<float> dg = {0.75f, -0.5f};
  auto backward = [&](const auto& r, const std::vector<float>& z) {
    std::vector<float> dz(z.size(), -7.0f);
    mr::route_inputs<float> in{z.data(), 1, static_cast<int>(z.size())};
    mr::cpu::admission_backward(r, ad::cipher_reroute(0.0f, 1.0f, 1.0f), in,
                                mr::admission_backward_args{routed.data(), admitted.data(), dg.data(), dz.data()});
    return dz;
  };
  // softmax, normalised: expert 2 holds every probability; in the limit of a huge logit dL/dz = 0.
  auto qwen = with_k(mr::presets::qwen3(), 2);
  for (float x : backward(qwen, {0.5f, -1.0f, finf, 2.0f, 0.25f})) CHECK(x == 0.0f);
  // sigmoid, normalised: routed experts at -inf (score 0, derivative 0); the rerouted gate is
  // sigma(3) / 1e-20 * scale, so dL/dz_2 = 0.75 * 2.5 * sigma'(3) / 1e-20.
  auto sig = with_k(sigmoid_router{}, 2);
  sig.normalize = true;
  sig.scaling_factor = 2.5f;
  const std::vector<float> dz = backward(sig, {-finf, 1.0f, 3.0f, -finf, 0.5f});
  const double s3 = 1.0 / (1.0 + std::exp(-3.0));
  CHECK(dz[0] == 0.0f);
  CHECK(dz[1] == 0.0f);
  CHECK(dz[2] == doctest::Approx(0.75 * 2.5 * s3 * (1.0 - s3) / 1e-20).epsilon(1e-5));
  CHECK(dz[3] == 0.0f);
  CHECK(dz[4] == 0.0f);
}

// ---------------------------------------------------------------------------
// Token mask (docs/policies.md, "Token mask"): on the valid tokens admission
// and expert choice equal the calls on the batch without the masked tokens
// (ranks break ties by token index, whose order compaction keeps); masked
// tokens get -1 / 0 / dropped, count nowhere, and are never read.

namespace admission_test {

batch without_masked(const batch& b, const std::vector<std::uint8_t>& mask) {
  batch v = b;
  v.z.clear(), v.xn.clear(), v.groups.clear(), v.routed.clear(), v.gates.clear();
  for (std::int64_t t = 0; t < b.N; ++t) {
    if (mask[t] == 0) continue;
    v.z.insert(v.z.end(), b.z.begin() + t * b.E, b.z.begin() + (t + 1) * b.E);
    v.routed.insert(v.routed.end(), b.routed.begin() + t * b.K, b.routed.begin() + (t + 1) * b.K);
    v.gates.insert(v.gates.end(), b.gates.begin() + t * b.K, b.gates.begin() + (t + 1) * b.K);
    v.xn.push_back(b.xn[t]);
    if (!b.groups.empty()) v.groups.push_back(b.groups[t]);
  }
  v.N = static_cast<std::int64_t>(v.xn.size());
  return v;
}

// b with garbage in the masked tokens' inputs.
batch with_garbage(batch b, const std::vector<std::uint8_t>& mask) {
  for (std::int64_t t = 0; t < b.N; ++t) {
    if (mask[t] != 0) continue;
    std::fill(b.z.begin() + t * b.E, b.z.begin() + (t + 1) * b.E, std::numeric_limits<float>::quiet_NaN());
    std::fill(b.routed.begin() + t * b.K, b.routed.begin() + (t + 1) * b.K, 1 << 20);
    b.xn[t] = -1.0f;
    if (!b.groups.empty()) b.groups[t] = -3;
  }
  return b;
}

template <class Router, class Policy>
void check_masked_admission(const Router& r, const Policy& p, const batch& b, const std::vector<std::uint8_t>& mask,
                            const char* what) {
  CAPTURE(what);
  const batch padded = with_garbage(b, mask);
  result got;
  got.idx.assign(b.N * b.K, -7);
  got.gates.assign(b.N * b.K, -7.0f);
  got.status.assign(b.N * b.K, -7);
  auto in = admission_cases::admission_inputs_of(padded, padded.z.data());
  in.token_mask = mask.data();
  mr::admission_outputs out{got.idx.data(), got.gates.data(), got.status.data(), nullptr};
  got.rep = mr::cpu::admit(r, p, in, out, mr::cpu::execution{2});
  const result want = run_admit(r, p, without_masked(b, mask));
  CHECK(admission_cases::same_report(got.rep, want.rep));
  std::int64_t v = 0;
  for (std::int64_t t = 0; t < b.N; ++t) {
    for (int j = 0; j < b.K; ++j) {
      const std::int64_t s = t * b.K + j, w = v * b.K + j;
      CHECK(got.idx[s] == (mask[t] ? want.idx[w] : -1));
      CHECK(got.gates[s] == (mask[t] ? want.gates[w] : 0.0f));
      CHECK(got.status[s] == (mask[t] ? want.status[w] : static_cast<std::int8_t>(ad::slot_status::dropped)));
    }
    v += mask[t] != 0;
  }
}

}  // namespace admission_test

TEST_CASE("admission: a token mask equals admitting the batch without the masked tokens") {
  for (int G : {1, 3}) {
    const auto r = with_k(softmax_router{}, 3);
    const batch b = make_batch(r, 41, 90, 12, 4, G, 1.5f);  // ties, groups, overflow
    std::vector<std::uint8_t> mask(b.N);
    for (std::int64_t t = 0; t < b.N; ++t) mask[t] = (t % 5 == 2 || t < 4) ? 0 : 1;
    check_masked_admission(r, ad::cipher_strict(0.05f, 1.0f), b, mask, "cipher_strict");
    check_masked_admission(r, ad::cipher_reroute(-0.5f, 1.0f, 0.75f), b, mask, "cipher_reroute");
    check_masked_admission(r, ad::capacity_position(0.8f), b, mask, "capacity_position");
    check_masked_admission(r, ad::capacity_probs(0.8f, 2), b, mask, "capacity_probs, min_capacity");
    check_masked_admission(r, ad::capacity_gate(0.8f), b, mask, "capacity_gate");
    check_masked_admission(r, ad::dropless(), b, mask, "dropless");
    check_masked_admission(r, ad::capacity_probs(0.8f), b, std::vector<std::uint8_t>(b.N, 0), "all masked");
    check_masked_admission(r, ad::capacity_probs(0.8f), b, std::vector<std::uint8_t>(b.N, 7), "none masked");
  }
}

TEST_CASE("expert choice: a token mask equals choosing among the valid tokens only") {
  for (int G : {1, 2}) {
    const auto r = with_k(softmax_router{}, 2);
    const batch b = make_batch(r, 43, 70, 37, 3, G);
    std::vector<std::uint8_t> mask(b.N);
    for (std::int64_t t = 0; t < b.N; ++t) mask[t] = t % 3 != 0;
    const batch padded = with_garbage(b, mask), compact = without_masked(b, mask);
    mr::selection::expert_choice p;
    p.capacity_factor = 1.25;
    auto run = [&](const batch& x, const std::uint8_t* m, std::vector<std::int32_t>& idx, std::vector<float>& gates,
                   std::vector<std::int32_t>& per_token, std::vector<float>& dz) {
      idx.assign(x.N * x.E, -7);
      gates.assign(x.N * x.E, -7.0f);
      per_token.assign(x.N, -7);
      auto in = admission_cases::expert_choice_inputs_of(x);
      in.token_mask = m;
      const auto rep = mr::cpu::expert_choice(p, in, {idx.data(), gates.data(), per_token.data()});
      std::vector<float> dg(x.N * x.E);
      for (std::size_t i = 0; i < dg.size(); ++i) dg[i] = static_cast<float>(i % x.E % 11) - 5.0f;
      dz.assign(x.N * x.E, -7.0f);
      mr::cpu::expert_choice_backward(in, idx.data(), dg.data(), dz.data());
      return rep;
    };
    std::vector<std::int32_t> idx, per, cidx, cper;
    std::vector<float> gates, dz, cgates, cdz;
    const auto rep = run(padded, mask.data(), idx, gates, per, dz);
    const auto want = run(compact, nullptr, cidx, cgates, cper, cdz);
    CHECK(rep.assignments == want.assignments);
    CHECK(rep.tokens_without_experts == want.tokens_without_experts);
    CHECK(rep.max_experts_per_token == want.max_experts_per_token);
    std::int64_t v = 0;
    for (std::int64_t t = 0; t < b.N; ++t) {
      CHECK(per[t] == (mask[t] ? cper[v] : 0));
      for (int e = 0; e < b.E; ++e) {
        CHECK(idx[t * b.E + e] == (mask[t] ? cidx[v * b.E + e] : -1));
        CHECK(gates[t * b.E + e] == (mask[t] ? cgates[v * b.E + e] : 0.0f));
        CHECK(dz[t * b.E + e] == (mask[t] ? cdz[v * b.E + e] : 0.0f));
        if (!mask[t]) CHECK(!std::signbit(dz[t * b.E + e]));
      }
      v += mask[t] != 0;
    }
  }
}
