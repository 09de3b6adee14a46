// CIPHER capacity bounds (docs/policies.md section 7, CIPHER App. A.4) against
// hand-computed values, the paper's illustrative regime and Table 7, and
// their documented errors on invalid parameter ranges.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include <moe_route/analysis/capacity_bounds.hpp>

namespace cb = moe_route::analysis::capacity_bounds;

TEST_CASE("capacity bounds: ell, G and the CIPHER budget B_e (eq. 7)") {
  // ell = log(1 / 0.09)
  CHECK(cb::ell(0.1, 0.01) == doctest::Approx(2.4079456086518722).epsilon(1e-14));
  CHECK(cb::ell(0.5, 0.0) == doctest::Approx(std::log(2.0)).epsilon(1e-14));
  // G(2, 0.6) = -log(0.64) / 2; G(1001, 0.1) = -500 log(0.99)
  CHECK(cb::geometric_exponent(2.0, 0.6) == doctest::Approx(0.22314355131420974).epsilon(1e-14));
  CHECK(cb::geometric_exponent(1001.0, 0.1) == doctest::Approx(5.025167926750726).epsilon(1e-13));
  // The paper's illustrative regime: mu = 1, eps = 0.1, eta = 0.01 -> B_e = 6 when N_e >= 6
  // (1 + 1 + ell/3 + sqrt(2 ell + ell^2/9) = 5.139...).
  CHECK(cb::cipher_budget(6, 1.0, 0.1, 0.01) == 6);
  CHECK(cb::cipher_budget(1000000, 1.0, 0.1, 0.01) == 6);
  CHECK(cb::cipher_budget(4, 1.0, 0.1, 0.01) == 4);  // min(N_e, .)
  CHECK(cb::cipher_budget(1, 1.0, 0.1, 0.01) == 1);
  // mu = 0: 1 + 2 ell / 3 = 2.605 -> 3.
  CHECK(cb::cipher_budget(100, 0.0, 0.1, 0.01) == 3);
  // mu = 4, eps = 0.05, eta = 0: ell = log 20 = 2.9957; 1 + 4 + 0.9986 + sqrt(23.966 + 0.9972) = 10.995 -> 11.
  CHECK(cb::cipher_budget(100, 4.0, 0.05, 0.0) == 11);
}

TEST_CASE("capacity bounds: natural-order admission (eqs. 8/20 and 19) and availability (eq. 26)") {
  // (1 - 0.1) 0.9 e^{G(1001, 0.1)} / 256
  CHECK(cb::natural_order_lower_bound(0.1, 0.9, 1.0, 256.0, 1001.0, 0.1) ==
        doctest::Approx(0.48155706050452457).epsilon(1e-12));
  CHECK(cb::natural_order_lower_bound(0.1, 0.9, 2.0, 256.0, 1001.0, 0.1) ==
        doctest::Approx(0.48155706050452457 / 2).epsilon(1e-12));
  // pi = 0.5, N = 10, eps = 0.1: P(3) = 0.875 / 0.99902 < 0.9 <= P(4) = 0.9375 / 0.99902 -> 4.
  CHECK(cb::natural_order_capacity(0.5, 10, 0.1) == 4);
  // pi = 0.01, N = 1000, eps = 0.1: log(1 - 0.9 (1 - 0.99^1000)) / log 0.99 = 229.07 -> 230.
  CHECK(cb::natural_order_capacity(0.01, 1000, 0.1) ==
        static_cast<std::int64_t>(std::ceil(std::log(1 - 0.9 * (1 - std::pow(0.99, 1000))) / std::log(0.99))));
  CHECK(cb::natural_order_capacity(0.01, 1000, 0.1) == 230);
  CHECK(cb::natural_order_capacity(0.3, 1, 0.5) == 1);
  // N_e >= log(1 - a0) / log(1 - pi): log 0.1 / log 0.9 = 21.85 -> 22
  CHECK(cb::availability_bound(0.9, 0.1) == doctest::Approx(21.854345326782834).epsilon(1e-13));
  CHECK(cb::min_available_pool(0.9, 0.1) == 22);
  CHECK(cb::min_available_pool(0.5, 0.5) == 1);
}

