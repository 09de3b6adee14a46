// RPB prior tools against independent references: preparation (clamp,
// renormalise, centred log), the builder (brute-force segmented mean), the
// shuffles (community preservation, permutation), and the prior-side
// validation statistics (hand-computed cases).
#include <doctest/doctest.h>

#include <moe_route/moe_route.hpp>
#include <moe_route/prior/prior.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace mr = moe_route;

namespace {

std::vector<float> random_prior(std::int64_t rows, int e, unsigned seed, double sharpness = 2.0) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> d(0.0, sharpness);
  std::vector<float> pi(rows * e);
  for (std::int64_t r = 0; r < rows; ++r) {
    std::vector<double> x(e);
    double s = 0;
    for (auto& v : x) s += (v = std::exp(d(gen)));
    for (int i = 0; i < e; ++i) pi[r * e + i] = static_cast<float>(x[i] / s);
  }
  return pi;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const mr::error& err) {
    return err.what();
  }
  return "";
}

}  // namespace

TEST_CASE("prior::prepare matches clamp -> renormalise -> centred log in double") {
  const int e = 64;
  const std::int64_t rows = 40;
  std::vector<float> pi = random_prior(rows, e, 1, 3.0);  // sharp rows: both clamps active
  std::vector<float> b(rows * e), c(rows * e);
  const mr::prior::prepare_report rep = mr::prior::prepare(pi.data(), rows, e, b.data(), c.data());
  const double lo = 0.05 / e, hi = 5.0 / e;
  std::int64_t upper = 0, lower = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    std::vector<double> cl(e);
    double sum = 0, mean_log = 0;
    for (int i = 0; i < e; ++i) {
      const double p = pi[r * e + i];
      upper += p >= hi;
      lower += p <= lo;
      cl[i] = std::min(hi, std::max(lo, p));
      sum += cl[i];
    }
    for (int i = 0; i < e; ++i) mean_log += std::log(cl[i] / sum) / e;
    double row_mean = 0;
    for (int i = 0; i < e; ++i) {
      CHECK(c[r * e + i] == doctest::Approx(cl[i] / sum).epsilon(1e-6));
      CHECK(b[r * e + i] == doctest::Approx(std::log(cl[i] / sum) - mean_log).epsilon(1e-6));
      row_mean += b[r * e + i];
    }
    CHECK(std::fabs(row_mean / e) < 1e-6);  // zero mean up to float rounding of the stored values
  }
  CHECK(rep.upper_clamped == upper);
  CHECK(rep.lower_clamped == lower);
  CHECK(upper > 0);
  CHECK(lower > 0);
}

TEST_CASE("prior::prepare hits the clamp bounds exactly") {
  // One expert holds all the mass, the others none: the bias spread is exactly
  // log(C/E) - log(eps/E) = log(C/eps) after renormalisation.
  const int e = 8;
  std::vector<float> pi(e, 0.0f);
  pi[3] = 1.0f;
  std::vector<float> b(e), c(e);
  mr::prior::clamp_bounds bounds{0.05f, 5.0f};
  const auto rep = mr::prior::prepare(pi.data(), 1, e, b.data(), c.data(), bounds);
  CHECK(rep.upper_clamped == 1);
  CHECK(rep.lower_clamped == 7);
  const double sum = 5.0 / e + 7 * 0.05 / e;
  CHECK(c[3] == doctest::Approx((5.0 / e) / sum).epsilon(1e-7));
  CHECK(c[0] == doctest::Approx((0.05 / e) / sum).epsilon(1e-7));
  CHECK(b[3] - b[0] == doctest::Approx(std::log(100.0)).epsilon(1e-6));
  // A uniform row is inside the bounds: zero bias.
  std::vector<float> u(e, 1.0f / e);
  mr::prior::prepare(u.data(), 1, e, b.data());
  for (float x : b) CHECK(std::fabs(x) < 1e-6f);
}

