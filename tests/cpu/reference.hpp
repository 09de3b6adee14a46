// Independent naive references for the CPU test suite, written in double
// precision from the formulas of docs/policies.md sections 1-2 and the documented
// choices of the headers. Nothing here calls the library's code paths: only
// its public value types (router, route_inputs, bfloat16, float16, ...) are
// used, and the 16-bit conversions are re-derived from IEEE definitions.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ios>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <moe_route/moe_route.hpp>

namespace ref {

namespace mr = moe_route;

inline constexpr double flt_max = 3.4028234663852886e38;  // FLT_MAX exactly
inline double inf() { return std::numeric_limits<double>::infinity(); }
inline double nan() { return std::numeric_limits<double>::quiet_NaN(); }
inline float finf() { return std::numeric_limits<float>::infinity(); }
inline float fnan() { return std::numeric_limits<float>::quiet_NaN(); }

// An execution on `threads` threads that splits even the smallest call (one
// token per thread at least), so the tests cross block boundaries at any N.
inline mr::cpu::execution on_threads(int threads, mr::cpu::instruction_set isa = mr::cpu::instruction_set::best) {
  mr::cpu::execution ex;
  ex.threads = threads;
  ex.isa = isa;
  ex.min_tokens_per_thread = 1;
  return ex;
}

inline std::uint32_t bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// ---------------------------------------------------------------------------
// 16-bit formats, from their IEEE definitions.

// binary16: 1 sign, 5 exponent (bias 15), 10 fraction bits.
inline double fp16_value(std::uint16_t b) {
  const int e = (b >> 10) & 31;
  const int m = b & 1023;
  double mag;
  if (e == 31)
    mag = m ? nan() : inf();
  else if (e == 0)
    mag = std::ldexp(static_cast<double>(m), -24);
  else
    mag = std::ldexp(static_cast<double>(1024 + m), e - 25);
  return (b & 0x8000u) ? -mag : mag;
}

// bfloat16: the upper half of a binary32.
inline double bf16_value(std::uint16_t b) { return from_bits(static_cast<std::uint32_t>(b) << 16); }

// Round-to-nearest-even encoders by bracketing the value between neighbouring
// codes (the code just past the largest finite one stands for 2^(emax+1), so
// overflow rounds to infinity exactly as IEEE prescribes).
inline std::uint16_t fp16_bits(float f) {
  const std::uint16_t sign = std::signbit(f) ? 0x8000u : 0u;
  if (std::isnan(f)) return static_cast<std::uint16_t>(sign | 0x7e00u);
  const double a = std::fabs(static_cast<double>(f));
  static const std::vector<double> table = [] {  // magnitudes of codes 0..0x7c00, increasing
    std::vector<double> t(0x7c01);
    for (int b = 0; b < 0x7c00; ++b) t[b] = fp16_value(static_cast<std::uint16_t>(b));
    t[0x7c00] = 65536.0;
    return t;
  }();
  auto val = [&](int b) { return table[b]; };
  if (a >= 65536.0) return static_cast<std::uint16_t>(sign | 0x7c00u);
  int lo = 0, hi = 0x7c00;  // val(lo) <= a < val(hi)
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (val(mid) <= a) lo = mid; else hi = mid;
  }
  const double dl = a - val(lo), dh = val(hi) - a;
  const int r = dl < dh ? lo : (dh < dl ? hi : ((lo & 1) ? hi : lo));
  return static_cast<std::uint16_t>(sign | r);
}

inline std::uint16_t bf16_bits(float f) {
  const std::uint16_t sign = std::signbit(f) ? 0x8000u : 0u;
  if (std::isnan(f)) return static_cast<std::uint16_t>(sign | 0x7fc0u);
  if (std::isinf(f)) return static_cast<std::uint16_t>(sign | 0x7f80u);
  const double a = std::fabs(static_cast<double>(f));
  const int lo = static_cast<int>(bits(std::fabs(f)) >> 16);
  const int hi = lo + 1;
  const double vl = bf16_value(static_cast<std::uint16_t>(lo));
  const double vh = hi == 0x7f80 ? std::ldexp(1.0, 128) : bf16_value(static_cast<std::uint16_t>(hi));
  const double dl = a - vl, dh = vh - a;
  const int r = dl < dh ? lo : (dh < dl ? hi : ((lo & 1) ? hi : lo));
  return static_cast<std::uint16_t>(sign | r);
}

