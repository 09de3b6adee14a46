// moe_route CUDA backend: the per-thread steps of cuda::dispatch (the
// sequence: dispatch_launch.cuh), replaying cpu::dispatch. Every step writes
// its own entries: nothing depends on the order the threads run in.
#pragma once

#include <cstdint>

#include <moe_route/admission/dispatch.hpp>
#include <moe_route/backend/cuda/detail/config.cuh>

namespace moe_route::cuda::admission_detail {

// Slot i: its expert as the sort key (E for a dropped or invalid slot), its id as the value.
struct dispatch_items_step {
  const std::int32_t* indices;
  int num_experts;
  std::uint32_t* keys;
  std::uint32_t* items;
  MOE_ROUTE_CUDA_DEVICE void operator()(std::int64_t i) const {
    const std::int32_t e = indices[i];
    keys[i] = e >= 0 && e < num_experts ? static_cast<std::uint32_t>(e) : static_cast<std::uint32_t>(num_experts);
    items[i] = static_cast<std::uint32_t>(i);
  }
};

// first[e] / last[e] (one past): the sorted positions of expert e (zeroed before).
struct dispatch_bounds_step {
  const std::uint32_t* keys;
  int n;
  int num_experts;
  std::uint32_t* first;
  std::uint32_t* last;
  MOE_ROUTE_CUDA_DEVICE void operator()(std::int64_t i) const {
    const std::uint32_t e = keys[i];
    if (e >= static_cast<std::uint32_t>(num_experts)) return;
    if (i == 0 || keys[i - 1] != e) first[e] = static_cast<std::uint32_t>(i);
    if (i + 1 == n || keys[i + 1] != e) last[e] = static_cast<std::uint32_t>(i + 1);
  }
};

// counts[e] (at most a fixed capacity: the slots past it are not executed),
// and padded[e] = expert_rows(counts[e]) (padded[E] = 0, for the scan).
struct dispatch_counts_step {
  const std::uint32_t* first;
  const std::uint32_t* last;
  int num_experts;
  int align;
  std::int64_t capacity;
  std::int64_t* counts;
  std::int64_t* padded;
  MOE_ROUTE_CUDA_DEVICE void operator()(std::int64_t e) const {
    if (e == num_experts) {
      padded[e] = 0;
      return;
    }
    std::int64_t c = static_cast<std::int64_t>(last[e]) - static_cast<std::int64_t>(first[e]);
    if (capacity > 0 && c > capacity) c = capacity;
    counts[e] = c;
    padded[e] = expert_rows(c, align, capacity);
  }
};

// The permutation (row -> slot) and its inverse (slot -> row); an expert's
// slots past a fixed capacity keep inverse -1.
struct dispatch_scatter_step {
  const std::uint32_t* keys;
  const std::uint32_t* items;
  int num_experts;
  std::int64_t capacity;
  const std::uint32_t* first;
  const std::int64_t* offsets;
  std::int64_t* permutation;
  std::int64_t* inverse;
  MOE_ROUTE_CUDA_DEVICE void operator()(std::int64_t i) const {
    const std::uint32_t e = keys[i];
    if (e >= static_cast<std::uint32_t>(num_experts)) return;
    const std::int64_t position = i - static_cast<std::int64_t>(first[e]);
    if (capacity > 0 && position >= capacity) return;
    const std::int64_t row = offsets[e] + position;
    const std::int64_t slot = items[i];
    if (permutation != nullptr) permutation[row] = slot;
    if (inverse != nullptr) inverse[slot] = row;
  }
};

// Rows per rank: rank r sums the counts of the experts it owns, in expert order.
struct dispatch_ranks_step {
  const std::int64_t* counts;
  int num_experts;
  const std::int32_t* expert_rank;
  int num_ranks;
  std::int64_t* rank_counts;
  MOE_ROUTE_CUDA_DEVICE void operator()(std::int64_t r) const {
    std::int64_t sum = 0;
    for (int e = 0; e < num_experts; ++e) {
      const int owner = expert_rank != nullptr ? expert_rank[e] : contiguous_rank(e, num_experts, num_ranks);
      if (owner == r) sum += counts[e];
    }
    rank_counts[r] = sum;
  }
};

}  // namespace moe_route::cuda::admission_detail
