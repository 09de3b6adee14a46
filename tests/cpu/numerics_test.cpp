// The bit-reproducible float math of detail/numerics.hpp against double
// precision, and the 16-bit storage types against conversions derived from
// the IEEE formats (tests/cpu/reference.hpp).
#include "reference.hpp"

namespace mr = moe_route;
namespace md = moe_route::detail;

namespace {

double rel_err(float lib, double expect) { return std::fabs(static_cast<double>(lib) - expect) / std::fabs(expect); }

}  // namespace

TEST_CASE("detail::exp: relative error below 2.5e-7 over a dense sweep of [-87, 88.72]") {
  double worst = 0;
  float worst_x = 0;
  std::int64_t count = 0;
  auto probe = [&](float x) {
    const float y = md::exp(x);
    const double e = rel_err(y, std::exp(static_cast<double>(x)));
    if (e > worst) { worst = e; worst_x = x; }
    ++count;
  };
  for (double x = -87.0; x <= 88.7; x += 1.0 / 4096) probe(static_cast<float>(x));
  // every float in a few narrow windows (reduction boundaries, around 0)
  for (int p = -40; p <= -10; ++p)
    for (int i = 0; i < 200; ++i) {
      const float x = static_cast<float>(std::ldexp(1.0 + i / 200.0, p));
      probe(x);
      probe(-x);
    }
  for (float x = 0.34657f; x <= 0.34658f; x = std::nextafter(x, 1.0f)) probe(x);
  for (float x = 88.7f; x < 88.72283f; x = std::nextafter(x, 100.0f)) probe(x);
  ref::rng g(1);
  for (int i = 0; i < 200000; ++i) probe(static_cast<float>(g.uniform(-87.0, 88.72)));
  MESSAGE("detail::exp: " << count << " points, worst relative error " << worst << " at x = " << worst_x);
  CHECK(worst < 2.5e-7);
}

TEST_CASE("detail::exp: special values, flush below -87, overflow") {
  CHECK(md::exp(0.0f) == 1.0f);
  CHECK(md::exp(-0.0f) == 1.0f);
  CHECK(std::isnan(md::exp(ref::fnan())));
  CHECK(md::exp(ref::finf()) == ref::finf());
  CHECK(md::exp(-ref::finf()) == 0.0f);
  CHECK(md::exp(89.0f) == ref::finf());
  CHECK(md::exp(1e30f) == ref::finf());
  CHECK(md::exp(-1e30f) == 0.0f);
  // results below the smallest normal are flushed to exactly 0 ...
  CHECK(md::exp(std::nextafter(-87.0f, -100.0f)) == 0.0f);
  CHECK(md::exp(-88.0f) == 0.0f);
  CHECK(md::exp(-103.0f) == 0.0f);
  // ... and -87 itself is still a normal, accurate result
  const float at = md::exp(-87.0f);
  CHECK(at >= std::numeric_limits<float>::min());
  CHECK(rel_err(at, std::exp(-87.0)) < 2.5e-7);
  // the largest x with a finite e^x
  const float below = 88.72282409667969f;  // the float before 88.72283172607421875f
  CHECK(std::isfinite(md::exp(below)));
  CHECK(rel_err(md::exp(below), std::exp(static_cast<double>(below))) < 2.5e-7);
  CHECK(md::exp(88.72283935546875f) == ref::finf());  // e^x > FLT_MAX
}

