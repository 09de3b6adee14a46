// Selection policies (docs/policies.md section 2) against the double-precision
// reference: top_k, expert_bias, group_limited<top_k>, group_limited<expert_bias>
// and fixed, on random inputs and on adversarial rows (ties, signed zeros,
// NaN/+-inf, E not a multiple of 32, K = E, K = 1, N = 0, N = 1).
#include "reference.hpp"

namespace mr = moe_route;
namespace sel = moe_route::selection;
using ref::fnan;
using ref::finf;

namespace {

constexpr float big = 3.402823466e+38f;

template <class G, class S, int MaxK = 32>
using router = mr::router<G, S, MaxK>;

}  // namespace

TEST_CASE_TEMPLATE("top_k: random logits, E not a multiple of 32, K from 1 to E", T, float, mr::bfloat16,
                   mr::float16) {
  ref::rng g(42);
  struct shape { int E, K; std::int64_t N; };
  const shape shapes[] = {{1, 1, 20},   {7, 1, 50},   {7, 3, 50},    {7, 7, 50},     {33, 1, 40},
                          {33, 5, 40},  {33, 32, 40}, {100, 8, 40},  {100, 16, 40},  {1000, 8, 12},
                          {1000, 32, 12}, {4096, 1, 6}, {4096, 9, 6}, {4096, 32, 6}, {31, 31, 30}};
  ref::for_each_gating([&](auto gate) {
    using G = decltype(gate);
    for (const shape& sh : shapes) {
      const std::string gating_name = G::name;
          CAPTURE(gating_name);
      CAPTURE(sh.E);
      CAPTURE(sh.K);
      router<G, sel::top_k> r;
      r.top_k = sh.K;
      const auto z = ref::random_logits<T>(g, sh.N, sh.E, 2.0);
      // rows of 1000+ experts: the softmax sum runs over 32 lanes of up to 128
      // sequential fp32 additions
      ref::route_and_check(r, z, sh.N, sh.E, nullptr, sh.E >= 1000 ? 1e-5 : 2e-6);
    }
  });
}

TEST_CASE_TEMPLATE("expert_bias: random logits and bias, keys s + b", T, float, mr::bfloat16, mr::float16) {
  ref::rng g(7);
  struct shape { int E, K; std::int64_t N; };
  const shape shapes[] = {{1, 1, 10}, {7, 2, 60}, {64, 6, 60}, {100, 8, 40}, {256, 8, 40}, {32, 32, 20},
                          {1000, 16, 8}};
  auto body = [&](auto gate) {
    using G = decltype(gate);
    if constexpr (ref::scores_before_selection<G>) {
      for (const shape& sh : shapes)
        for (double bias_sigma : {0.0, 0.02, 0.5}) {
          const std::string gating_name = G::name;
          CAPTURE(gating_name);
          CAPTURE(sh.E);
          CAPTURE(sh.K);
          CAPTURE(bias_sigma);
          router<G, sel::expert_bias> r;
          r.top_k = sh.K;
          r.scaling_factor = 2.0f;
          const auto z = ref::random_logits<T>(g, sh.N, sh.E, 1.5);
          const auto b = ref::random_bias(g, sh.E, bias_sigma);
          const auto st = ref::route_and_check(r, z, sh.N, sh.E, b.data(), sh.E >= 1000 ? 1e-5 : 2e-6);
          CHECK(st.ambiguous_positions <= st.rows / 10);
        }
    }
  };
  ref::for_each_gating(body);
}

