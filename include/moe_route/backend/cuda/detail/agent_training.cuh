// moe_route CUDA backend: the training agents, for routers with a prior policy
// or penalties in mode::train (backend/cpu/detail/training.hpp and route_token /
// backward on the CPU, replayed exactly). One warp per token, the row re-read
// from global memory (L1/L2), the packed keys in shared memory.
//
// Forward, per token: the selection row (z, or z' = z + beta b[r(t)] under
// log_prior_bias, or the prior bias itself under prior_override), its keys and
// top-K, the gate weights (from z' with bias_gates, else from z); then the
// penalties' per-token work on the unbiased z: fixed-point distribution sums
// into the warp's shared region (lane l owns experts l + 32 j: plain adds),
// selection counts and token counters into block-shared counters, and one
// double per scalar penalty written by lane 0.
//
// Backward, per token: the gate gradient on the row the gates came from, then
// the penalties' gradients added in the CPU's order (distribution, kl_to_base,
// logit_l2, z_loss) after W::sync() orders the gate gradient's stores.
//
// Device-side inputs cannot be checked before launch: a token_prior_row
// outside [-1, S) acts as -1 (no prior), a sequence id outside
// [0, num_sequences) leaves the token out of the per-sequence sums.
//
// A padding token (token_mask byte 0) reads no input: it is routed nowhere
// (indices -1, gates 0), is in no penalty sum, count or per-token value (its
// values are 0) and gets a zero gradient row.
#pragma once

#include <cstdint>

#include <moe_route/admission/admission.hpp>
#include <moe_route/admission/gates.hpp>
#include <moe_route/backend/cuda/detail/agent_backward.cuh>
#include <moe_route/backend/cuda/detail/agent_common.cuh>
#include <moe_route/backend/cuda/detail/config.cuh>
#include <moe_route/backend/cuda/detail/warp_reduce.cuh>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/gating/gating.hpp>
#include <moe_route/prior/policy.hpp>
#include <moe_route/router.hpp>
#include <moe_route/selection/selection.hpp>
#include <moe_route/training/finalize.hpp>
#include <moe_route/training/workspace.hpp>
#include <moe_route/types.hpp>

