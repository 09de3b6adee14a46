// Fuzz target: the CPU entry points (runtime::route, backward, admit and
// cpu::dispatch) on fuzzer-chosen configurations, shapes and values (NaN,
// +-inf, subnormals, ties, extremes), against the test suite's double
// reference (tests/cpu/reference.hpp) and the properties every result must
// have (docs/policies.md sections 1, 2 and 4):
//  - route: K distinct experts in range per row, the reference's selection
//    and gates, the non-finite row count, the same bits on 1 and n threads
//    (one case in eight is large enough to be split over threads);
//  - backward: the analytic VJP within the gradient test's tolerance;
//  - admit: indices -1 or routed/rerouted experts a token holds once, status
//    consistent with the indices, no expert of a group above its capacity,
//    rerouted slots only into experts within their fill limit, the strict
//    pass's kept slots identical under drop and reroute (CIPHER eq. 27),
//    dropped gates 0, the report's counts consistent;
//  - dispatch: counts, aligned offsets, a permutation of the executed slots
//    ordered by (token, slot) within each expert, inverse its inverse.
// The configurations are valid by construction, so any exception is a finding.
// The reference's header brings doctest, whose test registration this target
// (a libFuzzer binary, no test runner) must not have.
#define DOCTEST_CONFIG_DISABLE
#include <moe_route/admission/dispatch.hpp>
#include <moe_route/backend/cpu/dispatch.hpp>

#include "cpu/reference.hpp"
#include "fuzz_input.hpp"
#include "router_choice.hpp"
#include "runtime_route.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

