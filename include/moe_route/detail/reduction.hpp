// moe_route: the canonical row reduction, replayed on the host.
#pragma once

#include <moe_route/detail/numerics.hpp>

namespace moe_route::detail {

// Sum of x[0..n) in the order a CUDA warp computes it (numerics.hpp): lane l
// adds x[l], x[l + 32], ... in order, then the lanes combine by the butterfly
// 16, 8, 4, 2, 1. The 32 independent lanes are also a good shape for SIMD.
inline float canonical_sum(const float* x, int n) {
  float lanes[reduction_lanes] = {};
  int base = 0;
  for (; base + reduction_lanes <= n; base += reduction_lanes)
    for (int l = 0; l < reduction_lanes; ++l) lanes[l] += x[base + l];
  for (int l = 0; base + l < n; ++l) lanes[l] += x[base + l];
  for (int offset = reduction_lanes / 2; offset > 0; offset >>= 1)
    for (int l = 0; l < offset; ++l) lanes[l] = lanes[l] + lanes[l + offset];
  return lanes[0];
}

}  // namespace moe_route::detail