namespace moe_route::cuda::detail {

template <class T>
struct training_params {
  const T* logits;                     // [N x E]
  std::int64_t num_tokens;
  int num_experts;
  const std::uint8_t* token_mask;      // [N] or null: 0 marks a padding token
  const std::int32_t* replay_indices;  // [N x K] or null: route to these experts
  const float* expert_bias;            // [E] or null
  group_layout groups;
  // Prior.
  const float* prior_bias;             // [S x E]
  const float* prior_probs;            // [S x E]
  std::int64_t prior_rows;
  const std::int32_t* token_prior_row; // [N] or null
  // Penalties.
  penalty::switches on;
  bool sequences;                      // load_balance over sequences
  bool counting;                       // load_balance counts selections (batch scope)
  bool count_top_k;                    // ... of the K largest unbiased logits (load_balance::count::top_k)
  const std::int32_t* sequence_ids;
  std::int32_t num_sequences;
  std::int64_t* valid_tokens;          // workspace header
  std::int64_t* prior_tokens;
  std::int64_t* distribution_sums;     // [E]
  std::int64_t* counts;                // [E]
  std::int64_t* sequence_sums;         // [num_sequences x E]
  std::int64_t* sequence_counts;
  std::int64_t* sequence_tokens;
  double* token_values;                // [N x scalar_penalties]
  const float* expert_grad;            // [E] (backward)
  const float* sequence_grad;          // [num_sequences x E] (backward)
  penalty::token_weights weights;      // (backward)
  // Forward outputs.
  std::int32_t* indices;               // [N x K]
  float* gates;                        // [N x K]
  // Backward.
  const std::int32_t* admitted_indices;  // [N x K] or null (backward_args::admitted_indices)
  bool renormalize;
  const std::int32_t* grad_indices;    // [N x K]
  const float* grad_gates;             // [N x K]
  float* grad_logits;                  // [N x E]
};

// How the prior acts on one token.
enum class prior_action { none, soft, soft_select_only, override };

template <class Router, class T>
MOE_ROUTE_CUDA_DEVICE prior_action prior_for(const Router& r, const training_params<T>& p, std::int64_t token,
                                              const float*& b, float& beta) {
  b = nullptr;
  beta = 0.0f;
  if constexpr (!Router::has_prior) {
    return prior_action::none;
  } else {
    if (p.token_prior_row == nullptr) return prior_action::none;
    const std::int32_t row = p.token_prior_row[token];
    if (row < 0 || row >= p.prior_rows) return prior_action::none;
    b = p.prior_bias + static_cast<std::int64_t>(row) * p.num_experts;
    if constexpr (Router::template has<prior::log_prior_bias>) {
      const auto& policy = get<prior::log_prior_bias>(r);
      if (policy.beta == 0.0f) return prior_action::none;
      beta = policy.beta;
      return policy.bias_gates ? prior_action::soft : prior_action::soft_select_only;
    } else {
      return prior_action::override;
    }
  }
}

// The (unsanitised) logit the selection sees: z or z + beta b.
template <class W, class T>
MOE_ROUTE_CUDA_DEVICE float selection_logit(const T* z, const float* b, float beta, bool biased, int e) {
  const float x = num::to_float(W::load(z + e));
  return biased ? num::fma(beta, W::load(b + e), x) : x;
}

// Row maximum and canonical sum of the softmax terms of a row (row_softmax).
template <class W, class G, class T>
MOE_ROUTE_CUDA_DEVICE void softmax_stats(const T* z, const float* b, float beta, bool biased, int E, float& row_max,
                                         float& row_sum) {
  const int lane = W::lane();
  float m = -num::float_max;
  for (int e = lane; e < E; e += warp_threads)
    m = num::max(m, num::sanitize(selection_logit<W>(z, b, beta, biased, e)));
  row_max = warp_max<W>(m);
  float partial = 0.0f;
  for (int e = lane; e < E; e += warp_threads)
    partial += G::term(num::sanitize(selection_logit<W>(z, b, beta, biased, e)), row_max);
  row_sum = warp_sum<W>(partial);
}

// Double sum over the warp in the canonical butterfly (lane partials in expert order).
template <class W>
MOE_ROUTE_CUDA_DEVICE double warp_sum_double(double v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = v + W::shfl_xor(v, offset);
  return v;
}

// One token's unbiased statistics (cpu::detail::penalty_row).
template <class W, class Router, class T>
struct warp_penalty_row {
  using G = typename Router::gating_type;
  static constexpr bool softmax_like = G::shape != gating::kind::elementwise;
  const T* z;
  int E;
  float row_max = 0.0f, norm = 0.0f, lse = 0.0f, soft_sum = 0.0f;
  bool valid = false;

  // Valid and computed exactly as cpu::detail::penalty_row.
  MOE_ROUTE_CUDA_DEVICE warp_penalty_row(const T* row, int num_experts, bool need_distribution, bool need_lse)
      : z(row), E(num_experts) {
    const int lane = W::lane();
    bool bad = false;
    float m = -num::float_max;
    for (int e = lane; e < E; e += warp_threads) {
      const float x = v(e);
      bad |= !num::is_finite(x);
      m = num::max(m, x);
    }
    if (W::any(bad)) return;
    row_max = warp_max<W>(m);
    if constexpr (!softmax_like) {
      if (!(G::score(row_max) > 0.0f)) return;
    }
    valid = true;
    if (need_distribution || (softmax_like && need_lse)) {
      float partial = 0.0f;
      for (int e = lane; e < E; e += warp_threads) partial += s(e);
      norm = warp_sum<W>(partial);
    }
    if (need_lse) {
      if constexpr (softmax_like) {
        lse = row_max + num::log(norm);
      } else {
        float q = 0.0f;
        for (int e = lane; e < E; e += warp_threads) q += num::exp(v(e) - row_max);
        soft_sum = warp_sum<W>(q);
        lse = row_max + num::log(soft_sum);
      }
    }
  }

  MOE_ROUTE_CUDA_DEVICE float v(int e) const { return num::to_float(W::load(z + e)); }
  MOE_ROUTE_CUDA_DEVICE float s(int e) const {
    if constexpr (softmax_like)
      return num::exp(v(e) - row_max);
    else
      return G::score(v(e));
  }
  MOE_ROUTE_CUDA_DEVICE float prob(int e) const { return num::div(s(e), norm); }
  MOE_ROUTE_CUDA_DEVICE float softmax(int e) const {
    if constexpr (softmax_like)
      return prob(e);
    else
      return num::div(num::exp(v(e) - row_max), soft_sum);
  }
  MOE_ROUTE_CUDA_DEVICE float log_p(int e, float log_norm) const {
    if constexpr (softmax_like)
      return (v(e) - row_max) - log_norm;
    else
      return G::log_score(v(e)) - log_norm;
  }

