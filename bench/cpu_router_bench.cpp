// moe_route CPU benchmark (docs/performance.md).
//
// For N = 16384 tokens of fp32 logits, (E, K) in {(64, 6), (256, 8)} and three
// router families -- softmax top-k (DeepSeek-V2-Lite: no normalisation), softmax
// top-k normalised (Qwen3) and sigmoid + expert bias, normalised and scaled
// (Moonlight) -- this times, on the same inputs in the same process:
//   forward:  the library (cpu::route), the same math composed from LibTorch
//             operators, and a naive per-token loop (std::exp, std::partial_sort);
//   backward: the library's fused backward against LibTorch autograd of the same
//             composition (backward only: the graph is recorded once, outside
//             the timing loop, and replayed with retain_graph);
//   scaling:  library and LibTorch at 1 and 2 threads.
// Before timing it checks that the library picks exactly LibTorch's top-k
// indices for the softmax routers (random normal logits, no ties), and aborts
// if not. After the runs it prints the ratios, all from this one process.
//
// Without LibTorch (find_package(Torch) failed at configure time) only the
// library and the naive loop are built and timed.
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
#include <utility>
#include <vector>

#include <moe_route/moe_route.hpp>

#include "bench_common.hpp"
#if MOE_ROUTE_BENCH_WITH_TORCH
#include "torch_reference.hpp"
#endif

