// A host emulation of one 32-lane CUDA warp, the W of the CUDA backend's
// agents (backend/cuda/warp_reduce.cuh): 32 lanes as ucontext fibers on the
// calling thread, run one after another up to each collective (shuffle,
// ballot, maximum, sync), where the warp meets, so the device code runs on a
// machine without a GPU and its results can be compared with the CPU backend.
// Lanes that disagree on a collective's result, or that do not all reach the
// same number of collectives, abort the test. Fibers rather than threads: the
// schedule is fixed (lane 0..31 between two collectives) and a collective
// costs 64 context switches on one core instead of 32 threads meeting at a
// barrier on however few cores the machine has.
#pragma once
#include <ucontext.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>
#include <cstdio>
#include <cstdlib>
#include <moe_route/types.hpp>

#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EMU_ASAN 1
#endif
#endif
#if defined(EMU_ASAN)
#include <sanitizer/common_interface_defs.h>
#endif

namespace emu {

inline constexpr int lanes = 32;
inline constexpr std::size_t stack_bytes = std::size_t{256} << 10;  // per lane: the agents keep small arrays
// (max_top_k, E / 32 values); ASan clears a fiber stack's shadow at every switch, so no bigger than needed

struct exchange {
  std::uint64_t buf[2][lanes];
  long collectives = 0;
  ucontext_t scheduler;
  ucontext_t lane_context[lanes];
  bool finished[lanes] = {};
  bool waiting[lanes] = {};
  int phase[lanes] = {};  // the buffer of each lane's next collective: lane 0 writes its next one
                          // while lanes 1..31 still read this one
  const void* fn = nullptr;  // the lanes' body (run's std::function<void(int)>)
#if defined(EMU_ASAN)
  void* scheduler_fake_stack = nullptr;
  const void* scheduler_stack_bottom = nullptr;
  std::size_t scheduler_stack_size = 0;
#endif
};

inline exchange* g_ex = nullptr;
inline int g_lane = 0;  // the lane now running

// The fibers' stacks, kept for the whole test run (one mmap per lane, not per call).
inline char* lane_stack(int lane) {
  static std::vector<std::unique_ptr<char[]>> stacks;
  if (stacks.empty())
    for (int l = 0; l < lanes; ++l) stacks.emplace_back(new char[stack_bytes]);
  return stacks[static_cast<std::size_t>(lane)].get();
}

// Back to the scheduler from the running lane (at a collective, or at its end: finished).
inline void yield_to_scheduler([[maybe_unused]] bool finished) {
  exchange& ex = *g_ex;
  const int lane = g_lane;
#if defined(EMU_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(finished ? nullptr : &fake, ex.scheduler_stack_bottom, ex.scheduler_stack_size);
#endif
  swapcontext(&ex.lane_context[lane], &ex.scheduler);
#if defined(EMU_ASAN)
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

inline void lane_entry() {
#if defined(EMU_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &g_ex->scheduler_stack_bottom, &g_ex->scheduler_stack_size);
#endif
  (*static_cast<const std::function<void(int)>*>(g_ex->fn))(g_lane);
  g_ex->finished[g_lane] = true;
  yield_to_scheduler(true);  // never resumed
}

inline void resume(exchange& ex, int lane) {
  g_lane = lane;
#if defined(EMU_ASAN)
  __sanitizer_start_switch_fiber(&ex.scheduler_fake_stack, lane_stack(lane), stack_bytes);
#endif
  swapcontext(&ex.scheduler, &ex.lane_context[lane]);
#if defined(EMU_ASAN)
  __sanitizer_finish_switch_fiber(ex.scheduler_fake_stack, nullptr, nullptr);
#endif
}

inline const std::uint64_t* collect(std::uint64_t v) {
  exchange& ex = *g_ex;
  const int phase = ex.phase[g_lane];
  ex.buf[phase][g_lane] = v;
  ex.waiting[g_lane] = true;
  yield_to_scheduler(false);  // resumed once every lane has written
  ex.waiting[g_lane] = false;
  ex.phase[g_lane] ^= 1;
  if (g_lane == 0) ex.collectives++;
  return ex.buf[phase];
}

// A lane's fiber, to start at lane_entry. Its own function: getcontext returns
// twice, which would make the caller's loop variable suspect (-Wclobbered).
inline void prepare_lane(exchange& ex, int lane) {
  ucontext_t& c = ex.lane_context[lane];
  getcontext(&c);
  c.uc_stack.ss_sp = lane_stack(lane);
  c.uc_stack.ss_size = stack_bytes;
  c.uc_link = nullptr;
  makecontext(&c, lane_entry, 0);
}

// fn(lane) on the 32 lanes, lane by lane from one collective to the next.
inline long run_lanes(const std::function<void(int)>& fn) {
  exchange ex;
  ex.fn = &fn;
  g_ex = &ex;
  for (int l = 0; l < lanes; ++l) prepare_lane(ex, l);
  for (;;) {
    for (int l = 0; l < lanes; ++l) resume(ex, l);
    int finished = 0, waiting = 0;
    for (int l = 0; l < lanes; ++l) finished += ex.finished[l], waiting += ex.waiting[l];
    if (finished == lanes) break;
    if (waiting != lanes) {
      std::fprintf(stderr, "warp emulator: %d lanes at a collective, %d returned\n", waiting, finished);
      std::abort();
    }
  }
  g_ex = nullptr;
  return ex.collectives;
}

inline std::uint32_t fbits(float f) { std::uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bitsf(std::uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

struct warp {
  static int lane() { return g_lane; }
  static float shfl_xor(float v, int off) { auto b = collect(fbits(v)); return bitsf((std::uint32_t)b[g_lane ^ off]); }
  static std::uint32_t shfl_xor(std::uint32_t v, int off) { auto b = collect(v); return (std::uint32_t)b[g_lane ^ off]; }
  static double shfl_xor(double v, int off) {
    std::uint64_t u;
    std::memcpy(&u, &v, 8);
    const std::uint64_t o = collect(u)[g_lane ^ off];
    double r;
    std::memcpy(&r, &o, 8);
    return r;
  }
  static std::uint64_t shfl_xor(std::uint64_t v, int off) { return collect(v)[g_lane ^ off]; }
  static float shfl(float v, int src) { auto b = collect(fbits(v)); return bitsf((std::uint32_t)b[src & 31]); }
  static int shfl(int v, int src) { auto b = collect((std::uint32_t)v); return (int)(std::uint32_t)b[src & 31]; }
  static std::uint32_t reduce_max(std::uint32_t v) {
    auto b = collect(v);
    std::uint32_t m = 0;
    for (int i = 0; i < 32; ++i) m = (std::uint32_t)b[i] > m ? (std::uint32_t)b[i] : m;
    return m;
  }
  static bool any(bool p) { auto b = collect(p); for (int i = 0; i < 32; ++i) if (b[i]) return true; return false; }
  static std::uint32_t ballot(bool p) { auto b = collect(p); std::uint32_t m = 0; for (int i = 0; i < 32; ++i) if (b[i]) m |= 1u << i; return m; }
  static void sync() { collect(0); }
  template <class T> static T load(const T* p) { return *p; }
  static void atomic_add(std::int64_t* p, std::int64_t v) { __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
  static void atomic_add(int* p, int v) { __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
  static void atomic_max(std::int64_t* p, std::int64_t v) {
    std::int64_t old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
  }
};

// Runs fn() on 32 lanes; returns lane 0's result.
template <class R>
R run(const std::function<R()>& fn, long* collectives = nullptr) {
  std::vector<R> res(lanes);
  const long n = run_lanes([&](int lane) { res[static_cast<std::size_t>(lane)] = fn(); });
  for (int l = 1; l < lanes; ++l) if (!(res[l] == res[0])) { fprintf(stderr, "lanes disagree\n"); abort(); }
  if (collectives) *collectives = n;
  return res[0];
}

}  // namespace emu
