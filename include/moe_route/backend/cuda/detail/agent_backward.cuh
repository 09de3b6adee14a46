// moe_route CUDA backend: the fused backward agent (cpu::detail::backward_row).
// One warp per token:
//   lane j < K reads indices[j] and dL/dgates[j] and recomputes the selected
//   score s_j from the logit; the lanes exchange them and every lane evaluates
//   detail::gate_weights_vjp (dsel);
//   row_softmax: dot = fma chain over the selected in slot order,
//     dz_e = s_e * -dot for every expert, then dz_{e_j} = s_j * (dsel_j - dot);
//   elementwise: dz = 0 except dz_{e_j} = dsel_j * G::derivative(v_j, s_j);
//   selected_softmax: dz = 0 except dz_{e_j} = dsel_j.
// The dense row is written first; after W::sync() (which orders the lanes'
// stores) the selected entries are overwritten, the last slot winning when an
// expert repeats, as in the CPU loop.
//
// Entries of `indices` outside [0, E) are ignored on the device (the CPU
// backend rejects them on the host): they read no logit, take part in the
// gate VJP with score 0 (logit -inf for softmax_after_topk, i.e. weight 0),
// are left out of the softmax dot product and write no gradient.
//
// A padding token (token_mask byte 0) gets a zero row; neither its logits nor
// its indices are read.
#pragma once

#include <cstdint>

#include <moe_route/backend/cuda/detail/agent_common.cuh>
#include <moe_route/backend/cuda/detail/config.cuh>
#include <moe_route/backend/cuda/detail/warp_reduce.cuh>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/gating/gating.hpp>
#include <moe_route/router.hpp>

