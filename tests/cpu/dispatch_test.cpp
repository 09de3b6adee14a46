// Dispatch metadata, expert-choice selection and workload statistics
// (docs/policies.md sections 2, 4 and 6) against brute-force references written here.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <moe_route/admission/admission.hpp>
#include <moe_route/admission/dispatch.hpp>
#include <moe_route/analysis/workload.hpp>
#include <moe_route/backend/cpu/admit.hpp>
#include <moe_route/backend/cpu/dispatch.hpp>
#include <moe_route/backend/cpu/expert_choice.hpp>
#include <moe_route/moe_route.hpp>
#include <moe_route/selection/expert_choice.hpp>

namespace dispatch_test {

namespace mr = moe_route;
namespace ad = moe_route::admission;

struct layout {
  std::vector<std::int64_t> counts, offsets, perm, inverse, ranks;
  std::int64_t rows = 0;
};

inline layout run_dispatch(const std::vector<std::int32_t>& idx, std::int64_t N, int S, int E, int align, int R,
                           const std::int32_t* rank_map = nullptr, std::int64_t capacity = 0) {
  layout l;
  l.counts.assign(E, -5);
  l.offsets.assign(E + 1, -5);
  l.perm.assign(mr::dispatch_rows_bound(N, S, E, align, capacity), -5);
  l.inverse.assign(N * S, -5);
  l.ranks.assign(R, -5);
  mr::dispatch_inputs in{idx.data(), N, S, E, align, R, rank_map, capacity};
  l.rows = mr::cpu::dispatch(in, mr::dispatch_outputs{l.counts.data(), l.offsets.data(), l.perm.data(), l.inverse.data(),
                                                       l.ranks.data()});
  return l;
}

// The reference: for each expert, its slots in increasing slot id, in a block
// of its count (or the fixed capacity) rounded up to align.
inline void check_layout(const layout& l, const std::vector<std::int32_t>& idx, std::int64_t N, int S, int E, int align,
                         int R, const std::int32_t* rank_map = nullptr, std::int64_t capacity = 0) {
  std::vector<std::vector<std::int64_t>> per(E);
  for (std::int64_t s = 0; s < N * S; ++s)
    if (idx[s] >= 0) per[idx[s]].push_back(s);
  std::int64_t row = 0;
  std::vector<std::int64_t> want_perm(l.perm.size(), -1), want_inv(N * S, -1), want_ranks(R, 0);
  for (int e = 0; e < E; ++e) {
    CHECK(l.counts[e] == static_cast<std::int64_t>(per[e].size()));
    CHECK(l.offsets[e] == row);
    for (std::size_t i = 0; i < per[e].size(); ++i) {
      want_perm[row + i] = per[e][i];
      want_inv[per[e][i]] = row + static_cast<std::int64_t>(i);
    }
    const std::int64_t block = capacity > 0 ? capacity : static_cast<std::int64_t>(per[e].size());
    const std::int64_t padded = (block + align - 1) / align * align;
    CHECK(padded % align == 0);
    row += padded;
    want_ranks[rank_map ? rank_map[e] : e / (E / R)] += static_cast<std::int64_t>(per[e].size());
  }
  CHECK(l.offsets[E] == row);
  CHECK(l.rows == row);
  CHECK(l.perm == want_perm);
  CHECK(l.inverse == want_inv);
  CHECK(l.ranks == want_ranks);
  // The combine step: inverse then permutation is the identity on executed slots.
  for (std::int64_t s = 0; s < N * S; ++s)
    if (l.inverse[s] >= 0) CHECK(l.perm[l.inverse[s]] == s);
}

inline std::vector<std::int32_t> random_indices(std::mt19937& rng, std::int64_t N, int S, int E, double drop) {
  std::vector<std::int32_t> idx(N * S);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<int> experts(E);
  for (std::int64_t t = 0; t < N; ++t) {
    for (int e = 0; e < E; ++e) experts[e] = e;
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int j = 0; j < S; ++j) idx[t * S + j] = u(rng) < drop ? -1 : experts[j % E];
  }
  return idx;
}

}  // namespace dispatch_test

