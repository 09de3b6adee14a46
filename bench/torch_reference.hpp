// moe_route benchmarks: the router math composed from LibTorch operators, the
// way a PyTorch model writes it. Only torch_reference.cpp includes LibTorch
// (its headers are slow to compile), behind this plain interface.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace moe_route_bench {

struct torch_spec {
  bool sigmoid_bias = false;          // false: softmax + top-k; true: sigmoid, key = s + bias
  bool normalize = false;             // w /= (sum_k w + 1e-20)
  float scaling_factor = 1.0f;        // w *= scaling_factor (skipped when 1)
  const float* logits = nullptr;      // [N x E], borrowed (not copied) by the forward
  std::int64_t num_tokens = 0;
  int num_experts = 0;
  int top_k = 1;
  const float* expert_bias = nullptr;  // [E], sigmoid_bias only
  const float* grad_gates = nullptr;   // [N x K] upstream gradient for the backward
};

class torch_router {
 public:
  explicit torch_router(const torch_spec& spec);
  ~torch_router();
  torch_router(const torch_router&) = delete;
  torch_router& operator=(const torch_router&) = delete;

  // One forward in inference mode (no autograd graph).
  void forward();
  // The last forward's results, indices narrowed to int32.
  void read_forward(std::int32_t* indices, float* gates) const;

  // Records the autograd graph of the same forward once; backward() then runs
  // only the backward through it (torch::autograd::grad, retain_graph).
  void prepare_backward();
  void backward();
  void read_backward(float* grad_logits) const;

  static void set_threads(int threads);
  static std::string version();

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};

}  // namespace moe_route_bench
