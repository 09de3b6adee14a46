// moe_route CUDA backend: the device executor of the admission-side launch
// sequences (admission_launch.cuh, expert_choice_launch.cuh,
// dispatch_launch.cuh). A sequence is written once over an executor, so the
// host warp emulator (tests/emulator/executor.hpp) runs the same steps:
//
//   for_each(n, f, what)              f(i) for i in [0, n), one thread each
//   for_each_warp(n, words, f, what)  f.run<W>(w, scratch) for w in [0, n), one
//                                     warp each; scratch: `words` 32-bit words
//                                     of shared memory per warp
//   fill(p, byte, bytes, what)        memset on the stream
//   sort_pairs(temp, temp_bytes, keys, values, n, end_bit, descending, what)
//                                     stable radix sort of (key bits [0, end_bit), value)
//   exclusive_sum(temp, temp_bytes, in, out, n, what)
//   sort_temp_bytes<K, V>(n, end_bit, descending), scan_temp_bytes(n): temp sizes
//
// Everything runs on one stream, asynchronously, with no allocation; a launch
// that fails throws cuda_error naming `what`.
#pragma once

#include <cuda_runtime.h>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <cstddef>
#include <cstdint>
#include <string>

#include <moe_route/backend/cuda/detail/admission_common.cuh>
#include <moe_route/backend/cuda/detail/config.cuh>
#include <moe_route/backend/cuda/detail/error.cuh>
#include <moe_route/backend/cuda/detail/tuning.cuh>
#include <moe_route/backend/cuda/detail/warp.cuh>
#include <moe_route/config.hpp>

namespace moe_route::cuda::detail {

inline constexpr int executor_block_threads = tuning::admission_block_threads;
inline constexpr int executor_warps_per_block = executor_block_threads / warp_threads;

template <class F>
MOE_ROUTE_KERNEL void __launch_bounds__(executor_block_threads) for_each_kernel(F f, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) f(i);
}

// Warp-uniform loop: every lane of a warp runs the same w, so f may use W's collectives.
template <class F>
MOE_ROUTE_KERNEL void __launch_bounds__(executor_block_threads) for_each_warp_kernel(F f, std::int64_t n, int words) {
  extern __shared__ std::uint32_t executor_scratch[];
  std::uint32_t* scratch = executor_scratch + static_cast<std::size_t>(threadIdx.x / warp_threads) * words;
  const std::int64_t stride = (static_cast<std::int64_t>(gridDim.x) * blockDim.x) / warp_threads;
  for (std::int64_t w = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / warp_threads; w < n;
       w += stride)
    f.template run<cuda_warp>(w, scratch);
}

struct device_executor {
  cudaStream_t stream = nullptr;

  // Blocks for `items` work items of `per_block` each, capped (the kernels loop).
  static unsigned grid_for(std::int64_t items, std::int64_t per_block) {
    std::int64_t b = (items + per_block - 1) / per_block;
    if (b < 1) b = 1;
    return static_cast<unsigned>(b < tuning::admission_max_blocks ? b : tuning::admission_max_blocks);
  }

  // Throws cuda_error naming `call` and `what` if code is an error (the name is built only then).
  static void check(cudaError_t code, const char* call, const char* what) {
    if (code != cudaSuccess) throw cuda_error((std::string(call) + " (" + what + ")").c_str(), code);
  }

  template <class F>
  void for_each(std::int64_t n, const F& f, const char* what) const {
    if (n <= 0) return;
    for_each_kernel<F><<<grid_for(n, executor_block_threads), executor_block_threads, 0, stream>>>(f, n);
    check(cudaGetLastError(), "moe_route::cuda: kernel launch", what);
  }

  template <class F>
  void for_each_warp(std::int64_t n, int words, const F& f, const char* what) const {
    if (n <= 0) return;
    const std::size_t shared = static_cast<std::size_t>(executor_warps_per_block) * words * sizeof(std::uint32_t);
    for_each_warp_kernel<F>
        <<<grid_for(n, executor_warps_per_block), executor_block_threads, shared, stream>>>(f, n, words);
    check(cudaGetLastError(), "moe_route::cuda: kernel launch", what);
  }

  void fill(void* p, int byte, std::size_t bytes, const char* what) const {
    if (bytes == 0) return;
    check(cudaMemsetAsync(p, byte, bytes, stream), "cudaMemsetAsync", what);
  }

  template <class K, class V>
  std::size_t sort_temp_bytes(int n, int end_bit, bool descending) const {
    std::size_t bytes = 0;
    cub::DoubleBuffer<K> k(nullptr, nullptr);
    cub::DoubleBuffer<V> v(nullptr, nullptr);
    check_launch(descending ? cub::DeviceRadixSort::SortPairsDescending(nullptr, bytes, k, v, n, 0, end_bit)
                            : cub::DeviceRadixSort::SortPairs(nullptr, bytes, k, v, n, 0, end_bit),
                 "cub::DeviceRadixSort (size query)");
    return bytes;
  }

  template <class K, class V>
  void sort_pairs(void* temp, std::size_t temp_bytes, admission_detail::double_buffer<K>& keys,
                  admission_detail::double_buffer<V>& values, int n, int end_bit, bool descending,
                  const char* what) const {
    cub::DoubleBuffer<K> k(keys.buffers[0], keys.buffers[1]);
    cub::DoubleBuffer<V> v(values.buffers[0], values.buffers[1]);
    k.selector = keys.selector;
    v.selector = values.selector;
    std::size_t bytes = temp_bytes;
    check(descending ? cub::DeviceRadixSort::SortPairsDescending(temp, bytes, k, v, n, 0, end_bit, stream)
                     : cub::DeviceRadixSort::SortPairs(temp, bytes, k, v, n, 0, end_bit, stream),
          "cub::DeviceRadixSort", what);
    keys.selector = k.selector;
    values.selector = v.selector;
  }

  std::size_t scan_temp_bytes(int n) const {
    std::size_t bytes = 0;
    check_launch(cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<const std::int64_t*>(nullptr),
                                               static_cast<std::int64_t*>(nullptr), n),
                 "cub::DeviceScan::ExclusiveSum (size query)");
    return bytes;
  }

  void exclusive_sum(void* temp, std::size_t temp_bytes, const std::int64_t* in, std::int64_t* out, int n,
                     const char* what) const {
    std::size_t bytes = temp_bytes;
    check(cub::DeviceScan::ExclusiveSum(temp, bytes, in, out, n, stream), "cub::DeviceScan::ExclusiveSum", what);
  }
};

}  // namespace moe_route::cuda::detail
