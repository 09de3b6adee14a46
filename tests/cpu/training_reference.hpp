// The double-precision reference of a training step (docs/policies.md sections
// 3 and 5): the prior policies and every penalty, their values and the loss
// whose finite differences the fused backward must match. Shared by
// tests/cpu/training_test.cpp and the training fuzz target, so it uses no test
// framework: compare_step describes every difference it finds.
#pragma once

#include "reference.hpp"

#include <string>
#include <vector>

namespace tref {

namespace mr = moe_route;
namespace pen = moe_route::penalty;
namespace pri = moe_route::prior;

// ---------------------------------------------------------------------------
// A training batch: logits, a prior table, per-token rows, sequences, ranks.

struct batch {
  std::int64_t N = 0;
  int E = 0;
  std::vector<float> z;
  std::int64_t S = 0;
  std::vector<float> bias, probs;  // prepared prior (b, clamped pi)
  std::vector<std::int32_t> rows;  // r(t)
  std::int32_t num_sequences = 0;
  std::vector<std::int32_t> sequence_ids;
  std::vector<float> load_fractions;
  std::vector<std::int32_t> expert_rank;
  std::int32_t rank = 0;
  std::vector<float> expert_bias;
  mr::mode mode = mr::mode::train;

  mr::route_inputs<float> inputs() const {
    mr::route_inputs<float> in;
    in.logits = z.data();
    in.num_tokens = N;
    in.num_experts = E;
    in.expert_bias = expert_bias.empty() ? nullptr : expert_bias.data();
    in.mode = mode;
    in.prior_bias = bias.empty() ? nullptr : bias.data();
    in.prior_probs = probs.empty() ? nullptr : probs.data();
    in.prior_rows = S;
    in.token_prior_row = rows.empty() ? nullptr : rows.data();
    in.sequence_ids = sequence_ids.empty() ? nullptr : sequence_ids.data();
    in.num_sequences = num_sequences;
    in.load_fractions = load_fractions.empty() ? nullptr : load_fractions.data();
    in.expert_rank = expert_rank.empty() ? nullptr : expert_rank.data();
    in.rank = rank;
    return in;
  }
};

// The reference prior preparation (RPB eq. 3) in double.
inline void prepare_reference(const std::vector<double>& pi, int E, double eps, double cap, std::vector<float>& b,
                       std::vector<float>& c_out) {
  const std::size_t rows = pi.size() / E;
  b.resize(pi.size());
  c_out.resize(pi.size());
  for (std::size_t r = 0; r < rows; ++r) {
    std::vector<double> c(E);
    double sum = 0;
    for (int e = 0; e < E; ++e) sum += (c[e] = std::clamp(pi[r * E + e], eps / E, cap / E));
    double mean = 0;
    for (int e = 0; e < E; ++e) mean += std::log(c[e] / sum) / E;
    for (int e = 0; e < E; ++e) {
      b[r * E + e] = static_cast<float>(std::log(c[e] / sum) - mean);
      c_out[r * E + e] = static_cast<float>(c[e] / sum);
    }
  }
}

inline batch make_batch(ref::rng& g, std::int64_t N, int E, std::int64_t S, double sigma = 1.5) {
  batch b;
  b.N = N;
  b.E = E;
  b.z = ref::random_logits<float>(g, N, E, sigma);
  b.S = S;
  std::vector<double> pi(S * E);
  for (std::int64_t r = 0; r < S; ++r) {
    double sum = 0;
    for (int e = 0; e < E; ++e) sum += (pi[r * E + e] = std::exp(g.normal(1.2)));
    for (int e = 0; e < E; ++e) pi[r * E + e] /= sum;
  }
  prepare_reference(pi, E, 0.05, 5.0, b.bias, b.probs);
  b.rows.resize(N);
  for (auto& r : b.rows) r = g.integer(-1, static_cast<int>(S) - 1);  // some tokens without a prior
  b.num_sequences = 3;
  b.sequence_ids.resize(N);
  for (std::int64_t t = 0; t < N; ++t) b.sequence_ids[t] = static_cast<std::int32_t>(t * 3 / N);
  b.load_fractions.resize(E);
  double total = 0;
  for (int e = 0; e < E; ++e) total += (b.load_fractions[e] = static_cast<float>(g.uniform(0.2, 1.0)));
  for (auto& f : b.load_fractions) f = static_cast<float>(f / total);
  b.expert_rank.resize(E);
  for (int e = 0; e < E; ++e) b.expert_rank[e] = e * 4 / E;  // 4 ranks
  b.rank = 1;
  return b;
}

// ---------------------------------------------------------------------------
// Running the library.

struct lib_run {
  std::vector<std::int32_t> idx;
  std::vector<float> gates;
  std::vector<double> values;
  std::vector<unsigned char> workspace;
  std::vector<float> dz;
  std::int64_t nonfinite = 0;  // the forward's count of rows with NaN or +-inf
};

// One training step, forward then backward, through route(in, outputs) and
// backward(in, args), every output poisoned first; num_values penalty values.
template <class Route, class Backward>
lib_run run_step(const mr::route_inputs<float>& in, int K, int num_values, std::size_t workspace_bytes,
                 const std::vector<float>& grad_gates, const std::vector<float>& penalty_grads, Route&& route,
                 Backward&& backward) {
  lib_run out;
  const std::int64_t N = in.num_tokens;
  out.idx.assign(N * K, -7);
  out.gates.assign(N * K, -7.0f);
  out.values.assign(num_values, -7.0);
  out.workspace.assign(workspace_bytes, 0xab);
  mr::route_outputs o;
  o.indices = out.idx.data();
  o.gates = out.gates.data();
  o.penalty_values = out.values.data();
  o.workspace = out.workspace.data();
  o.workspace_bytes = out.workspace.size();
  o.nonfinite_rows = &out.nonfinite;
  route(in, o);
  out.dz.assign(N * in.num_experts, -7.0f);
  mr::backward_args a;
  a.indices = out.idx.data();
  a.grad_gates = grad_gates.data();
  a.grad_logits = out.dz.data();
  a.workspace = out.workspace.data();
  a.workspace_bytes = out.workspace.size();
  a.penalty_grads = penalty_grads.empty() ? nullptr : penalty_grads.data();
  backward(in, a);
  return out;
}

// The step of a typed router on the CPU backend, with replayed experts and a
// token mask where given.
template <class Router>
lib_run run_lib(const Router& r, const batch& b, const std::vector<float>& grad_gates,
                const std::vector<float>& penalty_grads, int threads = 1,
                const std::vector<std::int32_t>* replay = nullptr, const std::uint8_t* mask = nullptr) {
  auto in = b.inputs();
  if (replay != nullptr) in.replay_indices = replay->data();
  in.token_mask = mask;
  const mr::cpu::execution ex = ref::on_threads(threads);
  return run_step(
      in, r.top_k, std::max(1, Router::num_penalties),
      mr::penalty::training_workspace_bytes(r, b.N, b.E, b.num_sequences), grad_gates, penalty_grads,
      [&](const auto& i, const auto& o) { mr::cpu::route(r, i, o, ex); },
      [&](const auto& i, const auto& a) { mr::cpu::backward(r, i, a, ex); });
}

// ---------------------------------------------------------------------------
// The reference: the training loss of one step as a function of the logits,
// the selection (and so the load counts f) held at the forward's indices.
//   L(z) = sum_{t,k} c_tk w_tk(z'_t) + sum_j u_j penalty_j(z)

struct policies {
  bool prior_soft = false, prior_hard = false, bias_gates = true;
  double beta = 0;
  bool lb = false, z = false, kl = false, l2 = false, loc = false;
  pen::load_balance::scope lb_scope = pen::load_balance::scope::batch;
  bool lb_top_k = false;       // f from each token's K largest unbiased logits
  bool lb_batch_mean = false;  // sequences normalised by the batch's mean valid length
  double lb_c = 0, z_c = 0, kl_c = 0, l2_c = 0, loc_c = 0, loc_eps = 1e-3;
};

template <class Router>
policies policies_of(const Router& r) {
  policies p;
  if constexpr (Router::template has<pri::log_prior_bias>) {
    p.prior_soft = true;
    p.beta = mr::get<pri::log_prior_bias>(r).beta;
    p.bias_gates = mr::get<pri::log_prior_bias>(r).bias_gates;
  }
  if constexpr (Router::template has<pri::prior_override>) p.prior_hard = true;
  if constexpr (Router::template has<pen::load_balance>) {
    p.lb = true;
    p.lb_c = mr::get<pen::load_balance>(r).coefficient;
    p.lb_scope = mr::get<pen::load_balance>(r).over;
    p.lb_top_k = mr::get<pen::load_balance>(r).counts == pen::load_balance::count::top_k;
    p.lb_batch_mean = mr::get<pen::load_balance>(r).sequence_length == pen::load_balance::length::batch_mean;
  }
  if constexpr (Router::template has<pen::z_loss>) p.z = true, p.z_c = mr::get<pen::z_loss>(r).coefficient;
  if constexpr (Router::template has<pen::kl_to_base>) p.kl = true, p.kl_c = mr::get<pen::kl_to_base>(r).coefficient;
  if constexpr (Router::template has<pen::logit_l2>) p.l2 = true, p.l2_c = mr::get<pen::logit_l2>(r).coefficient;
  if constexpr (Router::template has<pen::locality>) {
    p.loc = true;
    p.loc_c = mr::get<pen::locality>(r).coefficient;
    p.loc_eps = mr::get<pen::locality>(r).epsilon;
  }
  return p;
}

// The routing distribution of the gating (docs/policies.md section 1) in double.
inline std::vector<double> distribution(ref::gate_kind gk, const std::vector<double>& z) {
  const int E = static_cast<int>(z.size());
  std::vector<double> p(E);
  double sum = 0;
  if (gk == ref::gate_kind::sigmoid || gk == ref::gate_kind::sqrt_softplus) {
    for (int e = 0; e < E; ++e)
      sum += (p[e] = gk == ref::gate_kind::sigmoid ? 1.0 / (1.0 + std::exp(-z[e])) : std::sqrt(std::log1p(std::exp(z[e]))));
  } else {
    const double m = *std::max_element(z.begin(), z.end());
    for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(z[e] - m));
  }
  for (auto& x : p) x /= sum;
  return p;
}