using namespace dispatch_test;

TEST_CASE("dispatch: counts, padded offsets, permutation, inverse and rank counts match the reference") {
  std::mt19937 rng(5);
  for (int E : {1, 7, 16, 64}) {
    for (int S : {1, 2, 6}) {
      if (S > E) continue;
      const std::int64_t N = 97;
      const auto idx = random_indices(rng, N, S, E, 0.2);
      for (int align : {1, 3, 8, 128})
        for (int R : {1, 2, 4, 8}) {
          if (E % R) continue;
          CAPTURE(E);
          CAPTURE(S);
          CAPTURE(align);
          CAPTURE(R);
          check_layout(run_dispatch(idx, N, S, E, align, R), idx, N, S, E, align, R);
        }
      // A custom expert -> rank map.
      std::vector<std::int32_t> map(E);
      for (int e = 0; e < E; ++e) map[e] = (e * 5 + 1) % 3;
      check_layout(run_dispatch(idx, N, S, E, 4, 3, map.data()), idx, N, S, E, 4, 3, map.data());
    }
  }
}

TEST_CASE("dispatch with a fixed capacity: every expert owns the same rows, empty ones -1") {
  std::mt19937 rng(13);
  for (int E : {1, 7, 16, 33}) {
    for (int S : {1, 2, 6}) {
      if (S > E) continue;
      const std::int64_t N = 61;
      const auto idx = random_indices(rng, N, S, E, 0.3);
      std::int64_t most = 0;
      for (int e = 0; e < E; ++e) most = std::max<std::int64_t>(most, std::count(idx.begin(), idx.end(), e));
      for (const std::int64_t capacity : {most, most + 1, most + 9, 2 * N})
        for (int align : {1, 4, 16}) {
          CAPTURE(E);
          CAPTURE(S);
          CAPTURE(capacity);
          CAPTURE(align);
          const layout l = run_dispatch(idx, N, S, E, align, 1, nullptr, capacity);
          check_layout(l, idx, N, S, E, align, 1, nullptr, capacity);
          const std::int64_t block = (capacity + align - 1) / align * align;
          CHECK(l.rows == E * block);  // a static shape
          CHECK(static_cast<std::int64_t>(l.perm.size()) == E * block);
        }
      // More slots for one expert than the capacity: rejected, nothing written.
      if (most > 0) {
        std::vector<std::int64_t> counts(E, -5), offsets(E + 1, -5);
        const std::string message = "more than capacity (= " + std::to_string(most - 1) + ") slots";
        CHECK_THROWS_WITH_AS(mr::cpu::dispatch(mr::dispatch_inputs{idx.data(), N, S, E, 1, 1, nullptr, most - 1},
                                               mr::dispatch_outputs{counts.data(), offsets.data()}),
                             doctest::Contains(message.c_str()), mr::error);
        CHECK(std::all_of(counts.begin(), counts.end(), [](std::int64_t c) { return c == -5; }));
      }
    }
  }
  // N = 0: E blocks of empty rows.
  const layout empty = run_dispatch({}, 0, 2, 4, 1, 1, nullptr, 3);
  CHECK(empty.rows == 12);
  CHECK(std::all_of(empty.perm.begin(), empty.perm.end(), [](std::int64_t r) { return r == -1; }));
}

