// The CPU backend's worker pool (backend/cpu/detail/worker_pool.hpp): every
// task runs exactly once per call, under the caller's floating-point
// environment; exceptions reach the caller after every task has ended; a call
// from inside a task, calls from several threads at once and a forked child
// all complete; and routing through the pool gives the sequential bits.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cfenv>
#include <stdexcept>
#include <thread>
#include <vector>

#include "reference.hpp"

#include <moe_route/backend/cpu/detail/worker_pool.hpp>

namespace mr = moe_route;
using pool = moe_route::cpu::detail::worker_pool;

namespace {

// Runs `tasks` tasks that each count their index; every count must be 1.
bool each_task_once(int tasks) {
  std::vector<std::atomic<int>> runs(tasks);
  auto task = [&](int i) { runs[i].fetch_add(1); };
  pool::instance().run(tasks, task);
  for (auto& r : runs)
    if (r.load() != 1) return false;
  return true;
}

}  // namespace

TEST_CASE("the worker pool runs every task exactly once, call after call") {
  for (int round = 0; round < 200; ++round)
    for (int tasks : {0, 1, 2, 3, 8, 17}) {
      CAPTURE(round);
      CAPTURE(tasks);
      REQUIRE(each_task_once(tasks));
    }
}

TEST_CASE("the worker pool's tasks run under the caller's rounding mode") {
  const int saved = std::fegetround();
  REQUIRE(std::fesetround(FE_DOWNWARD) == 0);
  std::vector<float> third(6);
  volatile float one = 1.0f, three = 3.0f;
  auto task = [&](int i) { third[i] = one / three; };
  pool::instance().run(6, task);
  std::fesetround(saved);
  for (float x : third) CHECK(x < 1.0f / 3.0f);  // rounded down, not to the nearest float (above 1/3)
}

TEST_CASE("an exception thrown by a task reaches the caller after every task has ended") {
  std::atomic<int> ended{0};
  auto task = [&](int i) {
    ended.fetch_add(1);
    if (i == 2) throw std::runtime_error("task 2");
  };
  CHECK_THROWS_WITH_AS(pool::instance().run(5, task), "task 2", std::runtime_error);
  CHECK(ended.load() == 5);
  CHECK(each_task_once(5));  // the pool is usable afterwards
}

TEST_CASE("a task that itself splits, and callers on several threads, all complete") {
  std::atomic<int> inner{0};
  auto nested = [&](int) {
    auto leaf = [&](int) { inner.fetch_add(1); };
    pool::instance().run(3, leaf);
  };
  pool::instance().run(4, nested);
  CHECK(inner.load() == 12);

  std::atomic<int> failures{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([&] {
      for (int round = 0; round < 100; ++round)
        if (!each_task_once(2 + round % 5)) failures.fetch_add(1);
    });
  for (auto& t : callers) t.join();
  CHECK(failures.load() == 0);
}

TEST_CASE("a forked child, which has none of the pool's threads, still runs its calls") {
  REQUIRE(each_task_once(4));  // the parent's pool exists and has workers
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) ::_exit(each_task_once(4) ? 0 : 1);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("routing on many threads from many callers at once gives the sequential bits") {
  ref::rng g(7);
  mr::router<mr::gating::softmax, mr::selection::top_k, 4> r;
  r.top_k = 4;
  const std::int64_t N = 3000;
  const int E = 40;
  std::vector<float> z(N * E);
  for (auto& x : z) x = static_cast<float>(g.normal(2.0));
  const auto seq = ref::run(r, z, N, E, nullptr, 1);
  std::atomic<int> mismatches{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 3; ++c)
    callers.emplace_back([&, c] {
      for (int round = 0; round < 10; ++round) {
        const auto par = ref::run(r, z, N, E, nullptr, 2 + (c + round) % 4);
        if (par.idx != seq.idx || par.gates != seq.gates) mismatches.fetch_add(1);
      }
    });
  for (auto& t : callers) t.join();
  CHECK(mismatches.load() == 0);
}
