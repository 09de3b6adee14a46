// moe_route benchmarks: LibTorch peers of prior::build and router_l2.
#include "torch_prior.hpp"

#include <torch/torch.h>

#include <cstring>

namespace moe_route_bench {

struct torch_prior_build::impl {
  torch::Tensor logits, rows, prior;  // logits, rows borrowed
  std::int64_t num_rows = 0;
};

torch_prior_build::torch_prior_build(const float* logits, std::int64_t num_tokens, int num_experts,
                                     const std::int32_t* rows, std::int64_t num_rows)
    : p_(std::make_unique<impl>()) {
  p_->logits = torch::from_blob(const_cast<float*>(logits), {num_tokens, num_experts}, torch::kFloat32);
  p_->rows = torch::from_blob(const_cast<std::int32_t*>(rows), {num_tokens}, torch::kInt32);
  p_->num_rows = num_rows;
}

torch_prior_build::~torch_prior_build() = default;

void torch_prior_build::run() {
  c10::InferenceMode guard;
  const torch::Tensor r64 = p_->rows.to(torch::kInt64);
  const torch::Tensor used = torch::nonzero(r64 >= 0).squeeze(1);
  const torch::Tensor r = r64.index_select(0, used);
  const torch::Tensor p = torch::softmax(p_->logits.index_select(0, used), -1);
  torch::Tensor sums = torch::zeros({p_->num_rows, p_->logits.size(1)}, torch::kFloat32);
  sums.index_add_(0, r, p);
  const torch::Tensor counts = torch::bincount(r, {}, p_->num_rows);
  p_->prior = sums / counts.clamp_min(1).to(torch::kFloat32).unsqueeze(1);
}

void torch_prior_build::read(float* prior) const {
  const torch::Tensor t = p_->prior.contiguous();
  std::memcpy(prior, t.data_ptr<float>(), sizeof(float) * t.numel());
}

struct torch_router_l2::impl {
  std::vector<torch::Tensor> w, w0, grad;  // borrowed
  float coefficient = 0.0f;
};

torch_router_l2::torch_router_l2(const std::vector<layer>& layers, float coefficient) : p_(std::make_unique<impl>()) {
  for (const layer& l : layers) {
    p_->w.push_back(torch::from_blob(const_cast<float*>(l.weights), {l.size}, torch::kFloat32));
    p_->w0.push_back(torch::from_blob(const_cast<float*>(l.base), {l.size}, torch::kFloat32));
    p_->grad.push_back(torch::from_blob(l.grad, {l.size}, torch::kFloat32));
  }
  p_->coefficient = coefficient;
}

torch_router_l2::~torch_router_l2() = default;

double torch_router_l2::apply() {
  c10::InferenceMode guard;
  const double scale = static_cast<double>(p_->coefficient) / static_cast<double>(p_->w.size());
  torch::Tensor value = torch::zeros({}, torch::kFloat64);
  for (std::size_t l = 0; l < p_->w.size(); ++l) {
    const torch::Tensor d = p_->w[l] - p_->w0[l];
    value += d.to(torch::kFloat64).square().sum();
    p_->grad[l].add_(d * (2.0 * scale));
  }
  return (value * scale).item<double>();
}

}  // namespace moe_route_bench