TEST_CASE("dispatch: N = 0, everything dropped, optional outputs") {
  const std::vector<std::int32_t> none;
  const layout empty = run_dispatch(none, 0, 4, 8, 16, 2);
  CHECK(std::all_of(empty.counts.begin(), empty.counts.end(), [](std::int64_t c) { return c == 0; }));
  CHECK(std::all_of(empty.offsets.begin(), empty.offsets.end(), [](std::int64_t c) { return c == 0; }));
  CHECK(std::all_of(empty.perm.begin(), empty.perm.end(), [](std::int64_t c) { return c == -1; }));
  const std::vector<std::int32_t> dropped(30 * 3, -1);
  const layout d = run_dispatch(dropped, 30, 3, 8, 4, 4);
  CHECK(d.rows == 0);
  CHECK(std::all_of(d.inverse.begin(), d.inverse.end(), [](std::int64_t c) { return c == -1; }));
  CHECK(std::all_of(d.ranks.begin(), d.ranks.end(), [](std::int64_t c) { return c == 0; }));
  // Only counts and offsets.
  std::mt19937 rng(9);
  const auto idx = random_indices(rng, 50, 2, 8, 0.1);
  std::vector<std::int64_t> counts(8), offsets(9);
  CHECK(mr::cpu::dispatch(mr::dispatch_inputs{idx.data(), 50, 2, 8, 2, 1, nullptr},
                          mr::dispatch_outputs{counts.data(), offsets.data()}) == offsets[8]);
  const layout full = run_dispatch(idx, 50, 2, 8, 2, 1);
  CHECK(counts == full.counts);
  CHECK(offsets == full.offsets);
}

TEST_CASE("dispatch: argument errors") {
  std::vector<std::int32_t> idx{0, 1, 2, 3};
  std::vector<std::int64_t> counts(4), offsets(5);
  const mr::dispatch_outputs out{counts.data(), offsets.data()};
  auto expect = [&](mr::dispatch_inputs in, const char* needle) {
    CAPTURE(needle);
    try {
      mr::cpu::dispatch(in, out);
      FAIL("no error");
    } catch (const mr::error& e) {
      CHECK(std::string(e.what()).find(needle) != std::string::npos);
    }
  };
  expect({idx.data(), 2, 2, 4, 0, 1, nullptr}, "align (= 0) must be >= 1");
  expect({idx.data(), 2, 2, 4, 1, 1, nullptr, -1}, "capacity (= -1) must be >= 0");
  expect({idx.data(), 2, 2, 4, 1, 3, nullptr}, "num_ranks (= 3) must divide num_experts (= 4)");
  expect({idx.data(), 2, 0, 4, 1, 1, nullptr}, "slots_per_token (= 0)");
  // Row counts past 64 bits, refused before any output is sized from them.
  constexpr std::int64_t most = std::numeric_limits<std::int64_t>::max();
  expect({idx.data(), 2, 2, 4, 8, 1, nullptr, most - 3},
         "capacity (= 9223372036854775804) padded to align (= 8) for 4 experts needs more rows than 64 bits count");
  expect({idx.data(), 2, 2, 4, 1, 1, nullptr, std::int64_t{1} << 62}, "needs more rows than 64 bits count");
  expect({idx.data(), most / 2 + 1, 2, 4, 1, 1, nullptr}, "num_tokens (= 4611686018427387904) * slots_per_token (= 2)");
  expect({idx.data(), most / 2 - 10, 2, 4096, 1 << 30, 1, nullptr}, "padded to align (= 1073741824) for 4096 experts");
  // The largest fixed capacity that still counts: E * C rows, exactly.
  CHECK_NOTHROW(mr::cpu::dispatch({idx.data(), 2, 2, 4, 1, 1, nullptr, most / 4}, out));
  CHECK(offsets[4] == 4 * (most / 4));
  expect({nullptr, 2, 2, 4, 1, 1, nullptr}, "indices is null");
  idx[2] = 4;
  expect({idx.data(), 2, 2, 4, 1, 1, nullptr}, "indices[2] (= 4) must be -1 or an expert");
  idx[2] = -2;
  expect({idx.data(), 2, 2, 4, 1, 1, nullptr}, "indices[2] (= -2)");
  idx[2] = 2;
  std::vector<std::int32_t> map{0, 1, 2, 0};
  expect({idx.data(), 2, 2, 4, 1, 2, map.data()}, "expert_rank[2] (= 2) is outside [0, num_ranks = 2)");
  CHECK_THROWS_AS(mr::cpu::dispatch({idx.data(), 2, 2, 4, 1, 1, nullptr}, mr::dispatch_outputs{nullptr, offsets.data()}),
                  mr::error);
}