// Logit values as the reference sees them.
inline double value(float x) { return x; }
inline double value(mr::bfloat16 x) { return bf16_value(x.bits); }
inline double value(mr::float16 x) { return fp16_value(x.bits); }

// Test inputs of each logit type, built with the reference encoders.
template <class T>
T make(float f) {
  if constexpr (std::is_same_v<T, float>) return f;
  else if constexpr (std::is_same_v<T, mr::bfloat16>) return T{bf16_bits(f)};
  else return T{fp16_bits(f)};
}

template <class T>
std::string type_name() {
  if constexpr (std::is_same_v<T, float>) return "float";
  else if constexpr (std::is_same_v<T, mr::bfloat16>) return "bfloat16";
  else return "float16";
}

// Readable vectors in failure messages.
template <class T>
std::string show(const std::vector<T>& v) {
  std::string s = "{";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "}";
}

// ---------------------------------------------------------------------------
// Elementwise math (docs/policies.md section 1 plus the documented choices).

// NaN -> -inf (never wins, scores 0), +-inf -> +-FLT_MAX.
inline double sanitize(double z) {
  if (std::isnan(z)) return -inf();
  if (z > flt_max) return flt_max;
  if (z < -flt_max) return -flt_max;
  return z;
}
// e^x, flushed to 0 below -87 (documented: results below FLT_MIN are 0).
inline double exp_flush(double x) { return x < -87.0 ? 0.0 : std::exp(x); }
inline double sigmoid(double x) {
  if (x >= 0) return 1.0 / (1.0 + exp_flush(-x));
  const double t = exp_flush(x);
  return t / (1.0 + t);
}
inline double softplus(double x) { return std::max(x, 0.0) + std::log1p(exp_flush(-std::fabs(x))); }
inline double sqrt_softplus(double x) { return std::sqrt(softplus(x)); }

// ---------------------------------------------------------------------------
// Router description, read from the public router type and its members.

enum class gate_kind { softmax, sigmoid, sqrt_softplus, softmax_after_topk };
enum class key_kind { logit, score, biased_score, fixed };

struct spec {
  gate_kind gate = gate_kind::softmax;
  key_kind key = key_kind::logit;
  bool grouped = false;
  int groups = 1, top_groups = 1, per_group_k = 1;
  int K = 1;
  bool normalize = false;
  double scaling = 1.0;
};

template <class S>
struct group_traits {
  static constexpr bool grouped = false;
  using key = S;
};
template <class Key>
struct group_traits<mr::selection::group_limited<Key>> {
  static constexpr bool grouped = true;
  using key = Key;
};

template <class Router>
spec spec_of(const Router& r) {
  using G = typename Router::gating_type;
  using S = typename Router::selection_type;
  using Key = typename group_traits<S>::key;
  spec sp;
  if constexpr (std::is_same_v<G, mr::gating::softmax>) sp.gate = gate_kind::softmax;
  else if constexpr (std::is_same_v<G, mr::gating::sigmoid>) sp.gate = gate_kind::sigmoid;
  else if constexpr (std::is_same_v<G, mr::gating::sqrt_softplus>) sp.gate = gate_kind::sqrt_softplus;
  else sp.gate = gate_kind::softmax_after_topk;
  if constexpr (std::is_same_v<Key, mr::selection::top_k>) sp.key = key_kind::logit;
  else if constexpr (std::is_same_v<Key, mr::selection::by_score>) sp.key = key_kind::score;
  else if constexpr (std::is_same_v<Key, mr::selection::expert_bias>) sp.key = key_kind::biased_score;
  else sp.key = key_kind::fixed;
  if constexpr (group_traits<S>::grouped) {
    sp.grouped = true;
    sp.groups = r.selection.groups;
    sp.top_groups = r.selection.top_groups;
    sp.per_group_k = r.selection.per_group_k;
  }
  sp.K = r.top_k;
  sp.normalize = r.normalize;
  sp.scaling = r.scaling_factor;
  return sp;
}

