// moe_route: the capacity bounds of CIPHER-MoE (Theorem 1 and App. A.4;
// docs/policies.md section 7). Host functions in double precision. Equation
// numbers refer to papers/001 (CIPHER). Every function checks its parameter
// ranges and throws moe_route::error naming the parameter instead of
// returning NaN. (std::log / std::exp are not constexpr in C++17, so only the
// purely arithmetic bound, eq. 37, is constexpr.)
//
// Parameters, as in the paper:
//   eps    target failure probability of signal retention, 0 < eps < 1 (eq. 6)
//   eta    candidate/threshold recall failure, 0 <= eta < eps (A2, eq. 14)
//   mu     bound on the expected number of competitors ranked ahead of the
//          witness, mu >= 0 (A3, eq. 15)
//   N_e    candidate pool size of expert e, N_e >= 1
//   d      (effective spherical) representation dimension, d >= 2
//   delta  certified signal margin, 0 < delta < 1 (eq. 12)
//   beta   exposure factor, beta >= 1 (eq. 12); E the number of experts >= 1
//   a0     signal availability, 0 < a0 < 1 (eq. 11)
//   pi_e   discriminative-token probability, 0 < pi_e < 1 (eq. 11)
//   kappa  desired capacity reduction factor, kappa > 1
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include <moe_route/types.hpp>