TEST_CASE("dispatch of admitted results: route -> admit -> dispatch, and the workload statistics") {
  auto r = mr::presets::qwen3();
  const std::int64_t N = 300;
  const int E = mr::presets::qwen3_experts, K = r.top_k;
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.0f, 1.5f);
  std::vector<float> z(N * E);
  for (auto& x : z) x = nd(rng);
  for (std::int64_t t = 0; t < N; ++t)
    for (int e = 0; e < 16; ++e) z[t * E + e] += 2.0f;  // hot experts
  std::vector<std::int32_t> routed(N * K), admitted(N * K);
  std::vector<float> gates(N * K), agates(N * K);
  mr::cpu::route(r, mr::route_inputs<float>{z.data(), N, E}, mr::route_outputs{routed.data(), gates.data()});
  mr::admission_inputs<float> in;
  in.logits = z.data();
  in.num_tokens = N;
  in.num_experts = E;
  in.routed_indices = routed.data();
  in.routed_gates = gates.data();
  const auto rep = mr::cpu::admit(r, ad::capacity_probs(1.0), in, mr::admission_outputs{admitted.data(), agates.data()});
  CHECK(rep.dropped > 0);
  const layout l = run_dispatch(admitted, N, K, E, 8, 4);
  check_layout(l, admitted, N, K, E, 8, 4);
  const auto w = mr::analysis::workload(admitted.data(), N, K, E);
  CHECK(w.executed == rep.kept);
  CHECK(w.dropped == rep.dropped);
  CHECK(w.loads == l.counts);
  CHECK(w.tokens_without_experts == rep.tokens_without_experts);
  const std::int64_t cap = ad::capacity_from_factor(1.0, 0, N, K, E);
  CHECK(w.max_load <= cap);
  const auto before = mr::analysis::workload(routed.data(), N, K, E);
  CHECK(before.dropped == 0);
  CHECK(before.max_load > cap);
  CHECK(w.top1_share < before.top1_share);
}

TEST_CASE("workload statistics: hand-computed values") {
  // N = 4 tokens, S = 2, E = 4: loads (3, 1, 1, 0), two dropped slots.
  const std::vector<std::int32_t> idx{0, 1, 0, -1, 0, 2, -1, -1};
  const auto w = mr::analysis::workload(idx.data(), 4, 2, 4);
  CHECK(w.tokens == 4);
  CHECK(w.slots == 8);
  CHECK(w.executed == 5);
  CHECK(w.dropped == 3);
  CHECK(w.dropped_rate == doctest::Approx(3.0 / 8.0));
  CHECK(w.loads == std::vector<std::int64_t>{3, 1, 1, 0});
  CHECK(w.max_load == 3);
  CHECK(w.top1_share == doctest::Approx(0.6));
  CHECK(w.peak_to_mean == doctest::Approx(3.0 / (5.0 / 4.0)));
  const double h = -(0.6 * std::log(0.6) + 2 * 0.2 * std::log(0.2));
  CHECK(w.load_entropy == doctest::Approx(h));
  CHECK(w.normalized_load_entropy == doctest::Approx(h / std::log(4.0)));
  CHECK(w.experts_per_token == doctest::Approx(5.0 / 4.0));
  CHECK(w.experts_per_token_histogram == std::vector<std::int64_t>{1, 1, 2});
  CHECK(w.tokens_without_experts == 1);
  // Nothing executed: shares are 0, not NaN.
  const std::vector<std::int32_t> none(6, -1);
  const auto z = mr::analysis::workload(none.data(), 3, 2, 5);
  CHECK(z.top1_share == 0.0);
  CHECK(z.peak_to_mean == 0.0);
  CHECK(z.load_entropy == 0.0);
  CHECK(z.dropped_rate == 1.0);
  // Perfect balance: entropy log E, peak-to-mean 1.
  const std::vector<std::int32_t> flat{0, 1, 2, 3};
  const auto f = mr::analysis::workload(flat.data(), 2, 2, 4);
  CHECK(f.peak_to_mean == doctest::Approx(1.0));
  CHECK(f.normalized_load_entropy == doctest::Approx(1.0));
  CHECK_THROWS_AS(mr::analysis::workload(flat.data(), 2, 2, 3), mr::error);
  CHECK_THROWS_AS(mr::analysis::workload(flat.data(), 2, 0, 4), mr::error);
}