TEST_CASE("expert_bias: the bias steers selection only; gates use s") {
  router<mr::gating::sigmoid, sel::expert_bias> r;
  r.top_k = 2;
  r.normalize = false;
  const std::vector<float> z = {0.0f, 0.0f, 0.0f, 0.0f, 1.0f};
  const std::vector<float> b = {0.0f, 0.1f, -0.1f, 0.2f, -0.5f};
  const auto o = ref::run(r, z, 1, 5, b.data());
  // keys: 0.5, 0.6, 0.4, 0.7, 0.731 - 0.5 = 0.231
  MOE_CHECK_VEC(o.idx, (std::vector<std::int32_t>{3, 1}));
  MOE_CHECK_VEC(o.gates, (std::vector<float>{0.5f, 0.5f}));
  // with expert_bias the key is a score, not a logit: saturated sigmoid scores tie
  const std::vector<float> z2 = {30.0f, 40.0f, 35.0f, -1.0f, 0.0f};
  const std::vector<float> b0(5, 0.0f);
  const auto o2 = ref::run(r, z2, 1, 5, b0.data());
  MOE_CHECK_VEC(o2.idx, (std::vector<std::int32_t>{0, 1}));  // s = 1.0f for all three: lower index
  // ... whereas top_k keys on the logit
  router<mr::gating::sigmoid, sel::top_k> t;
  t.top_k = 2;
  const auto o3 = ref::run(t, z2, 1, 5);
  MOE_CHECK_VEC(o3.idx, (std::vector<std::int32_t>{1, 2}));
}

TEST_CASE("expert_bias: a NaN logit stays below every number whatever its bias") {
  router<mr::gating::softmax, sel::expert_bias> r;
  r.top_k = 2;
  const std::vector<float> z = {fnan(), 0.0f, -finf(), 1.0f};
  const std::vector<float> b = {100.0f, 0.0f, 0.0f, 0.0f};
  const auto o = ref::run(r, z, 1, 4, b.data());
  MOE_CHECK_VEC(o.idx, (std::vector<std::int32_t>{3, 1}));
  r.top_k = 4;
  const auto all = ref::run(r, z, 1, 4, b.data());
  MOE_CHECK_VEC(all.idx, (std::vector<std::int32_t>{3, 1, 2, 0}));
}

// docs/policies.md section 2: "NaN keys rank below -inf". Under expert_bias the key
// is s + b, so a NaN entry in the caller's bias makes that expert's key NaN,
// which must then rank last, not first (regression: it packed above +inf).
TEST_CASE("expert_bias: a NaN key (from a NaN bias entry) ranks below -inf") {
  router<mr::gating::sigmoid, sel::expert_bias> r;
  r.top_k = 2;
  const std::vector<float> z = {0.0f, 0.0f, 0.0f, 0.0f};          // s = 0.5 everywhere
  const std::vector<float> b = {fnan(), -0.3f, 0.0f, -finf()};    // keys NaN, 0.2, 0.5, -inf
  MOE_CHECK_VEC(ref::run(r, z, 1, 4, b.data()).idx, (std::vector<std::int32_t>{2, 1}));
  r.top_k = 4;
  MOE_CHECK_VEC(ref::run(r, z, 1, 4, b.data()).idx, (std::vector<std::int32_t>{2, 1, 3, 0}));
  // the same under group_limited: group 0's best key is 0.2 (NaN ranks last),
  // group 1's is 0.5, so group 1 is kept
  router<mr::gating::sigmoid, sel::group_limited<sel::expert_bias>> gr;
  gr.top_k = 2;
  gr.selection.groups = 2;
  gr.selection.top_groups = 1;
  gr.selection.per_group_k = 1;
  MOE_CHECK_VEC(ref::run(gr, z, 1, 4, b.data()).idx, (std::vector<std::int32_t>{2, 3}));
}

