// Fuzz target: cpu::expert_choice and its backward (docs/policies.md §2.7) on
// fuzzer-chosen shapes, groups, capacities (the factor rule or a caller
// array), token masks and values (NaN, +-inf, +-FLT_MAX, subnormals, ties):
//  - the scores: each gate is the double softmax of the sanitised row, within
//    the rounding of fp32 (tests/cpu/reference.hpp `scores`);
//  - the choice: in each group every expert takes exactly the top C_e valid
//    tokens by (score desc, token asc), ranked here on the library's fp32
//    scores (the canonical softmax, which the gates must equal bit for bit);
//    rows list the chosen experts in ascending order then -1 / 0; the
//    per-token counts and the report match;
//  - the backward: s * (ds - <ds, s>) in double, zero on masked rows;
//  - the same bits on 1 and n threads (one case in eight is repeated to 600
//    tokens, where the backend splits a call).
// The inputs are valid by construction, so any exception is a finding.
#define DOCTEST_CONFIG_DISABLE
#include <moe_route/admission/scores.hpp>
#include <moe_route/backend/cpu/expert_choice.hpp>
#include <moe_route/selection/expert_choice.hpp>

#include "cpu/reference.hpp"
#include "fuzz_input.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

namespace mr = moe_route;
namespace ad = moe_route::admission;

constexpr std::int64_t threaded_tokens = 600;

struct ec_case {
  mr::selection::expert_choice policy;
  std::int64_t N = 0;
  int E = 1;
  int groups = 1;
  int threads = 1;
  std::vector<float> logits;
  std::vector<std::int32_t> group_ids;  // empty: one group
  std::vector<std::int64_t> capacity;   // empty: the factor rule
  std::vector<std::uint8_t> mask;       // empty: every token valid
  std::vector<float> grad_gates;

  mr::expert_choice_inputs<float> inputs() const {
    mr::expert_choice_inputs<float> in;
    in.logits = logits.empty() ? nullptr : logits.data();
    in.num_tokens = N;
    in.num_experts = E;
    in.group_ids = group_ids.empty() ? nullptr : group_ids.data();
    in.num_groups = groups;
    in.capacity = capacity.empty() ? nullptr : capacity.data();
    in.token_mask = mask.empty() ? nullptr : mask.data();
    return in;
  }
  bool valid(std::int64_t t) const { return mask.empty() || mask[t] != 0; }
  int group(std::int64_t t) const { return group_ids.empty() ? 0 : group_ids[t]; }
};

ec_case decode(fuzz::input& in) {
  ec_case c;
  c.E = in.in(1, 40);
  c.N = in.in(0, 16);
  c.policy.top_k = in.in(1, 4);
  const double factors[] = {1.0, 0.5, 2.0, 0.0, 1.25, 100.0, 1e-9, 0.3};
  c.policy.capacity_factor = factors[in.in(0, 7)];
  c.policy.min_capacity = in.in(0, 3);
  c.threads = in.in(1, 3);
  c.logits.resize(static_cast<std::size_t>(c.N) * c.E);
  for (float& z : c.logits) z = in.hard_float();
  c.groups = in.in(1, 3);
  if (c.groups > 1)
    for (std::int64_t t = 0; t < c.N; ++t) c.group_ids.push_back(in.in(0, c.groups - 1));
  if (in.in(0, 3) == 0)
    for (int e = 0; e < c.E; ++e) c.capacity.push_back(in.in(0, 6));
  if (c.N > 0 && in.in(0, 7) == 0) {  // rows (and their groups) repeated
    const std::int64_t copies = (threaded_tokens + c.N - 1) / c.N;
    const std::vector<float> rows = c.logits;
    const std::vector<std::int32_t> ids = c.group_ids;
    for (std::int64_t i = 1; i < copies; ++i) {
      c.logits.insert(c.logits.end(), rows.begin(), rows.end());
      c.group_ids.insert(c.group_ids.end(), ids.begin(), ids.end());
    }
    c.N *= copies;
  }
  if (in.in(0, 3) == 0)
    for (std::int64_t t = 0; t < c.N; ++t) {
      c.mask.push_back(in.in(0, 2) != 0);
      if (c.mask[t] != 0) continue;
      // A padding row may hold anything: none of it may be read.
      std::fill_n(c.logits.begin() + t * c.E, c.E, std::numeric_limits<float>::quiet_NaN());
      if (!c.group_ids.empty()) c.group_ids[t] = 1 << 30;
    }
  for (std::int64_t i = 0; i < c.N * c.E; ++i) c.grad_gates.push_back(in.moderate_float());
  return c;
}

