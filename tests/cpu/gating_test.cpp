// Gating functions (docs/policies.md section 1) against the double-precision
// reference: scores, normalisation, scaling, and the handling of NaN, +-inf
// and huge logits.
#include "reference.hpp"

namespace mr = moe_route;
using ref::fnan;
using ref::finf;

namespace {

template <class G, int MaxK = 32>
using topk_router = mr::router<G, mr::selection::top_k, MaxK>;

constexpr float big = 3.402823466e+38f;

}  // namespace

TEST_CASE_TEMPLATE("every gating matches the double reference on random logits", T, float, mr::bfloat16,
                   mr::float16) {
  ref::rng g(1234);
  struct shape { int E, K; };
  const shape shapes[] = {{1, 1}, {8, 2}, {64, 6}, {100, 7}, {256, 8}, {33, 32}, {32, 32}};
  ref::for_each_gating([&](auto gate) {
    using G = decltype(gate);
    for (const shape& sh : shapes)
      for (bool normalize : {false, true})
        for (float scaling : {1.0f, 2.5f}) {
          const std::string gating_name = G::name;
          CAPTURE(gating_name);
          CAPTURE(sh.E);
          CAPTURE(sh.K);
          CAPTURE(normalize);
          CAPTURE(scaling);
          topk_router<G> r;
          r.top_k = sh.K;
          r.normalize = normalize;
          r.scaling_factor = scaling;
          const std::int64_t N = 40;
          const auto z = ref::random_logits<T>(g, N, sh.E, 2.0);
          ref::route_and_check(r, z, N, sh.E);
        }
  });
}

TEST_CASE("router defaults: normalisation on for sigmoid and sqrt_softplus, off for softmax; scaling 1") {
  CHECK_FALSE(topk_router<mr::gating::softmax>{}.normalize);
  CHECK(topk_router<mr::gating::sigmoid>{}.normalize);
  CHECK(topk_router<mr::gating::sqrt_softplus>{}.normalize);
  CHECK_FALSE(topk_router<mr::gating::softmax_after_topk>{}.normalize);
  CHECK(topk_router<mr::gating::softmax>{}.scaling_factor == 1.0f);
  CHECK(topk_router<mr::gating::sigmoid>{}.top_k == 1);
}

TEST_CASE("hand-computed gates") {
  const int E = 4;
  const std::vector<float> z = {0.0f, 1.0f, 2.0f, 3.0f};
  SUBCASE("softmax, K = 2, not normalised, scaled by 2") {
    topk_router<mr::gating::softmax> r;
    r.top_k = 2;
    r.scaling_factor = 2.0f;
    const auto o = ref::run(r, z, 1, E);
    const double S = 1 + std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
    MOE_CHECK_VEC(o.idx, (std::vector<std::int32_t>{3, 2}));
    CHECK(o.gates[0] == doctest::Approx(2 * std::exp(3.0) / S).epsilon(1e-6));
    CHECK(o.gates[1] == doctest::Approx(2 * std::exp(2.0) / S).epsilon(1e-6));
  }
  SUBCASE("softmax, K = 2, normalised: the two gates are the softmax of the two") {
    topk_router<mr::gating::softmax> r;
    r.top_k = 2;
    r.normalize = true;
    const auto o = ref::run(r, z, 1, E);
    CHECK(o.gates[0] == doctest::Approx(1 / (1 + std::exp(-1.0))).epsilon(1e-6));
    CHECK(o.gates[1] == doctest::Approx(1 / (1 + std::exp(1.0))).epsilon(1e-6));
  }
  SUBCASE("sigmoid, K = 3, normalised") {
    topk_router<mr::gating::sigmoid> r;
    r.top_k = 3;
    const auto o = ref::run(r, z, 1, E);
    const double s3 = 1 / (1 + std::exp(-3.0)), s2 = 1 / (1 + std::exp(-2.0)), s1 = 1 / (1 + std::exp(-1.0));
    MOE_CHECK_VEC(o.idx, (std::vector<std::int32_t>{3, 2, 1}));
    CHECK(o.gates[0] == doctest::Approx(s3 / (s1 + s2 + s3)).epsilon(1e-6));
    CHECK(o.gates[2] == doctest::Approx(s1 / (s1 + s2 + s3)).epsilon(1e-6));
  }
  SUBCASE("sqrt_softplus, K = 1, not normalised") {
    topk_router<mr::gating::sqrt_softplus> r;
    r.top_k = 1;
    r.normalize = false;
    const auto o = ref::run(r, z, 1, E);
    CHECK(o.idx[0] == 3);
    CHECK(o.gates[0] == doctest::Approx(std::sqrt(std::log1p(std::exp(3.0)))).epsilon(1e-6));
  }
  SUBCASE("sqrt_softplus, K = 1, normalised: the gate is 1") {
    topk_router<mr::gating::sqrt_softplus> r;
    const auto o = ref::run(r, z, 1, E);
    CHECK(o.gates[0] == doctest::Approx(1.0).epsilon(1e-6));
  }
  SUBCASE("softmax_after_topk (Mixtral), K = 2, scaled: normalize is irrelevant") {
    for (bool normalize : {false, true}) {
      topk_router<mr::gating::softmax_after_topk> r;
      r.top_k = 2;
      r.normalize = normalize;
      r.scaling_factor = 3.0f;
      const auto o = ref::run(r, z, 1, E);
      MOE_CHECK_VEC(o.idx, (std::vector<std::int32_t>{3, 2}));
      CHECK(o.gates[0] == doctest::Approx(3 / (1 + std::exp(-1.0))).epsilon(1e-6));
      CHECK(o.gates[1] == doctest::Approx(3 / (1 + std::exp(1.0))).epsilon(1e-6));
    }
  }
}

