// moe_route CPU backend: the token blocks of a call over its threads. Each
// block is a contiguous token range with its own scratch, so the results do
// not depend on the thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include <moe_route/backend/cpu/detail/rows.hpp>
#include <moe_route/backend/cpu/execution.hpp>

namespace moe_route::cpu::detail {

// The threads a call over `items` uses: ex.threads (<= 0: every hardware
// thread), but no more than gives each thread min_items_per_thread items.
inline int resolve_threads(const execution& ex, std::int64_t items, std::int64_t min_items_per_thread) {
  int threads = ex.threads > 0 ? ex.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const std::int64_t useful = (items + min_items_per_thread - 1) / min_items_per_thread;
  threads = static_cast<int>(std::min<std::int64_t>(threads, useful));
  return std::max(threads, 1);
}

// body(begin, end, worker) over contiguous blocks of [0, n) on up to
// `threads` threads (the caller's included).
template <class Body>
void parallel_blocks(std::int64_t n, int threads, Body body) {
  if (n <= 0) return;
  const std::int64_t block = (n + threads - 1) / threads;
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int w = 1; w < threads; ++w) {
    const std::int64_t begin = w * block, end = std::min(n, begin + block);
    if (begin < end) pool.emplace_back([&body, begin, end, w] { body(begin, end, w); });
  }
  body(0, std::min(n, block), 0);
  for (auto& t : pool) t.join();
}

// body(begin, end, worker, scratch) over contiguous token blocks, with one
// row scratch per thread.
template <class Body>
void for_token_blocks(std::int64_t num_tokens, const execution& ex, Body body) {
  if (num_tokens == 0) return;
  constexpr std::int64_t min_tokens_per_thread = 256;  // below this a thread costs more than it saves
  const int threads = resolve_threads(ex, num_tokens, min_tokens_per_thread);
  std::vector<std::unique_ptr<row_scratch>> scratch(threads);
  for (auto& s : scratch) s.reset(new row_scratch);  // default-initialised: no 128 KiB memset per call
  parallel_blocks(num_tokens, threads,
                  [&](std::int64_t begin, std::int64_t end, int w) { body(begin, end, w, *scratch[w]); });
}

// The workers of a call: one partial result each.
inline std::size_t workers_of(const execution& ex) {
  return ex.threads > 0 ? ex.threads : std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace moe_route::cpu::detail
