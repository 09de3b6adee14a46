// moe_route CUDA backend: launch tuning as constexpr values (host side; no
// device code reads them). Changing a value here changes performance only,
// never results: every launch shape computes the same bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include <moe_route/backend/cuda/detail/config.cuh>
#include <moe_route/config.hpp>

namespace moe_route::cuda::tuning {

// One kernel launch shape: warps per block (one warp per token) and the most
// blocks a grid gets; larger batches loop (grid-stride) over their tokens.
struct launch_policy {
  int warps_per_block;
  std::int64_t max_blocks;

  constexpr int block_threads() const { return warps_per_block * warp_threads; }
  // Blocks for n tokens.
  constexpr std::int64_t blocks_for(std::int64_t tokens) const {
    const std::int64_t b = (tokens + warps_per_block - 1) / warps_per_block;
    return b < max_blocks ? b : max_blocks;
  }
  friend constexpr bool operator==(const launch_policy& a, const launch_policy& b) {
    return a.warps_per_block == b.warps_per_block && a.max_blocks == b.max_blocks;
  }
  friend constexpr bool operator!=(const launch_policy& a, const launch_policy& b) { return !(a == b); }
};

// Every routing kernel is compiled with __launch_bounds__(max_block_threads).
inline constexpr int max_block_threads = 256;

inline constexpr launch_policy route_bucket{8, std::int64_t{1} << 16};
inline constexpr launch_policy route_general{8, std::int64_t{1} << 16};
inline constexpr launch_policy backward_bucket{8, std::int64_t{1} << 16};
inline constexpr launch_policy backward_general{8, std::int64_t{1} << 16};

// The general forward path keeps a warp's E packed keys in shared memory; it
// uses fewer warps per block when E is large so a block stays within this
// budget (no opt-in to large dynamic shared memory needed).
inline constexpr int general_shared_bytes = 48 * 1024;

// The training route kernel (agent_training.cuh) keeps E keys and E
// fixed-point sums per warp in shared memory (opting in above 48 KiB), and a
// bounded grid so each warp routes many tokens before its sums are flushed.
inline constexpr std::size_t training_shared_bytes = 96 * 1024;
inline constexpr std::int64_t training_max_blocks = 2048;

// Admission, expert choice and dispatch metadata: threads per block of their
// item and token kernels (token kernels: one warp per token), and the most
// blocks a grid gets (the kernels loop).
inline constexpr int admission_block_threads = 256;
inline constexpr std::int64_t admission_max_blocks = std::int64_t{1} << 16;

// Threads of the single block of the expert-bias update.
inline constexpr int bias_update_threads = 256;

// The register-resident buckets: E <= bucket runs with bucket / 32 values per lane.
inline constexpr int buckets[] = {64, 128, 256, 384, 512};

// The smallest bucket >= E, or 0: the general path (E in (512, 4096]).
constexpr int bucket_for(int num_experts) {
  for (int b : buckets)
    if (num_experts <= b) return b;
  return 0;
}

static_assert(route_bucket.block_threads() <= max_block_threads && route_general.block_threads() <= max_block_threads &&
                  backward_bucket.block_threads() <= max_block_threads &&
                  backward_general.block_threads() <= max_block_threads,
              "a routing launch policy exceeds the kernels' __launch_bounds__");
static_assert(bucket_for(1) == 64 && bucket_for(64) == 64 && bucket_for(65) == 128 && bucket_for(384) == 384 &&
                  bucket_for(512) == 512 && bucket_for(513) == 0,
              "bucket_for must pick the smallest bucket that holds E");
static_assert(buckets[4] == max_fast_path_experts, "the largest bucket is config.hpp's max_fast_path_experts");

}  // namespace moe_route::cuda::tuning