// exp_nonpositive leaves out steps of exp that are the identity for x <= 0;
// every non-positive float (-0 through -inf), compared by bits, in blocks
// the compiler vectorises.
TEST_CASE("detail::exp_nonpositive: the bits of detail::exp for every x <= 0") {
  constexpr std::uint32_t first = 0x80000000u, last = 0xff800000u;  // -0, -inf
  constexpr std::uint32_t block = 1u << 16;
  std::vector<float> x(block);
  std::vector<std::uint32_t> a(block), b(block);
  std::uint64_t mismatches = 0;
  std::uint32_t first_mismatch = 0;
  for (std::uint64_t base = first; base <= last; base += block) {
    const auto count = static_cast<std::uint32_t>(std::min<std::uint64_t>(block, last - base + 1));
    for (std::uint32_t i = 0; i < count; ++i) x[i] = md::bits_to_float(static_cast<std::uint32_t>(base + i));
    for (std::uint32_t i = 0; i < count; ++i) a[i] = md::float_to_bits(md::exp(x[i]));
    for (std::uint32_t i = 0; i < count; ++i) b[i] = md::float_to_bits(md::exp_nonpositive(x[i]));
    for (std::uint32_t i = 0; i < count; ++i)
      if (a[i] != b[i] && mismatches++ == 0) first_mismatch = static_cast<std::uint32_t>(base + i);
  }
  INFO("first mismatch at bits 0x" << std::hex << first_mismatch);
  CHECK(mismatches == 0);
  CHECK(md::exp_nonpositive(-0.0f) == 1.0f);
  CHECK(md::exp_nonpositive(-ref::finf()) == 0.0f);
}

// exp(88.72283172607421875f) = 3.40279e38 < FLT_MAX = 3.40282e38 does not
// overflow (regression: the threshold test was `x >=` this float, giving +inf).
TEST_CASE("detail::exp: the largest float below ln(FLT_MAX) gives a finite result") {
  const float x = 88.72283172607421875f;
  REQUIRE(static_cast<double>(x) < std::log(ref::flt_max));
  const float y = md::exp(x);
  CHECK(std::isfinite(y));
  CHECK(rel_err(y, std::exp(static_cast<double>(x))) < 2.5e-7);
}

TEST_CASE("detail::log1p_unit: relative error over [0, 1] and for tiny u") {
  double worst = 0;
  float worst_u = 0;
  auto probe = [&](float u) {
    const double expect = std::log1p(static_cast<double>(u));
    const float y = md::log1p_unit(u);
    if (u == 0.0f) {
      CHECK(y == 0.0f);
      return;
    }
    const double e = rel_err(y, expect);
    if (e > worst) { worst = e; worst_u = u; }
  };
  for (double u = 0; u <= 1.0; u += 1.0 / 65536) probe(static_cast<float>(u));
  for (double p = -38; p <= 0; p += 0.01) probe(static_cast<float>(std::pow(10.0, p)));
  probe(1e-30f);
  probe(std::numeric_limits<float>::min());
  probe(1.0f);
  probe(std::nextafter(1.0f, 0.0f));
  MESSAGE("log1p_unit: worst relative error " << worst << " at u = " << worst_u);
  CHECK(worst < 2.5e-7);
  CHECK(md::log1p_unit(1e-30f) == doctest::Approx(1e-30).epsilon(1e-7));
}

TEST_CASE("detail::sigmoid: relative accuracy on both tails") {
  double worst = 0;
  float worst_x = 0;
  for (double x = -87.0; x <= 87.0; x += 1.0 / 1024) {
    const float xf = static_cast<float>(x);
    const double expect = 1.0 / (1.0 + std::exp(-static_cast<double>(xf)));
    const double e = rel_err(md::sigmoid(xf), expect);
    if (e > worst) { worst = e; worst_x = xf; }
  }
  MESSAGE("sigmoid: worst relative error " << worst << " at x = " << worst_x);
  CHECK(worst < 3.6e-7);
  CHECK(md::sigmoid(0.0f) == 0.5f);
  CHECK(md::sigmoid(100.0f) == 1.0f);
  CHECK(md::sigmoid(ref::finf()) == 1.0f);
  CHECK(md::sigmoid(-ref::finf()) == 0.0f);
  CHECK(md::sigmoid(-100.0f) == 0.0f);  // e^x flushed below -87
  // the negative tail keeps full relative precision where 1 - sigmoid(-x) would not
  CHECK(rel_err(md::sigmoid(-80.0f), std::exp(-80.0) / (1 + std::exp(-80.0))) < 3.6e-7);
  CHECK(rel_err(md::sigmoid(-20.0f), 1 / (1 + std::exp(20.0))) < 3.6e-7);
}

