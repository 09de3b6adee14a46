// moe_route: Router-L2, the parameter-space anchor (RPB eq. 5). POLICIES.md section 5.
#pragma once

#include <cstdint>
#include <string>

#include "../types.hpp"
#include "../validate.hpp"
#include "penalty.hpp"

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
struct router_l2 {
  float coefficient = 1e4f;

  // Returns the penalty value and accumulates the gradients. Each layer's sum
  // runs in double in element order: deterministic.
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
      for (std::int64_t i = 0; i < w.size; ++i) {
        const double d = static_cast<double>(w.weights[i]) - static_cast<double>(w.base[i]);
        sum += d * d;
        if (w.grad != nullptr) w.grad[i] += grad_scale * (w.weights[i] - w.base[i]);
      }
      value += sum;
    }
    return scale * value;
  }
};

template <>
inline constexpr bool is_penalty<router_l2> = true;

}  // namespace moe_route::penalty