TEST_CASE("top_k keys on the sanitised logit: ties, signed zeros, infinities, NaN") {
  router<mr::gating::sigmoid, sel::top_k> r;
  SUBCASE("all-equal rows select 0..K-1") {
    for (int E : {1, 7, 33, 100}) {
      for (float x : {0.0f, -0.0f, 3.0f, -finf(), finf(), fnan()}) {
        const int K = std::min(E, 5);
        r.top_k = K;
        const std::vector<float> z(E, x);
        const auto o = ref::run(r, z, 1, E);
        for (int j = 0; j < K; ++j) CHECK(o.idx[j] == j);
      }
    }
  }
  SUBCASE("-0.0 and +0.0 tie: the lower index wins in either order") {
    r.top_k = 1;
    CHECK(ref::run(r, std::vector<float>{-0.0f, 0.0f, -1.0f}, 1, 3).idx[0] == 0);
    CHECK(ref::run(r, std::vector<float>{0.0f, -0.0f, -1.0f}, 1, 3).idx[0] == 0);
    CHECK(ref::run(r, std::vector<float>{-1.0f, -0.0f, 0.0f}, 1, 3).idx[0] == 1);
    r.top_k = 3;
    MOE_CHECK_VEC(ref::run(r, std::vector<float>{-1.0f, -0.0f, 0.0f}, 1, 3).idx, (std::vector<std::int32_t>{1, 2, 0}));
  }
  SUBCASE("+inf saturates to FLT_MAX and ties with it; -inf ties with -FLT_MAX; NaN below -inf") {
    r.top_k = 2;
    MOE_CHECK_VEC(ref::run(r, std::vector<float>{big, finf(), 1.0f}, 1, 3).idx, (std::vector<std::int32_t>{0, 1}));
    MOE_CHECK_VEC(ref::run(r, std::vector<float>{1.0f, finf(), big}, 1, 3).idx, (std::vector<std::int32_t>{1, 2}));
    MOE_CHECK_VEC(ref::run(r, std::vector<float>{fnan(), -finf(), -big}, 1, 3).idx, (std::vector<std::int32_t>{1, 2}));
    MOE_CHECK_VEC(ref::run(r, std::vector<float>{fnan(), fnan(), -finf()}, 1, 3).idx, (std::vector<std::int32_t>{2, 0}));
    MOE_CHECK_VEC(ref::run(r, std::vector<float>{-big, fnan(), -finf()}, 1, 3).idx, (std::vector<std::int32_t>{0, 2}));
  }
  SUBCASE("sigmoid scores saturate at 1 but the logits still rank") {
    r.top_k = 3;
    const auto o = ref::run(r, std::vector<float>{20.0f, 30.0f, 25.0f, 0.0f}, 1, 4);
    MOE_CHECK_VEC(o.idx, (std::vector<std::int32_t>{1, 2, 0}));
    for (float w : o.gates) CHECK(w == doctest::Approx(1.0 / 3).epsilon(1e-6));
  }
  SUBCASE("huge magnitudes rank exactly") {
    r.top_k = 3;
    const auto o = ref::run(r, std::vector<float>{1e30f, -1e30f, 1.0000001e30f, 80.0f, -80.0f}, 1, 5);
    MOE_CHECK_VEC(o.idx, (std::vector<std::int32_t>{2, 0, 3}));
  }
  SUBCASE("NaN is never selected while a number exists (random positions)") {
    ref::rng g(5);
    const int E = 50;
    const std::int64_t N = 100;
    std::vector<float> z(N * E);
    for (std::int64_t t = 0; t < N; ++t) {
      const int finite = g.integer(1, E);  // number of non-NaN entries in the row
      std::vector<int> perm(E);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), g.gen);
      for (int e = 0; e < E; ++e) z[t * E + perm[e]] = e < finite ? static_cast<float>(g.normal(5.0)) : fnan();
    }
    r.top_k = 12;
    const auto o = ref::run(r, z, N, E);
    for (std::int64_t t = 0; t < N; ++t) {
      int finite = 0;
      for (int e = 0; e < E; ++e) finite += !std::isnan(z[t * E + e]);
      for (int j = 0; j < 12; ++j) {
        const bool is_nan = std::isnan(z[t * E + o.idx[t * 12 + j]]);
        CHECK(is_nan == (j >= finite));
      }
    }
    ref::check_route(r, z, N, E, nullptr, o);
  }
}

