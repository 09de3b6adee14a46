// moe_route CPU benchmark of admission (issue 4, docs/performance.md).
//
// Route + admission + dispatch end to end, for every admission preset and for
// expert choice, at N in {4096, 65536} tokens and (E, K) in {(64, 6), (256, 8)},
// 1 and 2 threads (and, named threads/..., the admission call alone on one and
// two threads from N = 256 up: register_thread_benchmarks):
//   library   cpu::route (DeepSeek-V2-Lite's router: softmax top-K, no
//             normalisation, Megatron's moe_router_pre_softmax=True, for which
//             the "probs" rank is the score s), cpu::admit with the preset, cpu::dispatch
//             (align 16, 8 ranks); expert choice: cpu::expert_choice then
//             cpu::dispatch with S = E;
//   LibTorch  the same composed from operators in this process
//             (torch_admission.cpp: topk per expert over the scattered
//             probabilities as Megatron-LM's drop_policy "probs" does, cumsum
//             position for capacity_position, cosine + tau masks for the
//             cosine presets, dispatch by stable sort + bincount + cumsum).
//
// Which LibTorch composition each preset is compared with:
//   dropless, capacity_position, capacity_probs, locmoe, cipher_strict,
//   expert_choice: the same algorithm (checked below);
//   cipher_reroute: NOT the same algorithm. LibTorch runs only the strict
//   (cipher_strict) pass; the reroute rounds have no operator composition
//   here, so its ratio is against a cheaper peer and is labelled so.
//
// Each library run gets counters computed in this process from Google
// Benchmark's own timings: lib/torch (library time / the LibTorch peer's
// fastest repetition so far; < 1: the library is faster), and for both
// implementations admit_share = admit time / (route + admit + dispatch) from
// per-stage clocks inside the loop, plus route_us, admit_us, dispatch_us.
// 1-thread runs use the calling thread's CPU time (for the total and for the
// stages), 2-thread runs wall-clock time.
//
// Before timing it checks, per configuration: the library's 1- and 2-thread
// results bit-identical; LibTorch's routed indices equal to the library's;
// for the like-for-like presets the admitted indices equal in every slot
// (differences are tolerated only at exact or 1e-6-relative ties of the
// affinity at an expert's cut-off, and counted), gates within 1e-6, and when
// the admitted indices are equal the dispatch metadata (counts, offsets,
// permutation, inverse, rank counts) equal exactly. It aborts otherwise.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <moe_route/backend/cpu/admit.hpp>
#include <moe_route/backend/cpu/dispatch.hpp>
#include <moe_route/backend/cpu/expert_choice.hpp>
#include <moe_route/moe_route.hpp>

#include "bench_common.hpp"
#if MOE_ROUTE_BENCH_WITH_TORCH
#include "torch_admission.hpp"
#include "torch_reference.hpp"
#endif

namespace {

namespace mr = moe_route;
namespace bench = moe_route_bench;
namespace ad = moe_route::admission;

constexpr std::uint32_t seed = 20261202;
constexpr int align = 16;
constexpr int ranks = 8;
// The presets' parameters. Capacity factor 1 for the Megatron / GShard /
// LocMoE presets (so capacity binds); the CIPHER presets keep their defaults
// (capacity factor 8, fill factor 4) with tau = 0.02.
constexpr double cf = 1.0;
constexpr float cipher_tau = 0.02f;
constexpr float locmoe_tau = 0.01f;

enum class policy { dropless, capacity_position, capacity_probs, locmoe, cipher_strict, cipher_reroute, expert_choice };
constexpr policy policies[] = {policy::dropless,      policy::capacity_position, policy::capacity_probs, policy::locmoe,
                               policy::cipher_strict, policy::cipher_reroute,    policy::expert_choice};

const char* policy_name(policy p) {
  switch (p) {
    case policy::dropless: return "dropless";
    case policy::capacity_position: return "capacity_position";
    case policy::capacity_probs: return "capacity_probs";
    case policy::locmoe: return "locmoe";
    case policy::cipher_strict: return "cipher_strict";
    case policy::cipher_reroute: return "cipher_reroute";
    case policy::expert_choice: return "expert_choice";
  }
  return "?";
}

bool like_for_like(policy p) { return p != policy::cipher_reroute; }

// The LibTorch benchmark a policy is compared with.
policy torch_peer(policy p) { return p == policy::cipher_reroute ? policy::cipher_strict : p; }

// fn(admission policy value) for the token-choice presets.
template <class F>
void with_policy(policy p, F&& fn) {
  switch (p) {
    case policy::dropless: fn(ad::dropless()); return;
    case policy::capacity_position: fn(ad::capacity_position(cf)); return;
    case policy::capacity_probs: fn(ad::capacity_probs(cf)); return;
    case policy::locmoe: fn(ad::locmoe(cf, locmoe_tau)); return;
    case policy::cipher_strict: fn(ad::cipher_strict(cipher_tau)); return;
    case policy::cipher_reroute: fn(ad::cipher_reroute(cipher_tau)); return;
    case policy::expert_choice: break;
  }
  std::abort();
}

// Inputs of one (N, E, K), generated once with a fixed seed: logits z =
// normal(0, 1) + a per-expert popularity skew ~ normal(0, 0.5), so the loads
// are uneven and capacity factor 1 drops; ||x_t|| ~ U(48, 80) (about
// sqrt(4096)), ||w_e|| ~ U(0.8, 1.2), so the cosines are z / ~64.
struct shape {
  std::int64_t tokens = 0;
  int experts = 0;
  int top_k = 0;
  std::vector<float> logits, hidden_norms, weight_norms;