inline double logsumexp(const std::vector<double>& z) {
  const double m = *std::max_element(z.begin(), z.end());
  double s = 0;
  for (double x : z) s += std::exp(x - m);
  return m + std::log(s);
}

// Each token's K largest logits of the batch, ties to the lower expert: the
// experts load_balance::count::top_k counts (constants, like the selection).
inline std::vector<std::int32_t> plain_top_k(const batch& b, int K) {
  std::vector<int> all(b.E);
  std::iota(all.begin(), all.end(), 0);
  std::vector<std::int32_t> idx(b.N * K);
  for (std::int64_t t = 0; t < b.N; ++t) {
    std::vector<double> key(b.E);
    for (int e = 0; e < b.E; ++e) key[e] = ref::sanitize(b.z[t * b.E + e]);
    const std::vector<int> order = ref::rank_by_key(key, all);
    std::copy_n(order.begin(), K, idx.begin() + t * K);
  }
  return idx;
}

// The penalty values in the router's penalty order (that of the test's
// router types: load_balance, z_loss, kl_to_base, logit_l2, locality, each if present).
inline std::vector<double> penalty_values(const policies& p, ref::gate_kind gk, const batch& b,
                                          const std::vector<double>& z, const std::vector<std::int32_t>& idx, int K,
                                          std::vector<double>* magnitudes = nullptr) {
  const int E = b.E;
  std::vector<std::vector<double>> dist(b.N);
  std::vector<char> valid(b.N);
  std::int64_t nv = 0, nt = 0;
  for (std::int64_t t = 0; t < b.N; ++t) {
    const std::vector<double> zt(z.begin() + t * E, z.begin() + (t + 1) * E);
    valid[t] = std::all_of(zt.begin(), zt.end(), [](double x) { return std::isfinite(x); });
    if (!valid[t]) continue;
    dist[t] = distribution(gk, zt);
    ++nv;
    nt += b.rows[t] >= 0 ? 1 : 0;
  }
  std::vector<double> out, size;  // size: the scale of the value's fp32 rounding (its terms' magnitudes)
  if (p.lb) {
    const std::vector<std::int32_t> counted = p.lb_top_k ? plain_top_k(b, K) : idx;
    double value = 0;
    if (p.lb_scope == pen::load_balance::scope::sequence) {
      int nonempty = 0;
      for (int s = 0; s < b.num_sequences; ++s) {
        std::vector<double> f(E, 0), P(E, 0);
        double ns = 0;
        for (std::int64_t t = 0; t < b.N; ++t) {
          if (!valid[t] || b.sequence_ids[t] != s) continue;
          ns += 1;
          for (int j = 0; j < K; ++j) f[counted[t * K + j]] += 1;
          for (int e = 0; e < E; ++e) P[e] += dist[t][e];
        }
        if (ns == 0) continue;
        ++nonempty;
        const double length = p.lb_batch_mean ? static_cast<double>(nv) / b.num_sequences : ns;
        for (int e = 0; e < E; ++e) value += (f[e] / (length * K)) * (P[e] / length);
      }
      const int averaged = p.lb_batch_mean && nonempty ? b.num_sequences : nonempty;
      value = averaged ? p.lb_c * E * value / averaged : 0.0;
    } else {
      std::vector<double> f(E, 0), P(E, 0);
      for (std::int64_t t = 0; t < b.N; ++t) {
        if (!valid[t]) continue;
        for (int j = 0; j < K; ++j) f[counted[t * K + j]] += 1.0 / (static_cast<double>(nv) * K);
        for (int e = 0; e < E; ++e) P[e] += dist[t][e] / nv;
      }
      if (p.lb_scope == pen::load_balance::scope::global_batch)
        for (int e = 0; e < E; ++e) f[e] = b.load_fractions[e];
      for (int e = 0; e < E; ++e) value += p.lb_c * E * f[e] * P[e];
    }
    out.push_back(value);
    size.push_back(std::fabs(value));  // terms of one sign
  }
  if (p.z) {
    double v = 0, m = 0;
    for (std::int64_t t = 0; t < b.N; ++t) {
      if (!valid[t]) continue;
      const std::vector<double> zt(z.begin() + t * E, z.begin() + (t + 1) * E);
      const double l = logsumexp(zt), top = *std::max_element(zt.begin(), zt.end());
      v += l * l;
      m += (std::fabs(top) + (l - top)) * (std::fabs(top) + (l - top));  // l = max + log(sum), rounded in each
    }
    out.push_back(nv ? p.z_c * v / nv : 0.0);
    size.push_back(nv ? std::fabs(p.z_c) * m / nv : 0.0);
  }
  if (p.kl) {
    double v = 0, m = 0;
    for (std::int64_t t = 0; t < b.N; ++t) {
      if (!valid[t] || b.rows[t] < 0) continue;
      // log p_e is log s_e - log sum s (softmax: v_e - max - log sum e^(v - max)),
      // rounded in fp32 on the scale of those terms, not of the difference;
      // and each log carries its argument's relative rounding as an absolute
      // error (the + 1).
      const std::vector<double> zt(z.begin() + t * E, z.begin() + (t + 1) * E);
      std::vector<double> log_size(E);
      if (gk == ref::gate_kind::sigmoid || gk == ref::gate_kind::sqrt_softplus) {
        const std::vector<double> score = ref::scores(gk, zt);
        const double sum = std::accumulate(score.begin(), score.end(), 0.0);
        for (int e = 0; e < E; ++e) log_size[e] = std::fabs(std::log(score[e])) + std::fabs(std::log(sum)) + 1;
      } else {
        const double top = *std::max_element(zt.begin(), zt.end()), lse = logsumexp(zt) - top;
        for (int e = 0; e < E; ++e) log_size[e] = std::fabs(zt[e] - top) + lse + 1;
      }
      for (int e = 0; e < E; ++e) {
        const double pi = b.probs[b.rows[t] * E + e];
        v += pi * (std::log(pi) - std::log(dist[t][e]));
        m += pi * (std::fabs(std::log(pi)) + log_size[e]);
      }
    }
    out.push_back(nt ? p.kl_c * v / nt : 0.0);
    size.push_back(nt ? std::fabs(p.kl_c) * m / nt : 0.0);
  }
  if (p.l2) {
    double v = 0, m = 0;
    for (std::int64_t t = 0; t < b.N; ++t) {
      if (!valid[t] || b.rows[t] < 0) continue;
      // center(z) - center(log pi) with pi the clamped prior
      double mz = 0, ml = 0;
      for (int e = 0; e < E; ++e) {
        mz += z[t * E + e] / E;
        ml += std::log(static_cast<double>(b.probs[b.rows[t] * E + e])) / E;
      }
      for (int e = 0; e < E; ++e) {
        const double lp = std::log(static_cast<double>(b.probs[b.rows[t] * E + e]));
        const double d = (z[t * E + e] - mz) - (lp - ml);
        const double parts = std::fabs(z[t * E + e]) + std::fabs(mz) + std::fabs(lp) + std::fabs(ml);
        v += d * d;
        m += parts * parts;
      }
    }
    out.push_back(nt ? p.l2_c * v / nt : 0.0);
    size.push_back(nt ? std::fabs(p.l2_c) * m / nt : 0.0);
  }
  if (p.loc) {
    int local = 0;
    for (int e = 0; e < E; ++e) local += b.expert_rank[e] == b.rank;
    double v = 0, m = 0;
    for (int e = 0; e < E; ++e) {
      double dc = 0;
      for (std::int64_t t = 0; t < b.N; ++t)
        if (valid[t]) dc += dist[t][e] / nv;
      const double dl = local == E ? 1.0 / E
                        : b.expert_rank[e] == b.rank ? (1 - p.loc_eps) / local
                                                     : p.loc_eps / (E - local);
      // (+ 1: the rounding of dc / dl, as for log p above)
      if (dc > 0) v += dc * std::log(dc / dl), m += dc * (std::fabs(std::log(dc)) + std::fabs(std::log(dl)) + 1);
    }
    out.push_back(p.loc_c * v);
    size.push_back(std::fabs(p.loc_c) * m);
  }
  if (magnitudes != nullptr) *magnitudes = size;
  return out;
}

