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


// The training composition of issue 3: an optional RPB prior bias
// z' = z + beta * b[r(t)], the gating, top-k and gates on z', and each enabled
// penalty's value written with LibTorch operators on the unbiased logits z
// (docs/policies.md section 5 / docs/training.md). step() runs the forward with
// autograd recording and then torch::autograd::grad of
// sum(grad_gates * gates) + sum of the penalty values with respect to z:
// forward + backward, every call.
struct torch_training_spec {
  bool sigmoid_bias = false;          // false: softmax + top-k; true: sigmoid, key = s + expert bias
  bool normalize = false;
  float scaling_factor = 1.0f;
  const float* logits = nullptr;      // [N x E] (copied once into the autograd leaf)
  std::int64_t num_tokens = 0;
  int num_experts = 0;
  int top_k = 1;
  const float* expert_bias = nullptr;  // [E], sigmoid_bias only
  const float* grad_gates = nullptr;   // [N x K], the c of sum(c * gates)

  // Prior table (prior::prepare's bias and probs) and each token's row (-1: none).
  const float* prior_bias = nullptr;    // [S x E]
  const float* prior_probs = nullptr;   // [S x E]
  std::int64_t prior_rows = 0;          // S
  const std::int32_t* token_prior_row = nullptr;  // [N]
  const std::int32_t* expert_rank = nullptr;      // [E], locality
  int rank = 0;

  // 0 = off (not in the composition).
  float beta = 0.0f;           // log_prior_bias (bias_gates = true)
  float load_balance = 0.0f;   // scope::batch
  bool load_balance_top_k = false;  // f counts the top-K of z (count::top_k), not the selection
  float z_loss = 0.0f;
  float kl_to_base = 0.0f;
  float logit_l2 = 0.0f;
  float locality = 0.0f;
  float locality_epsilon = 1e-3f;
};

class torch_training {
 public:
  explicit torch_training(const torch_training_spec& spec);
  ~torch_training();
  torch_training(const torch_training&) = delete;
  torch_training& operator=(const torch_training&) = delete;

  void step();  // forward (autograd recording) + backward
  // The last step's results. values: the enabled penalties' values in the order
  // load_balance, z_loss, kl_to_base, logit_l2, locality (disabled ones skipped);
  // returns how many were written.
  int read(std::int32_t* indices, float* gates, float* grad_logits, double* values) const;

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};

}  // namespace moe_route_bench