TEST_CASE("N = 0: no error, nothing written, null pointers allowed") {
  router<mr::gating::softmax, sel::top_k> r;
  r.top_k = 2;
  std::vector<std::int32_t> idx(4, -3);
  std::vector<float> gates(4, -3.0f);
  std::int64_t counter = 0;
  mr::route_inputs<float> in;
  in.num_tokens = 0;
  in.num_experts = 8;
  mr::route_outputs out;
  SUBCASE("with null buffers") {
    const auto rep = mr::cpu::route(r, in, out);
    CHECK(rep.nonfinite_rows == 0);
  }
  SUBCASE("with real buffers, which stay untouched") {
    const std::vector<float> z(16, fnan());
    in.logits = z.data();
    out.indices = idx.data();
    out.gates = gates.data();
    out.nonfinite_rows = &counter;
    for (int threads : {1, 2, 0}) {
      const auto rep = mr::cpu::route(r, in, out, ref::on_threads(threads));
      CHECK(rep.nonfinite_rows == 0);
    }
    MOE_CHECK_VEC(idx, (std::vector<std::int32_t>(4, -3)));
    MOE_CHECK_VEC(gates, (std::vector<float>(4, -3.0f)));
    CHECK(counter == 0);
    // backward with N = 0 writes nothing either
    std::vector<float> dz(16, -3.0f);
    mr::backward_args args;
    args.indices = idx.data();
    args.grad_gates = gates.data();
    args.grad_logits = dz.data();
    mr::cpu::backward(r, in, args);
    MOE_CHECK_VEC(dz, (std::vector<float>(16, -3.0f)));
  }
  SUBCASE("grouped and biased selections too") {
    router<mr::gating::sigmoid, sel::group_limited<sel::expert_bias>> gr;
    gr.top_k = 2;
    gr.selection.groups = 4;
    gr.selection.top_groups = 2;
    const std::vector<float> bias(8, 0.0f);
    in.expert_bias = bias.data();
    CHECK(mr::cpu::route(gr, in, out).nonfinite_rows == 0);
  }
}

TEST_CASE("N = 1 and K = E for every selection") {
  ref::rng g(11);
  for (int E : {1, 2, 7, 16, 32}) {
    const auto z = ref::random_logits<float>(g, 1, E, 2.0);
    const auto b = ref::random_bias(g, E, 0.1);
    CAPTURE(E);
    router<mr::gating::softmax, sel::top_k> a;
    a.top_k = E;
    ref::route_and_check(a, z, 1, E);
    router<mr::gating::sigmoid, sel::expert_bias> bsel;
    bsel.top_k = E;
    ref::route_and_check(bsel, z, 1, E, b.data());
    router<mr::gating::sqrt_softplus, sel::fixed> f;
    f.top_k = E;
    ref::route_and_check(f, z, 1, E);
    router<mr::gating::softmax_after_topk, sel::top_k> m;
    m.top_k = E;
    ref::route_and_check(m, z, 1, E);
    if (E > 1) {
      // K = E softmax_after_topk equals the full softmax
      router<mr::gating::softmax, sel::top_k> s;
      s.top_k = E;
      const auto full = ref::run(s, z, 1, E);
      const auto mm = ref::run(m, z, 1, E);
      CHECK(full.idx == mm.idx);
      for (int j = 0; j < E; ++j) CHECK(mm.gates[j] == doctest::Approx(full.gates[j]).epsilon(1e-5));
    }
    if (E % 2 == 0 && E >= 2) {
      router<mr::gating::sigmoid, sel::group_limited<sel::top_k>> gl;
      gl.top_k = E;
      gl.selection.groups = 2;
      gl.selection.top_groups = 2;
      gl.selection.per_group_k = 1;
      ref::route_and_check(gl, z, 1, E);
    }
  }
}