struct ec_result {
  std::vector<std::int32_t> indices, per_token;
  std::vector<float> gates, dz;
  mr::expert_choice_report report;
};

ec_result run(const ec_case& c, int threads) {
  ec_result r;
  const std::size_t NE = static_cast<std::size_t>(c.N) * c.E;
  r.indices.assign(NE, -9);
  r.gates.assign(NE, -9.0f);
  r.per_token.assign(c.N, -9);
  r.dz.assign(NE, -9.0f);
  const auto in = c.inputs();
  r.report = mr::cpu::expert_choice(c.policy, in, {r.indices.data(), r.gates.data(), r.per_token.data()},
                                    ref::on_threads(threads));
  mr::cpu::expert_choice_backward(in, r.indices.data(), c.grad_gates.data(), r.dz.data(),
                                  ref::on_threads(threads));
  return r;
}

std::string describe(const ec_case& c) {
  return "N=" + std::to_string(c.N) + " E=" + std::to_string(c.E) + " groups=" + std::to_string(c.groups) +
         " top_k=" + std::to_string(c.policy.top_k) + " factor=" + ref::precise(c.policy.capacity_factor) +
         " min=" + std::to_string(c.policy.min_capacity) + (c.capacity.empty() ? "" : " caller capacity") +
         (c.mask.empty() ? "" : " masked");
}