namespace moe_route::analysis::capacity_bounds {

namespace detail {

[[noreturn]] inline void invalid(const char* function, const char* parameter, double value, const char* range) {
  throw error(std::string("moe_route: capacity_bounds::") + function + ": " + parameter + " (= " +
              std::to_string(value) + ") must be " + range);
}

inline void check_eps_eta(const char* f, double eps, double eta) {
  if (!(eps > 0.0 && eps < 1.0)) invalid(f, "eps", eps, "in (0, 1)");
  if (!(eta >= 0.0 && eta < eps)) invalid(f, "eta", eta, "in [0, eps)");
}
inline void check_dimension(const char* f, double d) {
  if (!(d >= 2.0) || !std::isfinite(d)) invalid(f, "d", d, "finite and >= 2");
}
inline void check_open_unit(const char* f, const char* name, double x) {
  if (!(x > 0.0 && x < 1.0)) invalid(f, name, x, "in (0, 1)");
}
inline void check_pool(const char* f, std::int64_t n) {
  if (n < 1) invalid(f, "N_e", static_cast<double>(n), ">= 1");
}
inline void check_beta_experts(const char* f, double beta, double experts) {
  if (!(beta >= 1.0) || !std::isfinite(beta)) invalid(f, "beta", beta, "finite and >= 1");
  if (!(experts >= 1.0) || !std::isfinite(experts)) invalid(f, "E", experts, "finite and >= 1");
}

// ceil of a finite, non-negative double as an integer (saturating).
inline std::int64_t ceil_count(double x) {
  const double c = std::ceil(x);
  if (c >= 9.0e18) return std::numeric_limits<std::int64_t>::max();
  return c <= 0.0 ? 0 : static_cast<std::int64_t>(c);
}

}  // namespace detail

// ell = log(1 / (eps - eta))  (eq. 7). Requires 0 <= eta < eps < 1.
inline double ell(double eps, double eta) {
  detail::check_eps_eta("ell", eps, eta);
  return -std::log(eps - eta);
}

// G(d, delta) = -((d - 1) / 2) log(1 - delta^2)  (eq. 7); e^{-G} bounds the
// spherical cap probability p_delta(d) (eq. 17). Requires d >= 2, 0 < delta < 1.
inline double geometric_exponent(double d, double delta) {
  detail::check_dimension("geometric_exponent", d);
  detail::check_open_unit("geometric_exponent", "delta", delta);
  return -0.5 * (d - 1.0) * std::log1p(-delta * delta);
}

// The sufficient CIPHER budget (eq. 7):
//   B_e = min(N_e, ceil(1 + mu + ell/3 + sqrt(2 mu ell + ell^2 / 9))),
// so C*_CIPHER <= B_e (eq. 8). Example: mu = 1, eps = 0.1, eta = 0.01 gives 6
// when N_e >= 6 (the paper's illustrative regime).
inline std::int64_t cipher_budget(std::int64_t N_e, double mu, double eps, double eta) {
  detail::check_pool("cipher_budget", N_e);
  if (!(mu >= 0.0) || !std::isfinite(mu)) detail::invalid("cipher_budget", "mu", mu, "finite and >= 0");
  const double l = ell(eps, eta);
  const std::int64_t b = detail::ceil_count(1.0 + mu + l / 3.0 + std::sqrt(2.0 * mu * l + l * l / 9.0));
  return b < N_e ? b : N_e;
}

// The natural-order lower bound (eq. 8 / eq. 20):
//   C*_natural >= (1 - eps) a0 e^{G(d, delta)} / (beta E).
inline double natural_order_lower_bound(double eps, double a0, double beta, double E, double d, double delta) {
  detail::check_open_unit("natural_order_lower_bound", "eps", eps);
  detail::check_open_unit("natural_order_lower_bound", "a0", a0);
  detail::check_beta_experts("natural_order_lower_bound", beta, E);
  return (1.0 - eps) * a0 * std::exp(geometric_exponent(d, delta)) / (beta * E);
}

// The exact natural-order capacity for pool size N_e and discriminative
// probability pi_e (eq. 19), from P_natural(C | A_e) = (1 - (1-pi)^C) / (1 - (1-pi)^N_e) >= 1 - eps:
//   C*_natural = ceil( log(1 - (1 - eps)(1 - (1 - pi_e)^N_e)) / log(1 - pi_e) ).
inline std::int64_t natural_order_capacity(double pi_e, std::int64_t N_e, double eps) {
  detail::check_open_unit("natural_order_capacity", "pi_e", pi_e);
  detail::check_pool("natural_order_capacity", N_e);
  detail::check_open_unit("natural_order_capacity", "eps", eps);
  const double log_q = std::log1p(-pi_e);                                          // log(1 - pi) < 0
  const double avail = -std::expm1(static_cast<double>(N_e) * log_q);              // 1 - (1 - pi)^N_e
  const double c = std::log1p(-(1.0 - eps) * avail) / log_q;
  // Guard the ceiling against a last-ulp overshoot at an exact integer.
  const double r = std::round(c);
  const std::int64_t v = std::abs(c - r) <= 1e-9 * std::max(1.0, std::abs(c)) ? detail::ceil_count(r) : detail::ceil_count(c);
  return v < 1 ? 1 : (v > N_e ? N_e : v);
}

// The dimension condition for a factor-kappa capacity reduction (eq. 16):
//   d >= 1 + 2 log(kappa beta E B_e / ((1 - eps) a0)) / (-log(1 - delta^2)).
// Returns the right-hand side (a real number); min_dimension returns the
// smallest integer d satisfying it (Table 7: E = 256, beta = 1, eps = 0.1,
// a0 = 0.9, B_e = 6, kappa = 2, delta = 0.05 gives 6586).
inline double dimension_condition(double kappa, double beta, double E, double B_e, double eps, double a0,
                                  double delta) {
  if (!(kappa > 1.0) || !std::isfinite(kappa)) detail::invalid("dimension_condition", "kappa", kappa, "finite and > 1");
  detail::check_beta_experts("dimension_condition", beta, E);
  if (!(B_e >= 1.0) || !std::isfinite(B_e)) detail::invalid("dimension_condition", "B_e", B_e, "finite and >= 1");
  detail::check_open_unit("dimension_condition", "eps", eps);
  detail::check_open_unit("dimension_condition", "a0", a0);
  detail::check_open_unit("dimension_condition", "delta", delta);
  return 1.0 + 2.0 * std::log(kappa * beta * E * B_e / ((1.0 - eps) * a0)) / -std::log1p(-delta * delta);
}

inline std::int64_t min_dimension(double kappa, double beta, double E, double B_e, double eps, double a0,
                                  double delta) {
  const double d = dimension_condition(kappa, beta, E, B_e, eps, a0, delta);
  const std::int64_t v = detail::ceil_count(d);
  return v < 2 ? 2 : v;
}

// Availability (eq. 26): the pool must satisfy N_e >= log(1 - a0) / log(1 - pi_e).
// Returns the right-hand side; min_available_pool the smallest integer N_e.
inline double availability_bound(double a0, double pi_e) {
  detail::check_open_unit("availability_bound", "a0", a0);
  detail::check_open_unit("availability_bound", "pi_e", pi_e);
  return std::log1p(-a0) / std::log1p(-pi_e);
}

inline std::int64_t min_available_pool(double a0, double pi_e) {
  const std::int64_t v = detail::ceil_count(availability_bound(a0, pi_e));
  return v < 1 ? 1 : v;
}

// The binomial-quantile ranking budget (eq. 29), for independent Bernoulli(q)
// blockers among the N_e - 1 competitors and ranking-failure allowance alpha
// (alpha = eps - eta with candidate recall):
//   C*_rank(alpha) = 1 + min{ k in {0..N_e-1} : P(Bin(N_e - 1, q) <= k) >= 1 - alpha }.
// Requires N_e >= 1, 0 <= q <= 1, 0 < alpha < 1. The CDF is summed in double
// from log-space terms (lgamma).
inline std::int64_t binomial_quantile_budget(std::int64_t N_e, double q, double alpha) {
  detail::check_pool("binomial_quantile_budget", N_e);
  if (!(q >= 0.0 && q <= 1.0)) detail::invalid("binomial_quantile_budget", "q", q, "in [0, 1]");
  detail::check_open_unit("binomial_quantile_budget", "alpha", alpha);
  const std::int64_t n = N_e - 1;
  if (n == 0 || q == 0.0) return 1;
  if (q == 1.0) return N_e;  // every competitor blocks: P(Bin <= k) = 0 for k < n
  const double target = 1.0 - alpha;
  const double lq = std::log(q), l1q = std::log1p(-q);
  const double lgn = std::lgamma(static_cast<double>(n) + 1.0);
  double cdf = 0.0;
  for (std::int64_t k = 0; k <= n; ++k) {
    const double kd = static_cast<double>(k);
    cdf += std::exp(lgn - std::lgamma(kd + 1.0) - std::lgamma(static_cast<double>(n - k) + 1.0) + kd * lq +
                    static_cast<double>(n - k) * l1q);
    if (cdf >= target) return 1 + k;
  }
  return N_e;  // rounding left the CDF just below 1 - alpha: all n blockers, rank N_e
}

// The simple sufficient budget (eq. 30):
//   C~ = min(N_e, ceil(max(2 N_e q, (16/3) log(1/alpha)))).
inline std::int64_t simple_budget(std::int64_t N_e, double q, double alpha) {
  detail::check_pool("simple_budget", N_e);
  if (!(q >= 0.0 && q <= 1.0)) detail::invalid("simple_budget", "q", q, "in [0, 1]");
  detail::check_open_unit("simple_budget", "alpha", alpha);
  const double a = 2.0 * static_cast<double>(N_e) * q;
  const double b = (16.0 / 3.0) * -std::log(alpha);
  const std::int64_t c = detail::ceil_count(a > b ? a : b);
  return c < N_e ? c : N_e;
}

// The drift tolerance (eq. 34): with L_kappa = log(kappa beta E B_e / ((1 - eps) a0)),
//   Delta + 2 zeta <= delta0 - sqrt(1 - exp(-2 L_kappa / (d - 1))).
// (Eq. 25 with the margin delta_eff = delta0 - Delta - 2 zeta solved for
// delta_eff; the square root is lost in the paper's text extraction but
// follows from G(d, delta_eff) >= L_kappa.) Returns the right-hand side; a
// negative value means the configuration tolerates no drift at all.
inline double drift_tolerance(double delta0, double kappa, double beta, double E, double B_e, double eps, double a0,
                              double d) {
  detail::check_open_unit("drift_tolerance", "delta0", delta0);
  if (!(kappa > 1.0) || !std::isfinite(kappa)) detail::invalid("drift_tolerance", "kappa", kappa, "finite and > 1");
  detail::check_beta_experts("drift_tolerance", beta, E);
  if (!(B_e >= 1.0) || !std::isfinite(B_e)) detail::invalid("drift_tolerance", "B_e", B_e, "finite and >= 1");
  detail::check_open_unit("drift_tolerance", "eps", eps);
  detail::check_open_unit("drift_tolerance", "a0", a0);
  detail::check_dimension("drift_tolerance", d);
  const double l_kappa = std::log(kappa * beta * E * B_e / ((1.0 - eps) * a0));
  return delta0 - std::sqrt(-std::expm1(-2.0 * l_kappa / (d - 1.0)));
}

// The output-fidelity bound of strict drop with renormalised weights (eq. 37):
// for expert outputs bounded by V and retained native gate mass r in (0, 1],
//   || sum_e w_e v_e - sum_{e in U} (w_e / r) v_e || <= 2 V (1 - r).
// For r = 0 (every assignment dropped, routed branch returns zero) the
// deviation is at most V, which is returned.
constexpr double output_fidelity_bound(double V, double r) {
  if (!(V >= 0.0) || V > std::numeric_limits<double>::max())
    detail::invalid("output_fidelity_bound", "V", V, "finite and >= 0");
  if (!(r >= 0.0 && r <= 1.0)) detail::invalid("output_fidelity_bound", "r", r, "in [0, 1]");
  return r == 0.0 ? V : 2.0 * V * (1.0 - r);
}

}  // namespace moe_route::analysis::capacity_bounds
