// The fused backward (cpu::backward) against central finite differences of the
// double-precision reference gates and against the analytic VJP formulas of
// docs/policies.md section 1, for every gating, with and without normalisation and
// scaling, and for every selection (the selection held fixed at the forward's
// indices).
#include "reference.hpp"

namespace mr = moe_route;
namespace sel = moe_route::selection;
using ref::fnan;
using ref::finf;

namespace {

struct grad_errors {  // the largest share of the allowed error used (<= 1 passes)
  double fd_max = 0;   // against finite differences
  double ana_max = 0;  // against the analytic VJP
};

// Runs forward and backward on the library and compares dL/dz with the
// reference for every token. L = sum_k c_k w_k with random c.
template <class Router, class T>
grad_errors check_gradient(const Router& r, const std::vector<T>& z, std::int64_t N, int E, const float* bias,
                           ref::rng& g, double fd_rtol = 1e-3, double ana_rtol = 2e-5, bool run_fd = true) {
  const int K = r.top_k;
  const ref::spec sp = ref::spec_of(r);
  const auto fwd = ref::run(r, z, N, E, bias);
  std::vector<float> c(N * K);
  for (auto& x : c) x = static_cast<float>(g.normal());
  const auto dz = ref::run_backward(r, z, N, E, bias, fwd.idx, c);
  grad_errors err;
  int reported = 0;
  for (std::int64_t t = 0; t < N; ++t) {
    std::vector<double> zt(E), ct(K);
    for (int e = 0; e < E; ++e) zt[e] = ref::value(z[t * E + e]);
    for (int j = 0; j < K; ++j) ct[j] = c[t * K + j];
    const std::vector<int> idx(fwd.idx.begin() + t * K, fwd.idx.begin() + (t + 1) * K);
    const auto ana = ref::vjp(sp, zt, idx.data(), ct);
    const auto bound = ref::vjp_bound(sp, zt, idx.data(), ct);
    double gsum = 0;  // the size of L, for the finite differences' own noise
    for (double x : ct) gsum += std::fabs(x) * sp.scaling;
    std::vector<double> fd;
    if (run_fd) {
      fd = ref::fd_gradient(sp, zt, idx.data(), ct);
      // the reference's own formulas agree with its finite differences
      for (int e = 0; e < E; ++e) CHECK(ref::close(ana[e], fd[e], 1e-5, 1e-7 * bound[e] + 1e-9 * gsum));
    }
    std::vector<char> selected(E, 0);
    for (int j = 0; j < K; ++j) selected[idx[j]] = 1;
    for (int e = 0; e < E; ++e) {
      const double lib = dz[t * E + e];
      bool ok = std::isfinite(lib);
      // float rounding in the row's sums (e.g. <ds, s> under softmax, which
      // cancels to 0 when the gates are normalised) leaves absolute errors of a
      // few ulps of the terms dz_e is made of: allow 1e-6 * that magnitude on top
      // of the relative tolerance
      const double allowed_ana = ana_rtol * std::fabs(ana[e]) + 1e-6 * bound[e] + 1e-30;
      const double ea = std::fabs(lib - ana[e]) / allowed_ana;
      err.ana_max = std::max(err.ana_max, ea);
      ok = ok && ea <= 1.0;
      if (run_fd) {
        const double allowed_fd = fd_rtol * std::fabs(fd[e]) + 1e-5 * bound[e] + 1e-9 * gsum;
        const double ef = std::fabs(lib - fd[e]) / allowed_fd;
        err.fd_max = std::max(err.fd_max, ef);
        ok = ok && ef <= 1.0;
      }
      // experts outside the selection get exactly 0 unless the gating couples the row
      if (sp.gate != ref::gate_kind::softmax && !selected[e]) ok = ok && lib == 0.0;
      if (!ok && reported++ < 5)
        FAIL_CHECK("token " << t << " expert " << e << std::string(selected[e] ? " (selected)" : "") << ": library " << lib
                            << ", analytic " << ana[e] << (run_fd ? ", finite differences " + std::to_string(fd[e]) : "")
                            << ", magnitude bound " << bound[e]);
    }
  }
  CHECK(reported == 0);
  return err;
}

template <class G, class S>
using router = mr::router<G, S, 32>;

}  // namespace