namespace {

namespace mr = moe_route;
namespace bench = moe_route_bench;

constexpr std::int64_t num_tokens = 16384;
constexpr std::uint32_t seed = 20261130;

enum class family { softmax_topk, softmax_topk_norm, sigmoid_bias };

const char* family_name(family f) {
  switch (f) {
    case family::softmax_topk: return "softmax_topk";
    case family::softmax_topk_norm: return "softmax_topk_norm";
    case family::sigmoid_bias: return "sigmoid_bias";
  }
  return "?";
}

// Calls fn(router) with the router of family f and top_k = k. The routers are
// the presets of the models each family stands for, with K set to the shape's.
template <class F>
void with_router(family f, int k, F&& fn) {
  switch (f) {
    case family::softmax_topk: {
      auto r = mr::presets::deepseek_v2_lite();  // normalize off, scale 1
      r.top_k = k;
      fn(r);
      return;
    }
    case family::softmax_topk_norm: {
      auto r = mr::presets::qwen3();  // normalize on, scale 1
      r.top_k = k;
      fn(r);
      return;
    }
    case family::sigmoid_bias: {
      auto r = mr::presets::moonlight();  // normalize on, scale 2.446
      r.top_k = k;
      fn(r);
      return;
    }
  }
}

// Inputs of one (E, K) shape, generated once with a fixed seed and shared by
// every implementation and family.
bench::route_data make_shape(int e, int k) {
  std::mt19937 gen(seed + static_cast<std::uint32_t>(e * 100 + k));
  return bench::route_data(num_tokens, e, k, gen);
}

struct config {
  family fam;
  const bench::route_data* data;
  std::string label() const {
    return std::string(family_name(fam)) + "/E" + std::to_string(data->experts) + "_K" + std::to_string(data->top_k);
  }
  bool uses_bias() const { return fam == family::sigmoid_bias; }
  mr::route_inputs<float> inputs() const { return data->inputs(uses_bias()); }
};

// ---------------------------------------------------------------- library

struct route_buffers {
  std::vector<std::int32_t> indices;
  std::vector<float> gates;
  std::vector<float> grad_logits;
  explicit route_buffers(const config& c)
      : indices(static_cast<std::size_t>(num_tokens) * c.data->top_k),
        gates(static_cast<std::size_t>(num_tokens) * c.data->top_k),
        grad_logits(static_cast<std::size_t>(num_tokens) * c.data->experts) {}
  mr::route_outputs outputs() { return {indices.data(), gates.data(), nullptr}; }
  mr::backward_args backward_args(const config& c) {
    return {indices.data(), c.data->grad_gates.data(), grad_logits.data()};
  }
};

void library_forward(const config& c, route_buffers& b, int threads) {
  with_router(c.fam, c.data->top_k, [&](const auto& r) {
    mr::cpu::route(r, c.inputs(), b.outputs(), mr::cpu::execution{threads});
  });
}

void library_backward(const config& c, route_buffers& b, int threads) {
  with_router(c.fam, c.data->top_k, [&](const auto& r) {
    mr::cpu::backward(r, c.inputs(), b.backward_args(c), mr::cpu::execution{threads});
  });
}

// ---------------------------------------------------------------- naive loop

// What a user writes without the library: per token, scores with std::exp,
// (key, expert) pairs ordered by std::partial_sort (ties to the lower expert),
// gates gathered from the unbiased scores, normalised and scaled. Buffers are
// allocated once per call, not per token.
void naive_forward(const config& c, route_buffers& b) {
  const int e_count = c.data->experts, k = c.data->top_k;
  const bool sigmoid = c.fam == family::sigmoid_bias;
  const bool normalize = c.fam != family::softmax_topk;
  const float scale = sigmoid ? mr::presets::moonlight().scaling_factor : 1.0f;
  const float* bias = c.data->bias.data();
  std::vector<float> s(e_count);
  std::vector<std::pair<float, int>> keyed(e_count);
  const auto by_key = [](const std::pair<float, int>& a, const std::pair<float, int>& x) {
    return a.first > x.first || (a.first == x.first && a.second < x.second);
  };
  for (std::int64_t t = 0; t < num_tokens; ++t) {
    const float* z = c.data->logits.data() + t * e_count;
    if (sigmoid) {
      for (int e = 0; e < e_count; ++e) {
        s[e] = 1.0f / (1.0f + std::exp(-z[e]));
        keyed[e] = {s[e] + bias[e], e};
      }
    } else {
      float m = z[0];
      for (int e = 1; e < e_count; ++e) m = std::max(m, z[e]);
      float sum = 0.0f;
      for (int e = 0; e < e_count; ++e) {
        s[e] = std::exp(z[e] - m);
        sum += s[e];
      }
      for (int e = 0; e < e_count; ++e) {
        s[e] /= sum;
        keyed[e] = {s[e], e};
      }
    }
    std::partial_sort(keyed.begin(), keyed.begin() + k, keyed.end(), by_key);
    std::int32_t* idx = b.indices.data() + t * k;
    float* w = b.gates.data() + t * k;
    float total = 0.0f;
    for (int j = 0; j < k; ++j) {
      idx[j] = keyed[j].second;
      w[j] = s[keyed[j].second];
      total += w[j];
    }
    for (int j = 0; j < k; ++j) w[j] = (normalize ? w[j] / (total + 1e-20f) : w[j]) * scale;
  }
}

// ---------------------------------------------------------------- LibTorch

#if MOE_ROUTE_BENCH_WITH_TORCH
moe_route_bench::torch_router& torch_for(const config& c) {
  static std::map<std::string, std::unique_ptr<moe_route_bench::torch_router>> cache;
  auto& slot = cache[c.label()];
  if (!slot) {
    moe_route_bench::torch_spec spec;
    spec.sigmoid_bias = c.fam == family::sigmoid_bias;
    with_router(c.fam, c.data->top_k, [&](const auto& r) {
      spec.normalize = r.normalize;
      spec.scaling_factor = r.scaling_factor;
    });
    spec.logits = c.data->logits.data();
    spec.num_tokens = num_tokens;
    spec.num_experts = c.data->experts;
    spec.top_k = c.data->top_k;
    spec.expert_bias = c.data->bias.data();
    spec.grad_gates = c.data->grad_gates.data();
    slot = std::make_unique<moe_route_bench::torch_router>(spec);
    slot->prepare_backward();
  }
  return *slot;
}
#endif

// ---------------------------------------------------------------- checks

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "\n*** moe_route_cpu_bench: CHECK FAILED: %s\n*** The comparison would not be apples to apples; aborting.\n",
               what.c_str());
  std::abort();
}