// ---------------------------------------------------------------------------
// Expert choice.

namespace dispatch_test {

struct ec_result {
  std::vector<std::int32_t> idx, per_token;
  std::vector<float> gates;
  mr::expert_choice_report rep;
};

inline ec_result run_ec(const mr::selection::expert_choice& p, const mr::expert_choice_inputs<float>& in, int threads = 1) {
  ec_result r;
  r.idx.assign(in.num_tokens * in.num_experts, -9);
  r.gates.assign(in.num_tokens * in.num_experts, -9.0f);
  r.per_token.assign(in.num_tokens, -9);
  r.rep = mr::cpu::expert_choice(p, in, mr::expert_choice_outputs{r.idx.data(), r.gates.data(), r.per_token.data()},
                                 mr::cpu::execution{threads, mr::cpu::instruction_set::best, 1});
  return r;
}

inline void check_ec(const mr::selection::expert_choice& p, const mr::expert_choice_inputs<float>& in) {
  const std::int64_t N = in.num_tokens;
  const int E = in.num_experts;
  const ec_result got = run_ec(p, in);
  // Scores: the library's softmax (checked against double below).
  using softmax_router = mr::router<mr::gating::softmax, mr::selection::top_k, 8>;
  std::vector<float> s(N * E);
  for (std::int64_t t = 0; t < N; ++t)
    for (int e = 0; e < E; ++e) s[t * E + e] = ad::affinity_of<ad::probability>(softmax_router{}, in.logits + t * E, E, e);
  auto group = [&](std::int64_t t) { return in.group_ids ? in.group_ids[t] : 0; };
  std::vector<std::vector<bool>> chosen(N, std::vector<bool>(E, false));
  for (int g = 0; g < in.num_groups; ++g) {
    std::vector<std::int64_t> members;
    for (std::int64_t t = 0; t < N; ++t)
      if (group(t) == g) members.push_back(t);
    const std::int64_t n_g = static_cast<std::int64_t>(members.size());
    for (int e = 0; e < E; ++e) {
      std::vector<std::int64_t> order = members;
      std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return s[a * E + e] > s[b * E + e]; });
      const std::int64_t c =
          in.capacity ? in.capacity[e]
                      : std::max<std::int64_t>(p.min_capacity, static_cast<std::int64_t>(std::ceil(
                                                                    static_cast<double>(n_g * p.top_k) / E * p.capacity_factor)));
      for (std::int64_t i = 0; i < std::min(c, n_g); ++i) chosen[order[i]][e] = true;
    }
  }
  std::int64_t total = 0, zero = 0, most = 0;
  for (std::int64_t t = 0; t < N; ++t) {
    int c = 0;
    for (int e = 0; e < E; ++e)
      if (chosen[t][e]) {
        CHECK(got.idx[t * E + c] == e);
        CHECK(std::memcmp(&got.gates[t * E + c], &s[t * E + e], sizeof(float)) == 0);
        ++c;
      }
    for (int j = c; j < E; ++j) {
      CHECK(got.idx[t * E + j] == -1);
      CHECK(got.gates[t * E + j] == 0.0f);
    }
    CHECK(got.per_token[t] == c);
    total += c;
    zero += c == 0;
    most = std::max<std::int64_t>(most, c);
  }
  CHECK(got.rep.assignments == total);
  CHECK(got.rep.tokens_without_experts == zero);
  CHECK(got.rep.max_experts_per_token == most);
  const ec_result three = run_ec(p, in, 3);
  CHECK(three.idx == got.idx);
  CHECK(std::memcmp(three.gates.data(), got.gates.data(), got.gates.size() * sizeof(float)) == 0);
}