TEST_CASE("prior::prepare rejects zero rows, NaN, negative entries and bad bounds") {
  const int e = 4;
  std::vector<float> b(8, 123.0f);
  std::vector<float> zeros = {0.25f, 0.25f, 0.25f, 0.25f, 0, 0, 0, 0};
  CHECK(error_of([&] { mr::prior::prepare(zeros.data(), 2, e, b.data()); }).find("prior row 1 is all zeros") !=
        std::string::npos);
  std::vector<float> nan = {0.25f, NAN, 0.25f, 0.25f};
  CHECK(error_of([&] { mr::prior::prepare(nan.data(), 1, e, b.data()); }).find("non-finite entry at expert 1") !=
        std::string::npos);
  std::vector<float> neg = {0.5f, -0.1f, 0.3f, 0.3f};
  CHECK(error_of([&] { mr::prior::prepare(neg.data(), 1, e, b.data()); }).find("negative") != std::string::npos);
  CHECK(error_of([&] { mr::prior::prepare(neg.data(), 1, e, b.data(), nullptr, {0.0f, 5.0f}); }).find("epsilon") !=
        std::string::npos);
  CHECK(error_of([&] { mr::prior::prepare(neg.data(), 1, 0, b.data()); }).find("num_experts") != std::string::npos);
  for (float x : b) CHECK(x == 123.0f);  // nothing written on a rejected call
}

TEST_CASE("prior::build equals a brute-force mean of the base distribution per row") {
  const int e = 37;  // not a multiple of 32
  const std::int64_t n = 500, rows = 9;
  std::mt19937 gen(3);
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<float> z(n * e);
  for (auto& x : z) x = d(gen);
  std::vector<std::int32_t> r(n);
  for (std::int64_t t = 0; t < n; ++t) r[t] = static_cast<std::int32_t>(t % 11) - 1;  // -1 and rows 0..9, row 9 absent
  for (auto& x : r)
    if (x == 9) x = -1;
  std::vector<float> pi(rows * e, -1.0f);
  const mr::route_inputs<float> base{z.data(), n, e};

  SUBCASE("softmax base router") {
    const auto rep = mr::prior::build<mr::gating::softmax>(base, r.data(), rows, pi.data());
    std::vector<double> ref(rows * e, 0.0);
    std::vector<int> cnt(rows, 0);
    for (std::int64_t t = 0; t < n; ++t) {
      if (r[t] < 0) continue;
      double m = -1e300, s = 0;
      for (int i = 0; i < e; ++i) m = std::max(m, static_cast<double>(z[t * e + i]));
      for (int i = 0; i < e; ++i) s += std::exp(z[t * e + i] - m);
      for (int i = 0; i < e; ++i) ref[r[t] * e + i] += std::exp(z[t * e + i] - m) / s;
      ++cnt[r[t]];
    }
    std::int64_t used = 0;
    for (std::int64_t row = 0; row < rows; ++row) {
      used += cnt[row];
      for (int i = 0; i < e; ++i)
        CHECK(pi[row * e + i] == doctest::Approx(cnt[row] ? ref[row * e + i] / cnt[row] : 0.0).epsilon(1e-5));
    }
    CHECK(rep.tokens_used == used);
    REQUIRE(rep.empty_rows.size() == 0);
  }
  SUBCASE("sigmoid base router: p = s / sum s; an empty row is reported and zero") {
    std::vector<std::int32_t> r2 = r;
    for (auto& x : r2)
      if (x == 4) x = -1;
    const auto rep = mr::prior::build<mr::gating::sigmoid>(base, r2.data(), rows, pi.data());
    REQUIRE(rep.empty_rows == std::vector<std::int64_t>{4});
    for (int i = 0; i < e; ++i) CHECK(pi[4 * e + i] == 0.0f);
    std::vector<double> ref(e, 0.0);
    int cnt = 0;
    for (std::int64_t t = 0; t < n; ++t) {
      if (r2[t] != 2) continue;
      double s = 0;
      for (int i = 0; i < e; ++i) s += 1.0 / (1.0 + std::exp(-static_cast<double>(z[t * e + i])));
      for (int i = 0; i < e; ++i) ref[i] += (1.0 / (1.0 + std::exp(-static_cast<double>(z[t * e + i])))) / s;
      ++cnt;
    }
    for (int i = 0; i < e; ++i) CHECK(pi[2 * e + i] == doctest::Approx(ref[i] / cnt).epsilon(1e-5));
    // The empty row cannot be prepared by accident.
    std::vector<float> b(rows * e);
    CHECK(error_of([&] { mr::prior::prepare(pi.data(), rows, e, b.data()); }).find("prior row 4") != std::string::npos);
  }
  SUBCASE("row index out of range is rejected, naming the token") {
    r[17] = static_cast<std::int32_t>(rows);
    std::fill(pi.begin(), pi.end(), 7.0f);
    CHECK(error_of([&] { mr::prior::build<mr::gating::softmax>(base, r.data(), rows, pi.data()); })
              .find("prior_rows[17]") != std::string::npos);
    CHECK(std::all_of(pi.begin(), pi.end(), [](float x) { return x == 7.0f; }));
    CHECK(error_of([&] { mr::prior::build<mr::gating::softmax>(base, r.data(), 0, pi.data()); }).find("prior rows S") !=
          std::string::npos);
  }
}

