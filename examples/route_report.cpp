// The main job for now: routes one batch through every model preset on the CPU
// backend (and on the GPU when the CUDA backend is compiled and a device is
// present), and prints what a training engineer checks first: speed, expert
// load balance, gate sums, non-finite rows, and CPU/GPU agreement. It then
// runs the aux-loss-free bias update of a sigmoid router for a few steps to
// show the load flattening.
//
//   route_report [--tokens N] [--threads T] [--seed S]
#include "report_presets.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace mr = moe_route;
using clock_type = std::chrono::steady_clock;

struct options {
  std::int64_t tokens = 65536;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  unsigned seed = 2026;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--tokens") o.tokens = std::stoll(value());
    else if (a == "--threads") o.threads = std::stoi(value());
    else if (a == "--seed") o.seed = static_cast<unsigned>(std::stoul(value()));
    else throw std::invalid_argument("unknown argument " + a + " (use --tokens N --threads T --seed S)");
  }
  if (o.tokens < 1) throw std::invalid_argument("--tokens must be positive");
  return o;
}

// Logits with a realistic skew: each expert has a popularity offset, so an
// unbalanced router shows a hot expert. A few rows carry NaN or inf, as a
// diverging run would produce; the report counts them.
std::vector<float> make_logits(std::int64_t tokens, int experts, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  std::vector<float> popularity(experts);
  for (auto& p : popularity) p = 0.6f * noise(gen);
  std::vector<float> z(static_cast<std::size_t>(tokens) * experts);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (int e = 0; e < experts; ++e) z[t * experts + e] = popularity[e] + noise(gen);
  for (std::int64_t t = 7; t < tokens; t += 9973) z[t * experts + t % experts] = std::nanf("");
  for (std::int64_t t = 11; t < tokens; t += 15013) z[t * experts] = INFINITY;
  return z;
}

struct load_stats {
  double top1_share, peak_to_mean;
};

load_stats loads_of(const std::vector<std::int32_t>& indices, int experts) {
  std::vector<double> load(experts, 0.0);
  for (std::int32_t e : indices) load[e] += 1.0;
  const double total = static_cast<double>(indices.size());
  const double peak = *std::max_element(load.begin(), load.end());
  return {peak / total, peak / (total / experts)};
}

double ms_since(clock_type::time_point start) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - start).count();
}

template <class Router>
void report_preset(const char* name, const Router& router, int experts, const options& o) {
  const int k = router.top_k;
  const std::vector<float> logits = make_logits(o.tokens, experts, o.seed);
  const std::vector<float> bias(experts, 0.0f);
  const mr::route_inputs<float> in{logits.data(), o.tokens, experts, bias.data()};
  std::vector<std::int32_t> indices(o.tokens * k);
  std::vector<float> gates(o.tokens * k);
  const mr::route_outputs out{indices.data(), gates.data()};

  auto start = clock_type::now();
  const mr::route_report rep = mr::cpu::route(router, in, out, {1});
  const double fwd1 = ms_since(start);
  start = clock_type::now();
  mr::cpu::route(router, in, out, {o.threads});
  const double fwdn = ms_since(start);

  std::vector<float> grad_gates(o.tokens * k, 1.0f), grad_logits(logits.size());
  start = clock_type::now();
  mr::cpu::backward(router, in, mr::backward_args{indices.data(), grad_gates.data(), grad_logits.data()},
                    {o.threads});
  const double bwdn = ms_since(start);

  double gate_sum = 0.0;
  for (float g : gates) gate_sum += g;
  const load_stats ls = loads_of(indices, experts);
  std::printf("%-17s %4d %3d %9.2f %9.2f %9.2f %9.3f %8.2f %9.4f %6lld", name, experts, k, fwd1, fwdn, bwdn,
              ls.top1_share, ls.peak_to_mean, gate_sum / o.tokens, static_cast<long long>(rep.nonfinite_rows));

  const report::gpu_outcome gpu =
      report::run_on_gpu(name, logits.data(), o.tokens, experts, bias.data(), indices.data(), gates.data());
  if (gpu.ran)
    std::printf("  %8.3f ms  indices %s, gates %s\n", gpu.forward_ms, gpu.indices_equal ? "equal" : "DIFFER",
                gpu.gates_equal ? "equal" : "DIFFER");
  else
    std::printf("  %s\n", gpu.note.c_str());
}

// Aux-loss-free balancing (DeepSeek-V3): after each step the bias of every
// underloaded expert rises by u and every overloaded one falls by u.
void balance_demo(const options& o) {
  auto router = mr::presets::moonlight();
  router.selection.update_rate = 0.02f;
  const int experts = mr::presets::moonlight_experts, k = router.top_k;
  const std::int64_t tokens = std::min<std::int64_t>(o.tokens, 16384);
  const std::vector<float> logits = make_logits(tokens, experts, o.seed + 1);
  std::vector<float> bias(experts, 0.0f);
  std::vector<std::int32_t> indices(tokens * k);
  std::vector<float> gates(tokens * k);
  std::printf("\naux-loss-free bias update (moonlight, %lld tokens, u = %.3f): peak-to-mean load per step\n",
              static_cast<long long>(tokens), router.selection.update_rate);
  for (int step = 0; step <= 40; ++step) {
    mr::cpu::route(router, mr::route_inputs<float>{logits.data(), tokens, experts, bias.data()},
                   mr::route_outputs{indices.data(), gates.data()}, {o.threads});
    std::vector<std::int64_t> load(experts, 0);
    for (std::int32_t e : indices) ++load[e];
    if (step % 8 == 0) std::printf("  step %2d: peak-to-mean %.3f\n", step, loads_of(indices, experts).peak_to_mean);
    router.selection.update(bias.data(), load.data(), experts);
  }
}

}  // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  std::printf("moe_route %d.%d.%d route report: %lld tokens, %d threads, seed %u\n", MOE_ROUTE_VERSION_MAJOR,
              MOE_ROUTE_VERSION_MINOR, MOE_ROUTE_VERSION_PATCH, static_cast<long long>(o.tokens), o.threads,
              o.seed);
  std::printf("%-17s %4s %3s %9s %9s %9s %9s %8s %9s %6s  %s\n", "preset", "E", "K", "fwd1 ms", "fwdT ms",
              "bwdT ms", "top1 shr", "peak/mn", "gate sum", "nonfin", "GPU");
  report::for_each_preset([&](const char* name, const auto& router, int experts) {
    report_preset(name, router, experts, o);
  });
  balance_demo(o);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "route_report: %s\n", e.what());
  return 2;
}

#if !defined(MOE_ROUTE_REPORT_WITH_CUDA)
report::gpu_outcome report::run_on_gpu(const std::string&, const float*, std::int64_t, int, const float*,
                                       const std::int32_t*, const float*) {
  return {false, "CUDA backend not compiled (no nvcc at configure time)"};
}
#endif
