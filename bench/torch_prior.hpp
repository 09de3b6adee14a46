// moe_route benchmarks: LibTorch peers of prior::build and penalty::router_l2
// (issue 3, docs/performance.md). Only torch_prior.cpp includes LibTorch.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace moe_route_bench {

// prior::build<gating::softmax>: softmax of the logits of the tokens with a
// row (rows[t] >= 0), index_add_ into a zeroed [S x E] float table, divided by
// the per-row counts (bincount; empty rows stay 0).
class torch_prior_build {
 public:
  torch_prior_build(const float* logits, std::int64_t num_tokens, int num_experts, const std::int32_t* rows,
                    std::int64_t num_rows);
  ~torch_prior_build();
  torch_prior_build(const torch_prior_build&) = delete;
  torch_prior_build& operator=(const torch_prior_build&) = delete;
  void run();
  void read(float* prior) const;  // [S x E]

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};

// router_l2: value = lambda / L * sum_l ((W_l - W0_l)^2).sum() (the sum in
// double) and grad_l.add_((W_l - W0_l) * (2 lambda / L)), on borrowed buffers.
class torch_router_l2 {
 public:
  struct layer {
    const float* weights;
    const float* base;
    std::int64_t size;
    float* grad;
  };
  torch_router_l2(const std::vector<layer>& layers, float coefficient);
  ~torch_router_l2();
  torch_router_l2(const torch_router_l2&) = delete;
  torch_router_l2& operator=(const torch_router_l2&) = delete;
  double apply();

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};

}  // namespace moe_route_bench
