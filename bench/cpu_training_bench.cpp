// moe_route CPU benchmark of the training policies (issue 3, docs/performance.md).
//
// One forward + backward step, cpu::route then cpu::backward with a training
// workspace, for N = 16384 fp32 tokens, of the routers
//   plain, rpb (prior::log_prior_bias, beta 1), each penalty alone
//   (load_balance scope::batch 1e-3, z_loss 1e-3, kl_to_base 1e-2, logit_l2 1e-2,
//   locality 1e-2), load_balance_top_k (load_balance with count::top_k: f from
//   a second top-K of the unbiased logits, Megatron's aux-loss counts) and all
//   combined (rpb + the five penalties),
// on top of the bases of cpu_router_bench.cpp:
//   softmax_topk/E64_K6   DeepSeek-V2-Lite (softmax top-6 of 64, no normalisation)
//   sigmoid_bias/E64_K6   Moonlight (sigmoid + expert bias top-6 of 64, normalised, x2.446)
//   sigmoid_bias/E256_K8  Moonlight's router at DeepSeek-V3's shape (top-8 of 256)
// at 1 and 2 threads, against the same math composed from LibTorch operators
// in this process (torch_reference.cpp, torch_training: forward with autograd
// recording + torch::autograd::grad of sum(c * gates) + sum of the penalty
// values, every iteration). Also each policy with a coefficient (beta) of 0,
// against the plain router: the cost of a switched-off policy.
//
// Each library run gets counters computed in this process from Google
// Benchmark's own timings: lib/torch (library time / LibTorch time of the
// same router; < 1: the library is faster) and /plain (this router's time /
// the plain router's; the overhead of the policy in the fused pass). 1-thread
// runs use the calling thread's CPU time, 2-thread runs wall-clock time; the
// peer's fastest repetition so far. A table of the fastest repetitions is
// printed at the end.
//
// Before timing it checks, for every router: 1- and 2-thread library results
// bit-identical; LibTorch's indices equal to the library's (softmax: exactly;
// sigmoid + bias: near-ties may flip, reported); gates, dL/dz (rows with equal
// indices) and penalty values within tolerance; a coefficient of 0 gives the
// plain router's bits and value 0. It aborts if a check fails.
//
// Also, outside a router step:
//   prior_build/E64, /E256   prior::build<gating::softmax> of N = 16384 tokens, 1 and 2 threads
//     into S = 64 rows (rows[t] = t S / N, every 10th token -1), against
//     LibTorch softmax + index_add_ + division by bincount (torch_prior.cpp);
//     checked: max |diff| <= 1e-6, and 2 threads give the 1-thread bits;
//   router_l2/L27_2048x64    (1 thread) penalty::router_l2{1e4}.apply over 27 layers of
//     2048 x 64 router weights (DeepSeek-V2-Lite-like), gradients accumulated,
//     against LibTorch ((W - W0)^2).sum() (in double) * lambda / L and
//     grad.add_((W - W0) * 2 lambda / L); checked: value rel diff <= 1e-9,
//     gradients max |diff| / max |grad| <= 1e-6.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <moe_route/moe_route.hpp>

#include "bench_common.hpp"
#if MOE_ROUTE_BENCH_WITH_TORCH
#include "torch_prior.hpp"
#include "torch_reference.hpp"
#endif