inline std::vector<float> ec_logits(std::mt19937& rng, std::int64_t N, int E, int levels) {
  std::normal_distribution<float> nd(0.0f, 1.5f);
  std::vector<float> z(N * E);
  for (auto& x : z) {
    x = nd(rng);
    if (levels) x = std::round(x * levels) / levels;
  }
  for (std::int64_t t = 3; t < N; t += 5) std::copy(z.begin() + (t - 1) * E, z.begin() + t * E, z.begin() + t * E);
  return z;
}

}  // namespace dispatch_test

TEST_CASE("expert_choice: every expert takes its top-C tokens (ties to the lower token), groups, capacities") {
  std::mt19937 rng(23);
  for (int levels : {0, 1}) {
    const std::int64_t N = 120;
    const int E = 12;
    const auto z = ec_logits(rng, N, E, levels);
    mr::expert_choice_inputs<float> in;
    in.logits = z.data();
    in.num_tokens = N;
    in.num_experts = E;
    mr::selection::expert_choice p;
    check_ec(p, in);  // C = ceil(120 * 2 / 12) = 20
    p.capacity_factor = 1.3;
    p.top_k = 1;
    check_ec(p, in);
    p.capacity_factor = 0.0;
    p.min_capacity = 3;
    check_ec(p, in);
    std::vector<std::int32_t> groups(N);
    for (std::int64_t t = 0; t < N; ++t) groups[t] = static_cast<std::int32_t>((t * 7) % 4 == 1 ? 3 : t % 2);
    in.group_ids = groups.data();
    in.num_groups = 5;  // groups 2 and 4 empty
    p = mr::selection::expert_choice{};
    check_ec(p, in);
    std::vector<std::int64_t> cap{0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 1000};
    in.capacity = cap.data();
    check_ec(p, in);
  }
  {  // capacity >= N: every expert takes every token; capacity 0: nothing.
    const auto z = ec_logits(rng, 10, 4, 0);
    mr::expert_choice_inputs<float> in{z.data(), 10, 4};
    mr::selection::expert_choice p;
    p.capacity_factor = 100.0;
    const ec_result all = run_ec(p, in);
    CHECK(all.rep.assignments == 40);
    CHECK(all.rep.max_experts_per_token == 4);
    p.capacity_factor = 0.0;
    const ec_result none = run_ec(p, in);
    CHECK(none.rep.assignments == 0);
    CHECK(none.rep.tokens_without_experts == 10);
  }
  {  // E = 1
    const auto z = ec_logits(rng, 9, 1, 0);
    mr::expert_choice_inputs<float> in{z.data(), 9, 1};
    mr::selection::expert_choice p;
    p.top_k = 1;
    p.capacity_factor = 0.5;  // C = ceil(4.5) = 5
    check_ec(p, in);
    CHECK(run_ec(p, in).rep.assignments == 5);
  }
  {  // N = 1: C = ceil(1 * 2 / 6) = 1, so every expert takes the only token; N = 0: no work, null logits.
    const auto z = ec_logits(rng, 1, 6, 0);
    mr::expert_choice_inputs<float> in{z.data(), 1, 6};
    mr::selection::expert_choice p;
    check_ec(p, in);
    CHECK(run_ec(p, in).rep.assignments == 6);
    in = mr::expert_choice_inputs<float>{nullptr, 0, 6};
    const ec_result none = run_ec(p, in);
    CHECK(none.rep.assignments == 0);
    CHECK(none.rep.tokens_without_experts == 0);
    CHECK(none.rep.max_experts_per_token == 0);
    CHECK_NOTHROW(mr::cpu::expert_choice_backward(in, none.idx.data(), nullptr, nullptr));
  }
}