// Scores of a row of sanitised logits (for softmax_after_topk: the logits).
inline std::vector<double> scores(gate_kind g, const std::vector<double>& v) {
  const std::size_t E = v.size();
  std::vector<double> s(E);
  switch (g) {
    case gate_kind::softmax: {
      double m = -flt_max;  // a row of NaN (all -inf) keeps a finite maximum
      for (double x : v) m = std::max(m, x);
      double sum = 0;
      for (std::size_t e = 0; e < E; ++e) sum += (s[e] = exp_flush(v[e] - m));
      for (std::size_t e = 0; e < E; ++e) s[e] = sum > 0 ? s[e] / sum : 0.0;
      break;
    }
    case gate_kind::sigmoid:
      for (std::size_t e = 0; e < E; ++e) s[e] = sigmoid(v[e]);
      break;
    case gate_kind::sqrt_softplus:
      for (std::size_t e = 0; e < E; ++e) s[e] = sqrt_softplus(v[e]);
      break;
    case gate_kind::softmax_after_topk:
      s = v;
      break;
  }
  return s;
}

// Gate weights for given selected experts (section 1, "Gate weights after top-k").
inline std::vector<double> gates(const spec& sp, const std::vector<double>& v, const std::vector<double>& s,
                                 const int* idx) {
  std::vector<double> w(sp.K);
  if (sp.gate == gate_kind::softmax_after_topk) {
    double m = -flt_max;
    for (int j = 0; j < sp.K; ++j) m = std::max(m, v[idx[j]]);
    double sum = 0;
    for (int j = 0; j < sp.K; ++j) sum += (w[j] = exp_flush(v[idx[j]] - m));
    for (int j = 0; j < sp.K; ++j) w[j] = (sum > 0 ? w[j] / sum : 0.0) * sp.scaling;
    return w;
  }
  double sum = 0;
  for (int j = 0; j < sp.K; ++j) sum += (w[j] = s[idx[j]]);
  for (int j = 0; j < sp.K; ++j) {
    if (sp.normalize) w[j] /= (sum + 1e-20);
    w[j] *= sp.scaling;
  }
  return w;
}

// The selection of one row: experts in rank order and the key of each expert.
struct selection_result {
  std::vector<int> order;     // the reference's selected experts, best first (K of them)
  std::vector<double> key;    // key of every expert (-inf for NaN logits)
  std::vector<int> ranked;    // every candidate expert in rank order (masked experts excluded)
  bool group_ambiguous = false;  // the kept groups are decided by less than float rounding
};

// Best key first, ties to the lower index; a NaN key (only a group score can
// be one: +inf and -inf keys summed) ranks below every number, -inf included.
inline std::vector<int> rank_by_key(const std::vector<double>& key, const std::vector<int>& candidates) {
  std::vector<int> order = candidates;
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    const bool nan_a = std::isnan(key[a]), nan_b = std::isnan(key[b]);
    if (nan_a != nan_b) return nan_b;
    if (!nan_a && key[a] != key[b]) return key[a] > key[b];
    return a < b;
  });
  return order;
}

// Group scores: the sum of the per_group_k best keys of each group, in fp32
// from 0 in descending key order as section 2.4 specifies, so two keys near
// -FLT_MAX overflow to -inf as they do in the library (a double sum would keep
// such a group above one holding a NaN logit).
inline std::vector<double> group_scores(const spec& sp, const std::vector<double>& key) {
  const int E = static_cast<int>(key.size());
  const int size = E / sp.groups;
  std::vector<double> score(sp.groups);
  for (int g = 0; g < sp.groups; ++g) {
    std::vector<double> k(key.begin() + g * size, key.begin() + (g + 1) * size);
    std::sort(k.begin(), k.end(), std::greater<double>());
    float sum = 0;
    for (int j = 0; j < sp.per_group_k; ++j) sum += static_cast<float>(k[j]);
    score[g] = sum;
  }
  return score;
}

