// moe_route CUDA backend: the launch sequence of cuda::dispatch
// (backend/cuda/dispatch.cuh), written over an executor (executor.cuh) so the
// host warp emulator runs the same steps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <moe_route/admission/detail/validate.hpp>
#include <moe_route/admission/dispatch.hpp>
#include <moe_route/backend/cuda/detail/admission_common.cuh>
#include <moe_route/backend/cuda/detail/agent_dispatch.cuh>

namespace moe_route::cuda::admission_detail {

struct dispatch_layout {
  std::uint32_t* keys[2] = {nullptr, nullptr};
  std::uint32_t* items[2] = {nullptr, nullptr};
  std::uint32_t* first = nullptr;
  std::uint32_t* last = nullptr;
  std::int64_t* padded = nullptr;
  void* temp = nullptr;
  std::size_t temp_bytes = 0;
  int key_bits = 1;
  std::size_t bytes = 0;
};

template <class Exec>
dispatch_layout make_dispatch_layout(const Exec& ex, void* base, int n, int num_experts) {
  carver c(base);
  dispatch_layout l;
  l.key_bits = bits_for(static_cast<std::uint64_t>(num_experts));
  for (int i = 0; i < 2; ++i) {
    l.keys[i] = c.take<std::uint32_t>(static_cast<std::size_t>(n));
    l.items[i] = c.take<std::uint32_t>(static_cast<std::size_t>(n));
  }
  l.first = c.take<std::uint32_t>(static_cast<std::size_t>(num_experts));
  l.last = c.take<std::uint32_t>(static_cast<std::size_t>(num_experts));
  l.padded = c.take<std::int64_t>(static_cast<std::size_t>(num_experts) + 1);
  const std::size_t a = ex.template sort_temp_bytes<std::uint32_t, std::uint32_t>(n, l.key_bits, false);
  const std::size_t b = ex.scan_temp_bytes(num_experts + 1);
  l.temp_bytes = a > b ? a : b;
  l.temp = c.take<unsigned char>(l.temp_bytes);
  l.bytes = c.bytes();
  return l;
}

inline void validate_device_dispatch(std::int64_t num_tokens, int slots_per_token) {
  if (num_tokens * slots_per_token >= moe_route::admission::detail::max_sort_items)
    moe_route::detail::fail("cuda::dispatch: num_tokens * slots_per_token (= " +
                            std::to_string(num_tokens * slots_per_token) + ") must be < 2^31 per call");
}

// The arguments are validated; `needed` is the queried workspace size.
template <class Exec>
void launch_dispatch(const Exec& ex, const dispatch_inputs& in, const dispatch_outputs& out, void* workspace,
                     std::size_t workspace_bytes, std::size_t needed) {
  check_workspace(workspace, workspace_bytes, needed, "cuda::dispatch");
  const int n = static_cast<int>(in.num_tokens * in.slots_per_token);
  const int e_count = in.num_experts;
  dispatch_layout l = make_dispatch_layout(ex, align_workspace(workspace), n, e_count);
  const std::int64_t bound = dispatch_rows_bound(in.num_tokens, in.slots_per_token, e_count, in.align, in.capacity);
  if (out.permutation != nullptr && bound > 0)
    ex.fill(out.permutation, 0xff, sizeof(std::int64_t) * bound, "permutation");
  if (out.inverse != nullptr && n > 0) ex.fill(out.inverse, 0xff, sizeof(std::int64_t) * n, "inverse");
  ex.fill(l.first, 0, sizeof(std::uint32_t) * e_count, "first");
  ex.fill(l.last, 0, sizeof(std::uint32_t) * e_count, "last");
  double_buffer<std::uint32_t> keys{{l.keys[0], l.keys[1]}};
  double_buffer<std::uint32_t> items{{l.items[0], l.items[1]}};
  if (n > 0) {
    ex.for_each(n, dispatch_items_step{in.indices, e_count, l.keys[0], l.items[0]}, "dispatch items");
    ex.sort_pairs(l.temp, l.temp_bytes, keys, items, n, l.key_bits, false, "dispatch by expert");
    ex.for_each(n, dispatch_bounds_step{keys.current(), n, e_count, l.first, l.last}, "dispatch bounds");
  }
  ex.for_each(e_count + 1, dispatch_counts_step{l.first, l.last, e_count, in.align, in.capacity, out.counts, l.padded},
              "dispatch counts");
  ex.exclusive_sum(l.temp, l.temp_bytes, l.padded, out.offsets, e_count + 1, "dispatch offsets");
  if (n > 0 && (out.permutation != nullptr || out.inverse != nullptr))
    ex.for_each(n,
                dispatch_scatter_step{keys.current(), items.current(), e_count, in.capacity, l.first, out.offsets,
                                      out.permutation, out.inverse},
                "dispatch scatter");
  if (out.rank_counts != nullptr)
    ex.for_each(in.num_ranks, dispatch_ranks_step{out.counts, e_count, in.expert_rank, in.num_ranks, out.rank_counts},
                "dispatch ranks");
}

}  // namespace moe_route::cuda::admission_detail