  shape(std::int64_t n, int e, int k) : tokens(n), experts(e), top_k(k) {
    std::mt19937 gen(seed + static_cast<std::uint32_t>(n + e * 100 + k));
    std::normal_distribution<float> normal(0.0f, 1.0f), skew_dist(0.0f, 0.5f);
    std::uniform_real_distribution<float> xn(48.0f, 80.0f), wn(0.8f, 1.2f);
    std::vector<float> skew(e);
    for (float& x : skew) x = skew_dist(gen);
    logits.resize(static_cast<std::size_t>(n) * e);
    for (std::int64_t t = 0; t < n; ++t)
      for (int x = 0; x < e; ++x) logits[t * e + x] = normal(gen) + skew[x];
    hidden_norms.resize(n);
    for (float& x : hidden_norms) x = xn(gen);
    weight_norms.resize(e);
    for (float& x : weight_norms) x = wn(gen);
  }
  std::string label() const {
    return "N" + std::to_string(tokens) + "/E" + std::to_string(experts) + "_K" + std::to_string(top_k);
  }
  int slots(policy p) const { return p == policy::expert_choice ? experts : top_k; }
  mr::presets::deepseek_v2_lite_router router() const {
    auto r = mr::presets::deepseek_v2_lite();
    r.top_k = top_k;
    return r;
  }
};

// Seconds on the clock a run is measured with: the calling thread's CPU time
// for 1 thread, wall-clock otherwise.
double now(int threads) {
  timespec ts;
  clock_gettime(threads == 1 ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct stage_seconds {
  double route = 0, admit = 0, dispatch = 0;
};

// ---------------------------------------------------------------- library

struct lib_buffers {
  std::vector<std::int32_t> routed;
  std::vector<float> routed_gates;
  std::vector<std::int32_t> indices;  // [N x S]
  std::vector<float> gates;           // [N x S]
  std::vector<std::int64_t> counts, offsets, permutation, inverse, rank_counts;
  mr::admission_report report;
  mr::expert_choice_report ec_report;
  std::int64_t rows = 0;
  lib_buffers(const shape& s, policy p) {
    const std::int64_t n = s.tokens;
    const int S = s.slots(p);
    routed.resize(static_cast<std::size_t>(n) * s.top_k);
    routed_gates.resize(routed.size());
    indices.resize(static_cast<std::size_t>(n) * S);
    gates.resize(indices.size());
    counts.resize(s.experts);
    offsets.resize(s.experts + 1);
    permutation.resize(static_cast<std::size_t>(mr::dispatch_rows_bound(n, S, s.experts, align)));
    inverse.resize(indices.size());
    rank_counts.resize(ranks);
  }
};

void library_run(const shape& s, policy p, lib_buffers& b, int threads, stage_seconds* st) {
  const mr::cpu::execution ex{threads};
  const double t0 = st != nullptr ? now(threads) : 0.0;
  double t1 = t0, t2 = t0;
  if (p == policy::expert_choice) {
    mr::selection::expert_choice sel;
    sel.top_k = s.top_k;
    sel.capacity_factor = cf;
    mr::expert_choice_inputs<float> in;
    in.logits = s.logits.data();
    in.num_tokens = s.tokens;
    in.num_experts = s.experts;
    b.ec_report = mr::cpu::expert_choice(sel, in, mr::expert_choice_outputs{b.indices.data(), b.gates.data(), nullptr, nullptr}, ex);
    if (st != nullptr) t1 = t2 = now(threads);  // the selection is reported as the route stage
  } else {
    const auto r = s.router();
    mr::route_inputs<float> rin;
    rin.logits = s.logits.data();
    rin.num_tokens = s.tokens;
    rin.num_experts = s.experts;
    mr::cpu::route(r, rin, mr::route_outputs{b.routed.data(), b.routed_gates.data(), nullptr}, ex);
    if (st != nullptr) t1 = now(threads);
    mr::admission_inputs<float> in;
    in.logits = s.logits.data();
    in.num_tokens = s.tokens;
    in.num_experts = s.experts;
    in.routed_indices = b.routed.data();
    in.routed_gates = b.routed_gates.data();
    in.hidden_norms = s.hidden_norms.data();
    in.weight_norms = s.weight_norms.data();
    with_policy(p, [&](const auto& pol) {
      b.report = mr::cpu::admit(r, pol, in, mr::admission_outputs{b.indices.data(), b.gates.data(), nullptr, nullptr}, ex);
    });
    if (st != nullptr) t2 = now(threads);
  }
  mr::dispatch_inputs din{b.indices.data(), s.tokens, s.slots(p), s.experts, align, ranks, nullptr};
  b.rows = mr::cpu::dispatch(din, mr::dispatch_outputs{b.counts.data(), b.offsets.data(), b.permutation.data(),
                                                        b.inverse.data(), b.rank_counts.data()});
  if (st != nullptr) {
    const double t3 = now(threads);
    st->route += t1 - t0;
    st->admit += t2 - t1;
    st->dispatch += t3 - t2;
  }
}

// ---------------------------------------------------------------- LibTorch

#if MOE_ROUTE_BENCH_WITH_TORCH
moe_route_bench::torch_admission& torch_for(const shape& s, policy p) {
  static std::map<std::string, std::unique_ptr<moe_route_bench::torch_admission>> cache;
  p = torch_peer(p);
  auto& slot = cache[s.label() + "/" + policy_name(p)];
  if (!slot) {
    using kind = moe_route_bench::torch_admission_kind;
    moe_route_bench::torch_admission_spec spec;
    switch (p) {
      case policy::dropless: spec.kind = kind::dropless; break;
      case policy::capacity_position: spec.kind = kind::position; break;
      case policy::capacity_probs: spec.kind = kind::probs; break;
      case policy::locmoe: spec.kind = kind::cosine; spec.tau = locmoe_tau; spec.capacity_factor = cf; break;
      case policy::cipher_strict:
      case policy::cipher_reroute:
        spec.kind = kind::cosine;
        spec.tau = cipher_tau;
        spec.capacity_factor = ad::cipher_strict(cipher_tau).capacity_factor;
        break;
      case policy::expert_choice: spec.kind = kind::expert_choice; break;
    }
    if (spec.kind == kind::probs || spec.kind == kind::position || spec.kind == kind::expert_choice) spec.capacity_factor = cf;
    spec.logits = s.logits.data();
    spec.num_tokens = s.tokens;
    spec.num_experts = s.experts;
    spec.top_k = s.top_k;
    spec.hidden_norms = s.hidden_norms.data();
    spec.weight_norms = s.weight_norms.data();
    spec.align = align;
    spec.num_ranks = ranks;
    slot = std::make_unique<moe_route_bench::torch_admission>(spec);
  }
  return *slot;
}

void torch_run(moe_route_bench::torch_admission& tr, int threads, stage_seconds* st) {
  const double t0 = st != nullptr ? now(threads) : 0.0;
  tr.route();
  const double t1 = st != nullptr ? now(threads) : 0.0;
  tr.admit();
  const double t2 = st != nullptr ? now(threads) : 0.0;
  tr.dispatch();
  if (st != nullptr) {
    const double t3 = now(threads);
    st->route += t1 - t0;
    st->admit += t2 - t1;
    st->dispatch += t3 - t2;
  }
}
#endif

// ---------------------------------------------------------------- checks

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "\n*** moe_route_cpu_admission_bench: CHECK FAILED: %s\n*** aborting.\n", what.c_str());
  std::abort();
}

// Per configuration, what the check found (printed again in the summary).
struct check_result {
  double dropped_rate = 0, rerouted_rate = 0;
  std::int64_t tie_slots = 0;  // slots whose admission differs from LibTorch's at a tie
  std::string note;
};
std::map<std::string, check_result>& results() {
  static std::map<std::string, check_result> r;
  return r;
}

std::string config_name(const shape& s, policy p) { return std::string(policy_name(p)) + "/" + s.label(); }

void check(const shape& s, policy p) {
  const std::string name = config_name(s, p);
  lib_buffers one(s, p), two(s, p);
  library_run(s, p, one, 1, nullptr);
  library_run(s, p, two, 2, nullptr);
  if (one.indices != two.indices || one.gates != two.gates || one.permutation != two.permutation ||
      one.inverse != two.inverse || one.counts != two.counts)
    die(name + ": the library's results differ between 1 and 2 threads");
  check_result& res = results()[name];
  const double slots = static_cast<double>(s.tokens) * s.top_k;
  if (p == policy::expert_choice) {
    res.dropped_rate = 0;
  } else {
    res.dropped_rate = static_cast<double>(one.report.dropped) / slots;
    res.rerouted_rate = static_cast<double>(one.report.rerouted) / slots;
  }
#if MOE_ROUTE_BENCH_WITH_TORCH
  const std::int64_t N = s.tokens;
  const int E = s.experts, K = s.top_k;
  auto& tr = torch_for(s, p);
  moe_route_bench::torch_router::set_threads(1);
  torch_run(tr, 1, nullptr);
  std::vector<float> aff(static_cast<std::size_t>(N) * E, 0.0f);
  tr.read_affinity(aff.data());
  lib_buffers ref(s, p);
  ref.rows = tr.read_dispatch(ref.counts.data(), ref.offsets.data(), ref.permutation.data(), ref.inverse.data(),
                              ref.rank_counts.data());
  float gate_diff = 0.0f;
  std::int64_t differ = 0, ties = 0;
  if (p == policy::expert_choice) {
    // Chosen (token, expert) pairs: the library's token-major rows against
    // LibTorch's dense gates (s > 0 where chosen).
    std::vector<float> dense(static_cast<std::size_t>(N) * E);
    tr.read_admitted(nullptr, dense.data());
    std::vector<unsigned char> lib_chosen(dense.size(), 0);
    for (std::int64_t t = 0; t < N; ++t)
      for (int j = 0; j < E && one.indices[t * E + j] >= 0; ++j) {
        const int e = one.indices[t * E + j];
        lib_chosen[t * E + e] = 1;
        if (dense[t * E + e] > 0.0f) gate_diff = std::max(gate_diff, std::abs(dense[t * E + e] - one.gates[t * E + j]));
      }
    // Cut-off per expert: the smallest chosen score (library).
    std::vector<float> cut(E, 2.0f);
    for (std::int64_t t = 0; t < N; ++t)
      for (int e = 0; e < E; ++e)
        if (lib_chosen[t * E + e]) cut[e] = std::min(cut[e], aff[t * E + e]);
    for (std::int64_t t = 0; t < N; ++t)
      for (int e = 0; e < E; ++e)
        if (static_cast<bool>(lib_chosen[t * E + e]) != (dense[t * E + e] > 0.0f)) {
          ++differ;
          if (std::abs(aff[t * E + e] - cut[e]) <= 1e-6f * std::abs(cut[e])) ++ties;
        }
    // The library's slot ids are t * E + j (compacted rows); LibTorch's t * E + e.
    for (std::int64_t& x : one.permutation)
      if (x >= 0) x = (x / E) * E + one.indices[x];
    if (differ == 0) {
      for (std::int64_t t = 0; t < N; ++t)
        for (int j = 0; j < E && one.indices[t * E + j] >= 0; ++j)
          if (ref.inverse[t * E + one.indices[t * E + j]] != one.inverse[t * E + j])
            die(name + ": inverse rows differ from LibTorch's");
    }
  } else {
    std::vector<std::int32_t> routed(static_cast<std::size_t>(N) * K), admitted(routed.size());
    std::vector<float> routed_gates(routed.size()), gates(routed.size());
    tr.read_routed(routed.data(), routed_gates.data());
    tr.read_admitted(admitted.data(), gates.data());
    if (routed != one.routed) die(name + ": LibTorch's routed indices differ from the library's");
    if (!like_for_like(p)) {
      std::int64_t torch_kept = 0;
      for (std::int32_t x : admitted) torch_kept += x >= 0;
      char buf[200];
      std::snprintf(buf, sizeof buf, "LibTorch strict pass keeps %lld slots; the library keeps %lld strictly and reroutes %lld",
                    static_cast<long long>(torch_kept), static_cast<long long>(one.report.kept),
                    static_cast<long long>(one.report.rerouted));
      res.note = buf;
      if (torch_kept != one.report.kept) die(name + ": the strict pass of LibTorch and the library keep different counts");
    } else {
      // Cut-off per expert: the lowest affinity the library kept (position: none).
      std::vector<float> cut(E, std::numeric_limits<float>::infinity());
      for (std::int64_t x = 0; x < N * K; ++x)
        if (one.indices[x] >= 0) {
          const std::int64_t t = x / K;
          gate_diff = std::max(gate_diff, std::abs(gates[x] - one.gates[x]));
          if (!aff.empty()) cut[one.indices[x]] = std::min(cut[one.indices[x]], aff[t * E + one.indices[x]]);
        }
      for (std::int64_t x = 0; x < N * K; ++x)
        if (admitted[x] != one.indices[x]) {
          ++differ;
          const std::int64_t t = x / K;
          const int e = one.routed[x];
          if (p != policy::capacity_position && p != policy::dropless &&
              std::abs(aff[t * E + e] - cut[e]) <= 1e-6f * std::abs(cut[e]))
            ++ties;
        }
    }
  }
  if (differ != ties) die(name + ": " + std::to_string(differ - ties) + " admission decisions differ from LibTorch's (not at a tie)");
  res.tie_slots = ties;
  if (gate_diff > 1e-6f) die(name + ": gates differ from LibTorch's by " + std::to_string(gate_diff));
  bool dispatch_equal = true;
  if (like_for_like(p) && differ == 0) {
    dispatch_equal = one.counts == ref.counts && one.offsets == ref.offsets && one.permutation == ref.permutation &&
                     one.rank_counts == ref.rank_counts && (p == policy::expert_choice || one.inverse == ref.inverse);
    if (!dispatch_equal) die(name + ": dispatch metadata differ from LibTorch's");
  }
  if (like_for_like(p))
    std::printf("check %-38s dropped %.4f rerouted %.4f | LibTorch: same algorithm; decisions differ in %lld slots (%lld "
                "at ties), max |gate diff| %.3g%s\n",
                name.c_str(), res.dropped_rate, res.rerouted_rate, static_cast<long long>(differ),
                static_cast<long long>(ties), static_cast<double>(gate_diff),
                differ == 0 ? ", dispatch metadata identical" : "");
  else
    std::printf("check %-38s dropped %.4f rerouted %.4f | LibTorch: NOT the same algorithm (strict pass only): %s\n",
                name.c_str(), res.dropped_rate, res.rerouted_rate, res.note.c_str());
#else
  std::printf("check %-38s dropped %.4f rerouted %.4f (no LibTorch)\n", name.c_str(), res.dropped_rate, res.rerouted_rate);
#endif
}

// ---------------------------------------------------------------- benchmarks

std::string bench_name(const shape& s, policy p, bool torch, int threads) {
  return "e2e/" + config_name(s, p) + (torch ? "/libtorch/t" : "/library/t") + std::to_string(threads);
}

void set_stage_counters(benchmark::State& state, const stage_seconds& st) {
  const double it = static_cast<double>(state.iterations());
  const double total = st.route + st.admit + st.dispatch;
  state.counters["route_us"] = benchmark::Counter(st.route / it * 1e6);
  state.counters["admit_us"] = benchmark::Counter(st.admit / it * 1e6);
  state.counters["dispatch_us"] = benchmark::Counter(st.dispatch / it * 1e6);
  state.counters["admit_share"] = benchmark::Counter(total > 0 ? st.admit / total : 0.0);
}

void register_library(const shape& s, policy p, int threads) {
  bench::add_benchmark(bench_name(s, p, false, threads), [&s, p, threads](benchmark::State& state) {
    lib_buffers b(s, p);
    stage_seconds st;
    bench::time_loop(state, s.tokens, [&] { library_run(s, p, b, threads, &st); });
    set_stage_counters(state, st);
  });
}

#if MOE_ROUTE_BENCH_WITH_TORCH
void register_torch(const shape& s, policy p, int threads) {
  bench::add_benchmark(bench_name(s, p, true, threads), [&s, p, threads](benchmark::State& state) {
    auto& tr = torch_for(s, p);
    moe_route_bench::torch_router::set_threads(threads);
    stage_seconds st;
    bench::time_loop(state, s.tokens, [&] { torch_run(tr, threads, &st); });
    set_stage_counters(state, st);
  });
}
#endif

// Per shape and thread count: the LibTorch peers first, so each library run
// finds its peer already timed. cipher_reroute has no LibTorch run of its own
// (its peer is cipher_strict's).
void register_all(const std::vector<const shape*>& shapes) {
  for (const shape* s : shapes)
    for (int threads : {1, 2}) {
#if MOE_ROUTE_BENCH_WITH_TORCH
      for (policy p : policies)
        if (torch_peer(p) == p) register_torch(*s, p, threads);
#endif
      for (policy p : policies) register_library(*s, p, threads);
    }
}

// threads/<policy>/E<e>_K<k>/N<n>/<t1 | t2 | t2_rule>/<cold | warm>: the
// admission call alone (expert choice: the selection) at (E, K) = (64, 6) and
// (256, 8), each call after 1 ms idle as between a model's router calls (cold:
// the pool's worker asleep) or back to back (warm): where a second thread
// starts to pay. t2 splits at any size (min_tokens_per_thread = 1); t2_rule
// keeps the backend's minimum tokens a thread (cpu/detail/threads.hpp).
void register_thread_benchmarks() {
  struct mode {
    const char* name;
    mr::cpu::execution ex;
  };
  const mode modes[] = {{"t1", {1, mr::cpu::instruction_set::best, 0}},
                        {"t2", {2, mr::cpu::instruction_set::best, 1}},
                        {"t2_rule", {2, mr::cpu::instruction_set::best, 0}}};
  static std::vector<std::unique_ptr<shape>> inputs;  // outlive the registration
  for (const auto& [e, k] : {std::pair{64, 6}, std::pair{256, 8}})
    for (const std::int64_t n : {256, 512, 1024, 2048, 4096, 8192, 16384}) {
      inputs.push_back(std::make_unique<shape>(n, e, k));
      const shape* s = inputs.back().get();
      for (const policy p : {policy::capacity_probs, policy::cipher_strict, policy::cipher_reroute, policy::expert_choice})
        for (const mode& md : modes)
          for (const bool cold : {true, false}) {
            const std::string label = std::string("threads/") + policy_name(p) + "/E" + std::to_string(e) + "_K" +
                                      std::to_string(k) + "/N" + std::to_string(n) + "/" + md.name +
                                      (cold ? "/cold" : "/warm");
            benchmark::RegisterBenchmark(label.c_str(), [s, p, md, cold](benchmark::State& state) {
              lib_buffers b(*s, p);
              library_run(*s, p, b, 1, nullptr);  // the routed indices the admission reads
              const auto r = s->router();
              mr::admission_inputs<float> in;
              in.logits = s->logits.data();
              in.num_tokens = s->tokens;
              in.num_experts = s->experts;
              in.routed_indices = b.routed.data();
              in.routed_gates = b.routed_gates.data();
              in.hidden_norms = s->hidden_norms.data();
              in.weight_norms = s->weight_norms.data();
              mr::selection::expert_choice sel;
              sel.top_k = s->top_k;
              sel.capacity_factor = cf;
              const mr::expert_choice_inputs<float> ec_in{s->logits.data(), s->tokens, s->experts};
              const mr::expert_choice_outputs ec_out{b.indices.data(), b.gates.data(), nullptr, nullptr};
              const mr::admission_outputs out{b.indices.data(), b.gates.data(), nullptr, nullptr};
              bench::time_single_calls(state, cold, [&] {
                if (p == policy::expert_choice)
                  mr::cpu::expert_choice(sel, ec_in, ec_out, md.ex);
                else
                  with_policy(p, [&](const auto& pol) { mr::cpu::admit(r, pol, in, out, md.ex); });
              });
            })->Apply(bench::single_call_settings);
          }
    }
}

// The LibTorch benchmark a library benchmark is compared with.
std::string peer_name(const std::string& name) {
  std::string peer = bench::libtorch_name(name);
  const std::string reroute = "/cipher_reroute/";
  const auto r = peer.find(reroute);
  if (r != std::string::npos) peer.replace(r, reroute.size(), "/cipher_strict/");
  return peer;
}

// Adds lib/torch to the library runs before printing them and keeps the
// counters of each benchmark's fastest repetition.
class ratio_reporter : public bench::fastest_reporter {
 public:
  ratio_reporter() : fastest_reporter(bench::terminal_options()) {}
  std::map<std::string, benchmark::UserCounters> best_counters;

