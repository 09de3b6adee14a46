// The small MoE layer that moe_route_ep trains, shared by the MPI driver and
// the single-process reference: sizes, deterministic data and weights, the two
// router configurations, the admission choices, the experts' forward and
// backward, and the record of one training step.
//
// Every value comes from a counter-based generator keyed by (seed, stream,
// index), so any rank can build any token or any expert's weights without
// communication, and both drivers see the same bits. Every float multiply-add
// is an explicit fma: the two drivers inline these helpers into different code,
// and the compiler must not be free to contract one call site and not another.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include <moe_route/moe_route.hpp>

#include "compare.hpp"
#include "options.hpp"

namespace ep {

namespace mr = moe_route;
using json = nlohmann::json;

// ---------------------------------------------------------------------------
// Deterministic values.

inline std::uint64_t mix(std::uint64_t x) {  // SplitMix64's step and finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

enum class stream : std::uint64_t { tokens = 1, targets = 2, router = 3, expert = 4 };

// A value in [-scale, scale) with 24 significant bits: exact in float for a
// power-of-two scale, so no rounding depends on how it is computed.
inline float draw(std::uint64_t seed, stream s, std::uint64_t index, float scale) {
  const std::uint64_t bits = mix(mix(seed ^ mix(static_cast<std::uint64_t>(s))) + index) >> 40;  // [0, 2^24)
  return (static_cast<float>(bits) - 8388608.0f) * (scale / 8388608.0f);
}

// Tokens [first, first + n) of the global batch: x_t (inputs) or c_t (the
// loss weights, L = sum_t <y_t, c_t>), row-major [n x d].
inline std::vector<float> token_rows(std::uint64_t seed, stream s, std::int64_t first, std::int64_t n) {
  std::vector<float> v(static_cast<std::size_t>(n) * hidden);
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = draw(seed, s, static_cast<std::uint64_t>(first) * hidden + i, 1.0f);
  return v;
}

inline std::vector<float> initial_router(std::uint64_t seed) {  // W [E x d]
  std::vector<float> w(experts * hidden);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = draw(seed, stream::router, i, 0.5f);
  return w;
}

inline std::vector<float> initial_expert(std::uint64_t seed, int e) {  // [expert_params]
  std::vector<float> w(expert_params);
  for (int i = 0; i < expert_params; ++i)
    w[i] = draw(seed, stream::expert, static_cast<std::uint64_t>(e) * expert_params + i, 0.25f);
  return w;
}

// ---------------------------------------------------------------------------
// Router side.

// load_balance over the global batch plus locality, softmax gating, plain top-k.
using balanced_router = mr::router<mr::gating::softmax, mr::selection::top_k, top_k, mr::penalty::load_balance,
                                   mr::penalty::locality>;
// Aux-loss-free balancing (selection bias), sigmoid gating, with a small
// complementary load_balance over the global batch as DeepSeek-V3 keeps one.
using aux_free_router = mr::router<mr::gating::sigmoid, mr::selection::expert_bias, top_k, mr::penalty::load_balance>;

inline balanced_router make_balanced() {
  balanced_router r;
  r.top_k = top_k;
  r.normalize = true;
  mr::get<mr::penalty::load_balance>(r) = {0.05f, mr::penalty::load_balance::scope::global_batch};
  mr::get<mr::penalty::locality>(r) = {0.05f, 1e-3f};
  return r;
}

inline aux_free_router make_aux_free() {
  aux_free_router r;
  r.top_k = top_k;
  r.normalize = true;
  r.selection.update_rate = 0.05f;
  mr::get<mr::penalty::load_balance>(r) = {1e-3f, mr::penalty::load_balance::scope::global_batch};
  return r;
}

template <class Router>
inline constexpr bool has_locality = Router::template has<mr::penalty::locality>;
template <class Router>
inline constexpr bool has_bias = std::is_same_v<typename Router::selection_type, mr::selection::expert_bias>;

using admission_choice =
    std::variant<mr::admission::policy<mr::admission::probability, mr::admission::drop>,
                 mr::admission::policy<mr::admission::cosine, mr::admission::drop>,
                 mr::admission::policy<mr::admission::cosine, mr::admission::reroute>, mr::admission::dropless_policy>;

inline admission_choice make_admission(const options& o) {
  namespace ad = mr::admission;
  if (o.admission == "capacity_probs") {
    auto p = ad::capacity_probs(o.capacity_factor);
    p.overflow.renormalize = o.renormalize;
    return p;
  }
  if (o.admission == "cipher_strict") {
    auto p = ad::cipher_strict(o.tau, o.capacity_factor);
    p.overflow.renormalize = o.renormalize;
    return p;
  }
  if (o.admission == "cipher_reroute") return ad::cipher_reroute(o.tau, o.capacity_factor);
  if (o.admission == "dropless") return ad::dropless();
  throw std::invalid_argument("--admission must be capacity_probs, cipher_strict, cipher_reroute or dropless");
}

// z = W x for n tokens, [n x E]; each dot in feature order.
inline std::vector<float> router_logits(const std::vector<float>& w, const std::vector<float>& x, std::int64_t n) {
  std::vector<float> z(static_cast<std::size_t>(n) * experts);
  for (std::int64_t t = 0; t < n; ++t)
    for (int e = 0; e < experts; ++e) {
      float acc = 0.0f;
      for (int j = 0; j < hidden; ++j) acc = std::fma(w[e * hidden + j], x[t * hidden + j], acc);
      z[t * experts + e] = acc;
    }
  return z;
}

// Euclidean norms of `rows` rows of width `width` (cosine affinity: ||x_t||, ||w_e||).
inline std::vector<float> row_norms(const std::vector<float>& v, std::int64_t rows, int width) {
  std::vector<float> n(rows);
  for (std::int64_t i = 0; i < rows; ++i) {
    double acc = 0.0;
    for (int j = 0; j < width; ++j) {
      const double a = v[i * width + j];
      acc = std::fma(a, a, acc);
    }
    n[i] = static_cast<float>(std::sqrt(acc));
  }
  return n;
}

// Per-expert counts of the entries of indices (-1 counts for nothing).
inline std::vector<std::int64_t> expert_counts(const std::vector<std::int32_t>& indices) {
  std::vector<std::int64_t> c(experts, 0);
  for (std::int32_t e : indices)
    if (e >= 0) ++c[e];
  return c;
}

// dL/dW += dz^T x over n tokens, [E x d], in token order.
inline void add_router_grad(const std::vector<float>& dz, const std::vector<float>& x, std::int64_t n,
                            std::vector<double>& grad) {
  for (std::int64_t t = 0; t < n; ++t)
    for (int e = 0; e < experts; ++e)
      for (int j = 0; j < hidden; ++j)
        grad[e * hidden + j] = std::fma(static_cast<double>(dz[t * experts + e]),
                                        static_cast<double>(x[t * hidden + j]), grad[e * hidden + j]);
}

// ---------------------------------------------------------------------------
// Experts: o = W2 relu(W1 x).

inline void expert_forward(const float* w, const float* x, float* out) {
  const float* w1 = w;
  const float* w2 = w + ffn * hidden;
  float a[ffn];
  for (int i = 0; i < ffn; ++i) {
    float acc = 0.0f;
    for (int j = 0; j < hidden; ++j) acc = std::fma(w1[i * hidden + j], x[j], acc);
    a[i] = acc > 0.0f ? acc : 0.0f;
  }
  for (int j = 0; j < hidden; ++j) {
    float acc = 0.0f;
    for (int i = 0; i < ffn; ++i) acc = std::fma(w2[j * ffn + i], a[i], acc);
    out[j] = acc;
  }
}

// Adds one row's weight gradient, given dL/do, to grad [expert_params] (double).
inline void expert_backward(const float* w, const float* x, const float* dout, double* grad) {
  const float* w1 = w;
  const float* w2 = w + ffn * hidden;
  double* g1 = grad;
  double* g2 = grad + ffn * hidden;
  float pre[ffn];
  for (int i = 0; i < ffn; ++i) {
    float acc = 0.0f;
    for (int j = 0; j < hidden; ++j) acc = std::fma(w1[i * hidden + j], x[j], acc);
    pre[i] = acc;
  }
  for (int j = 0; j < hidden; ++j)
    for (int i = 0; i < ffn; ++i) {
      const double a = pre[i] > 0.0f ? pre[i] : 0.0f;
      g2[j * ffn + i] = std::fma(static_cast<double>(dout[j]), a, g2[j * ffn + i]);
    }
  for (int i = 0; i < ffn; ++i) {
    if (!(pre[i] > 0.0f)) continue;
    float da = 0.0f;
    for (int j = 0; j < hidden; ++j) da = std::fma(w2[j * ffn + i], dout[j], da);
    for (int j = 0; j < hidden; ++j)
      g1[i * hidden + j] = std::fma(static_cast<double>(da), static_cast<double>(x[j]), g1[i * hidden + j]);
  }
}

// ---------------------------------------------------------------------------
// Combine and the gate gradient, per token, from the expert output of each
// slot (`rows` holds the expert-major buffer, inverse maps slot -> row).

// y_t = sum_k g_tk o_tk in slot order; dL/dg_tk = <c_t, o_tk> (0 for a dropped slot).
inline void combine(const std::vector<float>& gates, const std::vector<std::int64_t>& inverse,
                    const std::vector<float>& rows, const std::vector<float>& c, std::int64_t n, std::vector<float>& y,
                    std::vector<float>& grad_gates) {
  y.assign(static_cast<std::size_t>(n) * hidden, 0.0f);
  grad_gates.assign(static_cast<std::size_t>(n) * top_k, 0.0f);
  for (std::int64_t t = 0; t < n; ++t)
    for (int k = 0; k < top_k; ++k) {
      const std::int64_t row = inverse[t * top_k + k];
      if (row < 0) continue;
      const float g = gates[t * top_k + k];
      const float* o = rows.data() + row * hidden;
      float dot = 0.0f;
      for (int j = 0; j < hidden; ++j) {
        y[t * hidden + j] = std::fma(g, o[j], y[t * hidden + j]);
        dot = std::fma(c[t * hidden + j], o[j], dot);
      }
      grad_gates[t * top_k + k] = dot;
    }
}

// sum_t <y_t, c_t> over n tokens, in token order.
inline double task_loss(const std::vector<float>& y, const std::vector<float>& c, std::int64_t n) {
  double acc = 0.0;
  for (std::int64_t i = 0; i < n * hidden; ++i) acc = std::fma(static_cast<double>(y[i]), c[i], acc);
  return acc;
}

// dL/do of a slot's expert output: g_tk c_t.
inline void output_grad(float gate, const float* c, float* dout) {
  for (int j = 0; j < hidden; ++j) dout[j] = gate * c[j];
}

// w -= lr * grad over n weights, rounded once to float.
inline void sgd(float* w, const double* grad, std::size_t n, float learning_rate) {
  for (std::size_t i = 0; i < n; ++i)
    w[i] = static_cast<float>(std::fma(-static_cast<double>(learning_rate), grad[i], static_cast<double>(w[i])));
}

// ---------------------------------------------------------------------------
// What one training step produced, for the whole global batch (the MPI
// driver gathers it on rank 0).

struct step_record {
  std::vector<std::int32_t> indices;     // [N x K] routed
  std::vector<std::int32_t> admitted;    // [N x K] after admission, -1 = dropped
  std::vector<std::int64_t> loads;       // [E] routed assignments of the global batch (all-reduced)
  std::vector<std::int64_t> send_counts; // [R x E] each rank's dispatch counts
  std::vector<std::int64_t> rank_counts; // [R x R] rows rank r sends to rank q
  std::vector<std::int64_t> expert_rows; // [E] rows each expert computed
  std::vector<float> outputs;            // [N x d] y
  std::vector<float> grad_logits;        // [N x E] dL/dz
  std::vector<double> grad_router;       // [E x d] dL/dW_router
  std::vector<double> grad_experts;      // [E x expert_params]
  double load_balance = 0.0;             // the single-batch value
  double locality = 0.0;                 // mean over the ranks' micro-batches
  double loss = 0.0;                     // sum_t <y_t, c_t> + the penalties
  std::vector<float> expert_bias;        // [E] after this step's update (aux_free)
};

inline json to_json(const step_record& s) {
  return {{"indices", s.indices},
          {"admitted", s.admitted},
          {"loads", s.loads},
          {"send_counts", s.send_counts},
          {"rank_counts", s.rank_counts},
          {"expert_rows", s.expert_rows},
          {"outputs", s.outputs},
          {"grad_logits", s.grad_logits},
          {"grad_router", s.grad_router},
          {"grad_experts", s.grad_experts},
          {"penalties", {{"load_balance", s.load_balance}, {"locality", s.locality}}},
          {"loss", s.loss},
          {"expert_bias", s.expert_bias}};
}

inline json layer_json(const options& o, int ranks, const char* mode) {
  return {{"mode", mode},
          {"ranks", ranks},
          {"tokens_per_rank", o.tokens_per_rank},
          {"experts", experts},
          {"top_k", top_k},
          {"hidden", hidden},
          {"ffn", ffn},
          {"router", o.router},
          {"admission", o.admission},
          {"renormalize", o.renormalize},
          {"capacity_factor", o.capacity_factor},
          {"tau", o.tau},
          {"steps", o.steps},
          {"seed", o.seed},
          {"learning_rate", o.learning_rate}};
}

// The drivers: the whole run as JSON (the MPI driver returns it on rank 0 and
// null elsewhere).
json run_reference(const options& o);
json run_mpi(const options& o);

}  // namespace ep
