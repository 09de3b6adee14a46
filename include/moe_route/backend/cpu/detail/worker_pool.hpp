// moe_route CPU backend: the process's parked worker threads. A call that
// splits its tokens over threads hands its blocks to them instead of starting
// threads: waking a parked thread costs microseconds, starting one 60-80 us on
// the 2-core guest measured in docs/performance.md. Both sides spin briefly
// before they sleep, about as long as a wake-up costs (spin_us), so calls
// that follow each other closely (a forward, its penalties, its backward)
// find their workers awake.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cfenv>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace moe_route::cpu::detail {

class worker_pool {
 public:
  // The pool of this process. Never destroyed, so a call from a static
  // destructor still finds it; its parked threads end with the process.
  static worker_pool& instance() {
    static worker_pool* const pool = new worker_pool;
    return *pool;
  }

  // task(i) once for every i in [0, tasks), on the caller and up to tasks - 1
  // workers, each under the caller's floating-point environment; returns when
  // every task has ended and then rethrows the first exception one threw.
  // Which thread runs which i is not fixed: a task's result may depend on i
  // alone. While the pool serves another call (from another thread, or from
  // inside one of its own tasks), and in a forked child, which has none of its
  // threads, the call starts its own threads as before the pool existed.
  template <class Task>
  void run(int tasks, Task& task) {
    if (tasks <= 1) {
      if (tasks == 1) task(0);
      return;
    }
    if (::getpid() != owner_ || busy_.exchange(true, std::memory_order_acquire)) return run_on_new_threads(tasks, task);
    struct release {
      std::atomic<bool>& busy;
      ~release() { busy.store(false, std::memory_order_release); }
    } released_at_exit{busy_};
    grow(tasks - 1);
    job j{[](void* t, int i) { (*static_cast<Task*>(t))(i); }, &task, tasks, {}};
    std::fegetenv(&j.env);
    std::uint32_t generation;
    {
      std::lock_guard<std::mutex> lock(state_);
      if (++generation_ == 0) ++generation_;  // 0 is what a new worker has seen
      generation = generation_;
      posted_ = j;
      error_ = nullptr;
      done_.store(0, std::memory_order_relaxed);
      next_.store(std::uint64_t{generation} << 32, std::memory_order_release);
    }
    for (int w = 1; w < tasks; ++w) wake_.notify_one();
    for (int i; (i = claim(generation, tasks)) >= 0;) execute(j, i);
    std::exception_ptr error;
    spin_until([&] { return done_.load(std::memory_order_acquire) == tasks; });
    {
      std::unique_lock<std::mutex> lock(state_);
      finished_.wait(lock, [&] { return done_.load(std::memory_order_acquire) == tasks; });
      error = error_;
    }
    if (error) std::rethrow_exception(error);
  }

 private:
  struct job {
    void (*call)(void* task, int i);
    void* task;
    int tasks;
    std::fenv_t env;
  };

  static constexpr int spin_us = 50;  // a sleeping thread's wake-up took 15-20 us on the guest

  worker_pool() = default;

  // Polls done() for up to spin_us; the thread sleeps afterwards if it is still false.
  template <class Done>
  static void spin_until(Done done) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
    do {
      for (int i = 0; i < 64; ++i) {
        if (done()) return;
#if defined(__x86_64__) || defined(__i386__)
        _mm_pause();
#endif
      }
    } while (std::chrono::steady_clock::now() < end);
  }

  // Parks workers until there are `count`. A thread that cannot be started
  // leaves fewer: the caller then runs more of the tasks itself, with the
  // same results.
  void grow(int count) {
    try {
      while (static_cast<int>(workers_.size()) < count) workers_.emplace_back([this] { work(); });
    } catch (const std::system_error&) {
    }
  }

  // The next unclaimed task of the job `generation`, or -1 when it has none
  // left or has ended (a worker that woke late must not touch a later job
  // through an earlier one's task pointer).
  int claim(std::uint32_t generation, int tasks) {
    std::uint64_t next = next_.load(std::memory_order_acquire);
    for (;;) {
      const auto index = static_cast<int>(next & 0xffffffffu);
      if (static_cast<std::uint32_t>(next >> 32) != generation || index >= tasks) return -1;
      if (next_.compare_exchange_weak(next, next + 1, std::memory_order_acq_rel)) return index;
    }
  }

  void execute(const job& j, int i) {
    try {
      j.call(j.task, i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(state_);
      if (!error_) error_ = std::current_exception();
    }
    if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == j.tasks) {
      std::lock_guard<std::mutex> lock(state_);  // the caller is between its check and its wait, or waiting
      finished_.notify_one();
    }
  }

  void work() {
    std::uint32_t seen = 0;
    for (;;) {
      job j;
      std::uint32_t generation;
      spin_until([&] { return static_cast<std::uint32_t>(next_.load(std::memory_order_acquire) >> 32) != seen; });
      {
        std::unique_lock<std::mutex> lock(state_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation = generation_;
        j = posted_;
      }
      std::fesetenv(&j.env);
      for (int i; (i = claim(generation, j.tasks)) >= 0;) execute(j, i);
    }
  }

  template <class Task>
  static void run_on_new_threads(int tasks, Task& task) {
    std::vector<std::exception_ptr> errors(tasks);
    auto guarded = [&](int i) {
      try {
        task(i);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    };
    std::vector<std::thread> threads;
    int started = 1;
    try {
      for (threads.reserve(tasks - 1); started < tasks; ++started) threads.emplace_back(guarded, started);
    } catch (const std::system_error&) {  // the tasks no thread took run here
    }
    for (int i = started; i < tasks; ++i) guarded(i);
    guarded(0);
    for (auto& t : threads) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }

  std::atomic<bool> busy_{false};
  const pid_t owner_ = ::getpid();
  std::mutex state_;  // guards generation_, posted_, error_ and the waits
  std::condition_variable wake_, finished_;
  std::uint32_t generation_ = 0;
  job posted_{};
  std::exception_ptr error_;
  std::atomic<std::uint64_t> next_{0};  // the posted generation << 32 | its next unclaimed task
  std::atomic<int> done_{0};
  std::vector<std::thread> workers_;
};

}  // namespace moe_route::cpu::detail
