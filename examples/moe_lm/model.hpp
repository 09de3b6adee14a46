// moe_lm: a small decoder-only MoE transformer whose routers are the
// library's. Each block is causal self-attention, then an MoE FFN of E routed
// experts (top-K) plus one shared expert, each behind a pre-norm and a
// residual. The router of every MoE layer computes logits = x W_r^T with
// LibTorch and hands them to a torch::autograd::Function whose forward is
// moe_route::runtime::route (+ runtime::admit) and whose backward is
// runtime::backward, the library's fused backward. The experts run on the
// rows the library's dispatch metadata assigns them. On CUDA tensors every
// one of these calls is the library's CUDA backend (runtime/cuda.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <moe_route/runtime/cpu.hpp>
#include <moe_route/selection/expert_choice.hpp>

#include "config.hpp"

namespace moe_lm {

// A prepared prior table of one layer (moe_route::prior::prepare).
struct prior_table {
  std::int64_t rows = 0;     // S
  std::vector<float> bias;   // [S x E] centred log prior
  std::vector<float> probs;  // [S x E] clamped, renormalised prior
};

// Per-call inputs of the routers that do not live in the model. The vectors
// are over the routed tokens: the non-PAD positions of the batch, row-major.
struct routing_context {
  moe_route::mode mode = moe_route::mode::train;
  const std::vector<std::int32_t>* prior_rows = nullptr;    // r(t), -1 = none
  const std::vector<std::int32_t>* sequence_ids = nullptr;  // load_balance scope::sequence
  std::int32_t num_sequences = 0;
  const std::vector<std::int32_t>* group_ids = nullptr;     // admission groups (null: one group)
  int num_groups = 1;
  bool keep_logits = false;  // record each layer's router logits (prior building)
};

// What the last forward of one MoE layer routed.
struct layer_record {
  torch::Tensor routed;     // [N x K] int32, the router's selection
  torch::Tensor executed;   // [N x K] int32, after admission (-1 = dropped)
  torch::Tensor values;     // [5] penalty values (differentiable), runtime::penalty_names order
  torch::Tensor logits;     // [N x E] (keep_logits only)
  // [N x K] float: the cosine v / (|x_t| |w_e|) of each routed slot, as cosine
  // admission computes it (training mode, token-choice routing, record_affinity only).
  torch::Tensor routed_affinity;
  std::vector<std::int64_t> routed_counts;  // [E] selections per expert before admission
  std::vector<std::int64_t> counts;         // [E] executed assignments per expert
  std::int64_t offered = 0;      // N * K: the assignments token-choice routing offers
  double expert_ms = 0.0;        // wall time of the routed experts' forward
  std::int64_t expert_rows = 0;  // rows the routed experts ran (padding included)
};

class rms_norm : public torch::nn::Module {
 public:
  explicit rms_norm(std::int64_t d);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::Tensor weight_;
};

class moe_ffn : public torch::nn::Module {
 public:
  explicit moe_ffn(const model_config& c);
  // x: [N x d], the routed tokens only.
  torch::Tensor forward(const torch::Tensor& x, const routing_context& ctx);

  torch::Tensor router_weight;  // [E x d], W_r
  torch::Tensor expert_bias;    // [E] buffer, the sigmoid_bias preset's selection bias
  rt::router_config router;
  rt::admission_config admission;  // dropless by default
  bool admit_at_eval = false;
  // Expert-choice routing while training (selection::expert_choice: every
  // expert takes its capacity of tokens by softmax score, a token gets 0..E
  // experts); set, it replaces the router and admission in mode::train.
  // Evaluation, which must route each token on its own, uses `router`.
  std::optional<moe_route::selection::expert_choice> expert_choice;
  // Run every expert on as many rows as the most loaded one (zero rows as
  // padding), as in expert-parallel training with capacity-padded buffers,
  // where the hottest expert sets the step time.
  bool pad_experts = false;
  // Record the cosine of each routed slot while training (layer_record::routed_affinity).
  bool record_affinity = false;
  std::shared_ptr<const prior_table> prior;
  int threads = 1;
  layer_record last;

 private:
  torch::Tensor w1_, w2_;           // [E x d x h], [E x h x d]
  torch::Tensor shared_w1_, shared_w2_;
};

class block : public torch::nn::Module {
 public:
  explicit block(const model_config& c);
  // x: [B x T x d]; valid: the flat indices of the non-PAD positions.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& valid, const routing_context& ctx);
  std::shared_ptr<moe_ffn> moe;

