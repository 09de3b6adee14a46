// moe_lm: batches, the training loop, evaluation, the routing probe and the
// RPB prior of a model.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <moe_route/analysis/signal_retention.hpp>

#include "analysis.hpp"
#include "data.hpp"
#include "model.hpp"

namespace moe_lm {

// One batch of examples as BOS prompt SEP answer EOS, inputs and next-token
// targets right-padded to the longest example. The per-token vectors are
// over the routed (non-PAD) input tokens, row-major, as the routers see them.
struct batch {
  torch::Tensor tokens;            // [B x T] int64 inputs
  torch::Tensor targets;           // [B x T] int64 next tokens (PAD past the end)
  torch::Tensor answer_positions;  // flat [B*T] positions whose target is an answer byte or EOS
  torch::Tensor target_positions;  // flat [B*T] positions with any target (prompt and answer)
  std::vector<std::int32_t> prior_rows;    // 2 * sample + span (0: BOS and prompt, 1: SEP and answer)
  std::vector<std::int32_t> sequence_ids;  // row of the batch
  std::vector<std::int32_t> domains;
  std::int32_t sequences = 0;
};
// `which` indexes `data`; that index is the sample of the prior rows.
batch make_batch(const std::vector<example>& data, const std::vector<std::size_t>& which, std::int64_t max_len);

// Each routed token's admission group: `groups` contiguous runs of the batch's
// sequences, like expert-parallel ranks each holding a micro-batch.
std::vector<std::int32_t> admission_groups(const batch& b, int groups);

struct step_log {
  int step = 0;
  double task_loss = 0.0;  // mean cross-entropy on the answer span
  double aux_loss = 0.0;   // sum of the routers' penalty values
  double router_l2 = 0.0;  // penalty::router_l2's value (0 when off)
  double ms = 0.0;         // wall time of the step
  double lr = 0.0;         // the learning rate of the step
  double expert_ms = 0.0;  // routed experts' forward, summed over layers
  std::int64_t expert_rows = 0;  // rows the routed experts ran, summed over layers
  double window_loss = 0.0;  // mean task loss since the previous on_log call (set for on_log)
};

// train_settings (config.hpp: what the command line sets) and what the
// driver adds from the model and the condition.
struct train_options : train_settings {
  int threads = 1;  // torch::set_num_threads (Debian's reference BLAS is single-threaded)
  bool update_expert_bias = true;  // expert_bias selections: selection::expert_bias::update each step
  float router_l2 = 0.0f;          // lambda of penalty::router_l2, against base_router
  std::vector<torch::Tensor> base_router;  // the frozen W_r of each layer
  bool prior_rows = false;  // pass r(t) (the model has a prior or a prior-space penalty)
  bool routed_affinities = false;  // keep every routed slot's cosine (train_result::routed_affinities)
  // When set, every step's admission is checked against CIPHER's Theorem 1
  // (analysis::signal_retention: the margin, the admission's capacity rule).
  std::optional<moe_route::analysis::signal_retention_options> signal_retention;
  int log_every = 0;        // call on_log every log_every steps (and at the last)
  std::function<void(const step_log&)> on_log;
};

struct train_result {
  std::vector<step_log> log;  // every step
  // Per layer, summed over the steps: selections per expert before admission
  // and executed assignments after it; slots = N * K summed over the steps.
  std::vector<std::vector<std::int64_t>> routed_loads, executed_loads;
  std::int64_t slots = 0;
  // Per layer, over the steps of token-choice training: the cosine of every
  // routed slot (with options.routed_affinities) and the signal retention
  // counts (with options.signal_retention).
  std::vector<std::vector<float>> routed_affinities;
  std::vector<moe_route::analysis::signal_retention_stats> signal_retention;
};

// AdamW on the answer-span loss plus the routers' penalties (and Router-L2),
// with a linear warm-up, a cosine decay and gradient clipping (RPB App. F's
// schedule, at this model's scale).
// Deterministic for a seed and thread count.
train_result train(model& m, const std::vector<example>& data, const train_options& o);

struct domain_metrics {
  std::string domain;
  std::int64_t examples = 0;
  double accuracy = 0.0;     // exact match of the greedy answer
  double answer_loss = 0.0;  // mean cross-entropy per answer-span token
};
// Per domain present in `data`, in domain order; routers in mode::eval.
std::vector<domain_metrics> evaluate(model& m, const std::vector<example>& data, int batch_size = 256);

// The greedy answer of one prompt (mode::eval): bytes until a special token,
// at most max_bytes of them. *eos (if given) tells whether EOS ended it.
std::string generate(model& m, const std::string& prompt, int max_bytes, bool* eos = nullptr);

// Routing indices of every MoE layer on every input token of `data`, bias-free
// (mode::eval: no prior, no penalty).
routing_trace probe(model& m, const std::vector<example>& data, int batch_size = 256);


// Across-expert spread of a [rows x E] table, as means over its rows: the
// population standard deviation and the range (max - min).
struct row_spread {
  double sd = 0.0, range = 0.0;
};
row_spread spread(const std::vector<float>& table, int experts);

struct base_prior {
  // Per layer a [2|data| x E] table whose row 2i (2i + 1) is the mean
  // distribution over example i's prompt (answer) span (RPB eq. 2).
  std::vector<std::vector<float>> pi;
  std::vector<row_spread> logits;  // per layer: the spread of the router logits over the tokens used
};
// The RPB prior of `data` under m's routers, in mode::eval.
base_prior build_prior(model& m, const std::vector<example>& data, prior_form form = prior_form::softmax,
                       int batch_size = 256);
// prior::prepare of each layer's table.
std::vector<prior_table> prepare_prior(const std::vector<std::vector<float>>& pi, int experts);

}  // namespace moe_lm