namespace {

namespace mr = moe_route;
namespace bench = moe_route_bench;

constexpr std::int64_t num_tokens = 16384;
constexpr std::int64_t prior_rows = 512;   // S: rows of the prior table
constexpr int ep_ranks = 8;                // locality: experts spread over 8 ranks, this call is rank 0
constexpr std::uint32_t seed = 20261201;

// The policies' parameters (the defaults of docs/training.md and RPB).
constexpr float beta = 1.0f, alpha = 1e-3f, z_coef = 1e-3f, kl_coef = 1e-2f, l2_coef = 1e-2f, loc_coef = 1e-2f,
                loc_eps = 1e-3f;

enum class variant { plain, rpb, load_balance, load_balance_top_k, z_loss, kl_to_base, logit_l2, locality, all };
constexpr variant variants[] = {variant::plain,      variant::rpb,        variant::load_balance,
                                variant::load_balance_top_k, variant::z_loss, variant::kl_to_base,
                                variant::logit_l2,   variant::locality,   variant::all};

const char* variant_name(variant v) {
  switch (v) {
    case variant::plain: return "plain";
    case variant::rpb: return "rpb";
    case variant::load_balance: return "load_balance";
    case variant::load_balance_top_k: return "load_balance_top_k";
    case variant::z_loss: return "z_loss";
    case variant::kl_to_base: return "kl_to_base";
    case variant::logit_l2: return "logit_l2";
    case variant::locality: return "locality";
    case variant::all: return "all";
  }
  return "?";
}

// Calls fn(router) with the base router plus the variant's policies; zero sets
// every coefficient (and beta) to 0.
template <class Base, class F>
void with_variant(const Base& base, variant v, bool zero, F&& fn) {
  const float z0 = zero ? 0.0f : 1.0f;
  const mr::prior::log_prior_bias rpb{beta * z0};
  const mr::penalty::load_balance lb{alpha * z0};
  const mr::penalty::load_balance lb_top_k{alpha * z0, mr::penalty::load_balance::scope::batch,
                                           mr::penalty::load_balance::count::top_k};
  const mr::penalty::z_loss zl{z_coef * z0};
  const mr::penalty::kl_to_base kl{kl_coef * z0};
  const mr::penalty::logit_l2 l2{l2_coef * z0};
  const mr::penalty::locality loc{loc_coef * z0, loc_eps};
  switch (v) {
    case variant::plain: fn(mr::with_policies(base)); return;
    case variant::rpb: fn(mr::with_policies(base, rpb)); return;
    case variant::load_balance: fn(mr::with_policies(base, lb)); return;
    case variant::load_balance_top_k: fn(mr::with_policies(base, lb_top_k)); return;
    case variant::z_loss: fn(mr::with_policies(base, zl)); return;
    case variant::kl_to_base: fn(mr::with_policies(base, kl)); return;
    case variant::logit_l2: fn(mr::with_policies(base, l2)); return;
    case variant::locality: fn(mr::with_policies(base, loc)); return;
    case variant::all: fn(mr::with_policies(base, rpb, lb, zl, kl, l2, loc)); return;
  }
}

// Inputs of one shape, generated once with a fixed seed: the router's
// (bench::route_data), then the prior and the locality ranks.
struct shape : bench::route_data {
  bool sigmoid = false;  // false: deepseek_v2_lite; true: moonlight
  std::vector<float> prior_bias;   // S x E, prior::prepare of a random prior
  std::vector<float> prior_probs;  // S x E
  std::vector<std::int32_t> rows;  // N, r(t) in [0, S); 1 token in 8 has none (-1)
  std::vector<std::int32_t> expert_rank;  // E

  shape(bool sig, int e, int k)
      : shape(sig, e, k, std::mt19937(seed + static_cast<std::uint32_t>(e * 100 + k + (sig ? 7 : 0)))) {}
  // gen is a parameter so that it exists before the base draws from it.
  shape(bool sig, int e, int k, std::mt19937 gen) : route_data(num_tokens, e, k, gen), sigmoid(sig) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    // A peaked prior: pi ~ exp(2 * normal), normalised per row.
    std::vector<float> pi(static_cast<std::size_t>(prior_rows) * e);
    for (std::int64_t r = 0; r < prior_rows; ++r) {
      double sum = 0.0;
      for (int x = 0; x < e; ++x) sum += pi[r * e + x] = std::exp(2.0f * normal(gen));
      for (int x = 0; x < e; ++x) pi[r * e + x] = static_cast<float>(pi[r * e + x] / sum);
    }
    prior_bias.resize(pi.size());
    prior_probs.resize(pi.size());
    mr::prior::prepare(pi.data(), prior_rows, e, prior_bias.data(), prior_probs.data());
    std::uniform_int_distribution<std::int32_t> row(0, static_cast<std::int32_t>(prior_rows) - 1), eighth(0, 7);
    rows.resize(num_tokens);
    for (std::int32_t& r : rows) r = eighth(gen) == 0 ? -1 : row(gen);
    expert_rank.resize(e);
    for (int x = 0; x < e; ++x) expert_rank[x] = x / (e / ep_ranks);
  }