 private:
  torch::Tensor norm(int which, const torch::Tensor& x);
  model_config cfg_;
  std::shared_ptr<rms_norm> rms1_, rms2_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr};
};

class model : public torch::nn::Module {
 public:
  explicit model(const model_config& c);
  // tokens: [B x T] int64 (T <= max_len), right-padded with PAD. Returns the
  // final hidden states [B x T x d]; logits(h) applies the output head.
  torch::Tensor forward(const torch::Tensor& tokens, const routing_context& ctx);
  torch::Tensor logits(const torch::Tensor& hidden);

  // The sum over layers of the last forward's penalty values (add to the loss).
  torch::Tensor aux_loss() const;

  // Router condition of every layer. top_k must stay the model's.
  void set_router(const rt::router_config& r);
  const rt::router_config& router() const { return moes_.front()->router; }
  void set_admission(const rt::admission_config& a, bool at_eval = false);
  void set_expert_choice(const std::optional<moe_route::selection::expert_choice>& p);
  // One prepared table per layer (or an empty vector to drop the prior).
  void set_prior(const std::vector<prior_table>& tables);
  void set_router_threads(int threads);
  void set_expert_padding(bool pad);
  void set_affinity_record(bool record);

  const model_config& config() const { return cfg_; }
  const std::vector<std::shared_ptr<moe_ffn>>& moe_layers() const { return moes_; }
  std::vector<torch::Tensor> router_weights() const;
  // Where the parameters live (Module::to moves them).
  torch::Device device() const { return pos_.device(); }

 private:
  model_config cfg_;
  torch::nn::Embedding embed_{nullptr};
  torch::Tensor pos_;
  std::vector<std::shared_ptr<block>> blocks_;
  std::vector<std::shared_ptr<moe_ffn>> moes_;
  std::shared_ptr<rms_norm> rms_f_;
  torch::nn::LayerNorm ln_f_{nullptr};
  torch::nn::Linear head_{nullptr};
};

// Whether this build routes CUDA tensors with the library's CUDA backend
// (MOE_LM_WITH_CUDA: built against a CUDA LibTorch with the CUDA runtime instances).
bool cuda_backend_built();

// Weights, buffers (expert biases) and the model_config in one file, always
// stored from the CPU (a checkpoint loads on any machine); load_model returns
// the model on the CPU.
void save_model(const std::shared_ptr<model>& m, const std::string& path);
std::shared_ptr<model> load_model(const std::string& path);

// The routing op alone: gates [N x K] and penalty values [5] of `logits`
// [N x E] under `router` (and `admission` when not dropless), differentiable
// through the library's fused backward. hidden_norms [N] and weight_norms [E]
// are needed by cosine admission only (undefined tensors otherwise). The
// indices land in `record` (routed, executed, counts). CPU logits take the
// library's CPU backend; CUDA logits (a build with MOE_LM_WITH_CUDA) its CUDA
// backend, runtime::cuda, on torch's current stream.
struct route_call {
  rt::router_config router;
  rt::admission_config admission;
  bool admit = false;
  moe_route::mode mode = moe_route::mode::train;
  torch::Tensor expert_bias;  // [E] float32 (copied by the call: the step may update it before the backward)
  std::shared_ptr<const prior_table> prior;
  std::vector<std::int32_t> prior_rows, sequence_ids, group_ids;
  std::int32_t num_sequences = 0;
  int num_groups = 1;
  int threads = 1;
};
std::vector<torch::Tensor> route(const torch::Tensor& logits, const route_call& call, layer_record& record,
                                 const torch::Tensor& hidden_norms = {}, const torch::Tensor& weight_norms = {});

// Expert-choice routing of `logits` [N x E]: gates [N x E] (the softmax score
// where the expert took the token, else 0), differentiable through
// expert_choice_backward (CPU or CUDA, as route()). The indices [N x E] (-1 past a token's
// experts) land in `record` (routed = executed); the penalty values are 0.
// With group ids [N] every group is selected from on its own (one rank each).
torch::Tensor route_expert_choice(const torch::Tensor& logits, const moe_route::selection::expert_choice& policy,
                                  int threads, layer_record& record,
                                  const std::vector<std::int32_t>* group_ids = nullptr, int num_groups = 1);

}  // namespace moe_lm
