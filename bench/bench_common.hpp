// moe_route benchmarks: what the CPU benchmarks (cpu_router_bench.cpp,
// cpu_training_bench.cpp, cpu_admission_bench.cpp, cpu_isa_bench.cpp) share -- the reporter that
// keeps each benchmark's fastest repetition, the cells of their tables,
// registration, seeded router inputs and the agreement checks' distance.
// No LibTorch header: torch_reference.hpp is a plain interface.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

#include <moe_route/types.hpp>

// Set to 1 by bench/CMakeLists.txt where LibTorch was found.
#ifndef MOE_ROUTE_BENCH_WITH_TORCH
#define MOE_ROUTE_BENCH_WITH_TORCH 0
#endif
#if MOE_ROUTE_BENCH_WITH_TORCH
#include "torch_reference.hpp"
#endif

namespace moe_route_bench {

// The start of each benchmark's first line: the LibTorch it compares with.
inline void print_libtorch() {
#if MOE_ROUTE_BENCH_WITH_TORCH
  std::printf("LibTorch %s; ", torch_router::version().c_str());
#else
  std::printf("LibTorch comparison not built (find_package(Torch) failed at configure time); ");
#endif
}

// ---------------------------------------------------------------- names

// Benchmark names end in their thread count. 1-thread runs are compared by the
// calling thread's CPU time (robust when other processes share the cores, and
// all their work happens on that thread), the others by wall-clock time.
inline bool single_thread(const std::string& name) {
  return name.size() >= 3 && name.compare(name.size() - 3, 3, "/t1") == 0;
}

// The LibTorch peer of a library benchmark (".../library/..." ->
// ".../libtorch/..."); "" for any other benchmark.
inline std::string libtorch_name(std::string name) {
  const auto at = name.find("/library/");
  if (at == std::string::npos) return "";
  return name.replace(at, 9, "/libtorch/");
}

// ---------------------------------------------------------------- reporting

// Shows every run as the console reporter does and keeps, per benchmark, the
// fastest time per iteration over repetitions on each clock. record() sees
// each completed run before it is printed, so it can add counters.
class fastest_reporter : public benchmark::ConsoleReporter {
 public:
  explicit fastest_reporter(OutputOptions options = OO_Defaults) : ConsoleReporter(options) {}

  std::map<std::string, double> cpu_seconds, real_seconds;  // calling thread's CPU time, wall clock

  // Seconds per iteration, -1 where the benchmark did not run: on each clock,
  // and on the clock its comparisons use (single_thread).
  double cpu(const std::string& name) const { return lookup(cpu_seconds, name); }
  double wall(const std::string& name) const { return lookup(real_seconds, name); }
  double best(const std::string& name) const { return single_thread(name) ? cpu(name) : wall(name); }

  void ReportRuns(const std::vector<Run>& runs) override {
    std::vector<Run> shown = runs;
    for (Run& run : shown) {
      if (run.run_type != Run::RT_Iteration || run.error_occurred || run.iterations == 0) continue;
      const std::string& name = run.run_name.function_name;
      const double cpu_t = run.cpu_accumulated_time / static_cast<double>(run.iterations);
      const double real_t = run.real_accumulated_time / static_cast<double>(run.iterations);
      const bool cpu_fastest = keep(cpu_seconds, name, cpu_t), real_fastest = keep(real_seconds, name, real_t);
      if (single_thread(name))
        record(run, cpu_t, cpu_fastest);
      else
        record(run, real_t, real_fastest);
    }
    ConsoleReporter::ReportRuns(shown);
  }

 protected:
  // seconds: this run's time per iteration on the clock of best(); fastest:
  // whether it is the fastest repetition so far.
  virtual void record(Run& /*run*/, double /*seconds*/, bool /*fastest*/) {}