  std::string label() const {
    return std::string(sigmoid ? "sigmoid_bias" : "softmax_topk") + "/E" + std::to_string(experts) + "_K" +
           std::to_string(top_k);
  }

  mr::route_inputs<float> inputs() const {
    mr::route_inputs<float> in = route_data::inputs(sigmoid);
    in.prior_bias = prior_bias.data();
    in.prior_probs = prior_probs.data();
    in.prior_rows = prior_rows;
    in.token_prior_row = rows.data();
    in.expert_rank = expert_rank.data();
    in.rank = 0;
    return in;
  }

  // fn(router) with this shape's base router and the variant's policies.
  template <class F>
  void with_router(variant v, bool zero, F&& fn) const {
    if (sigmoid) {
      auto r = mr::presets::moonlight();  // normalise, scale 2.446
      r.top_k = top_k;
      with_variant(r, v, zero, fn);
    } else {
      auto r = mr::presets::deepseek_v2_lite();  // no normalisation, scale 1
      r.top_k = top_k;
      with_variant(r, v, zero, fn);
    }
  }
};

// ---------------------------------------------------------------- library

struct step_buffers {
  std::vector<std::int32_t> indices;
  std::vector<float> gates, grad_logits;
  std::vector<double> values = std::vector<double>(8, 0.0);
  std::vector<unsigned char> workspace;
  int num_penalties = 0;
  step_buffers(const shape& s, variant v, bool zero)
      : indices(static_cast<std::size_t>(num_tokens) * s.top_k),
        gates(static_cast<std::size_t>(num_tokens) * s.top_k),
        grad_logits(static_cast<std::size_t>(num_tokens) * s.experts) {
    s.with_router(v, zero, [&](const auto& r) {
      using R = std::decay_t<decltype(r)>;
      workspace.resize(std::max<std::size_t>(1, mr::penalty::training_workspace_bytes(r, num_tokens, s.experts)));
      num_penalties = R::num_penalties;
    });
  }
};

// One training step: forward (values, workspace) then the fused backward.
void library_step(const shape& s, variant v, bool zero, step_buffers& b, int threads) {
  s.with_router(v, zero, [&](const auto& r) {
    const mr::route_inputs<float> in = s.inputs();
    mr::route_outputs out;
    out.indices = b.indices.data();
    out.gates = b.gates.data();
    out.penalty_values = b.values.data();
    out.workspace = b.workspace.data();
    out.workspace_bytes = b.workspace.size();
    mr::cpu::route(r, in, out, mr::cpu::execution{threads});
    mr::backward_args args;
    args.indices = b.indices.data();
    args.grad_gates = s.grad_gates.data();
    args.grad_logits = b.grad_logits.data();
    args.workspace = b.workspace.data();
    args.workspace_bytes = b.workspace.size();
    mr::cpu::backward(r, in, args, mr::cpu::execution{threads});
  });
}

// ---------------------------------------------------------------- LibTorch