TEST_CASE("fixed: expert (t*K + j) mod E, gates from the scores at those experts") {
  const int E = 7, K = 3;
  const std::int64_t N = 10;
  ref::rng g(3);
  const auto z = ref::random_logits<float>(g, N, E, 2.0);
  router<mr::gating::sigmoid, sel::fixed> r;
  r.top_k = K;
  const auto o = ref::run(r, z, N, E);
  for (std::int64_t t = 0; t < N; ++t)
    for (int j = 0; j < K; ++j) CHECK(o.idx[t * K + j] == static_cast<std::int32_t>((t * K + j) % E));
  // hand check of token 2: experts 6, 0, 1
  CHECK(o.idx[6] == 6);
  CHECK(o.idx[7] == 0);
  CHECK(o.idx[8] == 1);
  const double s6 = ref::sigmoid(z[2 * E + 6]), s0 = ref::sigmoid(z[2 * E + 0]), s1 = ref::sigmoid(z[2 * E + 1]);
  CHECK(o.gates[6] == doctest::Approx(s6 / (s6 + s0 + s1)).epsilon(1e-6));
  // the fixed experts ignore the logits entirely, NaN included
  std::vector<float> nan_row(E, fnan());
  nan_row[0] = 5.0f;
  const auto on = ref::run(r, nan_row, 1, E);
  MOE_CHECK_VEC(on.idx, (std::vector<std::int32_t>{0, 1, 2}));
  CHECK(on.gates[0] == doctest::Approx(1.0).epsilon(1e-6));
  CHECK(on.gates[1] == 0.0f);
  CHECK(on.report == 1);
}

TEST_CASE_TEMPLATE("fixed: every gating on random inputs", T, float, mr::bfloat16, mr::float16) {
  ref::rng g(8);
  ref::for_each_gating([&](auto gate) {
    using G = decltype(gate);
    for (int E : {5, 33, 256})
      for (int K : {1, 3, 5})
        for (bool normalize : {false, true}) {
          const std::string gating_name = G::name;
          CAPTURE(gating_name);
          CAPTURE(E);
          CAPTURE(K);
          router<G, sel::fixed> r;
          r.top_k = K;
          r.normalize = normalize;
          r.scaling_factor = 1.25f;
          const std::int64_t N = 70;  // wraps around E several times
          const auto z = ref::random_logits<T>(g, N, E, 2.0);
          ref::route_and_check(r, z, N, E);
        }
  });
}

// ---------------------------------------------------------------------------
// group_limited

TEST_CASE("group_limited: hand-constructed rows") {
  // 4 groups of 4. The single best expert (0) sits in a group whose second key is poor.
  const int E = 16;
  const std::vector<float> z = {10.0f, -10.0f, -10.0f, -10.0f,  // group 0: best2 sum 0
                                1.0f,  1.0f,   0.0f,   0.0f,    // group 1: 2
                                0.9f,  0.9f,   0.0f,   0.0f,    // group 2: 1.8
                                0.0f,  0.0f,   0.0f,   0.0f};   // group 3: 0 (ties group 0)
  router<mr::gating::softmax, sel::group_limited<sel::top_k>> r;
  r.top_k = 2;
  r.selection.groups = 4;
  r.selection.top_groups = 2;
  r.selection.per_group_k = 2;
  MOE_CHECK_VEC(ref::run(r, z, 1, E).idx, (std::vector<std::int32_t>{4, 5}));
  r.top_k = 4;
  MOE_CHECK_VEC(ref::run(r, z, 1, E).idx, (std::vector<std::int32_t>{4, 5, 8, 9}));
  r.selection.top_groups = 3;  // group 0 ties group 3 at 0: the lower group index is kept
  r.top_k = 3;
  MOE_CHECK_VEC(ref::run(r, z, 1, E).idx, (std::vector<std::int32_t>{0, 4, 5}));
  r.selection.per_group_k = 1;  // group scores 10, 1, 0.9, 0
  r.selection.top_groups = 2;
  r.top_k = 2;
  MOE_CHECK_VEC(ref::run(r, z, 1, E).idx, (std::vector<std::int32_t>{0, 4}));
  r.selection.per_group_k = 4;  // sums -20, 2, 1.8, 0
  r.selection.top_groups = 1;
  MOE_CHECK_VEC(ref::run(r, z, 1, E).idx, (std::vector<std::int32_t>{4, 5}));
  r.selection.top_groups = 4;  // every group kept: plain top-k
  r.top_k = 3;
  MOE_CHECK_VEC(ref::run(r, z, 1, E).idx, (std::vector<std::int32_t>{0, 4, 5}));
}