void check(const ec_case& c, const ec_result& r) {
  const std::int64_t N = c.N;
  const int E = c.E;
  const std::string where = "; " + describe(c);
  // The library's fp32 scores, each checked against the double softmax.
  using softmax_router = mr::router<mr::gating::softmax, mr::selection::top_k, 8>;
  std::vector<float> s(static_cast<std::size_t>(N) * E, 0.0f);
  std::vector<std::vector<double>> exact(N);
  std::vector<double> spread(N, 0.0);
  for (std::int64_t t = 0; t < N; ++t) {
    if (!c.valid(t)) continue;
    std::vector<double> v(E);
    double top = -ref::flt_max, low = ref::flt_max;
    for (int e = 0; e < E; ++e) {
      v[e] = ref::sanitize(c.logits[t * E + e]);
      if (v[e] != -ref::inf()) top = std::max(top, v[e]), low = std::min(low, v[e]);
    }
    exact[t] = ref::scores(ref::gate_kind::softmax, v);
    // fp32 rounds v - max (up to 2^-24 |v - max| relative, where exp does not flush).
    spread[t] = std::min(std::max(top - low, 0.0), 104.0);
    for (int e = 0; e < E; ++e) {
      s[t * E + e] = ad::affinity_of<ad::probability>(softmax_router{}, c.logits.data() + t * E, E, e);
      const double want = exact[t][e], allowed = want * (4e-6 + 1.2e-7 * spread[t]) + 1e-37;
      FUZZ_CHECK(std::fabs(s[t * E + e] - want) <= allowed, "score (" + std::to_string(t) + ", " + std::to_string(e) +
                                                                ") = " + ref::precise(s[t * E + e]) + ", double " +
                                                                ref::precise(want) + where);
    }
  }
  // Each group's valid tokens; every expert takes its top C_e of them.
  std::vector<std::vector<char>> chosen(N, std::vector<char>(E, 0));
  for (int g = 0; g < c.groups; ++g) {
    std::vector<std::int64_t> members;
    for (std::int64_t t = 0; t < N; ++t)
      if (c.valid(t) && c.group(t) == g) members.push_back(t);
    const std::int64_t n_g = static_cast<std::int64_t>(members.size());
    for (int e = 0; e < E; ++e) {
      std::vector<std::int64_t> order = members;
      std::stable_sort(order.begin(), order.end(),
                       [&](std::int64_t a, std::int64_t b) { return s[a * E + e] > s[b * E + e]; });
      const double factor_rule = std::ceil(static_cast<double>(n_g) * c.policy.top_k / E * c.policy.capacity_factor);
      const std::int64_t rule = std::max<std::int64_t>(c.policy.min_capacity, static_cast<std::int64_t>(factor_rule));
      const std::int64_t cap = std::min(n_g, c.capacity.empty() ? rule : c.capacity[e]);
      for (std::int64_t i = 0; i < cap; ++i) chosen[order[i]][e] = 1;
    }
  }
  std::int64_t total = 0, without = 0, most = 0;
  for (std::int64_t t = 0; t < N; ++t) {
    const std::string at = "token " + std::to_string(t);
    int n = 0;
    for (int e = 0; e < E; ++e)
      if (chosen[t][e]) {
        FUZZ_CHECK(r.indices[t * E + n] == e, at + " slot " + std::to_string(n) + " holds expert " +
                                                  std::to_string(r.indices[t * E + n]) + ", expected " +
                                                  std::to_string(e) + where);
        FUZZ_CHECK(ref::bits(r.gates[t * E + n]) == ref::bits(s[t * E + e]), at + " gate" + where);
        ++n;
      }
    for (int j = n; j < E; ++j)
      FUZZ_CHECK(r.indices[t * E + j] == -1 && ref::bits(r.gates[t * E + j]) == 0, at + " past its experts" + where);
    FUZZ_CHECK(r.per_token[t] == n, at + " count" + where);
    if (c.valid(t)) total += n, without += n == 0, most = std::max<std::int64_t>(most, n);
  }
  FUZZ_CHECK(r.report.assignments == total && r.report.tokens_without_experts == without &&
                 r.report.max_experts_per_token == most && r.report.invalid == 0,
             "report " + std::to_string(r.report.assignments) + "/" + std::to_string(r.report.tokens_without_experts) +
                 "/" + std::to_string(r.report.max_experts_per_token) + ", counted " + std::to_string(total) + "/" +
                 std::to_string(without) + "/" + std::to_string(most) + where);
  // Backward: dz_t = s_t (ds - <ds, s_t>), ds the gate gradients at the chosen experts.
  for (std::int64_t t = 0; t < N; ++t) {
    if (!c.valid(t)) {
      for (int e = 0; e < E; ++e) FUZZ_CHECK(ref::bits(r.dz[t * E + e]) == 0, "dz of a padding token" + where);
      continue;
    }
    std::vector<double> ds(E, 0.0);
    for (int j = 0; j < E; ++j)
      if (const std::int32_t e = r.indices[t * E + j]; e >= 0) ds[e] = c.grad_gates[t * E + j];
    double dot = 0, size = 0;
    for (int e = 0; e < E; ++e) dot += ds[e] * exact[t][e], size += std::fabs(ds[e]) * exact[t][e];
    for (int e = 0; e < E; ++e) {
      const double want = exact[t][e] * (ds[e] - dot);
      // The scores' rounding (above), then the dot's, in fp32.
      const double allowed =
          2e-5 * std::fabs(want) + (1e-5 + 2.4e-7 * spread[t]) * exact[t][e] * (std::fabs(ds[e]) + size) + 1e-37;
      FUZZ_CHECK(std::fabs(r.dz[t * E + e] - want) <= allowed,
                 "dz (" + std::to_string(t) + ", " + std::to_string(e) + ") = " + ref::precise(r.dz[t * E + e]) +
                     ", double " + ref::precise(want) + where);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::input in(data, size);
  const ec_case c = decode(in);
  const ec_result r = run(c, c.threads);
  check(c, r);
  if (c.threads > 1) {
    const ec_result one = run(c, 1);
    FUZZ_CHECK(fuzz::same_bits(r.indices, one.indices) && fuzz::same_bits(r.gates, one.gates) &&
                   fuzz::same_bits(r.per_token, one.per_token) && fuzz::same_bits(r.dz, one.dz),
               "different bits on " + std::to_string(c.threads) + " threads and on 1; " + describe(c));
  }
  return 0;
}
