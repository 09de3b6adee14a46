// moe_route: dispatch metadata on the CPU (layout: admission/dispatch.hpp).
//
//   cpu::dispatch(dispatch_inputs, dispatch_outputs) -> rows (= offsets[E])
//
// A counting sort of the slots by expert, in slot order, so every expert's
// slots are ordered by (token, slot). Identical to cuda::dispatch.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <moe_route/admission/detail/validate.hpp>
#include <moe_route/admission/dispatch.hpp>

namespace moe_route::cpu {

// Writes counts, offsets and, when set, permutation (all dispatch_rows_bound
// rows), inverse and rank_counts. Returns the number of rows, offsets[E].
// Throws moe_route::error, writing nothing, if an argument is invalid
// (including entries of indices outside [-1, E) and ranks outside [0, R)).
inline std::int64_t dispatch(const dispatch_inputs& in, const dispatch_outputs& out) {
  admission::detail::validate_dispatch(in, out);
  admission::detail::validate_dispatch_data(in);
  const int e_count = in.num_experts;
  const std::int64_t slots = in.num_tokens * in.slots_per_token;
  std::fill(out.counts, out.counts + e_count, std::int64_t{0});
  for (std::int64_t s = 0; s < slots; ++s)
    if (in.indices[s] >= 0) ++out.counts[in.indices[s]];
  out.offsets[0] = 0;
  for (int e = 0; e < e_count; ++e)
    out.offsets[e + 1] = out.offsets[e] + expert_rows(out.counts[e], in.align, in.capacity);
  if (out.permutation != nullptr || out.inverse != nullptr) {
    std::vector<std::int64_t> cursor(out.offsets, out.offsets + e_count);
    if (out.permutation != nullptr)
      std::fill(out.permutation,
                out.permutation + dispatch_rows_bound(in.num_tokens, in.slots_per_token, e_count, in.align, in.capacity),
                std::int64_t{-1});
    for (std::int64_t s = 0; s < slots; ++s) {
      const std::int32_t e = in.indices[s];
      const std::int64_t row = e >= 0 ? cursor[e]++ : -1;
      if (out.inverse != nullptr) out.inverse[s] = row;
      if (out.permutation != nullptr && row >= 0) out.permutation[row] = s;
    }
  }
  if (out.rank_counts != nullptr) {
    std::fill(out.rank_counts, out.rank_counts + in.num_ranks, std::int64_t{0});
    for (int e = 0; e < e_count; ++e) {
      const int rank = in.expert_rank != nullptr ? in.expert_rank[e] : contiguous_rank(e, e_count, in.num_ranks);
      out.rank_counts[rank] += out.counts[e];
    }
  }
  return out.offsets[e_count];
}

}  // namespace moe_route::cpu