TEST_CASE("group_limited: ties between groups go to the lower group index") {
  const int E = 16;
  std::vector<float> z;
  for (int g = 0; g < 4; ++g)
    for (float x : {3.0f, 2.0f, 1.0f, 0.0f}) z.push_back(x);
  router<mr::gating::sigmoid, sel::group_limited<sel::top_k>> r;
  r.top_k = 4;
  r.selection.groups = 4;
  r.selection.top_groups = 2;
  MOE_CHECK_VEC(ref::run(r, z, 1, E).idx, (std::vector<std::int32_t>{0, 4, 1, 5}));
  // the same with the bias policy and a zero bias
  router<mr::gating::sigmoid, sel::group_limited<sel::expert_bias>> b;
  b.top_k = 4;
  b.selection.groups = 4;
  b.selection.top_groups = 2;
  const std::vector<float> zero(E, 0.0f);
  MOE_CHECK_VEC(ref::run(b, z, 1, E, zero.data()).idx, (std::vector<std::int32_t>{0, 4, 1, 5}));
  // a bias that lifts group 3's best expert moves group 3 in, replacing group 1
  std::vector<float> lift(E, 0.0f);
  lift[13] = 0.001f;
  MOE_CHECK_VEC(ref::run(b, z, 1, E, lift.data()).idx, (std::vector<std::int32_t>{0, 12, 13, 1}));
  // groups made only of NaN rank last
  std::vector<float> zn = z;
  for (int e = 0; e < 4; ++e) zn[e] = fnan();
  MOE_CHECK_VEC(ref::run(r, zn, 1, E).idx, (std::vector<std::int32_t>{4, 8, 5, 9}));
  // all NaN: groups tie at -inf, groups 0 and 1 kept, experts 0.. in order
  const std::vector<float> all_nan(E, fnan());
  MOE_CHECK_VEC(ref::run(r, all_nan, 1, E).idx, (std::vector<std::int32_t>{0, 1, 2, 3}));
}

TEST_CASE_TEMPLATE("group_limited: random rows against the sort-based and brute-force references", T, float,
                   mr::bfloat16, mr::float16) {
  ref::rng g(2024);
  struct shape { int E, G, top_groups, per_group_k, K; };
  const shape shapes[] = {{8, 4, 2, 2, 2},    {16, 4, 1, 1, 3},   {16, 8, 3, 2, 4},  {64, 8, 3, 3, 6},
                          {96, 6, 2, 2, 8},   {256, 8, 4, 2, 8},  {30, 5, 5, 2, 7},  {63, 7, 2, 4, 9},
                          {160, 32, 4, 2, 8}, {4096, 16, 2, 2, 16}, {240, 12, 5, 5, 8}, {120, 10, 3, 1, 8},
                          {72, 9, 4, 8, 6}};
  auto run_one = [&](auto r_proto, const shape& sh, bool biased) {
    auto r = r_proto;
    r.top_k = sh.K;
    r.selection.groups = sh.G;
    r.selection.top_groups = sh.top_groups;
    r.selection.per_group_k = sh.per_group_k;
    const std::int64_t N = sh.E >= 1000 ? 6 : 60;
    const auto z = ref::random_logits<T>(g, N, sh.E, 2.0);
    const auto b = ref::random_bias(g, sh.E, 0.05);
    const float* bias = biased ? b.data() : nullptr;
    const auto lib = ref::run(r, z, N, sh.E, bias);
    const auto st = ref::check_route(r, z, N, sh.E, bias, lib, sh.E >= 1000 ? 1e-5 : 2e-6);
    CHECK(st.ambiguous_rows <= N / 20);
    // brute force over every choice of top_groups groups (G <= 16)
    if (sh.G <= 16) {
      const ref::spec sp = ref::spec_of(r);
      for (std::int64_t t = 0; t < N; ++t) {
        std::vector<double> v(sh.E);
        for (int e = 0; e < sh.E; ++e) v[e] = ref::sanitize(ref::value(z[t * sh.E + e]));
        const auto s = ref::scores(sp.gate, v);
        const auto selr = ref::select(sp, v, s, bias, t);
        if (selr.group_ambiguous) continue;
        const auto bf = ref::select_group_bruteforce(sp, selr.key);
        CHECK(bf == selr.order);  // the two references agree
        if (!biased) {  // logit keys are exact: the library must match the brute force exactly
          const std::vector<int> li(lib.idx.begin() + t * sh.K, lib.idx.begin() + (t + 1) * sh.K);
          CHECK(li == bf);
        }
      }
    }
  };
  for (const shape& sh : shapes) {
    CAPTURE(sh.E);
    CAPTURE(sh.G);
    CAPTURE(sh.top_groups);
    CAPTURE(sh.per_group_k);
    CAPTURE(sh.K);
    run_one(router<mr::gating::sigmoid, sel::group_limited<sel::top_k>>{}, sh, false);
    run_one(router<mr::gating::softmax_after_topk, sel::group_limited<sel::top_k>>{}, sh, false);
    run_one(router<mr::gating::sigmoid, sel::group_limited<sel::expert_bias>>{}, sh, true);
    run_one(router<mr::gating::softmax, sel::group_limited<sel::expert_bias>>{}, sh, true);
    run_one(router<mr::gating::sqrt_softplus, sel::group_limited<sel::expert_bias>>{}, sh, true);
    run_one(router<mr::gating::softmax, sel::group_limited<sel::by_score>>{}, sh, true);
    run_one(router<mr::gating::sigmoid, sel::group_limited<sel::by_score>>{}, sh, true);
  }
}