TEST_CASE("large logits: +-80, +-1e30, +-FLT_MAX and wide random rows") {
  ref::rng g(77);
  const int E = 24;
  const std::int64_t N = 64;
  std::vector<float> z(N * E);
  const float specials[] = {80.0f, -80.0f, 1e30f, -1e30f, big, -big, 87.5f, -87.5f, 0.0f, -0.0f, 1.0f};
  for (std::int64_t t = 0; t < N; ++t)
    for (int e = 0; e < E; ++e) {
      float x;
      if (t < N / 2) x = specials[g.integer(0, 10)] * (g.integer(0, 3) == 0 ? 1.0f : 0.5f);
      else x = static_cast<float>(g.normal(40.0));
      z[t * E + e] = x;
    }
  ref::for_each_gating([&](auto gate) {
    using G = decltype(gate);
    for (bool normalize : {false, true})
      for (int K : {1, 4, 24}) {
        const std::string gating_name = G::name;
          CAPTURE(gating_name);
        CAPTURE(K);
        CAPTURE(normalize);
        topk_router<G> r;
        r.top_k = K;
        r.normalize = normalize;
        r.scaling_factor = 1.5f;
        // exp's argument v - max is rounded to float: relative error up to
        // ulp(87)/2 ~ 4e-6 for the smallest terms
        ref::route_and_check(r, z, N, E, nullptr, 1e-5);
      }
  });
}

TEST_CASE("a row of all NaN under softmax: indices 0..K-1, gates 0, row counted") {
  const int E = 5, K = 3;
  std::vector<float> z(E, fnan());
  for (bool normalize : {false, true}) {
    topk_router<mr::gating::softmax> r;
    r.top_k = K;
    r.normalize = normalize;
    const auto o = ref::run(r, z, 1, E);
    MOE_CHECK_VEC(o.idx, (std::vector<std::int32_t>{0, 1, 2}));
    MOE_CHECK_VEC(o.gates, (std::vector<float>{0.0f, 0.0f, 0.0f}));
    CHECK(o.report == 1);
    CHECK(o.counter == 1);
  }
}

TEST_CASE("a row of all NaN under the elementwise gatings: gates 0") {
  const int E = 4, K = 2;
  std::vector<float> z(E, fnan());
  topk_router<mr::gating::sigmoid> a;
  a.top_k = K;
  topk_router<mr::gating::sqrt_softplus> b;
  b.top_k = K;
  for (const auto& o : {ref::run(a, z, 1, E), ref::run(b, z, 1, E)}) {
    MOE_CHECK_VEC(o.idx, (std::vector<std::int32_t>{0, 1}));
    MOE_CHECK_VEC(o.gates, (std::vector<float>{0.0f, 0.0f}));
    CHECK(o.report == 1);
  }
}

