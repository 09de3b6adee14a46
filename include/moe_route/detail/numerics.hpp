// moe_route: bit-reproducible float math shared by the CPU and CUDA backends.
//
// CPU and CUDA must agree exactly on top-k indices, and selection keys such as
// sigmoid(z) + bias depend on transcendental functions whose library versions
// differ between glibc and the CUDA math library. These functions therefore use
// only IEEE-exact operations (fma, add, mul, div, sqrt with round-to-nearest)
// in a fixed order. Every product that feeds a sum is written as an explicit
// fma, so no compiler can change a result by contracting a*b+c on its own
// (nvcc --fmad, g++ -ffp-contract=fast with -mfma): the result is the same
// whatever the flags, except --use_fast_math / -ffast-math, which are not
// supported. A value an fma produced is negated with negate(), never with
// unary minus (see there). tests/contraction/ checks this by compiling the
// same code with and without contraction.
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>

#include <moe_route/config.hpp>

namespace moe_route::detail {

MOE_ROUTE_HD float bits_to_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

MOE_ROUTE_HD std::uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

inline constexpr float float_max = 3.402823466e+38f;
MOE_ROUTE_HD float infinity() { return bits_to_float(0x7f800000u); }

MOE_ROUTE_HD bool is_nan(float x) { return x != x; }
MOE_ROUTE_HD bool is_finite(float x) { return x - x == 0.0f; }

// IEEE fused multiply-add, rounded once, on every backend.
MOE_ROUTE_HD float fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

MOE_ROUTE_HD double fma(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
  return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// IEEE division and square root even if a translation unit is built with
// approximate division (nvcc -prec-div=false).
MOE_ROUTE_HD float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

MOE_ROUTE_HD float sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

MOE_ROUTE_HD float max(float a, float b) { return a < b ? b : a; }

// -x, as a flip of the sign bit. Write negate(d), not -d, wherever d is the
// result of an fma: g++ folds -fma(a, b, c) into one fnmsub, -(a*b) - c,
// whatever -ffp-contract says, when nothing else uses the fma's result, which
// depends on the optimisation level and on vectorisation (the gate VJP's -dot
// was folded at -O3 and not at -O2). The two differ in the sign of a zero: if
// a*b + c is an exact zero of opposite-signed terms, the fma gives +0 and its
// negation -0, but -(a*b) - c gives +0. The bit flip is not a floating-point
// negation, so no compiler folds it into the fma.
MOE_ROUTE_HD float negate(float x) { return bits_to_float(float_to_bits(x) ^ 0x80000000u); }

// The common core of exp and exp_nonpositive, for an argument already clamped
// to [-87, ln FLT_MAX]: x = n ln 2 + r with n = round(x / ln 2), found by the
// 1.5 * 2^23 shifter (`shifted` = n + shifter, exactly), r = x - n ln 2 in two
// steps, and e^r by its Taylor polynomial of degree 7 on |r| <= 0.35
// (truncation below 0.05 ulp). The callers differ only in how they scale by 2^n.
constexpr float exp_shifter = 12582912.0f;

struct exp_reduction {
  float shifted;   // n + exp_shifter
  float mantissa;  // e^r
};

MOE_ROUTE_HD exp_reduction exp_reduce(float xc) {
  const float shifted = fma(xc, 1.44269502162933349609375f, exp_shifter);
  const float n = shifted - exp_shifter;
  float r = fma(n, -0.693145751953125f, xc);
  r = fma(n, -1.428606765330187045e-06f, r);
  float p = 1.98412698412698412e-04f;
  p = fma(p, r, 1.38888888888888889e-03f);
  p = fma(p, r, 8.33333333333333333e-03f);
  p = fma(p, r, 4.16666666666666667e-02f);
  p = fma(p, r, 1.66666666666666667e-01f);
  p = fma(p, r, 0.5f);
  p = fma(p, r, 1.0f);
  p = fma(p, r, 1.0f);
  return {shifted, p};
}

// e^x with error below one ulp in the normal range. NaN propagates, results
// that would overflow are +inf, and results below the smallest normal float
// (x < -87) are flushed to 0 so the final scaling is always exact.
// Branch-free: the argument is clamped, the polynomial always evaluated and
// the special cases applied as bit-mask selects, so loops over a row
// vectorise (plain early returns or ternaries on the result let the compiler
// move the polynomial into a branch). Bit for bit the former branching form
// on every non-NaN input (checked exhaustively when it was introduced).
MOE_ROUTE_HD float exp(float x) {
  const float hi = 88.72283172607421875f;  // the largest float below ln(FLT_MAX)
  float xc = x < -87.0f ? -87.0f : x;
  xc = xc > hi ? hi : xc;
  xc = is_nan(x) ? 0.0f : xc;
  const exp_reduction red = exp_reduce(xc);
  const float p = red.mantissa;
  // Near the overflow threshold (n = 128) the scale 2^n is applied in two exact steps.
  const int e = static_cast<int>(red.shifted - exp_shifter);
  const int big = e > 127 ? 1 : 0;
  const float p2 = p * bits_to_float(static_cast<std::uint32_t>(127 + big) << 23);
  std::uint32_t y = float_to_bits(p2 * bits_to_float(static_cast<std::uint32_t>(e - big + 127) << 23));
  const std::uint32_t over = 0u - static_cast<std::uint32_t>(x > hi);
  const std::uint32_t under = 0u - static_cast<std::uint32_t>(x < -87.0f);
  const std::uint32_t nan = 0u - static_cast<std::uint32_t>(is_nan(x));
  y = (y & ~over) | (0x7f800000u & over);
  y &= ~under;
  y = (y & ~nan) | (float_to_bits(x) & nan);
  return bits_to_float(y);
}

// exp(x) for x <= 0 (including -inf, never NaN), bit for bit: a softmax term
// exp(v - max) of a sanitised row is such an argument. Nothing there
// overflows, n <= 0 needs no two-step scale and NaN cannot occur, so those
// steps of exp are left out (a third of a vectorised row's instructions).
// Checked against exp over every non-positive float (tests/cpu/numerics_test.cpp).
MOE_ROUTE_HD float exp_nonpositive(float x) {
  const float xc = x > -87.0f ? x : -87.0f;  // the operand order of a vector max
  const exp_reduction red = exp_reduce(xc);
  // 2^n: the low bits of `shifted` hold n + 2^22 (its encoding is 0x4b400000 + n).
  const std::uint32_t y =
      float_to_bits(red.mantissa * bits_to_float((float_to_bits(red.shifted) - 0x4b400000u + 127u) << 23));
  return bits_to_float(y & ~(0u - static_cast<std::uint32_t>(x < -87.0f)));
}

// log(1 + u) for u in [0, 1] with a relative error of about one ulp, also
// for tiny u: log1p(u) = 2 atanh(s), s = u / (2 + u) in [0, 1/3].
MOE_ROUTE_HD float log1p_unit(float u) {
  const float s = div(u, 2.0f + u);
  const float s2 = s * s;
  float p = 1.0f / 15.0f;
  p = fma(p, s2, 1.0f / 13.0f);
  p = fma(p, s2, 1.0f / 11.0f);
  p = fma(p, s2, 1.0f / 9.0f);
  p = fma(p, s2, 1.0f / 7.0f);
  p = fma(p, s2, 1.0f / 5.0f);
  p = fma(p, s2, 1.0f / 3.0f);
  const float half = fma(s * s2, p, s);
  return half + half;
}

// Natural logarithm of a positive normal float (log(0) = -inf, NaN and
// negative inputs give NaN, +inf stays +inf). x = m 2^k with m in [0.75, 1.5),
// log x = k ln 2 + 2 atanh((m - 1) / (m + 1)), |s| <= 0.2: within 2 ulp.
MOE_ROUTE_HD float log(float x) {
  // Branch-free like exp: a safe argument for the evaluation, the special
  // cases applied as bit-mask selects at the end. Every select is on bits or
  // a factor, not a ?: of floats, so that loops over log vectorise (g++
  // otherwise duplicates the paths and gives up).
  const std::uint32_t regular = 0u - static_cast<std::uint32_t>((x > 0.0f) & (x != infinity()));
  std::uint32_t u = (float_to_bits(x) & regular) | (float_to_bits(1.0f) & ~regular);
  u = u < 0x00800000u ? 0x00800000u : u;  // subnormals: clamp to the smallest normal (positive: bits order as values)
  const float m1 = bits_to_float((u & 0x007fffffu) | 0x3f800000u);  // [1, 2)
  const std::uint32_t upper = (u >> 22) & 1u;                       // m1 >= 1.5: the mantissa's top bit
  const float m = m1 * bits_to_float(0x3f800000u - (upper << 23));  // m1 or m1 / 2, exactly
  const int k = static_cast<int>((u >> 23) & 0xffu) - 127 + static_cast<int>(upper);
  const float s = div(m - 1.0f, m + 1.0f);
  const float s2 = s * s;
  float p = 1.0f / 13.0f;
  p = fma(p, s2, 1.0f / 11.0f);
  p = fma(p, s2, 1.0f / 9.0f);
  p = fma(p, s2, 1.0f / 7.0f);
  p = fma(p, s2, 1.0f / 5.0f);
  p = fma(p, s2, 1.0f / 3.0f);
  const float half = fma(s * s2, p, s);
  // k ln 2 in two parts so the sum rounds once at the end.
  const float kf = static_cast<float>(k);
  std::uint32_t y = float_to_bits(fma(kf, 0.693145751953125f, fma(kf, 1.428606765330187045e-06f, half + half)));
  const std::uint32_t zero = 0u - static_cast<std::uint32_t>(x == 0.0f);      // log(+-0) = -inf
  const std::uint32_t invalid = 0u - static_cast<std::uint32_t>(!(x >= 0.0f));  // negative or NaN: NaN
  const std::uint32_t inf = 0u - static_cast<std::uint32_t>(x == infinity());  // log(inf) = inf
  y = (y & ~zero) | (0xff800000u & zero);
  y = (y & ~invalid) | (0x7fc00000u & invalid);
  y = (y & ~inf) | (0x7f800000u & inf);
  return bits_to_float(y);
}

// Logistic function, accurate in relative terms on both tails.
MOE_ROUTE_HD float sigmoid(float x) {
  const float t = exp(bits_to_float(float_to_bits(x) | 0x80000000u));  // e^{-|x|}, in [0, 1]
  const std::uint32_t negative = 0u - static_cast<std::uint32_t>(x < 0.0f);
  const float numerator = bits_to_float((float_to_bits(t) & negative) | (float_to_bits(1.0f) & ~negative));
  return div(numerator, 1.0f + t);  // x < 0: t / (1 + t), else 1 / (1 + t); branch-free
}

// softplus(x) = max(x, 0) + log(1 + e^{-|x|}).
MOE_ROUTE_HD float softplus(float x) {
  const float minus_ax = bits_to_float(float_to_bits(x) | 0x80000000u);  // -|x|
  return max(x, 0.0f) + log1p_unit(exp(minus_ax));
}

// The value every policy computes with: NaN becomes -inf (it never wins and
// contributes nothing), +-inf saturate to +-FLT_MAX (the limit of a huge logit).
MOE_ROUTE_HD float sanitize(float z) {
  if (is_nan(z)) return -infinity();
  if (z > float_max) return float_max;
  if (z < -float_max) return -float_max;
  return z;
}

// A selection key packed with its expert index so that one unsigned maximum
// orders by key (descending) and then by index (ascending). Key 0 is below
// every real key and marks "no candidate". -0.0 and +0.0 compare equal. A NaN
// key (e.g. from a NaN in a caller's bias) ranks below every number, -inf included.
MOE_ROUTE_HD std::uint64_t pack_key(float key, int expert) {
  std::uint32_t u = float_to_bits(key == 0.0f ? 0.0f : key);
  u = is_nan(key) ? 0u : ((u & 0x80000000u) ? ~u : (u | 0x80000000u));
  return (static_cast<std::uint64_t>(u) << 32) | (0xffffffffu - static_cast<std::uint32_t>(expert));
}

MOE_ROUTE_HD int packed_expert(std::uint64_t packed) {
  return static_cast<int>(0xffffffffu - static_cast<std::uint32_t>(packed));
}

MOE_ROUTE_HD float packed_value(std::uint64_t packed) {
  std::uint32_t u = static_cast<std::uint32_t>(packed >> 32);
  u = (u & 0x80000000u) ? (u & 0x7fffffffu) : ~u;
  return bits_to_float(u);
}

// The canonical order of a row reduction: 32 lanes, lane l accumulates the
// elements e = l, l + 32, l + 64, ... in order, then the lanes combine by the
// butterfly 16, 8, 4, 2, 1. A CUDA warp computes exactly this; the CPU backend
// replays it, so row sums agree bit for bit between backends.
inline constexpr int reduction_lanes = 32;

}  // namespace moe_route::detail