inline selection_result select(const spec& sp, const std::vector<double>& v, const std::vector<double>& s,
                               const float* bias, std::int64_t token, double group_tol = 4e-6) {
  const int E = static_cast<int>(v.size());
  selection_result r;
  if (sp.key == key_kind::fixed) {
    for (int j = 0; j < sp.K; ++j) r.order.push_back(static_cast<int>((token * sp.K + j) % E));
    r.ranked = r.order;
    return r;
  }
  r.key.resize(E);
  for (int e = 0; e < E; ++e) {
    if (v[e] == -inf()) r.key[e] = -inf();  // NaN logit: below every number
    else if (sp.key == key_kind::logit) r.key[e] = v[e];
    else r.key[e] = sp.key == key_kind::score ? s[e] : s[e] + static_cast<double>(bias[e]);
  }
  std::vector<int> candidates;
  if (sp.grouped) {
    const int size = E / sp.groups;
    const std::vector<double> gs = group_scores(sp, r.key);
    std::vector<int> gi(sp.groups);
    std::iota(gi.begin(), gi.end(), 0);
    const std::vector<int> gorder = rank_by_key(gs, gi);
    if (sp.top_groups < sp.groups) {
      const double a = gs[gorder[sp.top_groups - 1]], b = gs[gorder[sp.top_groups]];
      if (a != b && std::isfinite(a) && std::isfinite(b) && a - b <= group_tol * (1.0 + std::fabs(a)))
        r.group_ambiguous = true;
    }
    for (int j = 0; j < sp.top_groups; ++j)
      for (int e = gorder[j] * size; e < (gorder[j] + 1) * size; ++e) candidates.push_back(e);
  } else {
    candidates.resize(E);
    std::iota(candidates.begin(), candidates.end(), 0);
  }
  r.ranked = rank_by_key(r.key, candidates);
  r.order.assign(r.ranked.begin(), r.ranked.begin() + sp.K);
  return r;
}

// Brute force for group-limited selection: among all sets of top_groups groups,
// the kept one has the largest total group score, ties to the lexicographically
// smallest group list (equivalent to "best groups, ties to the lower index" when
// scores are distinct or tied only at equal values). Then top-K of its union.
inline std::vector<int> select_group_bruteforce(const spec& sp, const std::vector<double>& key) {
  const int E = static_cast<int>(key.size());
  const int size = E / sp.groups;
  const std::vector<double> gs = group_scores(sp, key);
  double best_total = -inf();
  unsigned best_mask = 0;
  bool have = false;
  for (unsigned mask = 0; mask < (1u << sp.groups); ++mask) {
    if (__builtin_popcount(mask) != sp.top_groups) continue;
    double total = 0;
    for (int g = 0; g < sp.groups; ++g)
      if (mask & (1u << g)) total += gs[g];
    // lexicographically smaller group list == lower bits preferred: compare the
    // sorted group lists of the two masks
    auto lex_less = [&](unsigned a, unsigned b) {
      for (int g = 0; g < sp.groups; ++g) {
        const bool ia = a & (1u << g), ib = b & (1u << g);
        if (ia != ib) return ia;  // a contains the smaller group first
      }
      return false;
    };
    if (!have || total > best_total || (total == best_total && lex_less(mask, best_mask))) {
      best_total = total;
      best_mask = mask;
      have = true;
    }
  }
  std::vector<int> candidates;
  for (int e = 0; e < E; ++e)
    if (best_mask & (1u << (e / size))) candidates.push_back(e);
  std::vector<int> order = rank_by_key(key, candidates);
  order.resize(sp.K);
  return order;
}

// ---------------------------------------------------------------------------
// Gradients (double precision).

// Gate weights as a function of the (unsanitised, finite) logits with the
// selection held fixed.
inline std::vector<double> gates_of_logits(const spec& sp, const std::vector<double>& z, const int* idx) {
  std::vector<double> v(z.size());
  for (std::size_t e = 0; e < z.size(); ++e) v[e] = sanitize(z[e]);
  return gates(sp, v, scores(sp.gate, v), idx);
}

// dL/dz of L = sum_k c_k w_k(z) by central differences.
inline std::vector<double> fd_gradient(const spec& sp, const std::vector<double>& z, const int* idx,
                                       const std::vector<double>& c) {
  std::vector<double> g(z.size());
  std::vector<double> zp = z;
  for (std::size_t e = 0; e < z.size(); ++e) {
    const double h = 1e-6 * std::max(1.0, std::fabs(z[e]));
    zp[e] = z[e] + h;
    const std::vector<double> wp = gates_of_logits(sp, zp, idx);
    zp[e] = z[e] - h;
    const std::vector<double> wm = gates_of_logits(sp, zp, idx);
    zp[e] = z[e];
    double d = 0;
    for (int k = 0; k < sp.K; ++k) d += c[k] * (wp[k] - wm[k]);
    g[e] = d / (2 * h);
  }
  return g;
}

