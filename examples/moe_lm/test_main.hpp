// The start of each moe_lm test executable's one translation unit: doctest
// with its main, after LibTorch's headers, and the tiny model both pretrain.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "data.hpp"

#include "model.hpp"
#include "train.hpp"

// LibTorch brings glog's CHECK macros (an abort, not a test assertion); doctest's must win.
#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

namespace moe_lm::testing {

// A model small enough for a smoke run of tens of steps in seconds.
inline model_config tiny_config(gating_preset g) {
  model_config c;
  c.d_model = 32;
  c.layers = 2;
  c.heads = 2;
  c.experts = 4;
  c.top_k = 2;
  c.expert_hidden = 32;
  c.shared_hidden = 32;
  c.gating = g;
  c.bias_update_rate = 1e-2f;
  return c;
}

// The mean task loss of steps [from, to) of a training log.
inline double mean_loss(const train_result& r, std::size_t from, std::size_t to) {
  double s = 0.0;
  for (std::size_t i = from; i < to; ++i) s += r.log[i].task_loss;
  return s / static_cast<double>(to - from);
}

// A tiny model of `preset` on `device`, pretrained for 40 steps with load
// balancing from seed 0; its loss must fall.
inline std::shared_ptr<model> pretrain_tiny(gating_preset preset, const std::vector<example>& data,
                                            const torch::Device& device = torch::kCPU) {
  torch::manual_seed(0);
  auto base = std::make_shared<model>(tiny_config(preset));
  base->to(device);
  rt::router_config r = preset_router(base->config());
  r.load_balance.coefficient = 0.01f;
  base->set_router(r);
  train_options pre;
  pre.steps = 40;
  pre.batch_size = 16;
  pre.lr = 1e-2;
  pre.threads = 1;
  const train_result pr = train(*base, data, pre);
  CHECK(mean_loss(pr, 35, 40) < mean_loss(pr, 0, 5));
  return base;
}

}  // namespace moe_lm::testing