TEST_CASE("detail::softplus: relative accuracy on both tails") {
  double worst = 0;
  float worst_x = 0;
  for (double x = -87.0; x <= 87.0; x += 1.0 / 1024) {
    const float xf = static_cast<float>(x);
    const double xd = xf;
    const double expect = std::max(xd, 0.0) + std::log1p(std::exp(-std::fabs(xd)));
    const double e = rel_err(md::softplus(xf), expect);
    if (e > worst) { worst = e; worst_x = xf; }
  }
  MESSAGE("softplus: worst relative error " << worst << " at x = " << worst_x);
  CHECK(worst < 3.6e-7);
  CHECK(md::softplus(0.0f) == doctest::Approx(std::log(2.0)).epsilon(1e-7));
  CHECK(md::softplus(1e30f) == 1e30f);
  CHECK(md::softplus(-ref::finf()) == 0.0f);
  CHECK(md::softplus(-100.0f) == 0.0f);  // e^x flushed below -87
}

TEST_CASE("detail::sanitize and pack_key ordering") {
  CHECK(md::sanitize(ref::fnan()) == -ref::finf());
  CHECK(md::sanitize(ref::finf()) == 3.402823466e+38f);
  CHECK(md::sanitize(-ref::finf()) == -3.402823466e+38f);
  CHECK(md::sanitize(-0.0f) == 0.0f);
  CHECK(md::sanitize(1.5f) == 1.5f);
  // packed keys order by key descending then index ascending; -0 == +0
  CHECK(md::pack_key(1.0f, 5) > md::pack_key(0.5f, 0));
  CHECK(md::pack_key(-0.0f, 3) == md::pack_key(0.0f, 3));
  CHECK(md::pack_key(0.0f, 2) > md::pack_key(-0.0f, 3));
  CHECK(md::pack_key(-ref::finf(), 0) > md::pack_key(-ref::finf(), 1));
  CHECK(md::pack_key(-ref::finf(), 4000) > 0u);  // 0 is below every real key
  CHECK(md::pack_key(-3.402823466e+38f, 9) > md::pack_key(-ref::finf(), 0));
  for (float x : {-2.5f, -0.0f, 1e-30f, 7.0f, 3.402823466e+38f})
    for (int e : {0, 17, 4095}) {
      CHECK(md::packed_expert(md::pack_key(x, e)) == e);
      CHECK(md::packed_value(md::pack_key(x, e)) == x);
    }
}

// ---------------------------------------------------------------------------
// 16-bit types

TEST_CASE("float16: to_float of all 65536 bit patterns equals the IEEE value") {
  int mismatches = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const mr::float16 h{static_cast<std::uint16_t>(b)};
    const float lib = md::to_float(h);
    const double expect = ref::fp16_value(h.bits);
    bool ok;
    if (std::isnan(expect)) ok = std::isnan(lib);
    else ok = static_cast<double>(lib) == expect && std::signbit(lib) == std::signbit(expect);
    if (!ok && mismatches++ < 5) FAIL_CHECK("fp16 bits 0x" << std::hex << b << ": library " << lib << ", expected " << expect);
  }
  CHECK(mismatches == 0);
}