 private:
  static double lookup(const std::map<std::string, double>& m, const std::string& name) {
    const auto it = m.find(name);
    return it == m.end() ? -1.0 : it->second;
  }
  // Lowers m[name] to t; true where t is the first or a faster time.
  static bool keep(std::map<std::string, double>& m, const std::string& name, double t) {
    auto [it, inserted] = m.emplace(name, t);
    if (!inserted && !(t < it->second)) return false;
    it->second = t;
    return true;
  }
};

// RunSpecifiedBenchmarks does not apply --benchmark_color to a reporter it is
// given: colour only on a terminal.
inline benchmark::ConsoleReporter::OutputOptions terminal_options() {
  return isatty(STDOUT_FILENO) ? benchmark::ConsoleReporter::OO_ColorTabular : benchmark::ConsoleReporter::OO_Tabular;
}

// Table cells; a negative value (a benchmark that did not run) shows as "-".
inline std::string cell(double v, const char* format) {
  if (v < 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}
inline std::string micros(double seconds) { return cell(seconds * 1e6, "%.0f"); }
inline std::string ratio(double num, double den, const char* format = "%.2f") {
  return cell(num >= 0 && den > 0 ? num / den : -1.0, format);
}

// ---------------------------------------------------------------- registration

// Reported in µs; UseRealTime sizes the iterations by wall clock, which
// 2-thread runs are measured by (the reporter keeps both clocks).
template <class F>
void add_benchmark(const std::string& name, F&& fn) {
  benchmark::RegisterBenchmark(name.c_str(), std::forward<F>(fn))->Unit(benchmark::kMicrosecond)->UseRealTime();
}

// The timed loop: body() per iteration, its stores kept; items per iteration.
template <class F>
void time_loop(benchmark::State& state, std::int64_t items, F&& body) {
  for (auto _ : state) {
    body();
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * items);
}

// The threads/ benchmarks: per iteration one call, timed alone, after 1 ms
// idle when `cold` (the worker pool's threads fall asleep, as between a
// model's router calls) or back to back.
template <class F>
void time_single_calls(benchmark::State& state, bool cold, F&& call) {
  for (auto _ : state) {
    if (cold) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const auto start = std::chrono::steady_clock::now();
    call();
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
}

// Their settings: 200 calls (of manual time only, so the idle millisecond does
// not count towards a minimum time), median of 3 repetitions, in µs.
inline void single_call_settings(benchmark::internal::Benchmark* b) {
  b->Unit(benchmark::kMicrosecond)->UseManualTime()->Iterations(200)->Repetitions(3)->ReportAggregatesOnly(true);
}

// ---------------------------------------------------------------- inputs and checks

// A router's inputs and upstream gradient, drawn from gen in this order:
// logits ~ normal(0, 1) [N x E], expert bias ~ U(-0.05, 0.05) [E] (sigmoid +
// bias routers only), dL/dgates ~ normal(0, 1) [N x K].
struct route_data {
  std::int64_t tokens = 0;
  int experts = 0;
  int top_k = 0;
  std::vector<float> logits, bias, grad_gates;

  route_data(std::int64_t n, int e, int k, std::mt19937& gen)
      : tokens(n), experts(e), top_k(k), logits(static_cast<std::size_t>(n) * e), bias(e),
        grad_gates(static_cast<std::size_t>(n) * k) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> uniform(-0.05f, 0.05f);
    for (float& x : logits) x = normal(gen);
    for (float& x : bias) x = uniform(gen);
    for (float& x : grad_gates) x = normal(gen);
  }

  moe_route::route_inputs<float> inputs(bool with_bias) const {
    moe_route::route_inputs<float> in;
    in.logits = logits.data();
    in.num_tokens = tokens;
    in.num_experts = experts;
    in.expert_bias = with_bias ? bias.data() : nullptr;
    return in;
  }
};

inline float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float d = 0.0f;
  for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, std::abs(a[i] - b[i]));
  return d;
}

}  // namespace moe_route_bench