TEST_CASE_TEMPLATE("backward: every gating x selection x normalisation x scaling, finite differences and VJP",
                   T, float, mr::bfloat16, mr::float16) {
  ref::rng g(555);
  double worst_fd = 0, worst_ana = 0;
  auto one = [&](auto r, int E, int K, bool normalize, float scaling, bool biased) {
    r.top_k = K;
    r.normalize = normalize;
    r.scaling_factor = scaling;
    const std::int64_t N = 6;
    // distinct logits 0.35 apart in [-4, 4]: no selection flips under the FD step
    const auto z = ref::separated_logits<T>(g, N, E, 8.0 / E);
    const auto b = ref::random_bias(g, E, 0.01);
    const auto err = check_gradient(r, z, N, E, biased ? b.data() : nullptr, g);
    worst_fd = std::max(worst_fd, err.fd_max);
    worst_ana = std::max(worst_ana, err.ana_max);
  };
  ref::for_each_gating([&](auto gate) {
    using G = decltype(gate);
    for (bool normalize : {false, true})
      for (float scaling : {1.0f, 2.5f}) {
        const std::string gating_name = G::name;
          CAPTURE(gating_name);
        CAPTURE(normalize);
        CAPTURE(scaling);
        one(router<G, sel::top_k>{}, 24, 4, normalize, scaling, false);
        one(router<G, sel::top_k>{}, 7, 7, normalize, scaling, false);
        one(router<G, sel::top_k>{}, 5, 1, normalize, scaling, false);
        one(router<G, sel::fixed>{}, 24, 5, normalize, scaling, false);
        router<G, sel::group_limited<sel::top_k>> gl;
        gl.selection.groups = 4;
        gl.selection.top_groups = 2;
        one(gl, 24, 4, normalize, scaling, false);
        if constexpr (ref::scores_before_selection<G>) {
          one(router<G, sel::expert_bias>{}, 24, 4, normalize, scaling, true);
          router<G, sel::group_limited<sel::expert_bias>> gb;
          gb.selection.groups = 4;
          gb.selection.top_groups = 2;
          one(gb, 24, 4, normalize, scaling, true);
        }
      }
  });
  MESSAGE(std::string(ref::type_name<T>()) << ": largest share of the tolerance used: finite differences (rtol 1e-3) "
                              << worst_fd << ", analytic VJP (rtol 2e-5) " << worst_ana);
}

TEST_CASE("backward: larger rows against the analytic VJP (E = 100, 256, 1000)") {
  ref::rng g(9);
  ref::for_each_gating([&](auto gate) {
    using G = decltype(gate);
    for (int E : {100, 256, 1000}) {
      const std::string gating_name = G::name;
          CAPTURE(gating_name);
      CAPTURE(E);
      router<G, sel::top_k> r;
      r.top_k = 8;
      r.normalize = true;
      r.scaling_factor = 1.5f;
      const std::int64_t N = 4;
      const auto z = ref::random_logits<float>(g, N, E, 2.0);
      check_gradient(r, z, N, E, nullptr, g, 0, 2e-5, false);
    }
  });
}

TEST_CASE("backward: NaN logits get gradient 0; rows with +-inf stay finite") {
  ref::rng g(10);
  const int E = 12;
  const std::int64_t N = 40;
  std::vector<float> z(N * E);
  for (std::int64_t t = 0; t < N; ++t)
    for (int e = 0; e < E; ++e) {
      const int k = g.integer(0, 9);
      float x = static_cast<float>(g.normal(2.0));
      if (k == 0) x = fnan();
      if (k == 1 && t % 3 == 0) x = finf();
      if (k == 2 && t % 3 == 1) x = -finf();
      if (t % 10 == 5 && e > 1) x = fnan();  // NaN must be selected: K > finite count
      z[t * E + e] = x;
    }
  ref::for_each_gating([&](auto gate) {
    using G = decltype(gate);
    for (bool normalize : {false, true}) {
      const std::string gating_name = G::name;
          CAPTURE(gating_name);
      CAPTURE(normalize);
      router<G, sel::top_k> r;
      r.top_k = 4;
      r.normalize = normalize;
      const auto fwd = ref::run(r, z, N, E);
      std::vector<float> c(N * 4);
      for (auto& x : c) x = static_cast<float>(g.normal());
      const auto dz = ref::run_backward(r, z, N, E, nullptr, fwd.idx, c);
      for (std::int64_t t = 0; t < N; ++t)
        for (int e = 0; e < E; ++e) {
          CAPTURE(t);
          CAPTURE(e);
          CHECK(std::isfinite(dz[t * E + e]));
          if (std::isnan(z[t * E + e])) CHECK(dz[t * E + e] == 0.0f);
        }
      // and the finite entries follow the analytic VJP on the sanitised row
      check_gradient(r, z, N, E, nullptr, g, 0, 2e-5, false);
    }
  });
}