TEST_CASE("capacity bounds: the dimension condition reproduces Table 7 (eq. 16)") {
  // E = 256, beta = 1, eps = 0.1, a0 = 0.9, B_e = 6.
  struct row {
    double delta;
    std::int64_t twofold, tenfold;
  };
  for (const row r : {row{0.05, 6586, 7872}, row{0.06, 4571, 5464}, row{0.07, 3357, 4012}}) {
    CAPTURE(r.delta);
    CHECK(cb::min_dimension(2.0, 1.0, 256.0, 6.0, 0.1, 0.9, r.delta) == r.twofold);
    CHECK(cb::min_dimension(10.0, 1.0, 256.0, 6.0, 0.1, 0.9, r.delta) == r.tenfold);
  }
  CHECK(cb::dimension_condition(2.0, 1.0, 256.0, 6.0, 0.1, 0.9, 0.05) == doctest::Approx(6585.3998573734325).epsilon(1e-12));
  // At the Table 7 dimension the natural-order bound is at least kappa B_e (eq. 25).
  const double d = static_cast<double>(cb::min_dimension(2.0, 1.0, 256.0, 6.0, 0.1, 0.9, 0.05));
  CHECK(cb::natural_order_lower_bound(0.1, 0.9, 1.0, 256.0, d, 0.05) >= 2.0 * 6.0);
  CHECK(cb::natural_order_lower_bound(0.1, 0.9, 1.0, 256.0, d - 1.0, 0.05) < 2.0 * 6.0);
}

TEST_CASE("capacity bounds: binomial-quantile (eq. 29) and simple (eq. 30) budgets") {
  // Bin(10, 0.5): P(<= 7) = 968/1024 < 0.95 <= P(<= 8) = 1013/1024 -> 1 + 8.
  CHECK(cb::binomial_quantile_budget(11, 0.5, 0.05) == 9);
  CHECK(cb::binomial_quantile_budget(11, 0.5, 0.06) == 8);   // 968/1024 = 0.9453 >= 0.94
  CHECK(cb::binomial_quantile_budget(1, 0.7, 0.1) == 1);     // no competitor
  CHECK(cb::binomial_quantile_budget(50, 0.0, 0.1) == 1);    // q = 0: one slot
  CHECK(cb::binomial_quantile_budget(50, 1.0, 0.1) == 50);   // every competitor blocks
  // Bin(3, 0.1): P(0) = 0.729, P(<= 1) = 0.972 -> alpha = 0.05 needs k = 1.
  CHECK(cb::binomial_quantile_budget(4, 0.1, 0.05) == 2);
  CHECK(cb::binomial_quantile_budget(4, 0.1, 0.3) == 1);
  // Never above the simple sufficient budget (it is a Bernstein bound on the same quantile).
  for (std::int64_t n : {10, 100, 1000})
    for (double q : {0.001, 0.01, 0.1})
      CHECK(cb::binomial_quantile_budget(n, q, 0.09) <= cb::simple_budget(n, q, 0.09));
  // C~ = min(N, ceil(max(2 N q, 16/3 log(1/alpha)))): 16/3 log(1/0.09) = 12.84 -> 13.
  CHECK(cb::simple_budget(100, 0.01, 0.09) == 13);
  CHECK(cb::simple_budget(10, 0.01, 0.09) == 10);
  CHECK(cb::simple_budget(1000, 0.05, 0.09) == 100);  // 2 N q = 100
}

TEST_CASE("capacity bounds: drift tolerance (eq. 34) and output fidelity (eq. 37)") {
  // delta0 = 0.1, kappa = 2, E = 256, B_e = 6, eps = 0.1, a0 = 0.9, d = 20000.
  CHECK(cb::drift_tolerance(0.1, 2.0, 1.0, 256.0, 6.0, 0.1, 0.9, 20000.0) ==
        doctest::Approx(0.07129839336189012).epsilon(1e-12));
  // At the Table 7 dimension for delta = 0.05 a margin of 0.05 leaves (almost) no room.
  const double edge = cb::drift_tolerance(0.05, 2.0, 1.0, 256.0, 6.0, 0.1, 0.9, 6586.0);
  CHECK(edge >= 0.0);
  CHECK(edge < 1e-5);
  CHECK(cb::drift_tolerance(0.05, 2.0, 1.0, 256.0, 6.0, 0.1, 0.9, 3000.0) < 0.0);
  static_assert(cb::output_fidelity_bound(2.0, 0.75) == 1.0);
  CHECK(cb::output_fidelity_bound(2.0, 1.0) == 0.0);
  CHECK(cb::output_fidelity_bound(2.0, 0.0) == 2.0);  // nothing retained: at most V
  CHECK(cb::output_fidelity_bound(0.0, 0.3) == 0.0);
}