// The analytic VJP of docs/policies.md section 1 (softmax: s*(ds - <ds,s>);
// sigmoid: ds*s(1-s); sqrt_softplus: ds*sigma(z)/(2s); softmax_after_topk: the
// softmax VJP restricted to the selected), composed with the VJP of the gate
// normalisation and scaling. NaN logits (v = -inf) get 0.
inline std::vector<double> vjp(const spec& sp, const std::vector<double>& z_raw, const int* idx,
                               const std::vector<double>& dw) {
  const int E = static_cast<int>(z_raw.size());
  const int K = sp.K;
  std::vector<double> v(E);
  for (int e = 0; e < E; ++e) v[e] = sanitize(z_raw[e]);
  const std::vector<double> s = scores(sp.gate, v);
  std::vector<double> dz(E, 0.0);
  std::vector<double> g(K);
  for (int j = 0; j < K; ++j) g[j] = sp.scaling * dw[j];
  if (sp.gate == gate_kind::softmax_after_topk) {
    double m = -flt_max;
    for (int j = 0; j < K; ++j) m = std::max(m, v[idx[j]]);
    std::vector<double> q(K);
    double sum = 0;
    for (int j = 0; j < K; ++j) sum += (q[j] = exp_flush(v[idx[j]] - m));
    double dot = 0;
    for (int j = 0; j < K; ++j) {
      q[j] = sum > 0 ? q[j] / sum : 0.0;
      dot += q[j] * g[j];
    }
    for (int j = 0; j < K; ++j) dz[idx[j]] = q[j] * (g[j] - dot);
    return dz;
  }
  // d/d(selected scores)
  std::vector<double> dsel(K);
  if (sp.normalize) {
    double S = 1e-20;
    for (int j = 0; j < K; ++j) S += s[idx[j]];
    double dot = 0;
    for (int j = 0; j < K; ++j) dot += g[j] * s[idx[j]] / S;
    for (int j = 0; j < K; ++j) dsel[j] = (g[j] - dot) / S;
  } else {
    dsel = g;
  }
  std::vector<double> ds(E, 0.0);
  for (int j = 0; j < K; ++j) ds[idx[j]] += dsel[j];
  if (sp.gate == gate_kind::softmax) {
    double dot = 0;
    for (int e = 0; e < E; ++e) dot += ds[e] * s[e];
    for (int e = 0; e < E; ++e) dz[e] = s[e] * (ds[e] - dot);
  } else if (sp.gate == gate_kind::sigmoid) {
    for (int e = 0; e < E; ++e) dz[e] = ds[e] == 0 ? 0.0 : ds[e] * s[e] * (1 - s[e]);
  } else {
    for (int e = 0; e < E; ++e)
      dz[e] = (ds[e] == 0 || s[e] == 0) ? 0.0 : ds[e] * sigmoid(v[e]) / (2 * s[e]);
  }
  return dz;
}

// The same VJP evaluated with absolute values and every difference turned into
// a sum: the magnitude of the terms each dz_e is computed from. A float
// implementation's rounding error in dz_e is a small multiple of eps times this
// bound (the usual |A||x| error bound), even where dz_e itself cancels to ~0.
inline std::vector<double> vjp_bound(const spec& sp, const std::vector<double>& z_raw, const int* idx,
                                     const std::vector<double>& dw) {
  const int E = static_cast<int>(z_raw.size());
  const int K = sp.K;
  std::vector<double> v(E);
  for (int e = 0; e < E; ++e) v[e] = sanitize(z_raw[e]);
  const std::vector<double> s = scores(sp.gate, v);
  std::vector<double> b(E, 0.0);
  std::vector<double> g(K);
  for (int j = 0; j < K; ++j) g[j] = std::fabs(sp.scaling * dw[j]);
  if (sp.gate == gate_kind::softmax_after_topk) {
    double m = -flt_max;
    for (int j = 0; j < K; ++j) m = std::max(m, v[idx[j]]);
    std::vector<double> q(K);
    double sum = 0;
    for (int j = 0; j < K; ++j) sum += (q[j] = exp_flush(v[idx[j]] - m));
    double dot = 0;
    for (int j = 0; j < K; ++j) {
      q[j] = sum > 0 ? q[j] / sum : 0.0;
      dot += q[j] * g[j];
    }
    for (int j = 0; j < K; ++j) b[idx[j]] = q[j] * (g[j] + dot);
    return b;
  }
  std::vector<double> dsel(K);
  if (sp.normalize) {
    double S = 1e-20;
    for (int j = 0; j < K; ++j) S += s[idx[j]];
    double dot = 0;
    for (int j = 0; j < K; ++j) dot += g[j] * s[idx[j]] / S;
    for (int j = 0; j < K; ++j) dsel[j] = (g[j] + dot) / S;
  } else {
    dsel = g;
  }
  std::vector<double> ds(E, 0.0);
  for (int j = 0; j < K; ++j) ds[idx[j]] += dsel[j];
  if (sp.gate == gate_kind::softmax) {
    double dot = 0;
    for (int e = 0; e < E; ++e) dot += ds[e] * s[e];
    for (int e = 0; e < E; ++e) b[e] = s[e] * (ds[e] + dot);
  } else if (sp.gate == gate_kind::sigmoid) {
    for (int e = 0; e < E; ++e) b[e] = ds[e] * s[e] * (1 + s[e]);  // 1 - s cancels as s -> 1
  } else {
    for (int e = 0; e < E; ++e) b[e] = (ds[e] == 0 || s[e] == 0) ? 0.0 : ds[e] * sigmoid(v[e]) / (2 * s[e]);
  }
  return b;
}

