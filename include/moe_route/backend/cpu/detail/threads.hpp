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

// body(begin, end, worker) over contiguous blocks of [0, n) on up to
// plan.threads threads (the caller's included), each on plan.isa.
template <class Body>
void parallel_blocks(std::int64_t n, const block_plan& plan, Body body) {
  if (n <= 0) return;
  const int threads = plan.threads;
  const std::int64_t block = (n + threads - 1) / threads;
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int w = 1; w < threads; ++w) {
    const std::int64_t begin = w * block, end = std::min(n, begin + block);
    if (begin < end) pool.emplace_back([&body, &plan, begin, end, w] { run_with_isa(plan.isa, body, begin, end, w); });
  }
  run_with_isa(plan.isa, body, std::int64_t{0}, std::min(n, block), 0);
  for (auto& t : pool) t.join();
}

// body(begin, end, worker, scratch) over contiguous token blocks, with one
// row scratch per thread.
template <class Body>
void for_token_blocks(std::int64_t num_tokens, const execution& ex, Body body) {
  if (num_tokens == 0) return;
  constexpr std::int64_t min_tokens_per_thread = 256;  // below this a thread costs more than it saves
  const block_plan plan = plan_blocks(ex, num_tokens, min_tokens_per_thread);
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