#if MOE_ROUTE_BENCH_WITH_TORCH
moe_route_bench::torch_training& torch_for(const shape& s, variant v) {
  static std::map<std::string, std::unique_ptr<moe_route_bench::torch_training>> cache;
  auto& slot = cache[s.label() + "/" + variant_name(v)];
  if (!slot) {
    moe_route_bench::torch_training_spec spec;
    spec.sigmoid_bias = s.sigmoid;
    s.with_router(variant::plain, false, [&](const auto& r) {
      spec.normalize = r.normalize;
      spec.scaling_factor = r.scaling_factor;
    });
    spec.logits = s.logits.data();
    spec.num_tokens = num_tokens;
    spec.num_experts = s.experts;
    spec.top_k = s.top_k;
    spec.expert_bias = s.bias.data();
    spec.grad_gates = s.grad_gates.data();
    spec.prior_bias = s.prior_bias.data();
    spec.prior_probs = s.prior_probs.data();
    spec.prior_rows = prior_rows;
    spec.token_prior_row = s.rows.data();
    spec.expert_rank = s.expert_rank.data();
    spec.rank = 0;
    const bool every = v == variant::all;
    if (every || v == variant::rpb) spec.beta = beta;
    if (every || v == variant::load_balance || v == variant::load_balance_top_k) spec.load_balance = alpha;
    spec.load_balance_top_k = v == variant::load_balance_top_k;
    if (every || v == variant::z_loss) spec.z_loss = z_coef;
    if (every || v == variant::kl_to_base) spec.kl_to_base = kl_coef;
    if (every || v == variant::logit_l2) spec.logit_l2 = l2_coef;
    if (every || v == variant::locality) spec.locality = loc_coef;
    spec.locality_epsilon = loc_eps;
    slot = std::make_unique<moe_route_bench::torch_training>(spec);
  }
  return *slot;
}
#endif

// ---------------------------------------------------------------- checks

[[noreturn]] void die(const std::string& what) {
  std::fflush(stdout);
  std::fprintf(stderr, "\n*** moe_route_cpu_training_bench: CHECK FAILED: %s\n*** aborting.\n", what.c_str());
  std::abort();
}

void check(const shape& s, variant v) {
  const std::string name = s.label() + "/" + variant_name(v);
  step_buffers one(s, v, false), two(s, v, false);
  library_step(s, v, false, one, 1);
  library_step(s, v, false, two, 2);
  if (one.indices != two.indices || one.gates != two.gates || one.grad_logits != two.grad_logits ||
      one.values != two.values)
    die(name + ": the library's results differ between 1 and 2 threads");
  if (v != variant::plain) {
    step_buffers zero(s, v, true), plain(s, variant::plain, false);
    library_step(s, v, true, zero, 1);
    library_step(s, variant::plain, false, plain, 1);
    for (int j = 0; j < zero.num_penalties; ++j)
      if (zero.values[j] != 0.0) die(name + ": a coefficient of 0 gives a nonzero value");
    if (zero.indices != plain.indices || zero.gates != plain.gates || zero.grad_logits != plain.grad_logits)
      die(name + ": a coefficient of 0 does not give the plain router's bits");
  }
#if MOE_ROUTE_BENCH_WITH_TORCH
  const int E = s.experts, k = s.top_k;
  auto& tr = torch_for(s, v);
  moe_route_bench::torch_router::set_threads(1);
  tr.step();
  std::vector<std::int32_t> idx(one.indices.size());
  std::vector<float> gates(one.gates.size()), dz(one.grad_logits.size());
  std::vector<double> values(8, 0.0);
  const int nv = tr.read(idx.data(), gates.data(), dz.data(), values.data());
  if (nv != one.num_penalties) die(name + ": LibTorch and the library have different numbers of penalties");
  std::int64_t rows_differ = 0;
  float gate_diff = 0.0f, dz_diff = 0.0f, dz_max = 0.0f;
  for (std::int64_t t = 0; t < num_tokens; ++t) {
    if (!std::equal(idx.begin() + t * k, idx.begin() + (t + 1) * k, one.indices.begin() + t * k)) {
      ++rows_differ;
      continue;
    }
    for (int j = 0; j < k; ++j) gate_diff = std::max(gate_diff, std::abs(gates[t * k + j] - one.gates[t * k + j]));
    for (int e = 0; e < E; ++e) {
      dz_diff = std::max(dz_diff, std::abs(dz[t * E + e] - one.grad_logits[t * E + e]));
      dz_max = std::max(dz_max, std::abs(one.grad_logits[t * E + e]));
    }
  }
  double value_rel = 0.0;
  std::string shown;
  for (int j = 0; j < nv; ++j) {
    value_rel = std::max(value_rel, std::abs(values[j] - one.values[j]) / std::max(1e-12, std::abs(one.values[j])));
    char buf[64];
    std::snprintf(buf, sizeof buf, " %.6g", one.values[j]);
    shown += buf;
  }
  std::printf("check %-34s libtorch: indices differ in %lld of %lld rows; rows with equal indices: max |gate diff| "
              "%.3g, max |dz diff| %.3g (max |dz| %.3g); max rel value diff %.3g; values%s\n",
              name.c_str(), static_cast<long long>(rows_differ), static_cast<long long>(num_tokens),
              static_cast<double>(gate_diff), static_cast<double>(dz_diff), static_cast<double>(dz_max), value_rel,
              shown.empty() ? " -" : shown.c_str());
  // Softmax: random normal logits have no ties, the selection must be torch.topk's.
  // Sigmoid + bias: one-ulp differences of sigmoid may flip near-tied keys; that
  // also moves load_balance's f by 1/(N K) per flip, hence the value tolerance.
  if (!s.sigmoid && rows_differ != 0) die(name + ": indices differ from LibTorch's");
  if (rows_differ > num_tokens / 1000) die(name + ": indices differ from LibTorch's in too many rows");
  if (gate_diff > 1e-5f || dz_diff > 1e-4f) die(name + ": gates or dL/dz differ from LibTorch's");
  if (value_rel > 1e-3) die(name + ": penalty values differ from LibTorch's");
#endif
}

