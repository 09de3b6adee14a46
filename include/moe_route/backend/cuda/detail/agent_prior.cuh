// moe_route CUDA backend: the prior builder's warp agent (prior::build on the
// device). One warp per token with a prior row: the routing distribution of
// the base logits (cpu::detail::distribution, the same operations in the
// canonical lane order), added in fixed point to the token's row with 64-bit
// integer atomics, so the result does not depend on the order of the tokens.
#pragma once

#include <cstdint>

#include <moe_route/backend/cuda/detail/config.cuh>
#include <moe_route/backend/cuda/detail/warp_reduce.cuh>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/gating/gating.hpp>
#include <moe_route/gating/softmax.hpp>
#include <moe_route/training/workspace.hpp>
#include <moe_route/types.hpp>

namespace moe_route::cuda::detail {

template <class T>
struct prior_build_params {
  const T* logits;              // [N x E] base router logits
  std::int64_t num_tokens;
  int num_experts;
  const std::int32_t* rows;     // [N] r(t), -1 = none
  std::int64_t num_rows;        // S
  std::int64_t* sums;           // [S x E] fixed-point sums (zeroed by the caller)
  std::int64_t* row_tokens;     // [S] tokens per row (zeroed by the caller)
};

template <class W, class Gating, class T>
MOE_ROUTE_CUDA_DEVICE void build_prior_row(const prior_build_params<T>& p, std::int64_t token) {
  namespace num = moe_route::detail;
  const std::int32_t r = p.rows[token];
  if (r < 0 || r >= p.num_rows) return;  // device data cannot be validated: out of range = no prior
  const int lane = W::lane();
  const int E = p.num_experts;
  const T* z = p.logits + token * E;
  const auto v = [z](int e) { return num::sanitize(num::to_float(W::load(z + e))); };
  float row_max = 0.0f;
  if constexpr (Gating::shape != gating::kind::elementwise) {
    float m = -num::float_max;
    for (int e = lane; e < E; e += warp_threads) m = num::max(m, v(e));
    row_max = warp_max<W>(m);
  }
  const auto s = [&](int e) {
    if constexpr (Gating::shape == gating::kind::elementwise)
      return Gating::score(v(e));
    else
      return gating::softmax::term(v(e), row_max);
  };
  float partial = 0.0f;
  for (int e = lane; e < E; e += warp_threads) partial += s(e);
  const float sum = warp_sum<W>(partial);
  std::int64_t* acc = p.sums + static_cast<std::int64_t>(r) * E;
  for (int e = lane; e < E; e += warp_threads) {
    const float prob = sum > 0.0f ? num::div(s(e), sum) : 0.0f;
    const std::int64_t fixed = penalty::to_fixed_point(prob);
    if (fixed != 0) W::atomic_add(acc + e, fixed);
  }
  if (lane == 0) W::atomic_add(p.row_tokens + r, std::int64_t{1});
}

}  // namespace moe_route::cuda::detail