std::int64_t rows_differing(const std::vector<std::int32_t>& a, const std::vector<std::int32_t>& b, int k,
                            std::int64_t* first) {
  std::int64_t n = 0;
  *first = -1;
  for (std::int64_t t = 0; t < num_tokens; ++t)
    if (!std::equal(a.begin() + t * k, a.begin() + (t + 1) * k, b.begin() + t * k)) {
      if (n++ == 0) *first = t;
    }
  return n;
}

void check(const config& c) {
  const int k = c.data->top_k;
  route_buffers lib(c), lib2(c), naive(c);
  library_forward(c, lib, 1);
  library_forward(c, lib2, 2);
  library_backward(c, lib, 1);
  library_backward(c, lib2, 2);
  if (lib.indices != lib2.indices || lib.gates != lib2.gates || lib.grad_logits != lib2.grad_logits)
    die(c.label() + ": the library's results differ between 1 and 2 threads");
  naive_forward(c, naive);
  std::int64_t first = -1;
  const std::int64_t naive_rows = rows_differing(lib.indices, naive.indices, k, &first);
  std::printf("check %-26s naive:    indices differ in %lld of %lld rows, max |gate diff| %.3g\n", c.label().c_str(),
              static_cast<long long>(naive_rows), static_cast<long long>(num_tokens),
              static_cast<double>(bench::max_abs_diff(lib.gates, naive.gates)));
  if (c.fam != family::sigmoid_bias && naive_rows != 0)
    die(c.label() + ": the naive loop's indices differ from the library's in row " + std::to_string(first));
#if MOE_ROUTE_BENCH_WITH_TORCH
  auto& tr = torch_for(c);
  moe_route_bench::torch_router::set_threads(1);
  route_buffers ref(c);
  tr.forward();
  tr.read_forward(ref.indices.data(), ref.gates.data());
  tr.backward();
  tr.read_backward(ref.grad_logits.data());
  const std::int64_t torch_rows = rows_differing(lib.indices, ref.indices, k, &first);
  std::printf("check %-26s libtorch: indices differ in %lld of %lld rows, max |gate diff| %.3g, max |dz diff| %.3g\n",
              c.label().c_str(), static_cast<long long>(torch_rows), static_cast<long long>(num_tokens),
              static_cast<double>(bench::max_abs_diff(lib.gates, ref.gates)),
              static_cast<double>(bench::max_abs_diff(lib.grad_logits, ref.grad_logits)));
  // The softmax routers must select exactly what torch.topk selects (random
  // normal logits have no ties). The sigmoid + bias key s + b is a sum of two
  // rounded values, so one-ulp differences between the library's sigmoid and
  // LibTorch's may swap near-tied experts; that is reported, not fatal.
  if (c.fam != family::sigmoid_bias && torch_rows != 0)
    die(c.label() + ": the library's indices differ from torch.topk's in row " + std::to_string(first));
  if (bench::max_abs_diff(lib.gates, ref.gates) > 1e-5f && c.fam != family::sigmoid_bias)
    die(c.label() + ": the library's gates differ from LibTorch's by more than 1e-5");
#endif
}

// ---------------------------------------------------------------- benchmarks

enum class impl { library, libtorch, naive };
const char* impl_name(impl i) {
  switch (i) {
    case impl::library: return "library";
    case impl::libtorch: return "libtorch";
    case impl::naive: return "naive";
  }
  return "?";
}

std::string bench_name(const config& c, bool forward, impl i, int threads) {
  return (forward ? "fwd/" : "bwd/") + c.label() + "/" + impl_name(i) + "/t" + std::to_string(threads);
}

void register_one(const config& c, bool forward, impl i, int threads) {
  bench::add_benchmark(bench_name(c, forward, i, threads), [c, forward, i, threads](benchmark::State& state) {
    route_buffers b(c);
    if (!forward) library_forward(c, b, 1);  // the indices the backward needs
#if MOE_ROUTE_BENCH_WITH_TORCH
    moe_route_bench::torch_router* tr = nullptr;
    if (i == impl::libtorch) {
      tr = &torch_for(c);
      moe_route_bench::torch_router::set_threads(threads);
    }
#endif
    bench::time_loop(state, num_tokens, [&] {
      switch (i) {
        case impl::library:
          if (forward)
            library_forward(c, b, threads);
          else
            library_backward(c, b, threads);
          break;
        case impl::naive:
          naive_forward(c, b);
          break;
        case impl::libtorch:
#if MOE_ROUTE_BENCH_WITH_TORCH
          if (forward)
            tr->forward();
          else
            tr->backward();
#endif
          break;
      }
    });
  });
}