TEST_CASE("capacity bounds: invalid parameter ranges throw moe_route::error naming the parameter") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  auto expect = [](auto f, const char* needle) {
    CAPTURE(needle);
    try {
      f();
      FAIL("no error");
    } catch (const moe_route::error& e) {
      CHECK(std::string(e.what()).find(needle) != std::string::npos);
    }
  };
  expect([] { cb::ell(0.1, 0.1); }, "ell: eta (= 0.100000) must be in [0, eps)");
  expect([] { cb::ell(1.0, 0.0); }, "ell: eps (= 1.000000) must be in (0, 1)");
  expect([&] { cb::ell(nan, 0.0); }, "eps");
  expect([] { cb::geometric_exponent(1.5, 0.1); }, "geometric_exponent: d (= 1.500000) must be finite and >= 2");
  expect([] { cb::geometric_exponent(10.0, 1.0); }, "delta (= 1.000000) must be in (0, 1)");
  expect([] { cb::cipher_budget(0, 1.0, 0.1, 0.01); }, "cipher_budget: N_e (= 0.000000) must be >= 1");
  expect([] { cb::cipher_budget(10, -1.0, 0.1, 0.01); }, "cipher_budget: mu (= -1.000000)");
  expect([] { cb::cipher_budget(10, 1.0, 0.1, -0.01); }, "eta");
  expect([] { cb::natural_order_lower_bound(0.1, 0.9, 0.5, 256, 100, 0.1); }, "beta (= 0.500000) must be finite and >= 1");
  expect([] { cb::natural_order_lower_bound(0.1, 1.0, 1.0, 256, 100, 0.1); }, "a0 (= 1.000000) must be in (0, 1)");
  expect([] { cb::natural_order_lower_bound(0.1, 0.9, 1.0, 0.0, 100, 0.1); }, "E (= 0.000000)");
  expect([] { cb::natural_order_capacity(0.0, 10, 0.1); }, "natural_order_capacity: pi_e (= 0.000000) must be in (0, 1)");
  expect([] { cb::natural_order_capacity(0.5, 0, 0.1); }, "N_e");
  expect([] { cb::dimension_condition(1.0, 1.0, 256, 6, 0.1, 0.9, 0.05); }, "kappa (= 1.000000) must be finite and > 1");
  expect([] { cb::min_dimension(2.0, 1.0, 256, 0.5, 0.1, 0.9, 0.05); }, "B_e (= 0.500000)");
  expect([] { cb::availability_bound(0.9, 1.0); }, "availability_bound: pi_e");
  expect([] { cb::min_available_pool(0.0, 0.5); }, "a0");
  expect([] { cb::binomial_quantile_budget(10, 1.5, 0.1); }, "binomial_quantile_budget: q (= 1.500000) must be in [0, 1]");
  expect([] { cb::binomial_quantile_budget(10, 0.5, 0.0); }, "alpha (= 0.000000) must be in (0, 1)");
  expect([] { cb::simple_budget(10, 0.5, 1.0); }, "simple_budget: alpha");
  expect([] { cb::drift_tolerance(0.0, 2, 1, 256, 6, 0.1, 0.9, 100); }, "drift_tolerance: delta0");
  expect([] { cb::drift_tolerance(0.1, 2, 1, 256, 6, 0.1, 0.9, 1.0); }, "drift_tolerance: d");
  expect([] { cb::output_fidelity_bound(-1.0, 0.5); }, "output_fidelity_bound: V (= -1.000000)");
  expect([] { cb::output_fidelity_bound(1.0, 1.5); }, "output_fidelity_bound: r (= 1.500000) must be in [0, 1]");
}