// ---------------------------------------------------------------- prior::build and router_l2

constexpr std::int64_t build_rows = 64;  // S of the prior builder rows
constexpr int l2_layers = 27;
constexpr std::int64_t l2_size = 2048 * 64;
constexpr float l2_lambda = 1e4f;

struct build_case {
  int experts;
  std::vector<float> logits;       // N x E, normal(0, 1)
  std::vector<std::int32_t> rows;  // t S / N, every 10th token -1
  std::vector<float> prior;        // S x E
  explicit build_case(int e) : experts(e), logits(static_cast<std::size_t>(num_tokens) * e), rows(num_tokens),
                               prior(static_cast<std::size_t>(build_rows) * e) {
    std::mt19937 gen(seed + 7000 + static_cast<std::uint32_t>(e));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& x : logits) x = normal(gen);
    for (std::int64_t t = 0; t < num_tokens; ++t)
      rows[t] = t % 10 == 0 ? -1 : static_cast<std::int32_t>(t * build_rows / num_tokens);
  }
  std::string name(bool torch, int threads = 1) const {
    return "prior_build/E" + std::to_string(experts) + (torch ? "/libtorch/t" : "/library/t") + std::to_string(threads);
  }
  void run_library(int threads = 1) {
    mr::prior::build<mr::gating::softmax>(mr::route_inputs<float>{logits.data(), num_tokens, experts}, rows.data(),
                                          build_rows, prior.data(), mr::cpu::execution{threads});
  }
};

struct l2_case {
  std::vector<float> w, w0, grad;  // l2_layers x l2_size each
  std::vector<mr::penalty::router_weights> layers;
  l2_case() : w(l2_layers * l2_size), w0(w.size()), grad(w.size(), 0.0f), layers(l2_layers) {
    std::mt19937 gen(seed + 9000);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::size_t i = 0; i < w.size(); ++i) {
      w0[i] = 0.02f * normal(gen);
      w[i] = w0[i] + 1e-3f * normal(gen);
    }
    set_grad(grad.data());
  }
  void set_grad(float* g) {
    for (int l = 0; l < l2_layers; ++l)
      layers[l] = mr::penalty::router_weights{w.data() + l * l2_size, w0.data() + l * l2_size, l2_size,
                                              g + l * l2_size};
  }
  static std::string name(bool torch) { return std::string("router_l2/L27_2048x64") + (torch ? "/libtorch/t1" : "/library/t1"); }
  double run_library() { return mr::penalty::router_l2{l2_lambda}.apply(layers.data(), l2_layers); }
};

