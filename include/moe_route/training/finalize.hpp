// moe_route: the penalties' cross-token arithmetic, shared by both backends
// (host and device code): the values from the forward's sums, the dL/dp that
// the distribution-space penalties share among all tokens, and the per-token
// gradient weights. One source for both backends, double arithmetic with every
// multiply-add written as an explicit fma: the same bits everywhere.
#pragma once

#include <cstdint>

#include <moe_route/config.hpp>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/router.hpp>
#include <moe_route/training/workspace.hpp>
#include <moe_route/types.hpp>

namespace moe_route::penalty {

// Which penalties do work in a call: none in mode::eval, and none whose
// coefficient is 0 (its value is 0 and it adds no gradient).
struct switches {
  bool distribution = false, z_loss = false, kl_to_base = false, logit_l2 = false;
  MOE_ROUTE_HD bool any() const { return distribution || z_loss || kl_to_base || logit_l2; }
};

template <class Router, class T>
switches active(const Router& r, const route_inputs<T>& in) {
  switches a;
  if (in.mode != mode::train) return a;
  if constexpr (Router::template has<load_balance>) a.distribution |= get<load_balance>(r).coefficient != 0.0f;
  if constexpr (Router::template has<locality>) a.distribution |= get<locality>(r).coefficient != 0.0f;
  if constexpr (Router::template has<z_loss>) a.z_loss = get<z_loss>(r).coefficient != 0.0f;
  if constexpr (Router::template has<kl_to_base>) a.kl_to_base = get<kl_to_base>(r).coefficient != 0.0f;
  if constexpr (Router::template has<logit_l2>) a.logit_l2 = get<logit_l2>(r).coefficient != 0.0f;
  return a;
}

// The workspace regions and the inputs the arithmetic reads, as plain pointers
// in the backend's memory space.
struct training_state {
  const workspace_header* header = nullptr;
  const std::int64_t* distribution_sums = nullptr;  // [E]
  const std::int64_t* counts = nullptr;             // [E]
  const std::int64_t* sequence_sums = nullptr;      // [num_sequences x E]
  const std::int64_t* sequence_counts = nullptr;    // [num_sequences x E]
  const std::int64_t* sequence_tokens = nullptr;    // [num_sequences]
  const double* chunk_values = nullptr;             // [chunks x scalar_penalties]
  std::int64_t chunks = 0;
  int num_experts = 0;
  int top_k = 1;
  std::int32_t num_sequences = 0;
  const float* load_fractions = nullptr;            // [E], global_batch
  const std::int32_t* expert_rank = nullptr;        // [E], locality
  std::int32_t rank = 0;
};

// Typed pointers into a workspace laid out by training_layout (null where a
// region is absent), and the training_state the shared arithmetic reads.
struct workspace_view {
  workspace_header* header = nullptr;
  std::int64_t *distribution_sums = nullptr, *counts = nullptr, *sequence_sums = nullptr,
               *sequence_counts = nullptr, *sequence_tokens = nullptr;
  double *token_values = nullptr, *chunk_values = nullptr;
  float *expert_grad = nullptr, *sequence_grad = nullptr;

  workspace_view(void* base, const workspace_layout& l) {
    auto* bytes = static_cast<unsigned char*>(base);
    const auto at = [bytes](std::size_t offset) -> void* { return offset == 0 ? nullptr : bytes + offset; };
    header = static_cast<workspace_header*>(base);
    distribution_sums = static_cast<std::int64_t*>(at(l.distribution_sums));
    counts = static_cast<std::int64_t*>(at(l.counts));
    sequence_sums = static_cast<std::int64_t*>(at(l.sequence_sums));
    sequence_counts = static_cast<std::int64_t*>(at(l.sequence_counts));
    sequence_tokens = static_cast<std::int64_t*>(at(l.sequence_tokens));
    token_values = static_cast<double*>(at(l.token_values));
    chunk_values = static_cast<double*>(at(l.chunk_values));
    expert_grad = static_cast<float*>(at(l.expert_grad));
    sequence_grad = static_cast<float*>(at(l.sequence_grad));
  }

