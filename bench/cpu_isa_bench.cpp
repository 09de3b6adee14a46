// How a CPU call runs (cpu::execution). Instruction sets: the runtime
// routers of five published models, forward and training step (forward +
// backward), on the baseline loops and the run-time x86-64-v3 loops of one
// binary, one thread, N = 16384 (docs/performance.md, "Run-time instruction
// sets"). Threads (the benchmarks named threads/...): three of them on one
// thread and on two, split at any size or where the backend's rule allows,
// N = 128..8192, each call after 1 ms idle as between a model's router calls
// (docs/performance.md, "Threads"), and the cost of handing two tasks to the
// worker pool against starting a thread. Built twice: moe_route_cpu_isa_bench for
// any x86-64, as a wheel or a consumer with default flags compiles the
// library, and moe_route_cpu_isa_bench_native with the project's
// -march=x86-64-v3, the figure the run-time path is measured against. Before
// timing, every router's outputs on the two paths are compared bit for bit.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <moe_route/backend/cpu/detail/worker_pool.hpp>
#include <moe_route/backend/cpu/isa.hpp>
#include <moe_route/runtime/cpu.hpp>

#include "bench_common.hpp"

namespace {

namespace mr = moe_route;
namespace rt = moe_route::runtime;
using mr::cpu::instruction_set;

constexpr std::int64_t tokens = 16384;

struct model {
  const char* name;
  int experts;
  rt::router_config config;
};

std::vector<model> models() {
  std::vector<model> m;
  rt::router_config c;
  c.top_k = 6;  // DeepSeek-V2-Lite: softmax, 6 of 64, with load balance and z-loss
  c.load_balance.coefficient = 1e-2f;
  c.z_loss.coefficient = 1e-3f;
  m.push_back({"deepseek_v2_lite+lb+z", 64, c});
  c = {};  // Moonlight: sigmoid + expert bias, 6 of 64, normalised, scaled
  c.gating = rt::gating_kind::sigmoid;
  c.selection = rt::selection_kind::expert_bias;
  c.top_k = 6;
  c.normalize = true;
  c.scaling_factor = 2.446f;
  c.load_balance.coefficient = 1e-2f;
  c.z_loss.coefficient = 1e-3f;
  m.push_back({"moonlight+lb+z", 64, c});
  c = {};  // DeepSeek-V3: sigmoid + bias, 8 of 256 in 4 of 8 groups
  c.gating = rt::gating_kind::sigmoid;
  c.selection = rt::selection_kind::group_limited_bias;
  c.top_k = 8;
  c.groups = 8;
  c.top_groups = 4;
  c.normalize = true;
  c.scaling_factor = 2.5f;
  m.push_back({"deepseek_v3", 256, c});
  c = {};  // Mixtral: softmax over the top 2 of 8
  c.gating = rt::gating_kind::softmax_after_topk;
  m.push_back({"mixtral", 8, c});
  c = {};  // Router Prior Bias on DeepSeek-V2-Lite's router, with the KL anchor
  c.top_k = 6;
  c.prior = rt::prior_kind::log_prior_bias;
  c.kl_to_base.coefficient = 0.1f;
  m.push_back({"deepseek_v2_lite+rpb+kl", 64, c});
  return m;
}

// One router's inputs and outputs, allocated once.
struct call {
  std::vector<float> logits, bias, prior_bias, prior_probs, gates, grad_gates, grad_logits;
  std::vector<std::int32_t> prior_rows, indices;
  std::vector<unsigned char> workspace;
  double penalties[rt::num_penalties] = {};
  mr::route_inputs<float> in;
  mr::route_outputs out;
  mr::backward_args back;

  call(const model& m, std::int64_t n) {
    const int e = m.experts, k = m.config.top_k;
    std::mt19937 g(1);
    auto value = [&] { return static_cast<float>(static_cast<int>(g() % 20001) - 10000) / 2048.0f; };
    logits.resize(n * e);
    for (float& v : logits) v = value();
    bias.resize(e);
    for (float& v : bias) v = value() / 64.0f;
    prior_bias.resize(4 * e);
    for (float& v : prior_bias) v = value() / 8.0f;
    prior_probs.assign(4 * e, 1.0f / static_cast<float>(e));
    prior_rows.resize(n);
    for (std::int64_t t = 0; t < n; ++t) prior_rows[t] = static_cast<std::int32_t>(t % 5) - 1;
    indices.resize(n * k);
    gates.resize(n * k);
    grad_gates.assign(n * k, 1.0f);
    grad_logits.resize(n * e);
    workspace.resize(rt::workspace_bytes(m.config, n, e));
    in.logits = logits.data();
    in.num_tokens = n;
    in.num_experts = e;
    in.expert_bias = bias.data();
    in.prior_bias = prior_bias.data();
    in.prior_probs = prior_probs.data();
    in.prior_rows = 4;
    in.token_prior_row = prior_rows.data();
    out.indices = indices.data();
    out.gates = gates.data();
    out.penalty_values = penalties;
    out.workspace = workspace.data();
    out.workspace_bytes = workspace.size();
    back.indices = indices.data();
    back.grad_gates = grad_gates.data();
    back.grad_logits = grad_logits.data();
    back.workspace = workspace.data();
    back.workspace_bytes = workspace.size();
  }