TEST_CASE("group_limited: the baseline and x86-64-v3 paths give the same bits (ties, NaN, +-inf)") {
  // Group scores come from per-lane chains of running maxima on the vector
  // path and from the same chains one group at a time on the baseline path;
  // per_group_k above 4 ranks packed keys instead. Rows with many equal keys
  // and non-finite logits exercise the repeats the chains must keep.
  const bool has_v3 = mr::cpu::detail::cpu_has_x86_64_v3();
  if (!has_v3) MESSAGE("this CPU has no x86-64-v3 path: only the baseline path is checked against the reference");
  ref::rng g(77);
  struct shape { int E, G, top_groups, per_group_k, K; };
  const shape shapes[] = {{256, 8, 4, 2, 8}, {160, 8, 3, 1, 6},  {256, 16, 5, 3, 8}, {240, 12, 5, 4, 8},
                          {256, 32, 7, 2, 8}, {96, 3, 2, 6, 8},  {40, 20, 6, 2, 5},  {27, 9, 2, 3, 4}};
  for (const shape& sh : shapes) {
    CAPTURE(sh.E);
    CAPTURE(sh.G);
    CAPTURE(sh.per_group_k);
    router<mr::gating::sigmoid, sel::group_limited<sel::expert_bias>, 8> r;
    r.top_k = sh.K;
    r.selection.groups = sh.G;
    r.selection.top_groups = sh.top_groups;
    r.selection.per_group_k = sh.per_group_k;
    const std::int64_t N = 64;
    std::vector<float> z(static_cast<std::size_t>(N * sh.E));
    for (std::size_t i = 0; i < z.size(); ++i) {
      const int pick = g.integer(0, 19);
      z[i] = pick == 0 ? fnan() : pick == 1 ? finf() : pick == 2 ? -finf() : static_cast<float>(g.integer(-2, 2));
    }
    const std::vector<float> bias(static_cast<std::size_t>(sh.E), 0.0f);
    ref::route_and_check(r, z, N, sh.E, bias.data());
    const auto base = ref::run(r, z, N, sh.E, bias.data(), 1, mr::cpu::instruction_set::baseline);
    const auto best = ref::run(r, z, N, sh.E, bias.data(), 1, mr::cpu::instruction_set::best);
    CHECK(base.idx == best.idx);
    for (std::size_t i = 0; i < base.gates.size(); ++i) CHECK(ref::bits(base.gates[i]) == ref::bits(best.gates[i]));
  }
}