// NaN logits score 0; a row of NaN under softmax has gates 0. Under
// softmax_after_topk the K selected logits of such a row are all NaN, and the
// same rule gives gates 0 (regression: they were 0/0 = NaN).
TEST_CASE("a row of all NaN under softmax_after_topk: gates 0 (finite)") {
  const int E = 4, K = 2;
  std::vector<float> z(E, fnan());
  topk_router<mr::gating::softmax_after_topk> r;
  r.top_k = K;
  const auto o = ref::run(r, z, 1, E);
  MOE_CHECK_VEC(o.idx, (std::vector<std::int32_t>{0, 1}));
  CHECK(o.gates[0] == 0.0f);
  CHECK(o.gates[1] == 0.0f);
  CHECK(o.report == 1);
}

TEST_CASE("NaN and infinities inside rows") {
  const int E = 6;
  SUBCASE("softmax: a single +inf takes the whole mass, two share it") {
    topk_router<mr::gating::softmax> r;
    r.top_k = 3;
    const std::vector<float> z = {1.0f, finf(), 2.0f, fnan(), -finf(), 0.5f,
                                  finf(), 1.0f, finf(), 0.0f, fnan(), fnan()};
    const auto o = ref::run(r, z, 2, E);
    MOE_CHECK_VEC(o.idx, (std::vector<std::int32_t>{1, 2, 0, 0, 2, 1}));
    MOE_CHECK_VEC(o.gates, (std::vector<float>{1.0f, 0.0f, 0.0f, 0.5f, 0.5f, 0.0f}));
    CHECK(o.report == 2);
  }
  SUBCASE("sigmoid: +inf scores 1, -inf scores 0, NaN never selected while a number exists") {
    topk_router<mr::gating::sigmoid> r;
    r.top_k = 5;
    r.normalize = false;
    const std::vector<float> z = {fnan(), -finf(), finf(), fnan(), 0.0f, -1.0f};
    const auto o = ref::run(r, z, 1, E);
    MOE_CHECK_VEC(o.idx, (std::vector<std::int32_t>{2, 4, 5, 1, 0}));
    CHECK(o.gates[0] == 1.0f);
    CHECK(o.gates[1] == 0.5f);
    CHECK(o.gates[3] == 0.0f);
    CHECK(o.gates[4] == 0.0f);  // a NaN logit scores 0
  }
  SUBCASE("sqrt_softplus: -inf and NaN score 0, +inf saturates to sqrt(FLT_MAX)") {
    topk_router<mr::gating::sqrt_softplus> r;
    r.top_k = 3;
    r.normalize = false;
    const std::vector<float> z = {fnan(), -finf(), finf(), 0.0f, 0.0f, 0.0f};
    std::vector<float> row(z);
    const auto o = ref::run(r, row, 1, E);
    MOE_CHECK_VEC(o.idx, (std::vector<std::int32_t>{2, 3, 4}));
    CHECK(o.gates[0] == doctest::Approx(std::sqrt(ref::flt_max)).epsilon(1e-6));
    CHECK(o.gates[1] == doctest::Approx(std::sqrt(std::log(2.0))).epsilon(1e-6));
    r.top_k = 6;
    const auto all = ref::run(r, row, 1, E);
    MOE_CHECK_VEC(all.idx, (std::vector<std::int32_t>{2, 3, 4, 5, 1, 0}));
    CHECK(all.gates[4] == 0.0f);
    CHECK(all.gates[5] == 0.0f);
  }
  SUBCASE("softmax_after_topk: a NaN among the selected gets gate 0") {
    topk_router<mr::gating::softmax_after_topk> r;
    r.top_k = 3;
    const std::vector<float> z = {fnan(), 2.0f, fnan(), fnan(), fnan(), 2.0f};
    const auto o = ref::run(r, z, 1, E);
    MOE_CHECK_VEC(o.idx, (std::vector<std::int32_t>{1, 5, 0}));
    MOE_CHECK_VEC(o.gates, (std::vector<float>{0.5f, 0.5f, 0.0f}));
  }
  SUBCASE("random rows with NaN/+-inf sprinkled in, every gating, against the reference") {
    ref::rng g(99);
    const int EE = 37;
    const std::int64_t N = 200;
    std::vector<float> z(N * EE);
    for (std::int64_t t = 0; t < N; ++t)
      for (int e = 0; e < EE; ++e) {
        const int kind = g.integer(0, 40);
        float x = static_cast<float>(g.normal(3.0));
        if (t % 4 != 0) {  // every fourth row stays finite
          if (kind == 0) x = fnan();
          else if (kind == 1) x = finf();
          else if (kind == 2) x = -finf();
        }
        if (t % 50 == 7)  // a few rows mostly NaN, so NaN must be selected
          x = e < 3 ? static_cast<float>(g.normal()) : fnan();
        z[t * EE + e] = x;
      }
    ref::for_each_gating([&](auto gate) {
      using G = decltype(gate);
      for (int K : {1, 5, 8}) {
        const std::string gating_name = G::name;
          CAPTURE(gating_name);
        CAPTURE(K);
        topk_router<G> r;
        r.top_k = K;
        const auto st = ref::route_and_check(r, z, N, EE, nullptr, 2e-6);
        CHECK(st.nonfinite_rows > 100);  // the sprinkling did produce nonfinite rows
        CHECK(st.nonfinite_rows < N);
      }
    });
  }
}