#if MOE_ROUTE_BENCH_WITH_TORCH
moe_route_bench::torch_prior_build& torch_build_for(const build_case& c) {
  static std::map<int, std::unique_ptr<moe_route_bench::torch_prior_build>> cache;
  auto& slot = cache[c.experts];
  if (!slot)
    slot = std::make_unique<moe_route_bench::torch_prior_build>(c.logits.data(), num_tokens, c.experts, c.rows.data(),
                                                                build_rows);
  return *slot;
}

std::vector<moe_route_bench::torch_router_l2::layer> torch_layers(const l2_case& c, float* grad) {
  std::vector<moe_route_bench::torch_router_l2::layer> out;
  for (int l = 0; l < l2_layers; ++l)
    out.push_back({c.w.data() + l * l2_size, c.w0.data() + l * l2_size, l2_size, grad + l * l2_size});
  return out;
}
#endif

void check_build(build_case& c) {
  c.run_library(2);
  const std::vector<float> two_threads = c.prior;
  c.run_library();
  if (two_threads != c.prior) die(c.name(false) + ": 1 and 2 threads give different priors");
#if MOE_ROUTE_BENCH_WITH_TORCH
  moe_route_bench::torch_router::set_threads(1);
  auto& tb = torch_build_for(c);
  tb.run();
  std::vector<float> peer(c.prior.size());
  tb.read(peer.data());
  const float diff = bench::max_abs_diff(peer, c.prior);
  std::printf("check %-34s libtorch: max |prior diff| %.3g\n", c.name(false).c_str(), static_cast<double>(diff));
  if (!(diff <= 1e-6f)) die(c.name(false) + ": the prior differs from LibTorch's");
#endif
}

void check_l2(l2_case& c) {
  std::vector<float> g_lib(c.w.size()), g_torch(c.w.size());
  std::mt19937 gen(seed + 9001);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : g_lib) x = normal(gen);  // an existing gradient to accumulate into
  g_torch = g_lib;
  c.set_grad(g_lib.data());
  const double v_lib = c.run_library();
  c.set_grad(c.grad.data());
#if MOE_ROUTE_BENCH_WITH_TORCH
  moe_route_bench::torch_router::set_threads(1);
  moe_route_bench::torch_router_l2 peer(torch_layers(c, g_torch.data()), l2_lambda);
  const double v_torch = peer.apply();
  const double v_rel = std::abs(v_torch - v_lib) / std::abs(v_lib);
  // Gradients: max |diff| over max |gradient| (elementwise relative differences
  // are meaningless where the accumulated gradient cancels to near 0; the
  // library rounds g + s (w - w0) once, LibTorch twice).
  double g_diff = 0.0, g_max = 0.0;
  for (std::size_t i = 0; i < g_lib.size(); ++i) {
    g_diff = std::max(g_diff, std::abs(static_cast<double>(g_torch[i]) - g_lib[i]));
    g_max = std::max(g_max, std::abs(static_cast<double>(g_lib[i])));
  }
  const double g_rel = g_diff / g_max;
  std::printf("check %-34s libtorch: value %.10g vs %.10g, rel diff %.3g; max |grad diff| %.3g / max |grad| %.3g = "
              "%.3g\n",
              c.name(false).c_str(), v_lib, v_torch, v_rel, g_diff, g_max, g_rel);
  if (!(v_rel <= 1e-9)) die(c.name(false) + ": the value differs from LibTorch's");
  if (!(g_rel <= 1e-6)) die(c.name(false) + ": the gradients differ from LibTorch's");
#else
  (void)v_lib;
#endif
}