// regression: the selected-softmax VJP divided 0 by 0
TEST_CASE("backward under softmax_after_topk of an all-NaN row: gradient 0") {
  const int E = 4;
  std::vector<float> z(E, fnan());
  router<mr::gating::softmax_after_topk, sel::top_k> r;
  r.top_k = 2;
  const std::vector<std::int32_t> idx = {0, 1};
  const std::vector<float> c = {1.0f, -2.0f};
  const auto dz = ref::run_backward(r, z, 1, E, nullptr, idx, c);
  MOE_CHECK_VEC(dz, (std::vector<float>(E, 0.0f)));
}

TEST_CASE("backward: hand-computed softmax and sigmoid gradients") {
  const std::vector<float> z = {0.0f, 1.0f, 2.0f};
  SUBCASE("softmax, K = 1, no normalisation: dz = s_top * (e_top - s)") {
    router<mr::gating::softmax, sel::top_k> r;
    r.top_k = 1;
    const auto dz = ref::run_backward(r, z, 1, 3, nullptr, {2}, {1.0f});
    const double S = 1 + std::exp(1.0) + std::exp(2.0);
    const double s0 = 1 / S, s1 = std::exp(1.0) / S, s2 = std::exp(2.0) / S;
    CHECK(dz[0] == doctest::Approx(-s2 * s0).epsilon(1e-6));
    CHECK(dz[1] == doctest::Approx(-s2 * s1).epsilon(1e-6));
    CHECK(dz[2] == doctest::Approx(s2 * (1 - s2)).epsilon(1e-6));
  }
  SUBCASE("softmax, K = 1, normalised: the gate is constant 1, the gradient 0") {
    router<mr::gating::softmax, sel::top_k> r;
    r.top_k = 1;
    r.normalize = true;
    const auto dz = ref::run_backward(r, z, 1, 3, nullptr, {2}, {1.0f});
    for (float x : dz) CHECK(std::fabs(x) < 1e-7f);
  }
  SUBCASE("sigmoid, K = 2, not normalised, scaled by 3") {
    router<mr::gating::sigmoid, sel::top_k> r;
    r.top_k = 2;
    r.normalize = false;
    r.scaling_factor = 3.0f;
    const auto dz = ref::run_backward(r, z, 1, 3, nullptr, {2, 1}, {1.0f, 2.0f});
    const double s1 = 1 / (1 + std::exp(-1.0)), s2 = 1 / (1 + std::exp(-2.0));
    CHECK(dz[0] == 0.0f);
    CHECK(dz[1] == doctest::Approx(3 * 2 * s1 * (1 - s1)).epsilon(1e-6));
    CHECK(dz[2] == doctest::Approx(3 * 1 * s2 * (1 - s2)).epsilon(1e-6));
  }
}

TEST_CASE("backward: the bias never receives or changes the gradient beyond the selection") {
  // expert_bias uses s for the gates: with the same indices, the gradient equals
  // that of plain top_k with the same gating.
  ref::rng g(4);
  const int E = 32, K = 4;
  const std::int64_t N = 16;
  const auto z = ref::random_logits<float>(g, N, E, 2.0);
  const auto b = ref::random_bias(g, E, 1.0);
  router<mr::gating::sigmoid, sel::expert_bias> rb;
  rb.top_k = K;
  router<mr::gating::sigmoid, sel::top_k> rt;
  rt.top_k = K;
  const auto fwd = ref::run(rb, z, N, E, b.data());
  std::vector<float> c(N * K, 1.0f);
  const auto db = ref::run_backward(rb, z, N, E, b.data(), fwd.idx, c);
  const auto dt = ref::run_backward(rt, z, N, E, nullptr, fwd.idx, c);
  CHECK(db == dt);
  // and the bias moved the selection on some tokens (the test is not vacuous)
  CHECK(ref::run(rt, z, N, E).idx != fwd.idx);
}