TEST_CASE("nonfinite_rows: route_report and route_outputs count rows with NaN or +-inf") {
  const int E = 3;
  const std::vector<float> z = {0.0f, 1.0f, 2.0f,     // finite
                                fnan(), 1.0f, 2.0f,   // NaN
                                0.0f, finf(), 2.0f,   // +inf
                                0.0f, 1.0f, -finf(),  // -inf
                                big, -big, 0.0f,    // finite extremes
                                fnan(), finf(), -finf()};
  topk_router<mr::gating::softmax> r;
  r.top_k = 2;
  const auto o = ref::run(r, z, 6, E);
  CHECK(o.report == 4);
  CHECK(o.counter == 4);
  // the counter is optional
  std::vector<std::int32_t> idx(12);
  std::vector<float> gates(12);
  mr::route_inputs<float> in;
  in.logits = z.data();
  in.num_tokens = 6;
  in.num_experts = E;
  mr::route_outputs out;
  out.indices = idx.data();
  out.gates = gates.data();
  CHECK(mr::cpu::route(r, in, out).nonfinite_rows == 4);
}

TEST_CASE("16-bit logits: NaN and infinity encodings are recognised") {
  const int E = 3;
  topk_router<mr::gating::softmax> r;
  r.top_k = 2;
  {
    const std::vector<mr::bfloat16> z = {mr::bfloat16{0x7fc0}, mr::bfloat16{0x3f80}, mr::bfloat16{0x7f80},
                                         mr::bfloat16{0xff81}, mr::bfloat16{0x0000}, mr::bfloat16{0x8000}};
    const auto o = ref::run(r, z, 2, E);
    MOE_CHECK_VEC(o.idx, (std::vector<std::int32_t>{2, 1, 1, 2}));  // row 2: +0 and -0 tie -> lower index
    CHECK(o.gates[0] == 1.0f);
    CHECK(o.gates[1] == 0.0f);
    CHECK(o.gates[2] == 0.5f);
    CHECK(o.report == 2);
  }
  {
    const std::vector<mr::float16> z = {mr::float16{0x7e00}, mr::float16{0x3c00}, mr::float16{0x7c00},
                                        mr::float16{0xfc01}, mr::float16{0xfc00}, mr::float16{0x0001}};
    const auto o = ref::run(r, z, 2, E);
    MOE_CHECK_VEC(o.idx, (std::vector<std::int32_t>{2, 1, 2, 1}));  // NaN below -inf
    CHECK(o.report == 2);
  }
}