TEST_CASE("float16: from_float rounds to nearest even, overflows to inf, keeps NaN") {
  int mismatches = 0;
  auto probe = [&](float f) {
    const std::uint16_t lib = mr::float16::from_float(f).bits;
    const std::uint16_t expect = ref::fp16_bits(f);
    bool ok;
    if (std::isnan(f)) ok = ((lib & 0x7c00u) == 0x7c00u) && (lib & 0x3ffu);
    else ok = lib == expect;
    if (!ok && mismatches++ < 5)
      FAIL_CHECK("from_float(" << f << ", bits 0x" << std::hex << ref::bits(f) << "): library 0x" << lib
                               << ", expected 0x" << expect);
  };
  // round trip of every non-NaN half, and every midpoint between neighbours
  // (exact floats) plus the floats just beside each midpoint
  for (std::uint32_t b = 0; b < 0x7c00; ++b) {
    for (std::uint32_t s : {0u, 0x8000u}) {
      const double v = ref::fp16_value(static_cast<std::uint16_t>(b | s));
      probe(static_cast<float>(v));
      const double next = b + 1 == 0x7c00 ? 65536.0 : ref::fp16_value(static_cast<std::uint16_t>(b + 1));
      const float mid = static_cast<float>((std::fabs(v) + next) / 2 * (s ? -1 : 1));
      probe(mid);
      probe(std::nextafter(mid, 0.0f));
      probe(std::nextafter(mid, s ? -1e9f : 1e9f));
    }
  }
  ref::rng g(16);
  for (int i = 0; i < 300000; ++i) {
    const float f = static_cast<float>(std::ldexp(g.uniform(-1.0, 1.0), g.integer(-30, 18)));
    probe(f);
  }
  for (float f : {0.0f, -0.0f, ref::finf(), -ref::finf(), ref::fnan(), 65504.0f, 65519.99f, 65520.0f, 1e10f,
                  -1e10f, 1e-10f, 5.96e-8f, 2.98e-8f, 2.99e-8f, std::numeric_limits<float>::denorm_min()})
    probe(f);
  CHECK(mismatches == 0);
  // a few hand values
  CHECK(mr::float16::from_float(1.0f).bits == 0x3c00);
  CHECK(mr::float16::from_float(65504.0f).bits == 0x7bff);
  CHECK(mr::float16::from_float(65520.0f).bits == 0x7c00);  // the tie rounds to even = inf
  CHECK(mr::float16::from_float(1.0f + 1.0f / 2048).bits == 0x3c00);  // tie to even (down)
  CHECK(mr::float16::from_float(1.0f + 3.0f / 2048).bits == 0x3c02);  // tie to even (up)
  CHECK(mr::float16::from_float(-0.0f).bits == 0x8000);
}

TEST_CASE("bfloat16: to_float of all 65536 bit patterns, round trips and from_float rounding") {
  int mismatches = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const mr::bfloat16 h{static_cast<std::uint16_t>(b)};
    const float lib = md::to_float(h);
    const double expect = ref::bf16_value(h.bits);
    const bool ok = std::isnan(expect) ? std::isnan(lib) : (static_cast<double>(lib) == expect && std::signbit(lib) == std::signbit(expect));
    if (!ok && mismatches++ < 5) FAIL_CHECK("bf16 bits 0x" << std::hex << b);
    if (!std::isnan(expect)) {
      const std::uint16_t back = mr::bfloat16::from_float(lib).bits;
      if (back != b && mismatches++ < 5) FAIL_CHECK("bf16 round trip of 0x" << std::hex << b << " gave 0x" << back);
    } else {
      const std::uint16_t back = mr::bfloat16::from_float(lib).bits;
      if (!((back & 0x7f80u) == 0x7f80u && (back & 0x7fu)) && mismatches++ < 5)
        FAIL_CHECK("bf16 NaN 0x" << std::hex << b << " became 0x" << back);
    }
  }
  auto probe = [&](float f) {
    const std::uint16_t lib = mr::bfloat16::from_float(f).bits;
    const std::uint16_t expect = ref::bf16_bits(f);
    const bool ok = std::isnan(f) ? ((lib & 0x7f80u) == 0x7f80u && (lib & 0x7fu)) : lib == expect;
    if (!ok && mismatches++ < 5)
      FAIL_CHECK("bf16 from_float(" << f << "): library 0x" << std::hex << lib << ", expected 0x" << expect);
  };
  for (std::uint32_t b = 0; b < 0x7f80; b += 1) {
    // midpoints between bf16 neighbours are exact floats: bits b<<16 | 0x8000
    const float mid = ref::from_bits((b << 16) | 0x8000u);
    probe(mid);
    probe(-mid);
    probe(ref::from_bits((b << 16) | 0x7fffu));
    probe(ref::from_bits((b << 16) | 0x8001u));
  }
  ref::rng g(17);
  for (int i = 0; i < 300000; ++i) probe(ref::from_bits(static_cast<std::uint32_t>(g.gen())));
  CHECK(mismatches == 0);
  CHECK(mr::bfloat16::from_float(1.0f).bits == 0x3f80);
  CHECK(mr::bfloat16::from_float(3.402823466e+38f).bits == 0x7f80);  // rounds past the largest bf16
  CHECK(mr::bfloat16::from_float(ref::fnan()).bits != mr::bfloat16::from_float(ref::finf()).bits);
}