TEST_CASE("group_limited: DeepSeek-V3 shape (E 256, 8 groups, top 4, per_group_k 2, K 8) with bias") {
  ref::rng g(31337);
  const int E = 256;
  const std::int64_t N = 300;
  router<mr::gating::sigmoid, sel::group_limited<sel::expert_bias>, 8> r;
  r.top_k = 8;
  r.selection.groups = 8;
  r.selection.top_groups = 4;
  r.selection.per_group_k = 2;
  r.scaling_factor = 2.5f;
  const auto z = ref::random_logits<float>(g, N, E, 1.0);
  const auto b = ref::random_bias(g, E, 0.02);
  const auto lib = ref::run(r, z, N, E, b.data());
  const auto st = ref::check_route(r, z, N, E, b.data(), lib);
  CHECK(st.ambiguous_rows <= 3);
  // every token uses at most 4 groups, and gates sum to the scaling factor
  for (std::int64_t t = 0; t < N; ++t) {
    std::vector<int> used(8, 0);
    double sum = 0;
    for (int j = 0; j < 8; ++j) {
      used[lib.idx[t * 8 + j] / 32] = 1;
      sum += lib.gates[t * 8 + j];
    }
    CHECK(std::accumulate(used.begin(), used.end(), 0) <= 4);
    CHECK(sum == doctest::Approx(2.5).epsilon(1e-5));
  }
  // group selection matters: against plain expert_bias the choice differs on some tokens
  router<mr::gating::sigmoid, sel::expert_bias, 8> flat;
  flat.top_k = 8;
  flat.scaling_factor = 2.5f;
  const auto flat_out = ref::run(flat, z, N, E, b.data());
  CHECK(flat_out.idx != lib.idx);
}

TEST_CASE("group_limited with NaN and infinities against the reference") {
  ref::rng g(12);
  const int E = 48;
  const std::int64_t N = 120;
  std::vector<float> z(N * E);
  for (auto& x : z) {
    const int k = g.integer(0, 30);
    x = k == 0 ? fnan() : k == 1 ? finf() : k == 2 ? -finf() : static_cast<float>(g.normal(2.0));
  }
  router<mr::gating::softmax, sel::group_limited<sel::top_k>> r;
  r.top_k = 5;
  r.selection.groups = 6;
  r.selection.top_groups = 3;
  r.selection.per_group_k = 2;
  ref::route_and_check(r, z, N, E);
}

TEST_CASE("dense ties: rows drawn from five values, every keyed selection, K up to 32") {
  // Many equal keys around the K-th largest: the tie order (lower expert
  // index first) must survive any candidate pruning in the backend.
  ref::rng g(77);
  for (int E : {32, 64, 100, 256, 1000, 4096})
    for (int K : {1, 5, 8, 16, 17, 32}) {
      CAPTURE(E);
      CAPTURE(K);
      const std::int64_t N = E >= 1000 ? 8 : 40;
      std::vector<float> z(N * E);
      for (auto& x : z) x = static_cast<float>(g.integer(-2, 2));
      // a few rows with almost every entry equal, a few with NaN
      for (std::int64_t t = 0; t < N; t += 7)
        for (int e = 0; e < E; ++e) z[t * E + e] = e % 97 == 3 ? 1.0f : 0.0f;
      for (std::int64_t t = 3; t < N; t += 11)
        for (int e = 0; e < E; e += 2) z[t * E + e] = fnan();
      const std::vector<float> zero_bias(E, 0.0f);
      router<mr::gating::sigmoid, sel::top_k> a;
      a.top_k = K;
      ref::route_and_check(a, z, N, E);
      router<mr::gating::softmax, sel::expert_bias> b;
      b.top_k = K;
      ref::route_and_check(b, z, N, E, zero_bias.data(), E >= 1000 ? 1e-5 : 2e-6);
      if (E % 4 == 0) {
        router<mr::gating::sigmoid, sel::group_limited<sel::top_k>> c;
        c.top_k = K;
        c.selection.groups = 4;
        c.selection.top_groups = 3;
        if (3 * (E / 4) >= K) ref::route_and_check(c, z, N, E);
      }
    }
}
