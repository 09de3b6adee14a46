// moe_route: Router-L2, the parameter-space anchor (RPB eq. 5). docs/policies.md section 5.
#pragma once

#include <cstdint>
#include <string>

#include <moe_route/penalty/penalty.hpp>
#include <moe_route/types.hpp>

namespace moe_route::penalty {

// One router weight matrix, its frozen base copy, and where its gradient goes.
struct router_weights {
  const float* weights = nullptr;  // W_l, any layout, `size` elements
  const float* base = nullptr;     // W_l^base, same layout
  std::int64_t size = 0;
  float* grad = nullptr;           // dL/dW_l is ADDED here (may be null: value only)
};

// L = lambda * mean_l ||W_l - W_l^base||_F^2 over the layers passed;
// dL/dW_l = (2 lambda / L_layers) (W_l - W_l^base). It acts on weights, not on
// logits, so it adds nothing to the router's forward or backward: a training
// step calls apply() next to them. The paper's main setting is lambda = 1e4.
// Elements per chunk of a layer's sum of squares.
inline constexpr std::int64_t l2_chunk = 4096;

// acc + (w - w0)^2 in double (the difference of two floats is exact in double).
MOE_ROUTE_HD double l2_term(float w, float w0, double acc) {
  const double d = static_cast<double>(w) - static_cast<double>(w0);
  return moe_route::detail::fma(d, d, acc);
}

// g + 2 lambda / L (w - w0), rounded once.
MOE_ROUTE_HD float l2_grad(float w, float w0, float grad_scale, float g) {
  return moe_route::detail::fma(grad_scale, w - w0, g);
}

// Router-L2 is not a router policy: it acts on weights, next to the router's
// backward (a router's policy list rejects it).
struct router_l2 {
  float coefficient = 1e4f;

  // Returns the penalty value and accumulates the gradients. Each layer's sum
  // runs in double in chunks of l2_chunk elements, each in element order, then
  // the chunks in order, then the layers in order: deterministic, and the
  // order cuda::penalty::router_l2_apply uses, so both give the same bits.
  double apply(const router_weights* layers, int num_layers) const {
    if (num_layers < 1) moe_route::detail::fail("router_l2: num_layers (= " + std::to_string(num_layers) + ") must be >= 1");
    if (layers == nullptr) moe_route::detail::fail("router_l2: layers is null");
    for (int l = 0; l < num_layers; ++l) {
      const router_weights& w = layers[l];
      const std::string at = "router_l2: layers[" + std::to_string(l) + "].";
      if (w.size < 0) moe_route::detail::fail(at + "size must be >= 0");
      if (w.size > 0 && (w.weights == nullptr || w.base == nullptr))
        moe_route::detail::fail(at + (w.weights == nullptr ? "weights" : "base") + " is null");
    }
    const double scale = static_cast<double>(coefficient) / num_layers;
    const float grad_scale = static_cast<float>(2.0 * scale);
    double value = 0.0;
    for (int l = 0; l < num_layers; ++l) {
      const router_weights& w = layers[l];
      double sum = 0.0;
      for (std::int64_t base = 0; base < w.size; base += l2_chunk) {
        const std::int64_t end = base + l2_chunk < w.size ? base + l2_chunk : w.size;
        double chunk = 0.0;
        for (std::int64_t i = base; i < end; ++i) chunk = l2_term(w.weights[i], w.base[i], chunk);
        sum += chunk;
      }
      if (w.grad != nullptr)
        for (std::int64_t i = 0; i < w.size; ++i) w.grad[i] = l2_grad(w.weights[i], w.base[i], grad_scale, w.grad[i]);
      value += sum;
    }
    return scale * value;
  }
};

}  // namespace moe_route::penalty
