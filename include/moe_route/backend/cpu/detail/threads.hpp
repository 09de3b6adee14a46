// moe_route CPU backend: the token blocks of a call over its threads. Each
// block is a contiguous token range with its own scratch, so the results do
// not depend on the thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include <moe_route/backend/cpu/detail/isa.hpp>
#include <moe_route/backend/cpu/detail/rows.hpp>
#include <moe_route/backend/cpu/detail/worker_pool.hpp>
#include <moe_route/backend/cpu/execution.hpp>

namespace moe_route::cpu::detail {

// How a call's blocks run: on how many threads, with which instruction set.
struct block_plan {
  int threads = 1;
  instruction_set isa = instruction_set::baseline;
};

// The plan of a call over `items`: ex.threads (<= 0: every hardware thread),
// but no more than gives each thread min_items_per_thread items, and
// resolve_isa's instruction set.
inline block_plan plan_blocks(const execution& ex, std::int64_t items, std::int64_t min_items_per_thread) {
  int threads = ex.threads > 0 ? ex.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const std::int64_t useful = (items + min_items_per_thread - 1) / min_items_per_thread;
  threads = static_cast<int>(std::min<std::int64_t>(threads, useful));
  return {std::max(threads, 1), resolve_isa(ex)};
}

// The plan of a pass over `tokens` tokens: ex.min_tokens_per_thread where the
// caller set it, else the pass's own estimate `own_min`.
inline block_plan plan_token_blocks(const execution& ex, std::int64_t tokens, std::int64_t own_min) {
  return plan_blocks(ex, tokens, ex.min_tokens_per_thread > 0 ? ex.min_tokens_per_thread : own_min);
}

// A routing row of E experts costs about what 64 + E experts' share of the
// per-expert work does (selection, gates and bookkeeping are the 64), and a
// woken thread pays for itself once it has about 2^16 of those
// (docs/performance.md, "Threads").
inline std::int64_t min_routing_tokens_per_thread(int num_experts) {
  constexpr std::int64_t row_overhead = 64, work_per_thread = std::int64_t{1} << 16;
  return std::max<std::int64_t>(1, work_per_thread / (row_overhead + std::max(num_experts, 0)));
}

// body(begin, end, worker) over contiguous blocks of [0, n), block `worker`
// of plan.threads, on the caller and the worker pool, each on plan.isa.
template <class Body>
void parallel_blocks(std::int64_t n, const block_plan& plan, Body body) {
  if (n <= 0) return;
  const std::int64_t block = (n + plan.threads - 1) / plan.threads;
  auto run_block = [&](int w) {
    const std::int64_t begin = w * block;
    run_with_isa(plan.isa, body, begin, std::min(n, begin + block), w);
  };
  worker_pool::instance().run(static_cast<int>((n + block - 1) / block), run_block);
}

// body(begin, end, worker, scratch) over contiguous token blocks of routing
// rows with `num_experts` experts, with one row scratch per thread.
template <class Body>
void for_token_blocks(std::int64_t num_tokens, int num_experts, const execution& ex, Body body) {
  if (num_tokens == 0) return;
  const block_plan plan = plan_token_blocks(ex, num_tokens, min_routing_tokens_per_thread(num_experts));
  std::vector<std::unique_ptr<row_scratch>> scratch(plan.threads);
  for (auto& s : scratch) {
    s.reset(new row_scratch);  // default-initialised: no 128 KiB memset per call
    s->x86_64_v3 = plan.isa == instruction_set::x86_64_v3;
  }
  parallel_blocks(num_tokens, plan,
                  [&](std::int64_t begin, std::int64_t end, int w) { body(begin, end, w, *scratch[w]); });
}

// The workers of a call: one partial result each.
inline std::size_t workers_of(const execution& ex) {
  return ex.threads > 0 ? ex.threads : std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace moe_route::cpu::detail