  template <class Router, class T>
  training_state state(const Router& r, const route_inputs<T>& in) const;
};

// Upstream gradients of the penalty values, router order (1 by default).
struct upstream_grads {
  float value[8] = {1, 1, 1, 1, 1, 1, 1, 1};
};

namespace detail {

using moe_route::detail::fma;

MOE_ROUTE_HD double mean_of(std::int64_t fixed_sum, double tokens) {
  return static_cast<double>(fixed_sum) / fixed_point_scale / tokens;
}

// The locality target D_l at expert e for a rank hosting `local` experts.
MOE_ROUTE_HD double locality_target(const training_state& s, float epsilon, int local, int e) {
  const int E = s.num_experts;
  if (local == E) return 1.0 / E;
  return s.expert_rank[e] == s.rank ? (1.0 - epsilon) / local : static_cast<double>(epsilon) / (E - local);
}

// log(D_c / D_l) in float (the shared bit-reproducible log), D_c floored at 1e-30.
MOE_ROUTE_HD float locality_log_ratio(double dc, double dl) {
  const double floored = dc > 1e-30 ? dc : 1e-30;
  return moe_route::detail::log(static_cast<float>(floored)) - moe_route::detail::log(static_cast<float>(dl));
}

MOE_ROUTE_HD int local_experts(const training_state& s) {
  int local = 0;
  for (int e = 0; e < s.num_experts; ++e) local += s.expert_rank[e] == s.rank ? 1 : 0;
  return local;
}

// Sum of column c over the chunk totals, in chunk order.
MOE_ROUTE_HD double column_total(const training_state& s, int columns, int c) {
  double total = 0.0;
  for (std::int64_t i = 0; i < s.chunks; ++i) total += s.chunk_values[i * columns + c];
  return total;
}

// f_e of load_balance over the batch or the global batch.
template <class Router>
MOE_ROUTE_HD double load_fraction(const Router& r, const training_state& s, int e, double valid) {
  if (get<load_balance>(r).over == load_balance::scope::global_batch) return static_cast<double>(s.load_fractions[e]);
  return static_cast<double>(s.counts[e]) / (valid * r.top_k);
}

}  // namespace detail

template <class Router, class T>
training_state workspace_view::state(const Router& r, const route_inputs<T>& in) const {
  training_state s;
  s.header = header;
  s.distribution_sums = distribution_sums;
  s.counts = counts;
  s.sequence_sums = sequence_sums;
  s.sequence_counts = sequence_counts;
  s.sequence_tokens = sequence_tokens;
  s.chunk_values = chunk_values;
  s.chunks = (in.num_tokens + value_chunk - 1) / value_chunk;
  s.num_experts = in.num_experts;
  s.top_k = r.top_k;
  s.num_sequences = in.num_sequences;
  s.load_fractions = in.load_fractions;
  s.expert_rank = in.expert_rank;
  s.rank = in.rank;
  return s;
}

template <class Router>
MOE_ROUTE_HD bool over_sequences(const Router& r) {
  if constexpr (Router::template has<load_balance>) return get<load_balance>(r).over == load_balance::scope::sequence;
  return false;
}

// Load balance over sequences (docs/policies.md section 5.2): the length that
// normalises sequence q's f and P; 0 for a sequence without a valid token,
// which adds nothing.
MOE_ROUTE_HD double sequence_length(const load_balance& lb, const training_state& s, std::int32_t q) {
  const double own = static_cast<double>(s.sequence_tokens[q]);
  if (own == 0.0 || lb.sequence_length == load_balance::length::own) return own;
  return static_cast<double>(s.header->valid_tokens) / static_cast<double>(s.num_sequences);
}

// The number of sequences the loss averages over: those with a valid token,
// or under batch_mean all of them (none when no token is valid).
template <class Router>
MOE_ROUTE_HD std::int64_t averaged_sequences(const Router& r, const training_state& s) {
  if constexpr (Router::template has<load_balance>) {
    if (get<load_balance>(r).sequence_length == load_balance::length::batch_mean)
      return s.header->valid_tokens > 0 ? s.num_sequences : 0;
    std::int64_t nonempty = 0;
    for (std::int32_t q = 0; q < s.num_sequences; ++q) nonempty += s.sequence_tokens[q] > 0 ? 1 : 0;
    return nonempty;
  }
  return 0;
}

// Every penalty value, in the router's penalty order (docs/policies.md section 5).
template <class Router>
MOE_ROUTE_HD void values(const Router& r, const training_state& s, double* out) {
  using traits = penalty_traits<Router>;
  const int E = s.num_experts;
  const double valid = static_cast<double>(s.header->valid_tokens);
  const double prior = static_cast<double>(s.header->prior_tokens);
  if constexpr (traits::load_balance) {
    const auto& lb = get<load_balance>(r);
    double value = 0.0;
    if (lb.over == load_balance::scope::sequence) {
      double total = 0.0;
      for (std::int32_t q = 0; q < s.num_sequences; ++q) {
        const double tokens = sequence_length(lb, s, q);
        if (tokens == 0.0) continue;
        double dot = 0.0;
        for (int e = 0; e < E; ++e) {
          const std::int64_t at = std::int64_t{q} * E + e;
          const double f = static_cast<double>(s.sequence_counts[at]) / (tokens * r.top_k);
          dot = detail::fma(f, detail::mean_of(s.sequence_sums[at], tokens), dot);
        }
        total += dot;
      }
      const std::int64_t sequences = averaged_sequences(r, s);
      if (sequences > 0) value = lb.coefficient * static_cast<double>(E) * total / static_cast<double>(sequences);
    } else if (valid > 0.0) {
      double dot = 0.0;
      for (int e = 0; e < E; ++e)
        dot = detail::fma(detail::load_fraction(r, s, e, valid), detail::mean_of(s.distribution_sums[e], valid), dot);
      value = lb.coefficient * static_cast<double>(E) * dot;
    }
    out[penalty_slot<load_balance, Router>] = value;
  }
  constexpr int columns = traits::scalar_penalties;
  if constexpr (traits::z_loss)
    out[penalty_slot<z_loss, Router>] =
        valid > 0.0 ? get<z_loss>(r).coefficient * detail::column_total(s, columns, traits::z_loss_column) / valid : 0.0;
  if constexpr (traits::kl_to_base)
    out[penalty_slot<kl_to_base, Router>] =
        prior > 0.0 ? get<kl_to_base>(r).coefficient * detail::column_total(s, columns, traits::kl_to_base_column) / prior
                    : 0.0;
  if constexpr (traits::logit_l2)
    out[penalty_slot<logit_l2, Router>] =
        prior > 0.0 ? get<logit_l2>(r).coefficient * detail::column_total(s, columns, traits::logit_l2_column) / prior
                    : 0.0;
  if constexpr (traits::locality) {
    const auto& loc = get<locality>(r);
    double value = 0.0;
    if (valid > 0.0) {
      const int local = detail::local_experts(s);
      for (int e = 0; e < E; ++e) {
        const double dc = detail::mean_of(s.distribution_sums[e], valid);
        if (dc == 0.0) continue;
        const float ratio = detail::locality_log_ratio(dc, detail::locality_target(s, loc.epsilon, local, e));
        value = detail::fma(dc, static_cast<double>(ratio), value);
      }
    }
    out[penalty_slot<locality, Router>] = loc.coefficient * value;
  }
}

// dL/dp_e shared by every token: load_balance over the batch or the global
// batch, plus locality. `local` is detail::local_experts(s) (locality only).
template <class Router>
MOE_ROUTE_HD float expert_grad(const Router& r, const training_state& s, const upstream_grads& up, int local, int e) {
  using traits = penalty_traits<Router>;
  const double valid = static_cast<double>(s.header->valid_tokens);
  double g = 0.0;
  if (!(valid > 0.0)) return 0.0f;
  if constexpr (traits::load_balance) {
    const auto& lb = get<load_balance>(r);
    if (lb.over != load_balance::scope::sequence) {
      const double scale = lb.coefficient * static_cast<double>(up.value[penalty_slot<load_balance, Router>]) *
                           s.num_experts / valid;
      g = scale * detail::load_fraction(r, s, e, valid);
    }
  }
  if constexpr (traits::locality) {
    const auto& loc = get<locality>(r);
    const double scale = loc.coefficient * static_cast<double>(up.value[penalty_slot<locality, Router>]) / valid;
    const double dc = detail::mean_of(s.distribution_sums[e], valid);
    const double ratio =
        static_cast<double>(detail::locality_log_ratio(dc, detail::locality_target(s, loc.epsilon, local, e)));
    g = detail::fma(scale, ratio + 1.0, g);
  }
  return static_cast<float>(g);
}

// dL/dp_e for the tokens of sequence q (load_balance over sequences);
// `sequences` is averaged_sequences(r, s).
template <class Router>
MOE_ROUTE_HD float sequence_grad(const Router& r, const training_state& s, const upstream_grads& up,
                                 std::int64_t sequences, std::int32_t q, int e) {
  if constexpr (!penalty_traits<Router>::load_balance) {
    return 0.0f;
  } else {
    const auto& lb = get<load_balance>(r);
    const double tokens = sequence_length(lb, s, q);
    if (tokens == 0.0) return 0.0f;
    const double f = static_cast<double>(s.sequence_counts[std::int64_t{q} * s.num_experts + e]) / (tokens * r.top_k);
    const double scale = lb.coefficient * static_cast<double>(up.value[penalty_slot<load_balance, Router>]) *
                         s.num_experts / (static_cast<double>(sequences) * tokens);
    return static_cast<float>(scale * f);
  }
}

// The per-token gradient weights of the scalar penalties.
struct token_weights {
  float kl_to_base = 0.0f;  // c u / |T|
  float logit_l2 = 0.0f;    // 2 c u / |T|
  float z_loss = 0.0f;      // 2 c u / N
};

template <class Router>
MOE_ROUTE_HD token_weights weights(const Router& r, const workspace_header& h, const upstream_grads& up) {
  using traits = penalty_traits<Router>;
  token_weights w;
  const double valid = static_cast<double>(h.valid_tokens);
  const double prior = static_cast<double>(h.prior_tokens);
  if constexpr (traits::kl_to_base)
    if (prior > 0.0)
      w.kl_to_base = static_cast<float>(get<kl_to_base>(r).coefficient *
                                        static_cast<double>(up.value[penalty_slot<kl_to_base, Router>]) / prior);
  if constexpr (traits::logit_l2)
    if (prior > 0.0)
      w.logit_l2 = static_cast<float>(2.0 * get<logit_l2>(r).coefficient *
                                      static_cast<double>(up.value[penalty_slot<logit_l2, Router>]) / prior);
  if constexpr (traits::z_loss)
    if (valid > 0.0)
      w.z_loss = static_cast<float>(2.0 * get<z_loss>(r).coefficient *
                                    static_cast<double>(up.value[penalty_slot<z_loss, Router>]) / valid);
  return w;
}

}  // namespace moe_route::penalty