namespace {

namespace mr = moe_route;
namespace rt = moe_route::runtime;

constexpr std::int64_t threaded_tokens = 600;

struct routing_case {
  rt::router_config config;
  int E = 1;
  std::int64_t N = 0;
  std::int64_t distinct = 0;  // rows decoded; rows past them repeat these in order
  int threads = 1;
  std::vector<float> logits, bias;
};

// Row t repeats row `copy_of(t)` exactly: the same result but for the fixed
// selection, whose choice depends on the position (-1: check it in full).
std::int64_t copy_of(const routing_case& c, std::int64_t t) {
  return t < c.distinct || c.config.selection == rt::selection_kind::fixed ? -1 : t % c.distinct;
}

template <class T>
bool same_row(const std::vector<T>& v, std::int64_t width, std::int64_t a, std::int64_t b) {
  return std::memcmp(v.data() + a * width, v.data() + b * width, width * sizeof(T)) == 0;
}

routing_case decode_routing(fuzz::input& in) {
  routing_case c;
  c.config = fuzz::decode_router(in, 80, c.E);
  c.N = c.distinct = in.in(0, 12);
  c.threads = in.in(1, 3);
  c.logits.resize(static_cast<std::size_t>(c.N) * c.E);
  for (float& z : c.logits) z = in.hard_float();
  c.bias.resize(c.E);
  for (float& b : c.bias) b = in.moderate_float();
  // One case in eight repeats its rows to 600 tokens, where the backend splits
  // a call over threads (256 tokens a thread for routing, 512 for admission):
  // below that the thread count changes nothing. (Few, as they are slow.)
  if (c.N > 0 && in.in(0, 7) == 0) {
    const std::int64_t copies = (threaded_tokens + c.N - 1) / c.N;
    std::vector<float> rows = c.logits;
    for (std::int64_t i = 1; i < copies; ++i) c.logits.insert(c.logits.end(), rows.begin(), rows.end());
    c.N *= copies;
  }
  return c;
}

using fuzz::spec_of;
using fuzz::routed;

routed route(const routing_case& c, int threads) {
  return fuzz::route(c.config, c.logits, c.N, c.E, c.bias.data(), threads);
}

void check_route(const routing_case& c, const routed& o) {
  const ref::spec sp = spec_of(c.config);
  const int K = sp.K;
  std::int64_t nonfinite = 0;
  for (std::int64_t t = 0; t < c.N; ++t) {
    if (const std::int64_t first = copy_of(c, t); first >= 0) {
      FUZZ_CHECK(same_row(o.indices, K, t, first) && same_row(o.gates, K, t, first),
                 "row " + std::to_string(t) + " differs from the row it repeats, " + std::to_string(first));
      nonfinite += !std::all_of(c.logits.begin() + t * c.E, c.logits.begin() + (t + 1) * c.E,
                                [](float z) { return std::isfinite(z); });
      continue;
    }
    const ref::row_check rc = ref::check_row(sp, c.logits.data() + t * c.E, c.E, c.bias.data(), t,
                                             o.indices.data() + t * K, o.gates.data() + t * K, 2e-6,
                                             ref::default_key_tol(sp));
    nonfinite += rc.nonfinite;
    FUZZ_CHECK(rc.problem.empty(), "row " + std::to_string(t) + " (E=" + std::to_string(c.E) + ", K=" +
                                       std::to_string(K) + "): " + rc.problem + "; logits " + ref::row_string(rc.logits));
  }
  FUZZ_CHECK(o.nonfinite == nonfinite, std::to_string(o.nonfinite) + " vs " + std::to_string(nonfinite));
  for (double p : o.penalties) FUZZ_CHECK(p == 0.0, "a penalty that is off has value " + std::to_string(p));
}

void check_backward(const routing_case& c, routed& o, fuzz::input& in) {
  const ref::spec sp = spec_of(c.config);
  const int K = sp.K, E = c.E;
  std::vector<float> dw(static_cast<std::size_t>(c.N) * K);
  for (float& x : dw) x = in.moderate_float();
  std::vector<float> dz(static_cast<std::size_t>(c.N) * E, std::numeric_limits<float>::quiet_NaN());
  mr::route_inputs<float> ri;
  ri.logits = c.logits.data();
  ri.num_tokens = c.N;
  ri.num_experts = E;
  ri.expert_bias = c.bias.data();
  mr::backward_args args;
  args.indices = o.indices.data();
  args.grad_gates = dw.data();
  args.grad_logits = dz.data();
  args.workspace = o.workspace.data();
  args.workspace_bytes = o.workspace.size();
  const std::vector<float> penalty_grads(rt::num_penalties, 0.0f);
  args.penalty_grads = penalty_grads.data();
  rt::backward(c.config, ri, args, ref::on_threads(c.threads));
  for (std::int64_t t = 0; t < c.N; ++t) {
    if (const std::int64_t first = copy_of(c, t); first >= 0 && same_row(dw, K, t, first)) {
      FUZZ_CHECK(same_row(dz, E, t, first), "dz row " + std::to_string(t) + " differs from the row it repeats");
      continue;
    }
    std::vector<double> z(E), g(K);
    for (int e = 0; e < E; ++e) z[e] = c.logits[t * E + e];
    for (int j = 0; j < K; ++j) g[j] = dw[t * K + j];
    const std::vector<int> idx(o.indices.begin() + t * K, o.indices.begin() + (t + 1) * K);
    const std::vector<double> ana = ref::vjp(sp, z, idx.data(), g);
    const std::vector<double> bound = ref::vjp_bound(sp, z, idx.data(), g);
    for (int e = 0; e < E; ++e) {
      const double lib = dz[t * E + e];
      const double allowed = 2e-5 * std::fabs(ana[e]) + 1e-6 * bound[e] + 1e-30;
      FUZZ_CHECK(std::isfinite(lib) && std::fabs(lib - ana[e]) <= allowed,
                 "dz[" + std::to_string(t) + ", " + std::to_string(e) + "] = " + std::to_string(lib) + ", analytic " +
                     std::to_string(ana[e]) + ", bound " + std::to_string(bound[e]));
    }
  }
}

rt::admission_config decode_admission(fuzz::input& in) {
  rt::admission_config a;
  a.dropless = in.in(0, 7) == 0;
  a.affinity = static_cast<rt::affinity_kind>(in.in(0, 4));
  const bool can_reroute = a.affinity != rt::affinity_kind::position && a.affinity != rt::affinity_kind::gate;
  a.overflow = can_reroute && in.flag() ? rt::overflow_kind::reroute : rt::overflow_kind::drop;
  a.threshold = -std::numeric_limits<float>::infinity();
  if (a.affinity != rt::affinity_kind::position && in.flag()) {
    a.threshold = in.hard_float();
    if (std::isnan(a.threshold)) a.threshold = 0.0f;
  }
  const double factors[] = {0.25, 0.5, 1.0, 1.25, 2.0, 8.0, 0.3, 1e-9};
  a.capacity_factor = factors[in.in(0, 7)];
  a.min_capacity = in.in(0, 4);
  a.renormalize = in.flag();
  const double fills[] = {0.5, 1.0, 4.0, 0.0};
  a.fill_factor = fills[in.in(0, 2)];
  a.max_rounds = in.in(-1, 3);
  return a;
}

struct admitted {
  std::vector<std::int32_t> indices;
  std::vector<float> gates;
  std::vector<std::int8_t> status;
  mr::admission_report report;
};

struct admission_case {
  int groups = 1;
  std::vector<std::int32_t> group_ids;
  std::vector<std::int64_t> capacity;  // empty: the factor rule
  std::vector<std::uint8_t> mask;      // empty: every token valid
  std::vector<float> hidden_norms, weight_norms;
};

admission_case decode_admission_inputs(fuzz::input& in, const routing_case& c) {
  admission_case a;
  a.groups = in.in(1, 3);
  if (a.groups > 1)
    for (std::int64_t t = 0; t < c.N; ++t) a.group_ids.push_back(in.in(0, a.groups - 1));
  if (in.in(0, 3) == 0)
    for (int e = 0; e < c.E; ++e) a.capacity.push_back(in.in(0, 5));
  if (in.in(0, 3) == 0)
    for (std::int64_t t = 0; t < c.N; ++t) a.mask.push_back(in.in(0, 3) != 0);
  const auto norm = [&] {  // finite and > 0, as cosine affinity requires
    const float v = std::fabs(in.moderate_float());
    return v > 0.0f ? v : 1.0f;
  };
  for (std::int64_t t = 0; t < c.N; ++t) a.hidden_norms.push_back(norm());
  for (int e = 0; e < c.E; ++e) a.weight_norms.push_back(norm());
  return a;
}

admitted admit(const routing_case& c, const routed& r, const rt::admission_config& a, const admission_case& ac,
               int threads) {
  admitted o;
  o.indices.assign(r.indices.size(), -7);
  o.gates.assign(r.indices.size(), -7.0f);
  o.status.assign(r.indices.size(), -7);
  mr::admission_inputs<float> in;
  in.logits = c.logits.data();
  in.num_tokens = c.N;
  in.num_experts = c.E;
  in.routed_indices = r.indices.data();
  in.routed_gates = r.gates.data();
  in.hidden_norms = ac.hidden_norms.data();
  in.weight_norms = ac.weight_norms.data();
  in.group_ids = ac.group_ids.empty() ? nullptr : ac.group_ids.data();
  in.num_groups = ac.groups;
  in.capacity = ac.capacity.empty() ? nullptr : ac.capacity.data();
  in.token_mask = ac.mask.empty() ? nullptr : ac.mask.data();
  mr::admission_outputs out;
  out.indices = o.indices.data();
  out.gates = o.gates.data();
  out.status = o.status.data();
  o.report = rt::admit(c.config, a, in, out, ref::on_threads(threads));
  return o;
}

void check_admission(const routing_case& c, const routed& r, const rt::admission_config& a,
                     const admission_case& ac, const admitted& o) {
  const int K = c.config.top_k, E = c.E;
  const auto masked = [&](std::int64_t t) { return !ac.mask.empty() && ac.mask[t] == 0; };
  const auto group = [&](std::int64_t t) { return ac.group_ids.empty() ? 0 : ac.group_ids[t]; };
  std::vector<std::int64_t> group_tokens(ac.groups, 0), load(static_cast<std::size_t>(ac.groups) * E, 0),
      rerouted_into(load.size(), 0);
  std::int64_t kept = 0, rerouted = 0, dropped = 0, empty_tokens = 0, masked_slots = 0;
  for (std::int64_t t = 0; t < c.N; ++t) {
    if (!masked(t)) ++group_tokens[group(t)];
    std::vector<char> held(E, 0);
    bool any = false;
    for (int j = 0; j < K; ++j) {
      const std::int64_t s = t * K + j;
      const std::int32_t e = o.indices[s];
      const std::string at = "slot (" + std::to_string(t) + ", " + std::to_string(j) + ")";
      FUZZ_CHECK(e >= -1 && e < E, at + " index " + std::to_string(e));
      FUZZ_CHECK(o.status[s] == static_cast<std::int8_t>(mr::admission::status_of(r.indices[s], e)), at);
      if (masked(t)) {
        FUZZ_CHECK(e == -1 && o.gates[s] == 0.0f, at + " of a padding token");
        ++masked_slots;
        continue;
      }
      if (a.dropless) {
        FUZZ_CHECK(e == r.indices[s] && fuzz::same_bits(std::vector<float>{o.gates[s]}, std::vector<float>{r.gates[s]}), at);
      }
      if (e < 0) {
        FUZZ_CHECK(o.gates[s] == 0.0f, at + " dropped with gate " + std::to_string(o.gates[s]));
        ++dropped;
        continue;
      }
      FUZZ_CHECK(!held[e]++, at + " holds expert " + std::to_string(e) + " twice");
      FUZZ_CHECK(!std::isnan(o.gates[s]), at + " gate NaN");
      any = true;
      ++load[group(t) * E + e];
      if (e == r.indices[s]) ++kept;
      else ++rerouted, ++rerouted_into[group(t) * E + e];
      if (a.overflow == rt::overflow_kind::drop) FUZZ_CHECK(e == r.indices[s], at + " rerouted under drop");
    }
    empty_tokens += !masked(t) && !any;
  }
  if (!a.dropless) {
    for (int g = 0; g < ac.groups; ++g)
      for (int e = 0; e < E; ++e) {
        const std::int64_t cap = !ac.capacity.empty() ? ac.capacity[e]
                                                      : mr::admission::capacity_from_factor(
                                                            a.capacity_factor, a.min_capacity, group_tokens[g], K, E);
        const std::int64_t l = load[g * E + e];
        FUZZ_CHECK(l <= cap, "group " + std::to_string(g) + " expert " + std::to_string(e) + " holds " +
                                 std::to_string(l) + " > capacity " + std::to_string(cap));
        if (rerouted_into[g * E + e] > 0) {
          const std::int64_t fill = mr::admission::capacity_from_factor(a.fill_factor, 0, group_tokens[g], K, E);
          FUZZ_CHECK(l <= std::min(fill, cap), "expert " + std::to_string(e) + " took rerouted slots beyond its limit");
        }
      }
  }
  const mr::admission_report& rep = o.report;
  FUZZ_CHECK(rep.offered == c.N * K - masked_slots, std::to_string(rep.offered));  // padding is not offered
  FUZZ_CHECK(rep.kept == kept && rep.rerouted == rerouted && rep.dropped == dropped,
             "report kept/rerouted/dropped " + std::to_string(rep.kept) + "/" + std::to_string(rep.rerouted) + "/" +
                 std::to_string(rep.dropped) + ", counted " + std::to_string(kept) + "/" + std::to_string(rerouted) +
                 "/" + std::to_string(dropped));
  FUZZ_CHECK(rep.below_threshold + rep.over_capacity == c.N * K - masked_slots - kept,
             "strict rejections " + std::to_string(rep.below_threshold) + " + " + std::to_string(rep.over_capacity));
  FUZZ_CHECK(rep.tokens_without_experts == empty_tokens, std::to_string(rep.tokens_without_experts));
  FUZZ_CHECK(rep.invalid == 0, std::to_string(rep.invalid));
}

void check_dispatch(const std::vector<std::int32_t>& indices, std::int64_t N, int K, int E, fuzz::input& in) {
  mr::dispatch_inputs d;
  d.indices = indices.data();
  d.num_tokens = N;
  d.slots_per_token = K;
  d.num_experts = E;
  d.align = in.in(1, 8);
  std::vector<int> divisors;
  for (int r = 1; r <= E; ++r)
    if (E % r == 0) divisors.push_back(r);
  d.num_ranks = divisors[in.in(0, static_cast<int>(divisors.size()) - 1)];
  const std::int64_t bound = mr::dispatch_rows_bound(N, K, E, d.align);
  std::vector<std::int64_t> counts(E, -7), offsets(E + 1, -7), permutation(bound, -7), inverse(N * K, -7),
      rank_counts(d.num_ranks, -7);
  mr::dispatch_outputs out{counts.data(), offsets.data(), permutation.data(), inverse.data(), rank_counts.data()};
  const std::int64_t rows = mr::cpu::dispatch(d, out);
  std::vector<std::int64_t> want(E, 0), want_ranks(d.num_ranks, 0);
  for (std::int32_t e : indices)
    if (e >= 0) ++want[e], ++want_ranks[mr::contiguous_rank(e, E, d.num_ranks)];
  FUZZ_CHECK(counts == want && rank_counts == want_ranks, "counts");
  FUZZ_CHECK(offsets[0] == 0 && rows == offsets[E] && rows <= bound, "rows " + std::to_string(rows));
  for (int e = 0; e < E; ++e) {
    FUZZ_CHECK(offsets[e + 1] - offsets[e] == mr::expert_rows(want[e], d.align, 0), "offsets of expert " + std::to_string(e));
    std::int64_t previous = -1;
    for (std::int64_t row = offsets[e]; row < offsets[e + 1]; ++row) {
      const std::int64_t s = permutation[row];
      if (row >= offsets[e] + want[e]) {
        FUZZ_CHECK(s == -1, "padding row " + std::to_string(row));
        continue;
      }
      FUZZ_CHECK(s > previous && s < N * K && indices[s] == e && inverse[s] == row,
                 "row " + std::to_string(row) + " of expert " + std::to_string(e));
      previous = s;
    }
  }
  for (std::int64_t row = rows; row < bound; ++row) FUZZ_CHECK(permutation[row] == -1, "row past the end");
  for (std::int64_t s = 0; s < N * K; ++s)
    FUZZ_CHECK((indices[s] < 0) == (inverse[s] == -1), "inverse of slot " + std::to_string(s));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::input in(data, size);
  const routing_case c = decode_routing(in);
  routed r = route(c, c.threads);
  check_route(c, r);
  const routed serial = route(c, 1);
  FUZZ_CHECK(fuzz::same_bits(r.indices, serial.indices) && fuzz::same_bits(r.gates, serial.gates),
             "different bits on " + std::to_string(c.threads) + " threads and on 1");
  check_backward(c, r, in);

  const rt::admission_config a = decode_admission(in);
  const admission_case ac = decode_admission_inputs(in, c);
  const admitted o = admit(c, r, a, ac, c.threads);
  check_admission(c, r, a, ac, o);
  const admitted serial_admit = admit(c, r, a, ac, 1);
  FUZZ_CHECK(fuzz::same_bits(o.indices, serial_admit.indices) && fuzz::same_bits(o.gates, serial_admit.gates),
             "admission differs between thread counts");
  if (!a.dropless && a.overflow == rt::overflow_kind::reroute) {
    rt::admission_config strict = a;  // the same strict pass, without rounds
    strict.overflow = rt::overflow_kind::drop;
    strict.renormalize = false;
    const admitted s = admit(c, r, strict, ac, 1);
    for (std::size_t i = 0; i < s.indices.size(); ++i)
      FUZZ_CHECK((s.status[i] == 0) == (o.status[i] == 0), "slot " + std::to_string(i) +
                                                               " kept by one of the strict pass and reroute only");
  }
  check_dispatch(o.indices, c.N, c.config.top_k, c.E, in);
  return 0;
}