namespace moe_route::cuda::detail {

// Everything about the K selected entries of one token that the dense and the
// scattered writes need.
struct selected_grad {
  int expert;     // lane j < K: indices[j]
  bool write;     // lane j writes dz[expert]: valid and the last slot with this expert
  float value;    // lane j: the value it writes
  float dot;      // row_softmax: <dsel, s> over the valid selected entries
};

// `logit(e)` is the sanitised logit of expert e in the row the gates came from.
template <class W, class Router, class Logit>
MOE_ROUTE_CUDA_DEVICE selected_grad backward_selected(const Router& r, const std::int32_t* indices,
                                                      const float* grad_gates, int E, std::int64_t token,
                                                      Logit logit, float row_max, float row_sum) {
  using G = typename Router::gating_type;
  const int lane = W::lane();
  const int k = r.top_k;

  int expert = -1;
  float dw = 0.0f, v = 0.0f;
  float score = G::shape == gating::kind::selected_softmax ? -num::infinity() : 0.0f;
  bool valid = false;
  if (lane < k) {
    const std::int64_t o = token * k + lane;
    expert = W::load(indices + o);
    dw = W::load(grad_gates + o);
    valid = expert >= 0 && expert < E;
    if (valid) {
      v = logit(expert);
      score = score_of<G>(v, row_max, row_sum);
    }
  }
  const std::uint32_t valid_mask = W::ballot(valid);

  float selected[Router::max_k] = {};  // zeroed: silences a GCC -Wmaybe-uninitialized false positive (emulator builds)
  float grad[Router::max_k] = {};
  float dsel[Router::max_k];
  bool last = valid;  // no later slot selects the same expert
  for (int j = 0; j < k; ++j) {
    selected[j] = W::shfl(score, j);
    grad[j] = W::shfl(dw, j);
    const int other = W::shfl(expert, j);
    if (j > lane && other == expert) last = false;
  }
  num::gate_weights_vjp(r, selected, grad, dsel, k);

  selected_grad out;
  out.expert = expert;
  out.write = last;
  out.dot = 0.0f;
  out.value = 0.0f;
  if constexpr (G::shape == gating::kind::row_softmax) {
    float dot = 0.0f;
    for (int j = 0; j < k; ++j)
      if ((valid_mask >> j) & 1u) dot = num::fma(dsel[j], selected[j], dot);
    out.dot = dot;
    if (last) out.value = score * (dsel[lane] - dot);
  } else if constexpr (G::shape == gating::kind::elementwise) {
    if (last) out.value = dsel[lane] * G::derivative(v, score);
  } else {
    if (last) out.value = dsel[lane];
  }
  return out;
}

// Bucket path for row_softmax gating: the terms stay in registers between the
// row sum and the dense write.
template <class W, class Router, class T, int Slots>
MOE_ROUTE_CUDA_DEVICE void backward_rows_bucket(const Router& r, const backward_params<T>& p, std::int64_t first,
                                                std::int64_t stride) {
  using G = typename Router::gating_type;
  static_assert(G::shape == gating::kind::row_softmax, "backward_rows_bucket serves row_softmax gatings");
  const int lane = W::lane();
  const int E = p.num_experts;
  for (std::int64_t token = first; token < p.num_tokens; token += stride) {
    if (is_padding<W>(p.token_mask, token)) {
      zero_row<W>(p.grad_logits + token * E, E);
      continue;
    }
    const T* z = p.logits + token * E;
    float v[Slots];
    float m = -num::float_max;
#pragma unroll
    for (int j = 0; j < Slots; ++j) {
      const int e = lane + warp_threads * j;
      v[j] = -num::infinity();
      if (e < E) {
        v[j] = num::sanitize(num::to_float(W::load(z + e)));
        m = num::max(m, v[j]);
      }
    }
    const float row_max = warp_max<W>(m);
    float term[Slots];
    float partial = 0.0f;
#pragma unroll
    for (int j = 0; j < Slots; ++j) {
      term[j] = 0.0f;
      if (lane + warp_threads * j < E) {
        term[j] = G::term(v[j], row_max);
        partial += term[j];
      }
    }
    const float row_sum = warp_sum<W>(partial);

    const selected_grad sg = backward_selected<W>(
        r, p.indices, p.grad_gates, E, token, [z](int e) { return num::sanitize(num::to_float(W::load(z + e))); },
        row_max, row_sum);
    float* dz = p.grad_logits + token * E;
#pragma unroll
    for (int j = 0; j < Slots; ++j) {
      const int e = lane + warp_threads * j;
      if (e < E) dz[e] = softmax_score(term[j], row_sum) * num::negate(sg.dot);
    }
    W::sync();  // the dense stores are ordered before the selected ones
    if (sg.write) dz[sg.expert] = sg.value;
  }
}

// General path: any E and every gating. Elementwise and selected_softmax
// gatings read only the K selected logits; row_softmax re-reads the row.
template <class W, class Router, class T>
MOE_ROUTE_CUDA_DEVICE void backward_rows_general(const Router& r, const backward_params<T>& p, std::int64_t first,
                                                 std::int64_t stride) {
  using G = typename Router::gating_type;
  constexpr bool row_softmax = G::shape == gating::kind::row_softmax;
  const int lane = W::lane();
  const int E = p.num_experts;
  for (std::int64_t token = first; token < p.num_tokens; token += stride) {
    if (is_padding<W>(p.token_mask, token)) {
      zero_row<W>(p.grad_logits + token * E, E);
      continue;
    }
    const T* z = p.logits + token * E;
    float row_max = 0.0f, row_sum = 0.0f;
    if constexpr (row_softmax) {
      float m = -num::float_max;
      for (int e = lane; e < E; e += warp_threads) m = num::max(m, num::sanitize(num::to_float(W::load(z + e))));
      row_max = warp_max<W>(m);
      float partial = 0.0f;
      for (int e = lane; e < E; e += warp_threads)
        partial += G::term(num::sanitize(num::to_float(W::load(z + e))), row_max);
      row_sum = warp_sum<W>(partial);
    }

    const selected_grad sg = backward_selected<W>(
        r, p.indices, p.grad_gates, E, token, [z](int e) { return num::sanitize(num::to_float(W::load(z + e))); },
        row_max, row_sum);
    float* dz = p.grad_logits + token * E;
    for (int e = lane; e < E; e += warp_threads) {
      if constexpr (row_softmax)
        dz[e] = score_of<G>(num::sanitize(num::to_float(W::load(z + e))), row_max, row_sum) * num::negate(sg.dot);
      else
        dz[e] = 0.0f;
    }
    W::sync();  // the dense stores are ordered before the selected ones
    if (sg.write) dz[sg.expert] = sg.value;
  }
}

}  // namespace moe_route::cuda::detail