// ---------------------------------------------------------------------------
// Random inputs.

struct rng {
  std::mt19937_64 gen;
  explicit rng(std::uint64_t seed) : gen(seed) {}
  double normal(double sigma = 1.0) { return std::normal_distribution<double>(0.0, sigma)(gen); }
  double uniform(double a, double b) { return std::uniform_real_distribution<double>(a, b)(gen); }
  int integer(int a, int b) { return std::uniform_int_distribution<int>(a, b)(gen); }
};

template <class T>
std::vector<T> random_logits(rng& g, std::int64_t N, int E, double sigma = 2.0) {
  std::vector<T> z(static_cast<std::size_t>(N * E));
  for (auto& x : z) x = make<T>(static_cast<float>(g.normal(sigma)));
  return z;
}

// Logits of each row a random permutation of well-separated values plus a small
// jitter: no near-ties, so a selection cannot flip under small perturbations.
template <class T>
std::vector<T> separated_logits(rng& g, std::int64_t N, int E, double spacing, double center = 0.0) {
  std::vector<T> z(static_cast<std::size_t>(N * E));
  std::vector<int> perm(E);
  for (std::int64_t t = 0; t < N; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), g.gen);
    for (int e = 0; e < E; ++e) {
      const double x = center + spacing * (perm[e] - 0.5 * (E - 1)) + g.uniform(-0.1, 0.1) * spacing;
      z[static_cast<std::size_t>(t * E + e)] = make<T>(static_cast<float>(x));
    }
  }
  return z;
}

inline std::vector<float> random_bias(rng& g, int E, double sigma = 0.05) {
  std::vector<float> b(E);
  for (auto& x : b) x = static_cast<float>(g.normal(sigma));
  return b;
}

// ---------------------------------------------------------------------------
// Running the library.

struct lib_result {
  std::vector<std::int32_t> idx;
  std::vector<float> gates;
  std::int64_t report = -1;   // route_report::nonfinite_rows
  std::int64_t counter = 0;   // route_outputs::nonfinite_rows
};

template <class Router, class T>
lib_result run(const Router& r, const std::vector<T>& z, std::int64_t N, int E, const float* bias = nullptr,
               int threads = 1, mr::cpu::instruction_set isa = mr::cpu::instruction_set::best) {
  lib_result o;
  o.idx.assign(static_cast<std::size_t>(N * r.top_k), -7);
  o.gates.assign(static_cast<std::size_t>(N * r.top_k), -7.0f);
  mr::route_inputs<T> in;
  in.logits = z.data();
  in.num_tokens = N;
  in.num_experts = E;
  in.expert_bias = bias;
  mr::route_outputs out;
  out.indices = o.idx.data();
  out.gates = o.gates.data();
  out.nonfinite_rows = &o.counter;
  o.report = mr::cpu::route(r, in, out, ref::on_threads(threads, isa)).nonfinite_rows;
  return o;
}

template <class Router, class T>
std::vector<float> run_backward(const Router& r, const std::vector<T>& z, std::int64_t N, int E, const float* bias,
                                const std::vector<std::int32_t>& idx, const std::vector<float>& dw, int threads = 1) {
  std::vector<float> dz(static_cast<std::size_t>(N * E), ref::fnan());  // must be overwritten
  mr::route_inputs<T> in;
  in.logits = z.data();
  in.num_tokens = N;
  in.num_experts = E;
  in.expert_bias = bias;
  mr::backward_args args;
  args.indices = idx.data();
  args.grad_gates = dw.data();
  args.grad_logits = dz.data();
  mr::cpu::backward(r, in, args, ref::on_threads(threads));
  return dz;
}