inline bool prior_acts(const policies& p, const batch& b, std::int64_t t) {
  return b.mode == mr::mode::train && b.rows[t] >= 0 && (p.prior_hard || (p.prior_soft && p.beta != 0.0));
}

// The loss with the selection fixed; without the gate terms of the rows
// marked in `skip` (rows in no penalty, whose gradient is taken otherwise).
inline double loss(const policies& p, const ref::spec& sp, const batch& b, const std::vector<double>& z,
            const std::vector<std::int32_t>& idx, const std::vector<float>& c, const std::vector<float>& u,
            const std::vector<char>* skip = nullptr) {
  const int E = b.E, K = sp.K;
  double L = 0;
  for (std::int64_t t = 0; t < b.N; ++t) {
    if (skip != nullptr && (*skip)[t]) continue;
    std::vector<double> zt(z.begin() + t * E, z.begin() + (t + 1) * E);
    if (prior_acts(p, b, t) && p.prior_soft && p.bias_gates)
      for (int e = 0; e < E; ++e) zt[e] += p.beta * b.bias[b.rows[t] * E + e];
    const auto w = ref::gates_of_logits(sp, zt, idx.data() + t * K);
    for (int j = 0; j < K; ++j) L += c[t * K + j] * w[j];
  }
  if (b.mode == mr::mode::train) {
    const auto v = penalty_values(p, sp.gate, b, z, idx, K);
    for (std::size_t j = 0; j < v.size(); ++j) L += u[j] * v[j];
  }
  return L;
}