TEST_CASE("within-community shuffles stay inside communities; global shuffles are permutations") {
  const int e = 64;
  std::vector<int> communities(e);
  for (int i = 0; i < e; ++i) communities[i] = (i * 7) % 5;  // 5 interleaved communities
  for (std::uint64_t seed : {0ull, 1ull, 42ull, 123456789ull}) {
    const std::vector<int> sigma = mr::prior::within_community_permutation(communities.data(), e, seed);
    std::set<int> image(sigma.begin(), sigma.end());
    CHECK(image.size() == static_cast<std::size_t>(e));
    int moved = 0;
    for (int i = 0; i < e; ++i) {
      CHECK(communities[sigma[i]] == communities[i]);
      moved += sigma[i] != i;
    }
    CHECK(moved > e / 2);  // it really shuffles
    CHECK(sigma == mr::prior::within_community_permutation(communities.data(), e, seed));  // reproducible
    const std::vector<int> g = mr::prior::global_permutation(e, seed);
    CHECK(std::set<int>(g.begin(), g.end()).size() == static_cast<std::size_t>(e));
    CHECK(g == mr::prior::global_permutation(e, seed));
    int crossed = 0;
    for (int i = 0; i < e; ++i) crossed += communities[g[i]] != communities[i];
    CHECK(crossed > 0);
  }
  CHECK(mr::prior::global_permutation(e, 1) != mr::prior::global_permutation(e, 2));
  // Each position of a global shuffle is roughly uniform over seeds.
  std::vector<int> hits(8, 0);
  for (std::uint64_t s = 0; s < 8000; ++s) ++hits[mr::prior::global_permutation(8, s)[0]];
  for (int h : hits) CHECK(std::abs(h - 1000) < 150);

  // apply_permutation moves expert e's mass to sigma(e).
  const std::vector<float> pi = random_prior(3, e, 9);
  const std::vector<int> sigma = mr::prior::global_permutation(e, 5);
  std::vector<float> out(pi.size());
  mr::prior::apply_permutation(pi.data(), 3, e, sigma, out.data());
  for (int r = 0; r < 3; ++r)
    for (int i = 0; i < e; ++i) CHECK(out[r * e + sigma[i]] == pi[r * e + i]);
  std::vector<int> bad = sigma;
  bad[0] = bad[1];
  CHECK(error_of([&] { mr::prior::apply_permutation(pi.data(), 3, e, bad, out.data()); }).find("not a permutation") !=
        std::string::npos);
}