  MOE_ROUTE_CUDA_DEVICE double kl(const float* pi) const {
    const float log_norm = num::log(norm);
    double partial = 0.0;
    for (int e = W::lane(); e < E; e += warp_threads) {
      const float q = W::load(pi + e);
      const float d = num::log(q) - log_p(e, log_norm);
      partial += static_cast<double>(q) * static_cast<double>(d);
    }
    return warp_sum_double<W>(partial);
  }

  MOE_ROUTE_CUDA_DEVICE double delta_mean(const float* b) const {
    double partial = 0.0;
    for (int e = W::lane(); e < E; e += warp_threads) partial += static_cast<double>(v(e) - W::load(b + e));
    return warp_sum_double<W>(partial) / E;
  }
  MOE_ROUTE_CUDA_DEVICE double delta_squared(const float* b, double mean) const {
    double partial = 0.0;
    for (int e = W::lane(); e < E; e += warp_threads) {
      const double c = static_cast<double>(v(e) - W::load(b + e)) - mean;
      partial = penalty::detail::fma(c, c, partial);
    }
    return warp_sum_double<W>(partial);
  }
};

// The expert lane j < K's load-balance counts take (docs/policies.md §5.2):
// its routed one, or under load_balance::count::top_k the j-th largest
// unbiased logit, ties to the lower expert (over the warp's shared `keys`).
template <class W, class T>
MOE_ROUTE_CUDA_DEVICE int counted_expert(const training_params<T>& p, const T* z, int routed, int k,
                                         std::uint64_t* keys) {
  if (!p.count_top_k) return routed;
  const int E = p.num_experts;
  W::sync();  // the selection has read its keys
  for (int e = W::lane(); e < E; e += warp_threads) keys[e] = num::pack_key(num::sanitize(num::to_float(W::load(z + e))), e);
  W::sync();
  return shared_top_k<W>(keys, E, k);
}

// Routes one token of a training call and does its penalty forward. `keys`
// is the warp's E-key shared region, `sums` its E fixed-point sums (shared,
// lane-owned), `counts` the block's selection counts, `tokens` the block's
// [valid, prior] counters. Returns whether the logits held NaN or +-inf.
template <class W, class Router, class T>
MOE_ROUTE_CUDA_DEVICE bool route_training_row(const Router& r, const training_params<T>& p, std::int64_t token,
                                              std::uint64_t* keys, std::int64_t* sums, int* counts,
                                              std::int64_t* tokens) {
  using G = typename Router::gating_type;
  using S = typename Router::selection_type;
  using traits = penalty::penalty_traits<Router>;
  constexpr bool row_softmax = G::shape == gating::kind::row_softmax;
  const int lane = W::lane();
  const int E = p.num_experts;
  const int k = r.top_k;
  if (is_padding<W>(p.token_mask, token)) {
    write_padding<W>(p.indices, p.gates, token, k);
    if constexpr (Router::has_penalties) {
      constexpr int columns = traits::scalar_penalties;
      if (p.on.any() && lane == 0)  // the value region is not zeroed by the launch
        for (int c = 0; c < columns; ++c) p.token_values[token * columns + c] = 0.0;
    }
    return false;
  }
  const T* z = p.logits + token * E;
  const float* b;
  float beta;
  const prior_action action = prior_for(r, p, token, b, beta);
  const bool biased = action == prior_action::soft || action == prior_action::soft_select_only;

  bool bad = false;
  for (int e = lane; e < E; e += warp_threads) bad |= !num::is_finite(num::to_float(W::load(z + e)));
  const bool nonfinite = W::any(bad);

  float row_max = 0.0f, row_sum = 0.0f;  // of the selection row
  if constexpr (row_softmax) softmax_stats<W, G>(z, b, beta, biased, E, row_max, row_sum);

  int my_expert = 0;
  const bool replayed = p.replay_indices != nullptr;  // warp-uniform
  if (replayed) {
    my_expert = replayed_expert<W>(p.replay_indices, token, k, E);
  } else if constexpr (S::shape == selection::kind::fixed) {
    if (action == prior_action::override) {
      // falls through to the keyed top-K below
    } else if (lane < k) {
      my_expert = S::expert(token, lane, k, E);
    }
  }
  const bool keyed = !replayed && (S::shape != selection::kind::fixed || action == prior_action::override);
  if (keyed) {
    W::sync();  // the previous token has read its keys
    for (int e = lane; e < E; e += warp_threads) {
      if (action == prior_action::override) {
        keys[e] = num::pack_key(W::load(b + e), e);
      } else if constexpr (S::shape != selection::kind::fixed) {
        const float v = num::sanitize(selection_logit<W>(z, b, beta, biased, e));
        float score = 0.0f;
        if constexpr (S::needs_scores) score = score_of<G>(v, row_max, row_sum);
        float bias = 0.0f;
        if constexpr (S::needs_expert_bias) bias = W::load(p.expert_bias + e);
        keys[e] = expert_key<S>(v, score, bias, e);
      }
    }
    if constexpr (S::shape == selection::kind::grouped) {
      if (p.groups.active && action != prior_action::override) {
        W::sync();
        const std::uint32_t kept = kept_groups<W>(p.groups, make_lane_group_slot(p.groups, lane), keys);
        W::sync();
        for (int e = lane; e < E; e += warp_threads)
          if (((kept >> p.groups.group_of(e)) & 1u) == 0) keys[e] = 0;
      }
    }
    W::sync();
    my_expert = shared_top_k<W>(keys, E, k);
  }

  // Gate weights: from the selection row, or from z (select-only and override).
  const bool gates_from_z = action == prior_action::soft_select_only || action == prior_action::override;
  float gate_max = row_max, gate_sum = row_sum;
  if constexpr (row_softmax)
    if (gates_from_z) softmax_stats<W, G>(z, b, 0.0f, false, E, gate_max, gate_sum);
  float mine = absent_score<G>();
  if (lane < k && my_expert >= 0) {
    const float v = num::sanitize(selection_logit<W>(z, b, beta, biased && !gates_from_z, my_expert));
    mine = score_of<G>(v, gate_max, gate_sum);
  }
  float selected[Router::max_k];
  float w[Router::max_k];
  for (int j = 0; j < k; ++j) selected[j] = W::shfl(mine, j);
  num::gate_weights(r, selected, w, k);
  if (lane < k) {
    p.indices[token * k + lane] = my_expert;
    p.gates[token * k + lane] = w[lane];
  }

  // The penalties' forward on the unbiased row.
  if constexpr (Router::has_penalties) {
    if (p.on.any()) {
      constexpr int columns = traits::scalar_penalties;
      double value[columns > 0 ? columns : 1] = {};
      const warp_penalty_row<W, Router, T> row(z, E, p.on.distribution || p.on.kl_to_base, traits::z_loss && p.on.z_loss);
      if (row.valid) {
        if (lane == 0) W::atomic_add(tokens + 0, std::int64_t{1});
        if (traits::distribution_space && p.on.distribution) {
          const int counted = counted_expert<W>(p, z, my_expert, k, keys);
          const std::int32_t q = p.sequences ? p.sequence_ids[token] : -1;
          const bool in_sequence = p.sequences && q >= 0 && q < p.num_sequences;
          for (int e = lane; e < E; e += warp_threads) {
            const std::int64_t fixed = penalty::to_fixed_point(row.prob(e));
            sums[e] += fixed;
            if (in_sequence) W::atomic_add(p.sequence_sums + static_cast<std::int64_t>(q) * E + e, fixed);
          }
          if (lane < k && counted >= 0) {
            if (in_sequence)
              W::atomic_add(p.sequence_counts + static_cast<std::int64_t>(q) * E + counted, std::int64_t{1});
            else if (p.counting)
              W::atomic_add(counts + counted, 1);
          }
          if (in_sequence && lane == 0) W::atomic_add(p.sequence_tokens + q, std::int64_t{1});
        }
        if constexpr (traits::z_loss)
          if (p.on.z_loss) value[traits::z_loss_column] = static_cast<double>(row.lse) * row.lse;
        if constexpr (traits::kl_to_base || traits::logit_l2) {
          const std::int32_t pr = p.token_prior_row[token];
          if (pr >= 0 && pr < p.prior_rows) {
            if (lane == 0) W::atomic_add(tokens + 1, std::int64_t{1});
            if constexpr (traits::kl_to_base)
              if (p.on.kl_to_base)
                value[traits::kl_to_base_column] = row.kl(p.prior_probs + static_cast<std::int64_t>(pr) * E);
            if constexpr (traits::logit_l2) {
              if (p.on.logit_l2) {
                const float* pb = p.prior_bias + static_cast<std::int64_t>(pr) * E;
                value[traits::logit_l2_column] = row.delta_squared(pb, row.delta_mean(pb));
              }
            }
          }
        }
      }
      if (lane == 0)
        for (int c = 0; c < columns; ++c) p.token_values[token * columns + c] = value[c];
    }
  }
  return nonfinite;
}

// The gate gradient of one token with its gates as routed (agent_backward.cuh's
// backward_selected on the row the gates came from, then the dense row and,
// after W::sync(), the selected entries).
template <class W, class Router, class T>
MOE_ROUTE_CUDA_DEVICE void routed_gate_grad(const Router& r, const training_params<T>& p, std::int64_t token,
                                            const T* z, const float* b, float beta, bool biased, float row_max,
                                            float row_sum, float* dz) {
  using G = typename Router::gating_type;
  const auto logit = [&](int e) { return num::sanitize(selection_logit<W>(z, b, beta, biased, e)); };
  const selected_grad sg =
      backward_selected<W>(r, p.grad_indices, p.grad_gates, p.num_experts, token, logit, row_max, row_sum);
  for (int e = W::lane(); e < p.num_experts; e += warp_threads) {
    if constexpr (G::shape == gating::kind::row_softmax)
      dz[e] = score_of<G>(logit(e), row_max, row_sum) * num::negate(sg.dot);
    else
      dz[e] = 0.0f;
  }
  W::sync();
  if (sg.write) dz[sg.expert] = sg.value;
}

// The gate gradient of one token whose gates were admitted
// (cpu::detail::admitted_backward_row): lane j < K holds slot j's routed and
// admitted experts, their gate inputs sigma_j and phi_j, and its upstream
// gradient; every lane evaluates admitted_gate_weights_vjp; the dense row is
// written, then (after W::sync()) the routed and the rerouted experts' entries.
// Admitted entries outside [-1, E) act as dropped, routed ones outside [0, E)
// write nothing (device data cannot be validated; the CPU backend rejects them).
template <class W, class Router, class T>
MOE_ROUTE_CUDA_DEVICE void admitted_gate_grad(const Router& r, const training_params<T>& p, std::int64_t token,
                                              const T* z, const float* b, float beta, bool biased, float row_max,
                                              float row_sum, float* dz) {
  using G = typename Router::gating_type;
  namespace adm = moe_route::admission;
  const int lane = W::lane();
  const int E = p.num_experts;
  const int k = r.top_k;
  int routed = -1, admitted = -1;
  float dg = 0.0f, sigma = 0.0f, phi = 0.0f;
  if (lane < k) {
    routed = W::load(p.grad_indices + token * k + lane);
    admitted = W::load(p.admitted_indices + token * k + lane);
    dg = W::load(p.grad_gates + token * k + lane);
    if (routed < 0 || routed >= E) routed = -1;
    if (admitted < -1 || admitted >= E) admitted = -1;
    if (routed >= 0) sigma = score_of<G>(num::sanitize(selection_logit<W>(z, b, beta, biased, routed)), row_max, row_sum);
    if (admitted >= 0 && admitted != routed)
      phi = score_of<G>(num::sanitize(selection_logit<W>(z, b, beta, biased, admitted)), row_max, row_sum);
  }
  float sigmas[Router::max_k] = {}, phis[Router::max_k] = {}, grads[Router::max_k] = {};
  std::int32_t routed_all[Router::max_k] = {}, admitted_all[Router::max_k] = {};
  float d_sigma[Router::max_k], d_phi[Router::max_k];
  for (int j = 0; j < k; ++j) {
    sigmas[j] = W::shfl(sigma, j);
    phis[j] = W::shfl(phi, j);
    grads[j] = W::shfl(dg, j);
    routed_all[j] = W::shfl(routed, j);
    admitted_all[j] = W::shfl(admitted, j);
  }
  adm::admitted_gate_weights_vjp(r, sigmas, phis, routed_all, admitted_all, p.renormalize, grads, d_sigma, d_phi, k);
  const bool rerouted = lane < k && adm::status_of(routed, admitted) == adm::slot_status::rerouted;
  float dot = 0.0f;
  if constexpr (G::shape == gating::kind::row_softmax) {
    for (int j = 0; j < k; ++j)
      if (routed_all[j] >= 0) dot = num::fma(d_sigma[j], sigmas[j], dot);
    for (int j = 0; j < k; ++j)
      if (adm::status_of(routed_all[j], admitted_all[j]) == adm::slot_status::rerouted) dot = num::fma(d_phi[j], phis[j], dot);
  }
  for (int e = lane; e < E; e += warp_threads) {
    if constexpr (G::shape == gating::kind::row_softmax)
      dz[e] = score_of<G>(num::sanitize(selection_logit<W>(z, b, beta, biased, e)), row_max, row_sum) * num::negate(dot);
    else
      dz[e] = 0.0f;
  }
  W::sync();
  if (lane < k && routed >= 0) {
    if constexpr (G::shape == gating::kind::row_softmax)
      dz[routed] = sigma * (d_sigma[lane] - dot);
    else if constexpr (G::shape == gating::kind::elementwise)
      dz[routed] = d_sigma[lane] * G::derivative(num::sanitize(selection_logit<W>(z, b, beta, biased, routed)), sigma);
    else
      dz[routed] = d_sigma[lane];
  }
  W::sync();
  if (rerouted) {
    if constexpr (G::shape == gating::kind::row_softmax)
      dz[admitted] = phi * (d_phi[lane] - dot);
    else if constexpr (G::shape == gating::kind::elementwise)
      dz[admitted] = d_phi[lane] * G::derivative(num::sanitize(selection_logit<W>(z, b, beta, biased, admitted)), phi);
    else
      dz[admitted] = d_phi[lane];
  }
}

// The fused backward of one token of a training call: the gate gradient on
// the row the gates came from, then the penalties' gradients.
template <class W, class Router, class T>
MOE_ROUTE_CUDA_DEVICE void backward_training_row(const Router& r, const training_params<T>& p, std::int64_t token) {
  using G = typename Router::gating_type;
  using traits = penalty::penalty_traits<Router>;
  constexpr bool row_softmax = G::shape == gating::kind::row_softmax;
  const int lane = W::lane();
  const int E = p.num_experts;
  if (is_padding<W>(p.token_mask, token)) {
    zero_row<W>(p.grad_logits + token * E, E);
    return;
  }
  const T* z = p.logits + token * E;
  const float* b;
  float beta;
  const bool biased = prior_for(r, p, token, b, beta) == prior_action::soft;  // dL/dz = dL/dz'

  float row_max = 0.0f, row_sum = 0.0f;
  if constexpr (row_softmax) softmax_stats<W, G>(z, b, beta, biased, E, row_max, row_sum);
  float* dz = p.grad_logits + token * E;
  if (p.admitted_indices != nullptr) {
    admitted_gate_grad<W>(r, p, token, z, b, beta, biased, row_max, row_sum, dz);
  } else {
    routed_gate_grad<W>(r, p, token, z, b, beta, biased, row_max, row_sum, dz);
  }
  W::sync();  // the gate gradient is complete before the penalties add to it

  if constexpr (Router::has_penalties) {
    if (!p.on.any()) return;
    const warp_penalty_row<W, Router, T> row(z, E, p.on.distribution || p.on.kl_to_base, traits::z_loss && p.on.z_loss);
    if (!row.valid) return;
    using RowG = typename Router::gating_type;
    if (traits::distribution_space && p.on.distribution) {
      const std::int32_t q = p.sequences ? p.sequence_ids[token] : -1;
      const bool in_sequence = p.sequences && q >= 0 && q < p.num_sequences;
      const float* gs = in_sequence ? p.sequence_grad + static_cast<std::int64_t>(q) * E : nullptr;
      float partial = 0.0f;
      for (int e = lane; e < E; e += warp_threads) {
        const float g = gs != nullptr ? gs[e] + p.expert_grad[e] : p.expert_grad[e];
        partial = num::fma(g, row.prob(e), partial);
      }
      const float gdot = warp_sum<W>(partial);
      for (int e = lane; e < E; e += warp_threads) {
        const float g = gs != nullptr ? gs[e] + p.expert_grad[e] : p.expert_grad[e];
        if constexpr (warp_penalty_row<W, Router, T>::softmax_like)
          dz[e] = num::fma(row.prob(e), g - gdot, dz[e]);
        else
          dz[e] = num::fma(num::div(g - gdot, row.norm), RowG::derivative(row.v(e), row.s(e)), dz[e]);
      }
    }
    if constexpr (traits::kl_to_base || traits::logit_l2) {
      const std::int32_t pr = p.token_prior_row[token];
      if (pr >= 0 && pr < p.prior_rows) {
        if constexpr (traits::kl_to_base) {
          if (p.on.kl_to_base) {
            const float* pi = p.prior_probs + static_cast<std::int64_t>(pr) * E;
            const float w = p.weights.kl_to_base;
            for (int e = lane; e < E; e += warp_threads) {
              if constexpr (warp_penalty_row<W, Router, T>::softmax_like) {
                dz[e] = num::fma(w, row.prob(e) - W::load(pi + e), dz[e]);
              } else {
                const float x = row.v(e);
                const float term = num::fma(-W::load(pi + e), RowG::log_derivative(x),
                                            num::div(RowG::derivative(x, row.s(e)), row.norm));
                dz[e] = num::fma(w, term, dz[e]);
              }
            }
          }
        }
        if constexpr (traits::logit_l2) {
          if (p.on.logit_l2) {
            const float* pb = p.prior_bias + static_cast<std::int64_t>(pr) * E;
            const double mean = row.delta_mean(pb);
            for (int e = lane; e < E; e += warp_threads) {
              const float c = static_cast<float>(static_cast<double>(row.v(e) - W::load(pb + e)) - mean);
              dz[e] = num::fma(p.weights.logit_l2, c, dz[e]);
            }
          }
        }
      }
    }
    if constexpr (traits::z_loss) {
      if (p.on.z_loss) {
        const float wl = p.weights.z_loss * row.lse;
        for (int e = lane; e < E; e += warp_threads) dz[e] = num::fma(wl, row.softmax(e), dz[e]);
      }
    }
  }
}

// Host side of a launch (no CUDA API): the workspace regions and the kernel
// parameters of a call.
template <class Router, class S, class T>
training_params<S> make_training_params(const Router& r, const route_inputs<T>& in, const S* logits,
                                        const penalty::switches& on, const penalty::workspace_view* ws) {
  training_params<S> p{};
  p.logits = logits;
  p.num_tokens = in.num_tokens;
  p.num_experts = in.num_experts;
  p.token_mask = in.token_mask;
  p.replay_indices = in.replay_indices;
  p.expert_bias = in.expert_bias;
  p.groups = make_group_layout(r, in.num_experts);
  p.prior_bias = in.prior_bias;
  p.prior_probs = in.prior_probs;
  p.prior_rows = in.prior_rows;
  p.token_prior_row = in.mode == mode::train ? in.token_prior_row : nullptr;  // eval: no prior
  p.on = on;
  p.sequences = penalty::over_sequences(r);
  if constexpr (Router::template has<penalty::load_balance>) {
    p.counting = get<penalty::load_balance>(r).over == penalty::load_balance::scope::batch;
    p.count_top_k = get<penalty::load_balance>(r).counts == penalty::load_balance::count::top_k;
  }
  p.sequence_ids = in.sequence_ids;
  p.num_sequences = in.num_sequences;
  if (ws != nullptr) {
    p.valid_tokens = &ws->header->valid_tokens;
    p.prior_tokens = &ws->header->prior_tokens;
    p.distribution_sums = ws->distribution_sums;
    p.counts = ws->counts;
    p.sequence_sums = ws->sequence_sums;
    p.sequence_counts = ws->sequence_counts;
    p.sequence_tokens = ws->sequence_tokens;
    p.token_values = ws->token_values;
    p.expert_grad = ws->expert_grad;
    p.sequence_grad = ws->sequence_grad;
  }
  return p;
}

}  // namespace moe_route::cuda::detail