  void step(const rt::router_config& c, const mr::cpu::execution& ex, bool backward) {
    rt::route(c, in, out, ex);
    if (backward) rt::backward(c, in, back, ex);
  }
};

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// The two paths' outputs of every model, bit for bit; false (and a message) if any differs.
bool paths_agree(const std::vector<model>& ms) {
  if (mr::cpu::isa_of({1, instruction_set::best}) != instruction_set::x86_64_v3) return true;
  for (const model& m : ms) {
    call a(m, 2048), b(m, 2048);
    a.step(m.config, {1, instruction_set::baseline}, true);
    b.step(m.config, {1, instruction_set::x86_64_v3}, true);
    if (a.indices != b.indices || !same_bits(a.gates, b.gates) || !same_bits(a.grad_logits, b.grad_logits) ||
        std::memcmp(a.penalties, b.penalties, sizeof a.penalties) != 0) {
      std::fprintf(stderr, "cpu_isa_bench: %s differs between the baseline and x86-64-v3 paths\n", m.name);
      return false;
    }
  }
  return true;
}

// threads/<model>/<forward|step>/N/<t1 | t2 (split at any size) | t2_rule (the
// backend's minimum tokens per thread)>: one call's time after 1 ms idle.
void register_thread_benchmarks(const std::vector<model>& ms) {
  struct mode {
    const char* name;
    mr::cpu::execution ex;
  };
  const mode modes[] = {{"t1", {1, instruction_set::best, 0}},
                        {"t2", {2, instruction_set::best, 1}},
                        {"t2_rule", {2, instruction_set::best, 0}}};
  for (const model& m : ms) {
    const std::string name(m.name);
    if (name != "mixtral" && name != "deepseek_v2_lite+lb+z" && name != "deepseek_v3") continue;  // E = 8, 64, 256
    for (const bool backward : {false, true})
      for (const std::int64_t n : {128, 256, 512, 1024, 2048, 4096, 8192})
        for (const mode& md : modes) {
          const std::string label = "threads/" + name + (backward ? "/step/" : "/forward/") + std::to_string(n) +
                                    "/" + md.name;
          benchmark::RegisterBenchmark(label.c_str(), [m, n, md, backward](benchmark::State& state) {
            call c(m, n);
            moe_route_bench::time_single_calls(state, true, [&] { c.step(m.config, md.ex, backward); });
          })->Apply(moe_route_bench::single_call_settings);
        }
  }
}

// threads/handoff/<pool | new_thread>/<gap>: two 5 us tasks on the caller
// and one more thread, the worker pool's or one started for the call, after
// `gap` us of the caller's own work (the pool's worker spins 50 us, then sleeps).
void busy_for(std::chrono::microseconds us) {
  const auto end = std::chrono::steady_clock::now() + us;
  while (std::chrono::steady_clock::now() < end) {
  }
}

void register_handoff_benchmarks() {
  using std::chrono::microseconds;
  for (const bool pool : {true, false})
    for (const int gap : {0, 20, 100, 1000}) {
      const std::string label =
          std::string("threads/handoff/") + (pool ? "pool/" : "new_thread/") + std::to_string(gap);
      benchmark::RegisterBenchmark(label.c_str(), [pool, gap](benchmark::State& state) {
        auto task = [](int) { busy_for(microseconds(5)); };
        for (auto _ : state) {
          busy_for(microseconds(gap));
          const auto start = std::chrono::steady_clock::now();
          if (pool) {
            mr::cpu::detail::worker_pool::instance().run(2, task);
          } else {
            std::thread other(task, 1);
            task(0);
            other.join();
          }
          state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        }
      })->Unit(benchmark::kMicrosecond)->UseManualTime()->Iterations(400)->Repetitions(3)->ReportAggregatesOnly(true);
    }
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<model> ms = models();
  if (!paths_agree(ms)) return 1;
  const bool has_v3 = mr::cpu::isa_of({1, instruction_set::best}) == instruction_set::x86_64_v3;
  std::printf("instruction sets: this CPU %s x86-64-v3; the binary's baseline is %s\n", has_v3 ? "runs" : "lacks",
              MOE_ROUTE_CPU_RUNTIME_X86_64_V3 ? "x86-64 (the x86-64-v3 loops are chosen at run time)"
                                              : "its compile flags' (no run-time copy)");
  for (const model& m : ms)
    for (const bool backward : {false, true})
      for (const instruction_set isa : {instruction_set::baseline, instruction_set::x86_64_v3}) {
        if (isa == instruction_set::x86_64_v3 && !has_v3) continue;
        const std::string name =
            std::string(m.name) + (backward ? "/step/" : "/forward/") + mr::cpu::name(isa) + "/t1";
        benchmark::RegisterBenchmark(name.c_str(), [m, isa, backward](benchmark::State& state) {
          call c(m, tokens);
          for (auto _ : state) c.step(m.config, {1, isa}, backward);
          state.SetItemsProcessed(state.iterations() * tokens);
        })->Unit(benchmark::kMillisecond)->MeasureProcessCPUTime()->UseRealTime();
      }
  register_handoff_benchmarks();
  register_thread_benchmarks(ms);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
