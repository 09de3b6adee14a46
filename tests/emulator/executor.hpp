// The host executor of the CUDA backend's admission-side launch sequences
// (backend/cuda/detail/executor.cuh has the device one and the contract):
// item steps run in a loop, warp steps on the 32-lane warp emulator, the
// sorts as stable sorts of the same key bits, so the emulated sequence is the
// device's step for step. Every "device" pointer is host memory.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "warp_emulator.hpp"
#include <moe_route/backend/cuda/detail/admission_common.cuh>

namespace emu {

struct executor {
  template <class F>
  void for_each(std::int64_t n, const F& f, const char*) const {
    for (std::int64_t i = 0; i < n; ++i) f(i);
  }

  // One emulated warp runs every w in order: a grid of one warp, as legal on a
  // device as any other grid (the steps never assume more than one warp).
  template <class F>
  void for_each_warp(std::int64_t n, int words, const F& f, const char*) const {
    if (n <= 0) return;
    std::vector<std::uint32_t> scratch(static_cast<std::size_t>(std::max(words, 1)));
    run<int>([&] {
      for (std::int64_t w = 0; w < n; ++w) f.template run<warp>(w, scratch.data());
      return 0;
    });
  }

  void fill(void* p, int byte, std::size_t bytes, const char*) const { std::memset(p, byte, bytes); }

  template <class K, class V>
  std::size_t sort_temp_bytes(int, int, bool) const { return 0; }

  template <class K, class V>
  void sort_pairs(void*, std::size_t, moe_route::cuda::admission_detail::double_buffer<K>& keys,
                  moe_route::cuda::admission_detail::double_buffer<V>& values, int n, int end_bit, bool descending,
                  const char*) const {
    const K mask = end_bit >= static_cast<int>(8 * sizeof(K)) ? ~K{0} : static_cast<K>((K{1} << end_bit) - 1);
    const K* k = keys.current();
    const V* v = values.current();
    std::vector<int> order(static_cast<std::size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return descending ? (k[a] & mask) > (k[b] & mask) : (k[a] & mask) < (k[b] & mask);
    });
    K* ko = keys.buffers[keys.selector ^ 1];
    V* vo = values.buffers[values.selector ^ 1];
    for (int i = 0; i < n; ++i) {
      ko[i] = k[order[i]];
      vo[i] = v[order[i]];
    }
    keys.selector ^= 1;
    values.selector ^= 1;
  }

  std::size_t scan_temp_bytes(int) const { return 0; }

  void exclusive_sum(void*, std::size_t, const std::int64_t* in, std::int64_t* out, int n, const char*) const {
    std::int64_t sum = 0;
    for (int i = 0; i < n; ++i) {
      const std::int64_t x = in[i];
      out[i] = sum;
      sum += x;
    }
  }
};

}  // namespace emu
