// moe_route CUDA backend: the warp agent of the expert-choice backward
// (cpu::expert_choice_backward replayed exactly). One warp per token: the
// row's softmax statistics, <ds, s> over the chosen slots in the canonical
// lane order (slot j in lane j mod 32), the dense row dz = s * -dot, then,
// after W::sync(), the chosen experts' entries s * (ds - dot). Slots with an
// index outside [0, E) are ignored (the CPU backend rejects them).
#pragma once

#include <cstdint>

#include <moe_route/admission/scores.hpp>
#include <moe_route/backend/cuda/detail/config.cuh>
#include <moe_route/backend/cuda/detail/warp_reduce.cuh>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/gating/softmax.hpp>

namespace moe_route::cuda::detail {

template <class W, class T>
MOE_ROUTE_CUDA_DEVICE void expert_choice_backward_row(const T* z, const std::int32_t* idx, const float* dg, int E,
                                                      float* dz) {
  namespace num = moe_route::detail;
  using moe_route::admission::gate_input;
  const int lane = W::lane();
  const auto v = [z](int e) { return num::sanitize(num::to_float(W::load(z + e))); };
  float m = -num::float_max;
  for (int e = lane; e < E; e += warp_threads) m = num::max(m, v(e));
  moe_route::admission::row_stats st;
  st.max = warp_max<W>(m);
  float partial = 0.0f;
  for (int e = lane; e < E; e += warp_threads) partial += gating::softmax::term(v(e), st.max);
  st.sum = warp_sum<W>(partial);
  float dot_part = 0.0f;
  for (int j = lane; j < E; j += warp_threads) {
    const std::int32_t e = W::load(idx + j);
    if (e >= 0 && e < E) dot_part = num::fma(W::load(dg + j), gate_input<gating::softmax>(v(e), st), dot_part);
  }
  const float dot = warp_sum<W>(dot_part);
  for (int e = lane; e < E; e += warp_threads) dz[e] = gate_input<gating::softmax>(v(e), st) * -dot;
  W::sync();
  for (int j = lane; j < E; j += warp_threads) {
    const std::int32_t e = W::load(idx + j);
    if (e >= 0 && e < E) dz[e] = gate_input<gating::softmax>(v(e), st) * (W::load(dg + j) - dot);
  }
}

}  // namespace moe_route::cuda::detail