TEST_CASE("prior-side validation statistics on hand-built cases") {
  // Row: experts 0..3 hold 0.4, 0.3, 0.2, 0.1; swapping experts 0 and 3 changes
  // one of the top-2 ({0,1} -> {3,1}): overlap 1/2.
  const int e = 4;
  const std::vector<float> pi = {0.4f, 0.3f, 0.2f, 0.1f};
  const std::vector<int> sigma = {3, 1, 2, 0};
  std::vector<float> shuffled(4);
  mr::prior::apply_permutation(pi.data(), 1, e, sigma, shuffled.data());
  const mr::prior::clamp_bounds wide{1e-3f, 100.0f};  // no clamping
  const auto v = mr::prior::validate_shuffle(pi.data(), shuffled.data(), 1, e, 2, 2.0f, wide);
  CHECK(v.topk_overlap == doctest::Approx(0.5));
  CHECK(v.change_rate == doctest::Approx(0.5));
  // |delta b| = |log 0.1 - log 0.4| = log 4 at experts 0 and 3, 0 elsewhere;
  // sorted {0, 0, L, L}: the 0.9 quantile at position 2.7 is L; times beta = 2.
  CHECK(v.p90_abs_bias_change == doctest::Approx(2.0 * std::log(4.0)).epsilon(1e-6));
  CHECK(v.upper_clamp_fraction == 0.0);
  // Identity shuffle: full overlap, no change.
  const auto same = mr::prior::validate_shuffle(pi.data(), pi.data(), 1, e, 3);
  CHECK(same.topk_overlap == 1.0);
  CHECK(same.p90_abs_bias_change == 0.0);
  // Upper clamp: with cap 1.2, the bound is 0.3: 0.4 and 0.3 are at the bound.
  const auto clamped = mr::prior::validate_shuffle(pi.data(), shuffled.data(), 1, e, 2, 1.0f, {0.05f, 1.2f});
  CHECK(clamped.upper_clamp_fraction == doctest::Approx(0.5));
}

namespace {

// prior::build's contract (docs/policies.md section 3.2) replayed one token
// at a time in the plainest form: the sanitised row, its terms (detail::exp of
// v - max, or the elementwise score), their sum in the 32-lane order, each
// quotient rounded to 2^-32 units, the mean in double.
template <class Gating>
std::vector<float> replayed_prior(const std::vector<float>& z, int e, const std::vector<std::int32_t>& rows,
                                  std::int64_t num_rows) {
  const auto n = static_cast<std::int64_t>(rows.size());
  std::vector<std::int64_t> sums(num_rows * e, 0), count(num_rows, 0);
  std::vector<float> v(e), t(e);
  for (std::int64_t tok = 0; tok < n; ++tok) {
    if (rows[tok] < 0) continue;
    ++count[rows[tok]];
    float m = -mr::detail::float_max;
    for (int i = 0; i < e; ++i) {
      v[i] = mr::detail::sanitize(z[tok * e + i]);
      m = std::max(m, v[i]);
    }
    for (int i = 0; i < e; ++i) {
      if constexpr (Gating::shape == mr::gating::kind::elementwise)
        t[i] = Gating::score(v[i]);
      else
        t[i] = mr::detail::exp(v[i] - m);
    }
    float lanes[32] = {};
    for (int i = 0; i < e; ++i) lanes[i % 32] += t[i];
    for (int half = 16; half > 0; half /= 2)
      for (int l = 0; l < half; ++l) lanes[l] += lanes[l + half];
    if (!(lanes[0] > 0.0f)) continue;
    for (int i = 0; i < e; ++i) {
      const float p = t[i] / lanes[0];
      sums[rows[tok] * e + i] += static_cast<std::int64_t>(static_cast<double>(p) * 4294967296.0 + 0.5);
    }
  }
  std::vector<float> pi(num_rows * e, 0.0f);
  for (std::int64_t r = 0; r < num_rows; ++r)
    for (int i = 0; i < e && count[r] > 0; ++i)
      pi[r * e + i] = static_cast<float>(static_cast<double>(sums[r * e + i]) / 4294967296.0 / count[r]);
  return pi;
}

template <class Gating>
void check_prior_bits(int e, std::int64_t n, std::int64_t num_rows, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::uniform_int_distribution<std::int32_t> row(-1, static_cast<std::int32_t>(num_rows) - 2);  // last row empty
  std::vector<float> z(n * e);
  for (auto& x : z) x = d(gen);
  // non-finite rows, a row of ties, a row of NaNs, bf16-rounded values
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), 3.0e38f, -3.0e38f};
  for (std::int64_t t = 0; t < n; t += 7) z[t * e + (t % e)] = specials[t % 5];
  if (n > 3) std::fill(z.begin() + 2 * e, z.begin() + 3 * e, 0.5f);
  if (n > 4) std::fill(z.begin() + 3 * e, z.begin() + 4 * e, std::numeric_limits<float>::quiet_NaN());
  std::vector<std::int32_t> rows(n);
  for (auto& r : rows) r = row(gen);  // not sorted: rows interleave
  const std::vector<float> want = replayed_prior<Gating>(z, e, rows, num_rows);
  const mr::route_inputs<float> in{z.data(), n, e};
  std::vector<mr::cpu::instruction_set> isas = {mr::cpu::instruction_set::baseline};
  if (mr::cpu::detail::cpu_has_x86_64_v3()) isas.push_back(mr::cpu::instruction_set::x86_64_v3);
  for (const auto isa : isas)
    for (const int threads : {1, 2, 3, 0}) {
      CAPTURE(threads);
      CAPTURE(mr::cpu::name(isa));
      std::vector<float> pi(num_rows * e, -1.0f);
      const auto rep = mr::prior::build<Gating>(in, rows.data(), num_rows, pi.data(), mr::cpu::execution{threads, isa});
      CHECK(std::memcmp(pi.data(), want.data(), pi.size() * sizeof(float)) == 0);
      std::int64_t used = 0;
      for (std::int64_t r = 0; r < num_rows; ++r) {
        const auto tokens = static_cast<std::int64_t>(std::count(rows.begin(), rows.end(), r));
        CHECK(rep.row_tokens[r] == tokens);
        used += tokens;
      }
      CHECK(rep.tokens_used == used);
      CHECK(rep.empty_rows.back() == num_rows - 1);
    }
}

}  // namespace