// The reference selection of every token: the router's own (ref::select) or,
// where the prior acts, on z' (soft) or on the prior bias row (hard).
inline std::vector<std::int32_t> reference_indices(const policies& p, const ref::spec& sp, const batch& b) {
  const int E = b.E, K = sp.K;
  std::vector<std::int32_t> idx(b.N * K);
  for (std::int64_t t = 0; t < b.N; ++t) {
    std::vector<double> v(E);
    for (int e = 0; e < E; ++e) v[e] = ref::sanitize(b.z[t * E + e]);
    if (prior_acts(p, b, t) && p.prior_soft)
      for (int e = 0; e < E; ++e) v[e] = ref::sanitize(b.z[t * E + e] + p.beta * b.bias[b.rows[t] * E + e]);
    std::vector<int> order;
    if (prior_acts(p, b, t) && p.prior_hard) {
      std::vector<double> key(b.bias.begin() + b.rows[t] * E, b.bias.begin() + (b.rows[t] + 1) * E);
      std::vector<int> all(E);
      std::iota(all.begin(), all.end(), 0);
      order = ref::rank_by_key(key, all);
      order.resize(K);
    } else {
      order = ref::select(sp, v, ref::scores(sp.gate, v), b.expert_bias.empty() ? nullptr : b.expert_bias.data(), t).order;
    }
    for (int j = 0; j < K; ++j) idx[t * K + j] = order[j];
  }
  return idx;
}

