// A host emulation of one 32-lane CUDA warp, the W of the CUDA backend's
// agents (backend/cuda/warp_reduce.cuh): 32 std::threads that meet at every
// collective (shuffle, ballot, maximum, sync), so the device code runs on a
// machine without a GPU and its results can be compared with the CPU backend.
// Lanes that disagree on a collective's result abort the test.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <moe_route/types.hpp>

namespace emu {

struct exchange {
  std::atomic<int> count{0};
  std::atomic<std::uint64_t> gen{0};
  std::uint64_t buf[2][32];
  std::atomic<long> collectives{0};
  // Every lane waits here until all 32 have arrived. The waiting lanes yield
  // rather than sleep: on a machine with fewer cores than lanes that costs
  // far less than a condition variable's 31 wake-ups per collective.
  void barrier() {
    const std::uint64_t my = gen.load(std::memory_order_acquire);
    if (count.fetch_add(1, std::memory_order_acq_rel) == 31) {
      count.store(0, std::memory_order_relaxed);
      gen.fetch_add(1, std::memory_order_acq_rel);
    } else {
      while (gen.load(std::memory_order_acquire) == my) std::this_thread::yield();
    }
  }
};

inline exchange* g_ex = nullptr;
inline thread_local int t_lane = 0;
inline thread_local int t_phase = 0;

inline const std::uint64_t* collect(std::uint64_t v) {
  g_ex->buf[t_phase][t_lane] = v;
  g_ex->barrier();
  const std::uint64_t* b = g_ex->buf[t_phase];
  t_phase ^= 1;
  if (t_lane == 0) g_ex->collectives++;
  return b;
}
inline std::uint32_t fbits(float f) { std::uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bitsf(std::uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

struct warp {
  static int lane() { return t_lane; }
  static float shfl_xor(float v, int off) { auto b = collect(fbits(v)); return bitsf((std::uint32_t)b[t_lane ^ off]); }
  static std::uint32_t shfl_xor(std::uint32_t v, int off) { auto b = collect(v); return (std::uint32_t)b[t_lane ^ off]; }
  static double shfl_xor(double v, int off) {
    std::uint64_t u;
    std::memcpy(&u, &v, 8);
    const std::uint64_t o = collect(u)[t_lane ^ off];
    double r;
    std::memcpy(&r, &o, 8);
    return r;
  }
  static std::uint64_t shfl_xor(std::uint64_t v, int off) { return collect(v)[t_lane ^ off]; }
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

// Runs fn(lane) on 32 lanes; returns lane 0's result.
template <class R>
R run(const std::function<R()>& fn, long* collectives = nullptr) {
  exchange ex;
  g_ex = &ex;
  std::vector<R> res(32);
  std::vector<std::thread> th;
  for (int l = 0; l < 32; ++l)
    th.emplace_back([&, l] { t_lane = l; t_phase = 0; res[l] = fn(); });
  for (auto& t : th) t.join();
  for (int l = 1; l < 32; ++l) if (!(res[l] == res[0])) { fprintf(stderr, "lanes disagree\n"); abort(); }
  if (collectives) *collectives = ex.collectives;
  g_ex = nullptr;
  return res[0];
}

}  // namespace emu