TEST_CASE("prior::build: the contract's bits for every thread count and instruction set") {
  for (const int e : {1, 7, 37, 64, 256}) {
    CAPTURE(e);
    check_prior_bits<mr::gating::softmax>(e, 1500, 9, 11u + e);
    check_prior_bits<mr::gating::sigmoid>(e, 700, 5, 12u + e);
    check_prior_bits<mr::gating::sqrt_softplus>(e, 700, 5, 13u + e);
    check_prior_bits<mr::gating::softmax_after_topk>(e, 700, 5, 14u + e);
  }
  check_prior_bits<mr::gating::softmax>(4096, 40, 3, 15u);
  check_prior_bits<mr::gating::softmax>(64, 1, 2, 16u);  // one token
}

TEST_CASE("prior::build: no tokens gives zero rows, all reported; bf16 logits equal their float values") {
  std::vector<float> pi(3 * 5, 7.0f);
  const auto rep = mr::prior::build<mr::gating::softmax>(mr::route_inputs<float>{nullptr, 0, 5}, nullptr, 3, pi.data());
  CHECK(rep.tokens_used == 0);
  CHECK(rep.empty_rows == std::vector<std::int64_t>{0, 1, 2});
  CHECK(std::all_of(pi.begin(), pi.end(), [](float x) { return x == 0.0f; }));

  const int e = 40;
  const std::int64_t n = 300;
  std::mt19937 gen(5);
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<mr::bfloat16> z16(n * e);
  std::vector<float> z(n * e);
  for (std::int64_t i = 0; i < n * e; ++i) {
    z16[i] = mr::bfloat16{static_cast<std::uint16_t>(mr::detail::float_to_bits(d(gen)) >> 16)};
    z[i] = mr::detail::bits_to_float(static_cast<std::uint32_t>(z16[i].bits) << 16);
  }
  std::vector<std::int32_t> rows(n);
  for (std::int64_t t = 0; t < n; ++t) rows[t] = static_cast<std::int32_t>(t % 4) - 1;
  std::vector<float> a(3 * e), b(3 * e);
  mr::prior::build<mr::gating::softmax>(mr::route_inputs<mr::bfloat16>{z16.data(), n, e}, rows.data(), 3, a.data(),
                                        mr::cpu::execution{2});
  mr::prior::build<mr::gating::softmax>(mr::route_inputs<float>{z.data(), n, e}, rows.data(), 3, b.data());
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}