// Forward (indices, gates, values) and backward (finite differences of loss())
// of the library against the reference.
// With `replay`, the forward routes to those experts (docs/policies.md §2.9)
// and the reference holds them instead of its own selection.

// Every way a library step (forward and backward) differs from the reference,
// one line each; empty when it agrees. num_penalties is the router's count of
// penalty values (0: none); the step's gate gradients are c, its penalty
// weights u. With `replay`, the reference holds those experts instead of its
// own selection. Penalty values are compared to 2e-5 of their value plus
// 4e-7 (a few fp32 ulp) of the magnitude of their terms.
inline std::vector<std::string> compare_step(const policies& p, const ref::spec& sp, int num_penalties,
                                             const batch& b, const lib_run& lib, const std::vector<float>& c,
                                             const std::vector<float>& u,
                                             const std::vector<std::int32_t>* replay = nullptr,
                                             bool gradients = true) {
  std::vector<std::string> problems;
  const int K = sp.K, E = b.E;
  std::vector<std::int32_t> idx = replay != nullptr ? *replay : reference_indices(p, sp, b);
  if (replay != nullptr && lib.idx != idx) problems.push_back("indices differ from the replayed experts");
  // Where the library's experts differ, they must be a choice the routing
  // reference accepts: keys computed in fp32 (s + b, s, or z' = z + beta b) may
  // order near-ties differently. The accepted experts are then the ones the
  // gates (from z or z', below), penalties and gradients are checked at.
  for (std::int64_t t = 0; t < b.N && replay == nullptr; ++t) {
    if (std::equal(idx.begin() + t * K, idx.begin() + (t + 1) * K, lib.idx.begin() + t * K)) continue;
    std::string problem = "the prior row's experts are not the library's";
    if (!(prior_acts(p, b, t) && p.prior_hard)) {
      const bool soft = prior_acts(p, b, t) && p.prior_soft;
      std::vector<float> zt(b.z.begin() + t * E, b.z.begin() + (t + 1) * E);
      if (soft)
        for (int e = 0; e < E; ++e) zt[e] = static_cast<float>(zt[e] + p.beta * b.bias[b.rows[t] * E + e]);
      problem = ref::check_row(sp, zt.data(), E, b.expert_bias.empty() ? nullptr : b.expert_bias.data(), t,
                               lib.idx.data() + t * K, lib.gates.data() + t * K, -1.0,
                               std::max(ref::default_key_tol(sp), soft ? 1e-6 : 0.0))
                    .problem;
    }
    if (problem.empty()) std::copy_n(lib.idx.begin() + t * K, K, idx.begin() + t * K);
    else problems.push_back("token " + std::to_string(t) + ": " + problem);
  }

  std::vector<double> z(b.z.begin(), b.z.end());
  for (std::int64_t t = 0; t < b.N; ++t) {
    std::vector<double> zt(z.begin() + t * E, z.begin() + (t + 1) * E);
    if (prior_acts(p, b, t) && p.prior_soft && p.bias_gates)
      for (int e = 0; e < E; ++e) zt[e] += p.beta * b.bias[b.rows[t] * E + e];
    const auto w = ref::gates_of_logits(sp, zt, idx.data() + t * K);
    for (int j = 0; j < K; ++j)
      if (!ref::close(lib.gates[t * K + j], w[j], 2e-5, 1e-7))
        problems.push_back("gate (" + std::to_string(t) + ", " + std::to_string(j) + ") = " +
                           ref::precise(lib.gates[t * K + j]) + ", reference " + ref::precise(w[j]));
  }
  if (num_penalties > 0) {
    std::vector<double> size(num_penalties, 0.0);
    const auto v = b.mode == mr::mode::train ? penalty_values(p, sp.gate, b, z, idx, K, &size)
                                             : std::vector<double>(num_penalties, 0.0);
    if (v.size() != static_cast<std::size_t>(num_penalties)) {
      problems.push_back("the reference has " + std::to_string(v.size()) + " penalties, the router " +
                         std::to_string(num_penalties));
      return problems;
    }
    for (std::size_t j = 0; j < v.size(); ++j)
      if (!ref::close(lib.values[j], v[j], 2e-5, 4e-7 * size[j] + 1e-9))
        problems.push_back("penalty " + std::to_string(j) + ": " + ref::precise(lib.values[j]) + ", reference " +
                           ref::precise(v[j]));
  }
  if (!gradients) return problems;
  // A row holding NaN or +-inf is in no penalty, so its dz is the gate VJP
  // alone, taken at the sanitised logits (+-FLT_MAX, where finite differences
  // cannot step): compared with the analytic VJP, as the routing tests do, and
  // left out of the loss differenced below (its gates, up to 1e19 under
  // sqrt_softplus, would drown the other rows' terms).
  std::vector<char> analytic(b.N, 0);
  for (std::int64_t t = 0; t < b.N; ++t) {
    std::vector<double> zt(z.begin() + t * E, z.begin() + (t + 1) * E);
    if (std::all_of(zt.begin(), zt.end(), [](double x) { return std::isfinite(x); })) continue;
    analytic[t] = 1;
    if (prior_acts(p, b, t) && p.prior_soft && p.bias_gates)
      for (int e = 0; e < E; ++e) zt[e] += p.beta * b.bias[b.rows[t] * E + e];
    const std::vector<double> g(c.begin() + t * K, c.begin() + (t + 1) * K);
    const auto ana = ref::vjp(sp, zt, idx.data() + t * K, g), bound = ref::vjp_bound(sp, zt, idx.data() + t * K, g);
    for (int e = 0; e < E; ++e)
      if (!(std::fabs(lib.dz[t * E + e] - ana[e]) <= 2e-5 * std::fabs(ana[e]) + 1e-6 * bound[e] + 1e-30))
        problems.push_back("dz[" + std::to_string(t) + ", " + std::to_string(e) + "] = " +
                           ref::precise(lib.dz[t * E + e]) + " in a row with a NaN or inf, the gates' VJP " +
                           ref::precise(ana[e]));
  }
  // dL/dz of the other rows by central differences of the reference loss.
  double scale = 0;
  std::vector<double> fd(z.size()), fd_noise(z.size(), 0.0);
  for (std::size_t i = 0; i < z.size(); ++i) {
    if (analytic[i / E]) {
      fd[i] = lib.dz[i];  // compared above
      continue;
    }
    const double h = 1e-5 * std::max(1.0, std::fabs(z[i]));
    const double z0 = z[i];
    z[i] = z0 + h;
    const double lp = loss(p, sp, b, z, idx, c, u, &analytic);
    z[i] = z0 - h;
    const double lm = loss(p, sp, b, z, idx, c, u, &analytic);
    z[i] = z0;
    fd[i] = (lp - lm) / (2 * h);
    fd_noise[i] = 1e-15 * std::max(std::fabs(lp), std::fabs(lm)) / h;  // a few ulp of the loss, per step
    scale = std::max(scale, std::fabs(fd[i]));
  }
  // Besides the steps' error, the library's own rounding: where the gate terms
  // cancel (equal gate gradients under normalisation), dz is noise on the
  // scale of the gate VJP's terms (ref::vjp_bound), not of the result.
  std::vector<double> rounding(z.size(), 0.0);
  for (std::int64_t t = 0; t < b.N; ++t) {
    if (analytic[t]) continue;
    std::vector<double> zt(z.begin() + t * E, z.begin() + (t + 1) * E);
    if (prior_acts(p, b, t) && p.prior_soft && p.bias_gates)
      for (int e = 0; e < E; ++e) zt[e] += p.beta * b.bias[b.rows[t] * E + e];
    const std::vector<double> g(c.begin() + t * K, c.begin() + (t + 1) * K);
    const auto bound = ref::vjp_bound(sp, zt, idx.data() + t * K, g);
    for (int e = 0; e < E; ++e) rounding[t * E + e] = 1e-6 * bound[e];
  }
  // And the penalties' rounding. Their gradient reaches z through the VJP of
  // each row's distribution p, p (g - <g, p>), whose fp32 rounding is about
  // eps p_e |g| with |g| up to the logs of p (the row's spread): where g - <g, p>
  // cancels (a uniform f under global_batch, a nearly one-hot p), dz is that
  // noise. g is u_j times the coefficient over the tokens averaged.
  double weights = 0;
  if (b.mode == mr::mode::train) {
    std::vector<double> coefficients;
    for (const auto& [on, coefficient] : {std::pair{p.lb, p.lb_c}, std::pair{p.z, p.z_c}, std::pair{p.kl, p.kl_c},
                                          std::pair{p.l2, p.l2_c}, std::pair{p.loc, p.loc_c}})
      if (on) coefficients.push_back(coefficient);
    for (std::size_t j = 0; j < coefficients.size() && j < u.size(); ++j) weights += std::fabs(u[j] * coefficients[j]);
  }
  const double averaged =
      std::max<double>(1.0, static_cast<double>(b.N - std::count(analytic.begin(), analytic.end(), 1)));
  for (std::int64_t t = 0; t < b.N && weights > 0; ++t) {
    if (analytic[t]) continue;
    const std::vector<double> zt(z.begin() + t * E, z.begin() + (t + 1) * E);
    const std::vector<double> pt = distribution(sp.gate, zt);
    const auto [low, high] = std::minmax_element(zt.begin(), zt.end());
    const double spread = std::min(*high - *low, 104.0);
    for (int e = 0; e < E; ++e) rounding[t * E + e] += 1e-7 * pt[e] * weights * (1 + spread) / averaged;
  }
  int bad = 0;
  for (std::size_t i = 0; i < z.size(); ++i)
    if (!ref::close(lib.dz[i], fd[i], 2e-3, 2e-5 * scale + rounding[i] + fd_noise[i] + 1e-8) && bad++ < 5)
      problems.push_back("dz[" + std::to_string(i) + "] = " + ref::precise(lib.dz[i]) + ", finite differences " +
                         ref::precise(fd[i]));
  if (bad > 5) problems.push_back(std::to_string(bad - 5) + " more dz entries differ");
  return problems;
}

}  // namespace tref