constexpr bool have_torch = MOE_ROUTE_BENCH_WITH_TORCH != 0;

void register_all(const std::vector<config>& configs) {
  for (const config& c : configs) {
    register_one(c, true, impl::library, 1);
    if (have_torch) register_one(c, true, impl::libtorch, 1);
    register_one(c, true, impl::naive, 1);
    register_one(c, false, impl::library, 1);
    if (have_torch) register_one(c, false, impl::libtorch, 1);
    register_one(c, true, impl::library, 2);
    if (have_torch) register_one(c, true, impl::libtorch, 2);
    register_one(c, false, impl::library, 2);
    if (have_torch) register_one(c, false, impl::libtorch, 2);
  }
}

// The 1-thread columns use the calling thread's CPU time, everything involving
// 2 threads wall-clock time (see bench::single_thread for why).
void print_ratios(const std::vector<config>& configs, const bench::fastest_reporter& rep) {
  const auto ratio = [&](const std::string& num, const std::string& den) {
    return bench::ratio(rep.cpu(num), rep.cpu(den), "%.1fx");
  };
  const auto ratio_wall = [&](const std::string& num, const std::string& den) {
    return bench::ratio(rep.wall(num), rep.wall(den), "%.1fx");
  };
  const auto micros = [&](const std::string& name) { return bench::micros(rep.cpu(name)); };
  std::printf("\nRatios (speed-up of the library = other time / library time; same process, same inputs, "
              "N = %lld, fp32; µs and 1-thread ratios from the calling thread's CPU time, 2-thread ratios and 1t/2t "
              "scaling from wall-clock time; "
              "fastest repetition)\n\n",
              static_cast<long long>(num_tokens));
  std::printf("| router / shape | fwd lib µs (1t) | fwd vs LibTorch | fwd vs naive | bwd lib µs (1t) | bwd vs autograd "
              "| fwd vs LibTorch 2t | bwd vs autograd 2t | lib fwd 1t/2t | lib bwd 1t/2t |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const config& c : configs) {
    const auto n = [&](bool fwd, impl i, int t) { return bench_name(c, fwd, i, t); };
    std::printf("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", c.label().c_str(),
                micros(n(true, impl::library, 1)).c_str(),
                ratio(n(true, impl::libtorch, 1), n(true, impl::library, 1)).c_str(),
                ratio(n(true, impl::naive, 1), n(true, impl::library, 1)).c_str(),
                micros(n(false, impl::library, 1)).c_str(),
                ratio(n(false, impl::libtorch, 1), n(false, impl::library, 1)).c_str(),
                ratio_wall(n(true, impl::libtorch, 2), n(true, impl::library, 2)).c_str(),
                ratio_wall(n(false, impl::libtorch, 2), n(false, impl::library, 2)).c_str(),
                ratio_wall(n(true, impl::library, 1), n(true, impl::library, 2)).c_str(),
                ratio_wall(n(false, impl::library, 1), n(false, impl::library, 2)).c_str());
  }
  std::printf("\nTargets: forward >= 10x LibTorch and >= 3x naive, backward >= 5x LibTorch autograd (1 thread).\n");
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;

  const bench::route_data small = make_shape(64, 6), large = make_shape(256, 8);
  std::vector<config> configs;
  for (const bench::route_data* d : {&small, &large})
    for (family f : {family::softmax_topk, family::softmax_topk_norm, family::sigmoid_bias}) configs.push_back({f, d});

  bench::print_libtorch();
  std::printf("N = %lld tokens, fp32 logits ~ normal(0, 1), seed %u\n", static_cast<long long>(num_tokens), seed);
  for (const config& c : configs) check(c);

  register_all(configs);
  bench::fastest_reporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  print_ratios(configs, reporter);
  benchmark::Shutdown();
  return 0;
}