 private:
  void record(Run& run, double t, bool fastest) override {
    const std::string& name = run.run_name.function_name;
    const std::string peer = peer_name(name);
    if (!peer.empty()) {
      const double peer_t = best(peer);
      if (peer_t >= 0) run.counters["lib/torch"] = benchmark::Counter(t / peer_t);
    }
    if (fastest) best_counters[name] = run.counters;
  }
};

void print_table(const std::vector<const shape*>& shapes, const ratio_reporter& rep) {
  const auto counter = [&](const std::string& name, const char* c) -> double {
    const auto it = rep.best_counters.find(name);
    if (it == rep.best_counters.end()) return -1.0;
    const auto jt = it->second.find(c);
    return jt == it->second.end() ? -1.0 : jt->second.value;
  };
  using bench::cell;
  using bench::micros;
  using bench::ratio;
  std::printf("\nRoute + admit + dispatch per call, fp32, align %d, %d ranks; fastest repetition; 1 thread: calling "
              "thread's CPU time, 2 threads: wall-clock. lib/torch < 1: the library is faster. share = admit / (route + "
              "admit + dispatch) of the fastest repetition (expert_choice: its selection is the route column, share -).\n\n",
              align, ranks);
  std::printf("| preset | N | E, K | LibTorch peer | dropped | lib µs 1t | LibTorch µs 1t | lib/torch 1t | lib/torch 2t | "
              "lib 1t/2t | lib share 1t | LibTorch share 1t | lib route / admit / dispatch µs 1t |\n");
  std::printf("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
  for (const shape* s : shapes)
    for (policy p : policies) {
      const std::string l1 = bench_name(*s, p, false, 1), l2 = bench_name(*s, p, false, 2);
      const double lib1 = rep.best(l1), lib2 = rep.best(l2);
      const double tor1 = rep.best(peer_name(l1)), tor2 = rep.best(peer_name(l2));
      const bool ec = p == policy::expert_choice;
      const check_result& cr = results()[config_name(*s, p)];
      std::string peer = like_for_like(p) ? "same algorithm" : "cipher_strict composition (NOT like for like)";
      if (cr.tie_slots > 0) peer += " (" + std::to_string(cr.tie_slots) + " tie slots)";
      std::printf("| %s | %lld | %d, %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s / %s / %s |\n", policy_name(p),
                  static_cast<long long>(s->tokens), s->experts, s->top_k, peer.c_str(),
                  ec ? "-" : cell(cr.dropped_rate, "%.3f").c_str(), micros(lib1).c_str(), micros(tor1).c_str(),
                  ratio(lib1, tor1).c_str(), ratio(lib2, tor2).c_str(), ratio(lib1, lib2).c_str(),
                  ec ? "-" : cell(counter(l1, "admit_share"), "%.2f").c_str(),
                  ec ? "-" : cell(counter(peer_name(l1), "admit_share"), "%.2f").c_str(),
                  cell(counter(l1, "route_us"), "%.0f").c_str(), cell(counter(l1, "admit_us"), "%.0f").c_str(),
                  cell(counter(l1, "dispatch_us"), "%.0f").c_str());
    }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;

  const shape a(4096, 64, 6), b(4096, 256, 8), c(65536, 64, 6), d(65536, 256, 8);
  const std::vector<const shape*> shapes = {&a, &b, &c, &d};

  bench::print_libtorch();
  std::printf("logits ~ normal(0, 1) + expert skew ~ normal(0, 0.5), ||x|| ~ U(48, 80), ||w|| ~ U(0.8, 1.2), seed %u; "
              "capacity factor %.2f (position, probs, locmoe tau %.2f, expert_choice), cipher tau %.2f (capacity factor 8, "
              "fill factor 4)\n",
              seed, cf, static_cast<double>(locmoe_tau), static_cast<double>(cipher_tau));
  for (const shape* s : shapes)
    for (policy p : policies) check(*s, p);

  register_all(shapes);
  register_thread_benchmarks();
  ratio_reporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  print_table(shapes, reporter);
  benchmark::Shutdown();
  return 0;
}