// The LibTorch peer first, then the library.
void register_extras(std::vector<std::unique_ptr<build_case>>& builds, l2_case& l2) {
  for (const int threads : {1, 2})
    for (auto& bp : builds) {
      build_case* c = bp.get();
#if MOE_ROUTE_BENCH_WITH_TORCH
      bench::add_benchmark(c->name(true, threads), [c, threads](benchmark::State& state) {
        auto& tb = torch_build_for(*c);
        moe_route_bench::torch_router::set_threads(threads);
        bench::time_loop(state, num_tokens, [&] { tb.run(); });
      });
#endif
      bench::add_benchmark(c->name(false, threads), [c, threads](benchmark::State& state) {
        bench::time_loop(state, num_tokens, [&] { c->run_library(threads); });
      });
    }
  l2_case* c = &l2;
#if MOE_ROUTE_BENCH_WITH_TORCH
  bench::add_benchmark(l2_case::name(true), [c](benchmark::State& state) {
    moe_route_bench::torch_router::set_threads(1);
    moe_route_bench::torch_router_l2 peer(torch_layers(*c, c->grad.data()), l2_lambda);
    bench::time_loop(state, l2_layers * l2_size, [&] { benchmark::DoNotOptimize(peer.apply()); });
  });
#endif
  bench::add_benchmark(l2_case::name(false), [c](benchmark::State& state) {
    bench::time_loop(state, l2_layers * l2_size, [&] { benchmark::DoNotOptimize(c->run_library()); });
  });
}

// ---------------------------------------------------------------- benchmarks

std::string bench_name(const shape& s, variant v, bool zero, bool torch, int threads) {
  return "step/" + s.label() + "/" + variant_name(v) + (zero ? "_c0" : "") + (torch ? "/libtorch/t" : "/library/t") +
         std::to_string(threads);
}

void register_library(const shape& s, variant v, bool zero, int threads) {
  bench::add_benchmark(bench_name(s, v, zero, false, threads), [&s, v, zero, threads](benchmark::State& state) {
    step_buffers b(s, v, zero);
    bench::time_loop(state, num_tokens, [&] { library_step(s, v, zero, b, threads); });
  });
}

#if MOE_ROUTE_BENCH_WITH_TORCH
void register_torch(const shape& s, variant v, int threads) {
  bench::add_benchmark(bench_name(s, v, false, true, threads), [&s, v, threads](benchmark::State& state) {
    auto& tr = torch_for(s, v);
    moe_route_bench::torch_router::set_threads(threads);
    bench::time_loop(state, num_tokens, [&] { tr.step(); });
  });
}
#endif

// Per shape and thread count: the LibTorch peers first, then the plain
// router, then the others, so each library run finds its peers already timed.
void register_all(const std::vector<const shape*>& shapes) {
  for (const shape* s : shapes)
    for (int threads : {1, 2}) {
#if MOE_ROUTE_BENCH_WITH_TORCH
      for (variant v : variants) register_torch(*s, v, threads);
#endif
      for (variant v : variants) register_library(*s, v, false, threads);
      if (threads == 1)
        for (variant v : variants)
          if (v != variant::plain) register_library(*s, v, true, threads);
    }
}

// Adds the ratio counters to the library runs before printing them.
class ratio_reporter : public bench::fastest_reporter {
 public:
  ratio_reporter() : fastest_reporter(bench::terminal_options()) {}

 private:
  void record(Run& run, double t, bool /*fastest*/) override {
    const std::string& name = run.run_name.function_name;
    const std::string torch = bench::libtorch_name(name);
    if (torch.empty()) return;
    const double peer = best(torch);
    if (peer >= 0) run.counters["lib/torch"] = benchmark::Counter(t / peer);
    std::string plain = name;
    const auto slash = plain.rfind("/library/");
    const auto start = plain.rfind('/', slash - 1);
    plain.replace(start + 1, slash - start - 1, "plain");
    const double base = best(plain);
    if (base >= 0 && plain != name) run.counters["/plain"] = benchmark::Counter(t / base);
  }
};