inline bool close(double lib, double expect, double rtol, double atol) {
  if (std::isnan(expect)) return std::isnan(lib);
  if (std::isinf(expect)) return lib == expect;
  return std::fabs(lib - expect) <= rtol * std::fabs(expect) + atol;
}

// A number with the digits that tell two floats apart.
inline std::string precise(double x) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.9g", x);
  return buffer;
}

inline std::string row_string(const std::vector<double>& x, std::size_t max_items = 12) {
  std::string s = "[";
  for (std::size_t i = 0; i < x.size() && i < max_items; ++i) s += (i ? ", " : "") + precise(x[i]);
  if (x.size() > max_items) s += ", ...";
  return s + "]";
}

struct check_stats {
  std::int64_t rows = 0;
  std::int64_t ambiguous_rows = 0;       // kept groups decided within float rounding: selection not compared
  std::int64_t ambiguous_positions = 0;  // slots whose reference keys are within key_tol of a neighbour
  std::int64_t failures = 0;
  std::int64_t nonfinite_rows = 0;       // reference count of rows with NaN or +-inf
};

// The relative error fp32 softmax gates carry from rounding v_e - m (m the
// row's, or for softmax_after_topk the selection's, largest logit): up to
// 2^-24 |v_e - m| in exp(v_e - m), in the numerator and, weighted, in the
// sum. Terms more than 104 below m flush to 0 and bring none. Small for
// ordinary logits; 4e-6 at a spread of 70, which fuzzed rows reach.
inline std::vector<double> softmax_rounding(const spec& sp, const std::vector<double>& v, const int* idx) {
  std::vector<double> r(sp.K, 0.0);
  if (sp.gate != gate_kind::softmax && sp.gate != gate_kind::softmax_after_topk) return r;
  std::vector<double> normalising;
  if (sp.gate == gate_kind::softmax) normalising = v;
  else for (int j = 0; j < sp.K; ++j) normalising.push_back(v[idx[j]]);
  double m = -flt_max, spread = 0;
  for (double x : normalising) m = std::max(m, x);
  for (double x : normalising)
    if (m - x < 104) spread = std::max(spread, m - x);
  for (int j = 0; j < sp.K; ++j) r[j] = 0x1p-23 * (std::min(m - v[idx[j]], 104.0) + spread);
  return r;
}

// One row of a library forward against the reference (no test framework, so
// the fuzz targets share it):
//  - indices: exactly the reference's, except that for keys computed in float
//    (key_tol > 0: s + b, or any key under group_limited) a slot may hold a
//    different expert whose reference key is within key_tol of the reference's;
//  - gates: the reference gates of the library's indices within gate_rtol
//    (a negative gate_rtol checks the selection only).
struct row_check {
  std::string problem;           // empty: the row agrees
  std::vector<int> expected;     // the reference's experts
  std::vector<double> logits;    // the sanitised row, for messages
  bool nonfinite = false;        // the row holds NaN or +-inf
  bool group_ambiguous = false;  // kept groups decided within float rounding: selection not compared
  int ambiguous_positions = 0;
};

template <class T>
row_check check_row(const spec& sp, const T* z, int E, const float* bias, std::int64_t t, const std::int32_t* li,
                    const float* lg, double gate_rtol, double key_tol) {
  const int K = sp.K;
  row_check c;
  c.logits.resize(E);
  for (int e = 0; e < E; ++e) {
    const double x = value(z[e]);
    c.nonfinite |= !std::isfinite(x);
    c.logits[e] = sanitize(x);
  }
  const std::vector<double>& v = c.logits;
  const std::vector<double> s = scores(sp.gate, v);
  const selection_result sel = select(sp, v, s, bias, t);
  c.expected = sel.order;
  c.group_ambiguous = sel.group_ambiguous;
  const std::vector<int> idx(li, li + K);
  std::vector<char> seen(E, 0);
  for (int j = 0; j < K && c.problem.empty(); ++j) {
    if (idx[j] < 0 || idx[j] >= E) c.problem = "index out of range at slot " + std::to_string(j);
    else if (seen[idx[j]]++) c.problem = "duplicate expert at slot " + std::to_string(j);
  }
  if (c.problem.empty() && !sel.group_ambiguous) {
    for (int j = 0; j < K; ++j) {
      if (idx[j] == sel.order[j]) continue;
      const double a = sel.key.empty() ? 0 : sel.key[idx[j]], b = sel.key.empty() ? 0 : sel.key[sel.order[j]];
      if (key_tol > 0 && std::isfinite(a) && std::isfinite(b) && std::fabs(a - b) <= key_tol * (1.0 + std::fabs(b))) {
        ++c.ambiguous_positions;
        continue;
      }
      c.problem = "slot " + std::to_string(j) + ": library expert " + std::to_string(idx[j]) + ", reference " +
                  std::to_string(sel.order[j]);
      break;
    }
  }
  if (c.problem.empty() && gate_rtol >= 0) {
    const std::vector<double> w = gates(sp, v, s, idx.data());
    const std::vector<double> rounding = softmax_rounding(sp, v, idx.data());
    for (int j = 0; j < K; ++j)
      if (!close(lg[j], w[j], gate_rtol + rounding[j], 1e-37)) {
        c.problem = "gate slot " + std::to_string(j) + ": library " + precise(lg[j]) + " reference " + precise(w[j]) +
                    " (rel err " + precise(std::fabs(lg[j] - w[j]) / std::fabs(w[j])) + ")";
        break;
      }
  }
  return c;
}