TEST_CASE("expert_choice: scores, dispatch with S = E, gradient, errors") {
  std::mt19937 rng(29);
  const std::int64_t N = 40;
  const int E = 8;
  const auto z = ec_logits(rng, N, E, 0);
  mr::expert_choice_inputs<float> in{z.data(), N, E};
  mr::selection::expert_choice p;
  const ec_result got = run_ec(p, in);
  // Gates are the softmax probabilities.
  for (std::int64_t t = 0; t < N; ++t) {
    double m = -1e300, sum = 0.0;
    for (int e = 0; e < E; ++e) m = std::max<double>(m, z[t * E + e]);
    for (int e = 0; e < E; ++e) sum += std::exp(z[t * E + e] - m);
    for (int j = 0; j < got.per_token[t]; ++j)
      CHECK(got.gates[t * E + j] == doctest::Approx(std::exp(z[t * E + got.idx[t * E + j]] - m) / sum).epsilon(2e-6));
  }
  check_layout(run_dispatch(got.idx, N, E, E, 4, 2), got.idx, N, E, E, 4, 2);
  const auto w = mr::analysis::workload(got.idx.data(), N, E, E);
  CHECK(w.executed == got.rep.assignments);
  CHECK(w.max_load == 10);  // every expert takes exactly C = ceil(40 * 2 / 8) = 10
  // Gradient of sum_j c_j g_j against central differences in double.
  std::vector<float> dg(N * E), dz(N * E);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& x : dg) x = u(rng);
  mr::cpu::expert_choice_backward(in, got.idx.data(), dg.data(), dz.data());
  for (std::int64_t t = 0; t < N; ++t) {
    auto loss = [&](std::vector<double> row) {
      double m = -1e300, sum = 0.0, l = 0.0;
      for (double x : row) m = std::max(m, x);
      for (double x : row) sum += std::exp(x - m);
      for (int j = 0; j < E; ++j)
        if (got.idx[t * E + j] >= 0) l += dg[t * E + j] * std::exp(row[got.idx[t * E + j]] - m) / sum;
      return l;
    };
    std::vector<double> row(z.begin() + t * E, z.begin() + (t + 1) * E);
    for (int e = 0; e < E; ++e) {
      auto p1 = row, m1 = row;
      p1[e] += 1e-6;
      m1[e] -= 1e-6;
      CHECK(dz[t * E + e] == doctest::Approx((loss(p1) - loss(m1)) / 2e-6).epsilon(1e-3).scale(1e-3));
    }
  }
  // Errors.
  std::vector<std::int32_t> idx(N * E);
  std::vector<float> gates(N * E);
  const mr::expert_choice_outputs out{idx.data(), gates.data()};
  p.capacity_factor = -1.0;
  CHECK_THROWS_WITH_AS(mr::cpu::expert_choice(p, in, out), doctest::Contains("expert_choice.capacity_factor"), mr::error);
  p = mr::selection::expert_choice{};
  p.top_k = 0;
  CHECK_THROWS_WITH_AS(mr::cpu::expert_choice(p, in, out), doctest::Contains("expert_choice.top_k (= 0)"), mr::error);
  p = mr::selection::expert_choice{};
  std::vector<std::int32_t> groups(N, 0);
  groups[7] = -1;
  auto bad = in;
  bad.group_ids = groups.data();
  CHECK_THROWS_WITH_AS(mr::cpu::expert_choice(p, bad, out), doctest::Contains("group_ids[7] (= -1)"), mr::error);
  CHECK_THROWS_AS(mr::cpu::expert_choice(p, in, mr::expert_choice_outputs{nullptr, gates.data()}), mr::error);
}