void print_table(const std::vector<const shape*>& shapes, const ratio_reporter& rep) {
  using bench::micros;
  using bench::ratio;
  std::printf("\nForward + backward per step, N = %lld, fp32; fastest repetition; 1 thread: calling thread's CPU time, "
              "2 threads: wall-clock. lib/torch < 1: the library is faster. /plain: time over the plain router's "
              "(same implementation, same threads).\n\n",
              static_cast<long long>(num_tokens));
  std::printf("| router / shape | policies | lib µs 1t | LibTorch µs 1t | lib/torch 1t | lib/torch 2t | lib /plain 1t | "
              "lib /plain 2t | LibTorch /plain 1t | coef 0: lib µs 1t | coef 0 /plain 1t |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const shape* s : shapes)
    for (variant v : variants) {
      const double l1 = rep.best(bench_name(*s, v, false, false, 1)), l2 = rep.best(bench_name(*s, v, false, false, 2));
      const double t1 = rep.best(bench_name(*s, v, false, true, 1)), t2 = rep.best(bench_name(*s, v, false, true, 2));
      const double p1 = rep.best(bench_name(*s, variant::plain, false, false, 1));
      const double p2 = rep.best(bench_name(*s, variant::plain, false, false, 2));
      const double tp1 = rep.best(bench_name(*s, variant::plain, false, true, 1));
      const double z1 = v == variant::plain ? -1.0 : rep.best(bench_name(*s, v, true, false, 1));
      std::printf("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", s->label().c_str(), variant_name(v),
                  micros(l1).c_str(), micros(t1).c_str(), ratio(l1, t1).c_str(), ratio(l2, t2).c_str(),
                  ratio(l1, p1).c_str(), ratio(l2, p2).c_str(), ratio(t1, tp1).c_str(), micros(z1).c_str(),
                  ratio(z1, p1).c_str());
    }
}

void print_extras(const std::vector<std::string>& names, const ratio_reporter& rep) {
  bool any = false;
  for (const std::string& n : names) any = any || rep.best(n + "/library/t1") >= 0;
  if (!any) return;
  std::printf("\nOutside the router step, fastest repetition; 1 thread: calling thread's CPU time, 2 threads: wall "
              "clock. lib/torch < 1: the library is faster.\n\n| case | threads | lib µs | LibTorch µs | lib/torch |\n"
              "|---|---:|---:|---:|---:|\n");
  for (const char* threads : {"1", "2"})
    for (const std::string& n : names) {
      const double l = rep.best(n + "/library/t" + threads), t = rep.best(n + "/libtorch/t" + threads);
      if (l < 0) continue;
      std::printf("| %s | %s | %s | %s | %s |\n", n.c_str(), threads, bench::micros(l).c_str(),
                  bench::micros(t).c_str(), bench::ratio(l, t).c_str());
    }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;

  const shape softmax64(false, 64, 6), sigmoid64(true, 64, 6), sigmoid256(true, 256, 8);
  const std::vector<const shape*> shapes = {&softmax64, &sigmoid64, &sigmoid256};

  bench::print_libtorch();
  std::printf("N = %lld tokens, fp32 logits ~ normal(0, 1), prior table %lld rows (1 token in 8 without one), seed %u\n",
              static_cast<long long>(num_tokens), static_cast<long long>(prior_rows), seed);
  for (const shape* s : shapes)
    for (variant v : variants) check(*s, v);

  std::vector<std::unique_ptr<build_case>> builds;
  builds.push_back(std::make_unique<build_case>(64));
  builds.push_back(std::make_unique<build_case>(256));
  l2_case l2;
  for (auto& c : builds) check_build(*c);
  check_l2(l2);

  register_all(shapes);
  register_extras(builds, l2);
  ratio_reporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  bool any_step = false;  // skip the table when --benchmark_filter left out every step
  for (const auto& [name, t] : reporter.cpu_seconds) any_step = any_step || name.compare(0, 5, "step/") == 0;
  if (any_step) print_table(shapes, reporter);
  print_extras({"prior_build/E64", "prior_build/E256", "router_l2/L27_2048x64"}, reporter);
  benchmark::Shutdown();
  return 0;
}