// The default key tolerance of a spec: keys computed in float may tie within rounding.
inline double default_key_tol(const spec& sp) {
  return sp.key == key_kind::biased_score || sp.key == key_kind::score ? 4e-6 : 0.0;
}

// Compares a library forward with the reference, row by row (check_row).
template <class Router, class T>
check_stats check_route(const Router& r, const std::vector<T>& z, std::int64_t N, int E, const float* bias,
                        const lib_result& lib, double gate_rtol = 2e-6, double key_tol = -1.0) {
  const spec sp = spec_of(r);
  if (key_tol < 0) key_tol = default_key_tol(sp);
  check_stats st;
  const int K = sp.K;
  for (std::int64_t t = 0; t < N; ++t) {
    ++st.rows;
    const std::int32_t* li = lib.idx.data() + t * K;
    const row_check c = check_row(sp, z.data() + t * E, E, bias, t, li, lib.gates.data() + t * K, gate_rtol, key_tol);
    st.nonfinite_rows += c.nonfinite;
    st.ambiguous_rows += c.group_ambiguous;
    st.ambiguous_positions += c.ambiguous_positions;
    if (!c.problem.empty()) {
      if (st.failures < 5) {
        std::string lib_idx, ref_idx;
        for (int j = 0; j < K; ++j) {
          lib_idx += std::to_string(li[j]) + " ";
          ref_idx += std::to_string(c.expected[j]) + " ";
        }
        FAIL_CHECK("row " << t << " (E=" << E << ", K=" << K << ", " << type_name<T>() << "): " << c.problem
                          << "\n  library indices: " << lib_idx << "\n  reference:       " << ref_idx
                          << "\n  logits: " << row_string(c.logits));
      }
      ++st.failures;
    }
  }
  CHECK(st.failures == 0);
  CHECK(lib.report == st.nonfinite_rows);
  CHECK(lib.counter == st.nonfinite_rows);
  return st;
}

// Runs the library and checks it against the reference in one step.
template <class Router, class T>
check_stats route_and_check(const Router& r, const std::vector<T>& z, std::int64_t N, int E,
                            const float* bias = nullptr, double gate_rtol = 2e-6, double key_tol = -1.0) {
  const lib_result lib = run(r, z, N, E, bias);
  return check_route(r, z, N, E, bias, lib, gate_rtol, key_tol);
}

// Calls f(gating{}) for every gating policy.
template <class F>
void for_each_gating(F&& f) {
  f(mr::gating::softmax{});
  f(mr::gating::sigmoid{});
  f(mr::gating::sqrt_softplus{});
  f(mr::gating::softmax_after_topk{});
}

template <class G>
inline constexpr bool scores_before_selection = !std::is_same_v<G, mr::gating::softmax_after_topk>;

}  // namespace ref

// CHECK(a == b) for vectors, printing both on failure.
#define MOE_CHECK_VEC(a, b)                                                                   \
  do {                                                                                        \
    const auto moe_check_a_ = (a);                                                            \
    const auto moe_check_b_ = (b);                                                            \
    CHECK_MESSAGE(moe_check_a_ == moe_check_b_,                                               \
                  "actual " << ref::show(moe_check_a_) << ", expected " << ref::show(moe_check_b_)); \
  } while (0)
