// The training policies (docs/policies.md sections 3 and 5) on the CPU backend:
// the prior policies and every penalty, alone and combined, against the
// double-precision references of training_reference.hpp, with
// finite-difference checks of the fused backward under every gating.
#include "training_reference.hpp"

namespace mr = moe_route;
namespace pen = moe_route::penalty;
namespace pri = moe_route::prior;
using namespace tref;

namespace {

template <class Router>
void check_training(const Router& r, const batch& b, ref::rng& g, int threads = 1,
                    const std::vector<std::int32_t>* replay = nullptr) {
  std::vector<float> c(b.N * r.top_k), u(std::max(1, Router::num_penalties));
  for (auto& x : c) x = static_cast<float>(g.normal());
  for (auto& x : u) x = static_cast<float>(g.uniform(0.5, 2.0));
  const auto lib = run_lib(r, b, c, u, threads, replay);
  const auto problems = compare_step(policies_of(r), ref::spec_of(r), Router::has_penalties ? Router::num_penalties : 0,
                                     b, lib, c, u, replay);
  for (const std::string& problem : problems) FAIL_CHECK(problem);
}

template <class G>
using plain = mr::router<G, mr::selection::top_k, 8>;

template <class G>
plain<G> base_router(int K = 3) {
  plain<G> r;
  r.top_k = K;
  return r;
}

}  // namespace

// ---------------------------------------------------------------------------

TEST_CASE_TEMPLATE("penalties: each alone, values and gradients against the references", G, mr::gating::softmax,
                   mr::gating::sigmoid, mr::gating::sqrt_softplus, mr::gating::softmax_after_topk) {
  ref::rng g(11);
  const batch b = make_batch(g, 19, 13, 4);
  const auto base = base_router<G>();
  SUBCASE("load_balance, batch") { check_training(mr::with_policies(base, pen::load_balance{0.7f}), b, g); }
  SUBCASE("load_balance, sequence") {
    check_training(mr::with_policies(base, pen::load_balance{0.7f, pen::load_balance::scope::sequence}), b, g);
  }
  SUBCASE("load_balance, global batch") {
    check_training(mr::with_policies(base, pen::load_balance{0.7f, pen::load_balance::scope::global_batch}), b, g);
  }
  SUBCASE("z_loss") { check_training(mr::with_policies(base, pen::z_loss{0.05f}), b, g); }
  SUBCASE("kl_to_base") { check_training(mr::with_policies(base, pen::kl_to_base{0.6f}), b, g); }
  SUBCASE("logit_l2") { check_training(mr::with_policies(base, pen::logit_l2{0.2f}), b, g); }
  SUBCASE("locality") { check_training(mr::with_policies(base, pen::locality{0.8f, 0.05f}), b, g); }
}

TEST_CASE_TEMPLATE("penalties combined with a prior policy, one and several threads", G, mr::gating::softmax,
                   mr::gating::sigmoid, mr::gating::sqrt_softplus) {
  ref::rng g(12);
  batch b = make_batch(g, 600, 20, 7);
  const auto base = base_router<G>(4);
  const auto r = mr::with_policies(base, pri::log_prior_bias{0.8f}, pen::load_balance{0.5f}, pen::z_loss{0.01f},
                                   pen::kl_to_base{0.3f}, pen::logit_l2{0.1f}, pen::locality{0.4f, 0.01f});
  b.N = 40;  // finite differences on a prefix; the threads check on all 600
  b.z.resize(b.N * b.E);
  b.rows.resize(b.N);
  b.sequence_ids.resize(b.N);
  check_training(r, b, g);
  const batch big = make_batch(g, 600, 20, 7);
  std::vector<float> c(600 * 4, 0.5f), u(5, 1.0f);
  const auto one = run_lib(r, big, c, u, 1);
  const auto three = run_lib(r, big, c, u, 3);
  CHECK(one.idx == three.idx);
  CHECK(std::memcmp(one.gates.data(), three.gates.data(), one.gates.size() * 4) == 0);
  CHECK(std::memcmp(one.values.data(), three.values.data(), one.values.size() * 8) == 0);
  CHECK(std::memcmp(one.dz.data(), three.dz.data(), one.dz.size() * 4) == 0);
}

TEST_CASE("log_prior_bias: selection and gates on z' (bias_gates) or gates on z, against the reference") {
  ref::rng g(13);
  const batch b = make_batch(g, 30, 16, 5);
  SUBCASE("softmax, bias_gates") {
    check_training(mr::with_policies(base_router<mr::gating::softmax>(), pri::log_prior_bias{1.0f}), b, g);
  }
  SUBCASE("sigmoid + expert bias, bias_gates = false") {
    mr::router<mr::gating::sigmoid, mr::selection::expert_bias, 8, pri::log_prior_bias> r;
    r.top_k = 4;
    mr::get<pri::log_prior_bias>(r) = {2.0f, false};
    batch bb = b;
    bb.expert_bias = ref::random_bias(g, bb.E, 0.1);
    check_training(r, bb, g);
  }
  SUBCASE("group-limited") {
    mr::router<mr::gating::sigmoid, mr::selection::group_limited<mr::selection::top_k>, 8, pri::log_prior_bias> r;
    r.top_k = 4;
    r.selection.groups = 4;
    r.selection.top_groups = 2;
    r.selection.per_group_k = 2;
    check_training(r, b, g);
  }
}

TEST_CASE("prior_override: the K largest prior biases, gates from the unmodified router") {
  ref::rng g(14);
  batch b = make_batch(g, 30, 12, 4);
  // ties in the prior: the lower expert wins
  for (int e = 0; e < 6; ++e) b.bias[e] = 0.25f;
  const auto r = mr::with_policies(base_router<mr::gating::softmax>(4), pri::prior_override{}, pen::kl_to_base{0.5f});
  check_training(r, b, g);
  const auto sig = mr::with_policies(base_router<mr::gating::sigmoid>(3), pri::prior_override{});
  check_training(sig, b, g);
}

TEST_CASE("beta = 0 is plain routing bit for bit; tokens without a prior row are untouched") {
  ref::rng g(15);
  const batch b = make_batch(g, 300, 24, 6);
  for (int K : {1, 4}) {
    const auto base = base_router<mr::gating::softmax>(K);
    std::vector<float> c(b.N * K);
    for (auto& x : c) x = static_cast<float>(g.normal());
    const auto plain_run = run_lib(base, b, c, {});
    const auto zero = run_lib(mr::with_policies(base, pri::log_prior_bias{0.0f}), b, c, {});
    CHECK(zero.idx == plain_run.idx);
    CHECK(std::memcmp(zero.gates.data(), plain_run.gates.data(), zero.gates.size() * 4) == 0);
    CHECK(std::memcmp(zero.dz.data(), plain_run.dz.data(), zero.dz.size() * 4) == 0);
    const auto soft = run_lib(mr::with_policies(base, pri::log_prior_bias{3.0f}), b, c, {});
    const auto hard = run_lib(mr::with_policies(base, pri::prior_override{}), b, c, {});
    int changed = 0;
    for (std::int64_t t = 0; t < b.N; ++t) {
      for (int j = 0; j < K; ++j) {
        const std::int64_t i = t * K + j;
        if (b.rows[t] < 0) {
          CHECK(soft.idx[i] == plain_run.idx[i]);
          CHECK(hard.idx[i] == plain_run.idx[i]);
          CHECK(ref::bits(soft.gates[i]) == ref::bits(plain_run.gates[i]));
        } else {
          changed += soft.idx[i] != plain_run.idx[i];
        }
      }
      if (b.rows[t] < 0)
        for (int e = 0; e < b.E; ++e) CHECK(ref::bits(soft.dz[t * b.E + e]) == ref::bits(plain_run.dz[t * b.E + e]));
    }
    CHECK(changed > 0);  // the prior does act on the other tokens
  }
}

TEST_CASE("mode::eval ignores the prior and the penalties, verifiably") {
  ref::rng g(16);
  batch b = make_batch(g, 200, 16, 5);
  const auto base = base_router<mr::gating::sigmoid>(3);
  const auto r = mr::with_policies(base, pri::log_prior_bias{2.0f}, pen::load_balance{0.5f}, pen::z_loss{0.1f},
                                   pen::kl_to_base{0.3f});
  std::vector<float> c(b.N * 3, 1.0f);
  const auto plain_run = run_lib(base, b, c, {});
  const auto train = run_lib(r, b, c, {});
  b.mode = mr::mode::eval;
  const auto eval = run_lib(r, b, c, {});
  CHECK(train.idx != plain_run.idx);
  CHECK(eval.idx == plain_run.idx);
  CHECK(std::memcmp(eval.gates.data(), plain_run.gates.data(), eval.gates.size() * 4) == 0);
  CHECK(std::memcmp(eval.dz.data(), plain_run.dz.data(), eval.dz.size() * 4) == 0);
  for (double v : eval.values) CHECK(v == 0.0);
  // eval needs no prior or workspace at all
  b.bias.clear();
  b.probs.clear();
  b.rows.clear();
  b.S = 0;
  mr::route_inputs<float> in = b.inputs();
  std::vector<std::int32_t> idx(b.N * 3);
  std::vector<float> gates(b.N * 3);
  std::vector<double> values(3, -1.0);
  mr::route_outputs o;
  o.indices = idx.data();
  o.gates = gates.data();
  o.penalty_values = values.data();
  mr::cpu::route(r, in, o);
  CHECK(idx == plain_run.idx);
  CHECK(values == std::vector<double>(3, 0.0));
}

TEST_CASE("a coefficient of 0: value 0 and the plain gradient, bit for bit") {
  ref::rng g(17);
  const batch b = make_batch(g, 150, 16, 5);
  const auto base = base_router<mr::gating::softmax>(3);
  const auto r = mr::with_policies(base, pen::load_balance{0.0f}, pen::z_loss{0.0f}, pen::kl_to_base{0.0f},
                                   pen::logit_l2{0.0f}, pen::locality{0.0f});
  std::vector<float> c(b.N * 3);
  for (auto& x : c) x = static_cast<float>(g.normal());
  const auto plain_run = run_lib(base, b, c, {});
  const auto zero = run_lib(r, b, c, {});
  CHECK(zero.values == std::vector<double>(5, 0.0));
  CHECK(std::memcmp(zero.dz.data(), plain_run.dz.data(), zero.dz.size() * 4) == 0);
}

TEST_CASE("rows with NaN or inf logits take no part in the penalties") {
  ref::rng g(18);
  batch b = make_batch(g, 24, 10, 3);
  b.z[5 * 10 + 2] = ref::fnan();
  b.z[9 * 10 + 7] = ref::finf();
  const auto r = mr::with_policies(base_router<mr::gating::softmax>(2), pen::load_balance{0.5f}, pen::z_loss{0.1f},
                                   pen::kl_to_base{0.3f}, pen::logit_l2{0.2f}, pen::locality{0.3f});
  check_training(r, b, g);  // the reference excludes them; dz of those rows is the gate gradient alone
  std::vector<float> c(b.N * 2, 1.0f);
  const auto lib = run_lib(r, b, c, {});
  for (double v : lib.values) CHECK(std::isfinite(v));
}

TEST_CASE("hand-computed penalty values") {
  // Two tokens, E = 2, softmax, K = 1: z = (0, 0) and (ln 3, 0).
  batch b;
  b.N = 2;
  b.E = 2;
  b.z = {0.0f, 0.0f, static_cast<float>(std::log(3.0)), 0.0f};
  b.S = 1;
  b.bias = {0.5f, -0.5f};
  b.probs = {0.75f, 0.25f};
  b.rows = {0, -1};
  b.expert_rank = {0, 1};
  b.rank = 0;
  auto r = mr::with_policies(base_router<mr::gating::softmax>(1), pen::load_balance{1.0f}, pen::z_loss{1.0f},
                             pen::kl_to_base{1.0f}, pen::logit_l2{1.0f}, pen::locality{1.0f, 0.5f});
  const auto lib = run_lib(r, b, std::vector<float>(2, 0.0f), {});
  // p = (1/2, 1/2), (3/4, 1/4); both tokens pick expert 0: f = (1, 0), P = (5/8, 3/8)
  CHECK(lib.values[0] == doctest::Approx(2.0 * 1.0 * 0.625).epsilon(1e-6));
  // lse = ln 2, ln 4
  const double l2 = std::log(2.0), l4 = std::log(4.0);
  CHECK(lib.values[1] == doctest::Approx((l2 * l2 + l4 * l4) / 2).epsilon(1e-6));
  // KL((3/4, 1/4) || (1/2, 1/2)) for token 0 only
  CHECK(lib.values[2] == doctest::Approx(0.75 * std::log(1.5) + 0.25 * std::log(0.5)).epsilon(1e-6));
  // center(z_0) = 0, b = (1/2, -1/2): ||.||^2 = 1/2
  CHECK(lib.values[3] == doctest::Approx(0.5).epsilon(1e-6));
  // D_c = (5/8, 3/8), D_l = (1/2, 1/2) (eps = 1/2, one local expert)
  CHECK(lib.values[4] == doctest::Approx(0.625 * std::log(1.25) + 0.375 * std::log(0.75)).epsilon(1e-6));
  CHECK(mr::penalty_slot<pen::locality, decltype(r)> == 4);
  CHECK(mr::penalty_slot<pen::z_loss, decltype(r)> == 1);
}

TEST_CASE("training inputs: bad arguments are rejected by name, nothing written") {
  ref::rng g(19);
  const batch good = make_batch(g, 10, 8, 3);
  const auto r = mr::with_policies(base_router<mr::gating::softmax>(2), pri::log_prior_bias{}, pen::kl_to_base{},
                                   pen::load_balance{0.1f, pen::load_balance::scope::sequence}, pen::locality{});
  const auto expect_error = [&](batch b, const std::string& what, std::size_t workspace = 1 << 16) {
    std::vector<std::int32_t> idx(b.N * 2, -7);
    std::vector<float> gates(b.N * 2, -7.0f);
    std::vector<double> values(3, -7.0);
    std::vector<unsigned char> ws(workspace);
    mr::route_outputs o;
    o.indices = idx.data();
    o.gates = gates.data();
    o.penalty_values = values.data();
    o.workspace = ws.data();
    o.workspace_bytes = ws.size();
    const auto in = b.inputs();
    std::string message;
    try {
      mr::cpu::route(r, in, o);
    } catch (const mr::error& e) {
      message = e.what();
    }
    CHECK_MESSAGE(message.find(what) != std::string::npos, "expected '", what, "' in '", message, "'");
    CHECK(idx == std::vector<std::int32_t>(b.N * 2, -7));
    CHECK(values == std::vector<double>(3, -7.0));
  };
  {
    batch b = good;
    b.rows[3] = 3;
    expect_error(b, "token_prior_row[3] (= 3)");
  }
  {
    batch b = good;
    b.rows[0] = -2;
    expect_error(b, "token_prior_row[0]");
  }
  {
    batch b = good;
    b.S = 0;
    expect_error(b, "prior_rows (= 0)");
  }
  {
    batch b = good;
    b.probs[5] = 0.0f;
    expect_error(b, "prior_probs row 0 has a zero");
  }
  {
    batch b = good;
    b.bias[9] = ref::fnan();
    expect_error(b, "prior_bias row 1 has a non-finite");
  }
  {
    batch b = good;
    b.rows.clear();
    expect_error(b, "token_prior_row is null");
  }
  {
    batch b = good;
    b.sequence_ids[4] = 3;
    expect_error(b, "sequence_ids[4] (= 3)");
  }
  {
    batch b = good;
    b.num_sequences = 0;
    expect_error(b, "num_sequences (= 0)");
  }
  {
    batch b = good;
    b.rank = 9;
    expect_error(b, "hosts no expert on rank (= 9)");
  }
  expect_error(good, "workspace_bytes (= 8)", 8);
}

TEST_CASE("penalty::load_fractions skips dropped assignments") {
  const std::vector<std::int32_t> idx = {0, 2, -1, 2, 2, -1};
  std::vector<float> f(3);
  mr::penalty::load_fractions(idx.data(), 3, 2, 3, f.data());
  CHECK(f == std::vector<float>{0.25f, 0.0f, 0.75f});
}

TEST_CASE("conditions: RPB Table 1 routers from any base router") {
  const auto base = mr::presets::moonlight();
  const auto lbl = mr::conditions::lbl(base);
  const auto rpb = mr::conditions::rpb(base, 0.5f);
  const auto hard = mr::conditions::global_hard(base);
  static_assert(decltype(lbl)::has<pen::load_balance> && decltype(lbl)::num_penalties == 1);
  static_assert(decltype(rpb)::has<pri::log_prior_bias> && !decltype(rpb)::has_penalties);
  static_assert(decltype(hard)::has<pri::prior_override>);
  static_assert(std::is_same_v<decltype(mr::conditions::sft(rpb)), decltype(mr::conditions::router_l2(base))>);
  static_assert(std::is_same_v<decltype(mr::conditions::within_soft(base)), std::remove_const_t<decltype(rpb)>>);
  static_assert(std::is_same_v<decltype(mr::conditions::within_hard(base)), std::remove_const_t<decltype(hard)>>);
  CHECK(mr::get<pen::load_balance>(lbl).coefficient == 1e-3f);
  CHECK(mr::get<pri::log_prior_bias>(rpb).beta == 0.5f);
  CHECK(mr::get<pen::kl_to_base>(mr::conditions::kl_to_base(base, 0.3f)).coefficient == 0.3f);
  CHECK(mr::get<pen::logit_l2>(mr::conditions::logit_l2(base)).coefficient == 1e-2f);
  CHECK(mr::get<pen::z_loss>(mr::conditions::z_loss(base)).coefficient == 1e-3f);
  // everything but the policies is the base router's
  CHECK(rpb.top_k == base.top_k);
  CHECK(rpb.normalize == base.normalize);
  CHECK(rpb.scaling_factor == base.scaling_factor);
  // switching conditions keeps the routing of a token without a prior identical
  ref::rng g(20);
  batch b = make_batch(g, 64, 64, 4);
  b.expert_bias = ref::random_bias(g, 64);
  std::vector<float> c(64 * 6, 1.0f);
  for (auto& r : b.rows) r = -1;
  const auto plain_run = run_lib(base, b, c, {});
  const auto rpb_run = run_lib(rpb, b, c, {});
  CHECK(plain_run.idx == rpb_run.idx);
  CHECK(std::memcmp(plain_run.dz.data(), rpb_run.dz.data(), plain_run.dz.size() * 4) == 0);
}

TEST_CASE("admitted gates: the backward adds the penalties' gradients to the admitted gate gradient") {
  ref::rng g(21);
  const batch b = make_batch(g, 80, 16, 4);
  const int K = 3;
  const auto base = base_router<mr::gating::softmax>(K);
  const auto r = mr::with_policies(base, pen::z_loss{0.05f}, pen::kl_to_base{0.3f});
  std::vector<float> c(b.N * K);
  for (auto& x : c) x = static_cast<float>(g.normal());
  const auto routed = run_lib(r, b, c, {});  // forward: indices, workspace; dz without admission
  const auto plain_routed = run_lib(base, b, c, {});
  // Admitted indices: drop every third slot, keep the others.
  std::vector<std::int32_t> admitted = routed.idx;
  for (std::size_t i = 0; i < admitted.size(); i += 3) admitted[i] = -1;
  const auto backward = [&](const auto& router, const std::vector<unsigned char>& ws_in) {
    auto ws = ws_in;
    std::vector<float> dz(b.N * b.E);
    mr::backward_args a;
    a.indices = routed.idx.data();
    a.admitted_indices = admitted.data();
    a.renormalize = true;
    a.grad_gates = c.data();
    a.grad_logits = dz.data();
    a.workspace = ws.data();
    a.workspace_bytes = ws.size();
    mr::cpu::backward(router, b.inputs(), a);
    return dz;
  };
  const auto with_penalties = backward(r, routed.workspace);
  const auto gates_only = backward(base, routed.workspace);
  double scale = 0;
  for (float x : routed.dz) scale = std::max(scale, std::fabs(static_cast<double>(x)));
  int bad = 0;
  for (std::size_t i = 0; i < with_penalties.size(); ++i) {
    const double penalty_part = static_cast<double>(routed.dz[i]) - plain_routed.dz[i];
    bad += !ref::close(with_penalties[i], gates_only[i] + penalty_part, 1e-4, 1e-6 * scale);
  }
  CHECK(bad == 0);
  // and the admitted gate gradient differs from the routed one where slots were dropped
  CHECK(std::memcmp(gates_only.data(), plain_routed.dz.data(), gates_only.size() * 4) != 0);
}

TEST_CASE("router_l2: value and gradient against a reference and finite differences; bad layers rejected") {
  ref::rng g(22);
  const std::vector<std::int64_t> sizes = {300, 0, 9000};  // 9000 spans three sum chunks
  std::vector<std::vector<float>> w(3), w0(3), grad(3);
  std::vector<pen::router_weights> layers(3);
  for (int l = 0; l < 3; ++l) {
    for (std::int64_t i = 0; i < sizes[l]; ++i) {
      w0[l].push_back(static_cast<float>(g.normal(0.05)));
      w[l].push_back(w0[l].back() + static_cast<float>(g.normal(0.01)));
      grad[l].push_back(0.25f);
    }
    layers[l] = {w[l].data(), w0[l].data(), sizes[l], grad[l].data()};
  }
  const pen::router_l2 policy{3.0f};
  const double value = policy.apply(layers.data(), 3);
  // reference: lambda * mean over layers of ||W - W0||^2, in long double
  long double expect = 0;
  for (int l = 0; l < 3; ++l)
    for (std::int64_t i = 0; i < sizes[l]; ++i) {
      const long double d = static_cast<long double>(w[l][i]) - w0[l][i];
      expect += d * d;
    }
  expect *= 3.0L / 3;
  CHECK(value == doctest::Approx(static_cast<double>(expect)).epsilon(1e-12));
  // gradient: 0.25 + 2 lambda / L (W - W0), and by central differences of the value
  for (int l = 0; l < 3; l += 2)
    for (std::int64_t i = 0; i < sizes[l]; i += 997) {
      CHECK(grad[l][i] == doctest::Approx(0.25 + 2.0 * 3.0 / 3 * (static_cast<double>(w[l][i]) - w0[l][i])).epsilon(1e-6));
      const auto value_at = [&](double x) {
        long double v = 0;
        for (int m = 0; m < 3; ++m)
          for (std::int64_t j = 0; j < sizes[m]; ++j) {
            const long double d = (m == l && j == i ? x : static_cast<long double>(w[m][j])) - w0[m][j];
            v += d * d;
          }
        return static_cast<double>(v * 3.0L / 3);
      };
      const double h = 1e-4;
      const double fd = (value_at(w[l][i] + h) - value_at(w[l][i] - h)) / (2 * h);
      CHECK(grad[l][i] - 0.25 == doctest::Approx(fd).epsilon(1e-4).scale(1e-6));
    }
  // value only (no gradient), deterministic
  std::vector<pen::router_weights> no_grad = layers;
  for (auto& x : no_grad) x.grad = nullptr;
  CHECK(policy.apply(no_grad.data(), 3) == policy.apply(no_grad.data(), 3));
  CHECK_THROWS_WITH_AS(policy.apply(layers.data(), 0), doctest::Contains("num_layers (= 0)"), mr::error);
  no_grad[2].base = nullptr;
  CHECK_THROWS_WITH_AS(policy.apply(no_grad.data(), 3), doctest::Contains("layers[2].base is null"), mr::error);
  static_assert(!pen::is_penalty<pen::router_l2>, "router_l2 acts on weights, not in a router's policy list");
}

// ---------------------------------------------------------------------------
// Token mask (docs/policies.md, "Token mask"): on the valid rows every output
// equals the call on the batch without the masked rows; masked rows are -1 / 0
// with a zero gradient, and none of their inputs is read.

namespace {

// The batch of b's valid rows only.
batch valid_rows(const batch& b, const std::vector<std::uint8_t>& mask) {
  batch v = b;
  v.z.clear();
  v.rows.clear();
  v.sequence_ids.clear();
  for (std::int64_t t = 0; t < b.N; ++t) {
    if (mask[t] == 0) continue;
    v.z.insert(v.z.end(), b.z.begin() + t * b.E, b.z.begin() + (t + 1) * b.E);
    v.rows.push_back(b.rows[t]);
    v.sequence_ids.push_back(b.sequence_ids[t]);
  }
  v.N = static_cast<std::int64_t>(v.rows.size());
  return v;
}

template <class Router>
void check_masked_training(const Router& r, batch b, const std::vector<std::uint8_t>& mask, ref::rng& g) {
  const int K = r.top_k, E = b.E;
  const batch compact = valid_rows(b, mask);
  // Padding rows hold what a padded batch may hold: NaN logits, no prior row
  // in range, no sequence; none of it may be read.
  for (std::int64_t t = 0; t < b.N; ++t)
    if (mask[t] == 0) {
      for (int e = 0; e < E; ++e) b.z[t * E + e] = e % 2 ? ref::fnan() : ref::finf();
      b.rows[t] = 1 << 30;
      b.sequence_ids[t] = -5;
    }
  std::vector<float> c(b.N * K), c_compact;
  for (auto& x : c) x = static_cast<float>(g.normal());
  for (std::int64_t t = 0; t < b.N; ++t)
    if (mask[t] != 0) c_compact.insert(c_compact.end(), c.begin() + t * K, c.begin() + (t + 1) * K);
  const std::vector<float> u(std::max(1, Router::num_penalties), 1.5f);

  const lib_run lib = run_lib(r, b, c, u, 2, nullptr, mask.data());
  CHECK(lib.nonfinite == 0);
  const auto want = run_lib(r, compact, c_compact, u, 1);
  std::int64_t v = 0;
  for (std::int64_t t = 0; t < b.N; ++t) {
    for (int j = 0; j < K; ++j) {
      const std::int32_t idx = lib.idx[t * K + j];
      const float gate = lib.gates[t * K + j];
      CHECK(idx == (mask[t] ? want.idx[v * K + j] : -1));
      CHECK(ref::bits(gate) == ref::bits(mask[t] ? want.gates[v * K + j] : 0.0f));
    }
    for (int e = 0; e < E; ++e)
      CHECK(ref::bits(lib.dz[t * E + e]) == ref::bits(mask[t] ? want.dz[v * E + e] : 0.0f));
    v += mask[t] ? 1 : 0;
  }
  // The per-token values are summed in chunks of token positions, which the
  // padding rows shift: the totals agree to rounding.
  for (int j = 0; j < Router::num_penalties; ++j)
    CHECK(ref::close(lib.values[j], want.values[j], 1e-12, 1e-15));
}

}  // namespace

TEST_CASE_TEMPLATE("token mask: every penalty, gating and selection equals the batch without the masked rows", G,
                   mr::gating::softmax, mr::gating::sigmoid, mr::gating::sqrt_softplus,
                   mr::gating::softmax_after_topk) {
  ref::rng g(31);
  const batch b = make_batch(g, 70, 37, 5);  // E not a multiple of 32
  std::vector<std::uint8_t> mask(b.N);
  for (std::int64_t t = 0; t < b.N; ++t) mask[t] = static_cast<std::uint8_t>(t % 4 == 1 || t > 60 ? 0 : 1 + t % 3);
  const auto base = base_router<G>(3);
  SUBCASE("plain") { check_masked_training(base, b, mask, g); }
  SUBCASE("load_balance batch + z_loss") {
    check_masked_training(mr::with_policies(base, pen::load_balance{0.7f}, pen::z_loss{0.05f}), b, mask, g);
  }
  SUBCASE("load_balance over sequences, a sequence fully masked") {
    std::vector<std::uint8_t> m = mask;
    for (std::int64_t t = 0; t < b.N; ++t)
      if (b.sequence_ids[t] == 1) m[t] = 0;
    check_masked_training(mr::with_policies(base, pen::load_balance{0.7f, pen::load_balance::scope::sequence}), b, m,
                          g);
  }
  SUBCASE("global batch, prior policies and prior-space penalties") {
    check_masked_training(mr::with_policies(base, pri::log_prior_bias{0.8f},
                                            pen::load_balance{0.5f, pen::load_balance::scope::global_batch},
                                            pen::kl_to_base{0.3f}, pen::logit_l2{0.1f}, pen::locality{0.4f, 0.01f}),
                          b, mask, g);
  }
  SUBCASE("K = E") {
    check_masked_training(base_router<G>(8), make_batch(g, 20, 8, 3),
                          std::vector<std::uint8_t>(mask.begin(), mask.begin() + 20), g);
  }
  SUBCASE("every token masked") {
    check_masked_training(mr::with_policies(base, pen::load_balance{0.7f}, pen::z_loss{0.05f}), b,
                          std::vector<std::uint8_t>(b.N, 0), g);
  }
  SUBCASE("no token masked") {
    check_masked_training(mr::with_policies(base, pen::z_loss{0.05f}), b, std::vector<std::uint8_t>(b.N, 1), g);
  }
}

TEST_CASE("token mask: grouped and expert-bias selections") {
  ref::rng g(32);
  batch b = make_batch(g, 50, 64, 3);
  b.expert_bias.resize(64);
  for (auto& x : b.expert_bias) x = static_cast<float>(g.uniform(-0.3, 0.3));
  std::vector<std::uint8_t> mask(b.N);
  for (std::int64_t t = 0; t < b.N; ++t) mask[t] = t % 3 != 0;
  mr::router<mr::gating::sigmoid, mr::selection::group_limited<>, 8> grouped;
  grouped.top_k = 8;
  grouped.selection.groups = 8;
  grouped.selection.top_groups = 4;
  check_masked_training(mr::with_policies(grouped, pen::load_balance{0.3f}), b, mask, g);
  mr::router<mr::gating::sigmoid, mr::selection::expert_bias, 8> biased;
  biased.top_k = 6;
  check_masked_training(mr::with_policies(biased, pen::z_loss{0.2f}), b, mask, g);
}

TEST_CASE("load_balance counts = top_k: f from the plain top-K under an expert bias, groups and masks") {
  ref::rng g(33);
  batch b = make_batch(g, 40, 64, 3);
  b.expert_bias.resize(64);
  for (auto& x : b.expert_bias) x = static_cast<float>(g.uniform(-0.5, 0.5));
  for (const auto over : {pen::load_balance::scope::batch, pen::load_balance::scope::sequence}) {
    CAPTURE(static_cast<int>(over));
    pen::load_balance lb{0.4f, over};
    lb.counts = pen::load_balance::count::top_k;
    mr::router<mr::gating::sigmoid, mr::selection::expert_bias, 8> biased;
    biased.top_k = 4;
    check_training(mr::with_policies(biased, lb, pen::z_loss{0.01f}), b, g, 2);
    mr::router<mr::gating::softmax, mr::selection::group_limited<>, 8> grouped;
    grouped.top_k = 6;
    grouped.selection.groups = 8;
    grouped.selection.top_groups = 3;
    check_training(mr::with_policies(grouped, lb), b, g);
    std::vector<std::uint8_t> mask(b.N);
    for (std::int64_t t = 0; t < b.N; ++t) mask[t] = t % 4 != 1;
    check_masked_training(mr::with_policies(biased, lb), b, mask, g);
  }
  // Without an expert bias or groups the plain top-K is the selection: the same bits as counts = selected.
  pen::load_balance lb{0.4f};
  auto plain_counts = mr::with_policies(base_router<mr::gating::softmax>(3), lb);
  lb.counts = pen::load_balance::count::top_k;
  auto top_k_counts = mr::with_policies(base_router<mr::gating::softmax>(3), lb);
  std::vector<float> c(b.N * 3, 0.5f), u(1, 1.0f);
  const auto a = run_lib(plain_counts, b, c, u, 1, nullptr);
  const auto d = run_lib(top_k_counts, b, c, u, 1, nullptr);
  CHECK(a.values == d.values);
  CHECK(a.dz == d.dz);
}

TEST_CASE("load_balance sequence_length = batch_mean: every sequence by the mean valid length") {
  ref::rng g(35);
  batch b = make_batch(g, 30, 33, 4);
  b.num_sequences = 4;
  for (std::int64_t t = 0; t < b.N; ++t) b.sequence_ids[t] = t < 4 ? 0 : t < 20 ? 1 : 3;  // unequal; 2 is empty
  pen::load_balance lb{0.6f, pen::load_balance::scope::sequence};
  lb.sequence_length = pen::load_balance::length::batch_mean;
  SUBCASE("softmax") { check_training(mr::with_policies(base_router<mr::gating::softmax>(3), lb), b, g, 2); }
  SUBCASE("sigmoid, top_k counts, z_loss") {
    auto counted = lb;
    counted.counts = pen::load_balance::count::top_k;
    check_training(mr::with_policies(base_router<mr::gating::sigmoid>(4), counted, pen::z_loss{0.02f}), b, g);
  }
  SUBCASE("a token mask") {
    std::vector<std::uint8_t> mask(b.N);
    for (std::int64_t t = 0; t < b.N; ++t) mask[t] = t % 3 != 2;
    check_masked_training(mr::with_policies(base_router<mr::gating::sqrt_softplus>(2), lb), b, mask, g);
  }
  SUBCASE("sequences of equal valid length: the bits of own") {
    for (std::int64_t t = 0; t < b.N; ++t) b.sequence_ids[t] = static_cast<std::int32_t>(t % 3);
    b.num_sequences = 3;
    auto own = lb;
    own.sequence_length = pen::load_balance::length::own;
    std::vector<float> c(b.N * 3, 0.5f), u(1, 1.0f);
    const auto a = run_lib(mr::with_policies(base_router<mr::gating::softmax>(3), lb), b, c, u, 1, nullptr);
    const auto d = run_lib(mr::with_policies(base_router<mr::gating::softmax>(3), own), b, c, u, 1, nullptr);
    CHECK(a.values == d.values);
    CHECK(a.dz == d.dz);
  }
  SUBCASE("outside the sequence scope: refused by name") {
    lb.over = pen::load_balance::scope::batch;
    std::vector<float> c(b.N * 3, 0.5f), u(1, 1.0f);
    CHECK_THROWS_WITH_AS(run_lib(mr::with_policies(base_router<mr::gating::softmax>(3), lb), b, c, u, 1, nullptr),
                         doctest::Contains("load_balance.sequence_length"), mr::error);
  }
}

TEST_CASE("load_balance counts = top_k over the global batch is refused by name") {
  ref::rng g(34);
  const batch b = make_batch(g, 8, 16, 2);
  pen::load_balance lb{0.4f, pen::load_balance::scope::global_batch};
  lb.counts = pen::load_balance::count::top_k;
  const auto r = mr::with_policies(base_router<mr::gating::softmax>(2), lb);
  std::vector<float> c(b.N * 2, 0.5f), u(1, 1.0f);
  CHECK_THROWS_WITH_AS(run_lib(r, b, c, u, 1, nullptr), doctest::Contains("load_balance.counts"), mr::error);
}

// ---------------------------------------------------------------------------
// Routing replay (docs/policies.md §2.9).

namespace {

// K distinct experts per token, none of them necessarily the router's choice.
std::vector<std::int32_t> random_experts(ref::rng& g, std::int64_t N, int E, int K) {
  std::vector<std::int32_t> idx(N * K);
  std::vector<std::int32_t> all(E);
  for (std::int64_t t = 0; t < N; ++t) {
    std::iota(all.begin(), all.end(), 0);
    for (int j = 0; j < K; ++j) std::swap(all[j], all[j + g.integer(0, E - 1 - j)]);
    std::copy_n(all.begin(), K, idx.begin() + t * K);
  }
  return idx;
}

}  // namespace

TEST_CASE_TEMPLATE("routing replay: gates, penalties and gradients at the caller's experts, by finite differences", G,
                   mr::gating::softmax, mr::gating::sigmoid, mr::gating::sqrt_softplus,
                   mr::gating::softmax_after_topk) {
  ref::rng g(41);
  const batch b = make_batch(g, 23, 11, 4);
  const auto base = base_router<G>(3);
  const auto replay = random_experts(g, b.N, b.E, 3);
  SUBCASE("plain") { check_training(base, b, g, 1, &replay); }
  SUBCASE("every penalty and the soft prior") {
    check_training(mr::with_policies(base, pri::log_prior_bias{0.8f}, pen::load_balance{0.5f}, pen::z_loss{0.01f},
                                     pen::kl_to_base{0.3f}, pen::logit_l2{0.1f}, pen::locality{0.4f, 0.01f}),
                   b, g, 2, &replay);
  }
  SUBCASE("load balance over sequences") {
    check_training(mr::with_policies(base, pen::load_balance{0.7f, pen::load_balance::scope::sequence}), b, g, 1,
                   &replay);
  }
  SUBCASE("load counts from the plain top-K, not the replayed experts (Megatron's replayed aux loss)") {
    pen::load_balance lb{0.6f, pen::load_balance::scope::sequence};
    lb.counts = pen::load_balance::count::top_k;
    check_training(mr::with_policies(base, lb), b, g, 1, &replay);
  }
  SUBCASE("prior_override: the replay wins") {
    check_training(mr::with_policies(base, pri::prior_override{}), b, g, 1, &replay);
  }
}

TEST_CASE("routing replay of the router's own choice is the normal call, bit for bit") {
  ref::rng g(42);
  batch b = make_batch(g, 90, 64, 5);
  b.expert_bias.resize(64);
  for (auto& x : b.expert_bias) x = static_cast<float>(g.uniform(-0.3, 0.3));
  std::vector<float> c(b.N * 8), u(5, 1.25f);
  for (auto& x : c) x = static_cast<float>(g.normal());
  auto same = [&](const auto& r) {
    const auto normal = run_lib(r, b, c, u, 1);
    const auto replayed = run_lib(r, b, c, u, 2, &normal.idx);
    CHECK(replayed.idx == normal.idx);
    CHECK(std::memcmp(replayed.gates.data(), normal.gates.data(), normal.gates.size() * 4) == 0);
    CHECK(std::memcmp(replayed.values.data(), normal.values.data(), normal.values.size() * 8) == 0);
    CHECK(std::memcmp(replayed.dz.data(), normal.dz.data(), normal.dz.size() * 4) == 0);
  };
  mr::router<mr::gating::sigmoid, mr::selection::group_limited<mr::selection::expert_bias>, 8> v3;
  v3.top_k = 8;
  v3.selection.groups = 8;
  v3.selection.top_groups = 4;
  same(mr::with_policies(v3, pen::load_balance{0.3f}, pen::z_loss{0.1f}));
  mr::router<mr::gating::softmax_after_topk, mr::selection::top_k, 8> mixtral;
  mixtral.top_k = 2;
  same(mr::with_policies(mixtral, pri::log_prior_bias{1.0f}, pen::load_balance{0.3f}));
  mr::router<mr::gating::softmax, mr::selection::top_k, 8> softmax;
  softmax.top_k = 6;
  softmax.scaling_factor = 2.5f;
  same(mr::with_policies(softmax, pri::log_prior_bias{0.5f, false}, pen::kl_to_base{0.2f}));
}

TEST_CASE("routing replay: an expert out of range or repeated in a row is refused by name, nothing written") {
  ref::rng g(43);
  const batch b = make_batch(g, 6, 8, 2);
  const auto r = mr::with_policies(base_router<mr::gating::softmax>(3), pen::z_loss{0.1f});
  for (const auto& [bad, message] : {std::pair<std::int32_t, const char*>{8, "replay_indices[7] (= 8) is not an expert"},
                                     {-1, "replay_indices[7] (= -1) is not an expert"},
                                     {1, "token 2 replays expert 1 twice"}}) {
    auto replay = random_experts(g, b.N, b.E, 3);
    replay[6] = 1;
    replay[7] = bad == 1 ? 1 : bad;
    if (bad == 1 && replay[8] == 1) replay[8] = replay[6] == 0 ? 2 : 0;
    std::vector<std::int32_t> idx(b.N * 3, -7);
    std::vector<float> gates(b.N * 3, -7.0f);
    std::vector<double> values(1, -7.0);
    std::vector<unsigned char> ws(mr::penalty::training_workspace_bytes(r, b.N, b.E, 0));
    auto in = b.inputs();
    in.replay_indices = replay.data();
    mr::route_outputs o{idx.data(), gates.data()};
    o.penalty_values = values.data();
    o.workspace = ws.data();
    o.workspace_bytes = ws.size();
    CHECK_THROWS_WITH_AS(mr::cpu::route(r, in, o), doctest::Contains(message), mr::error);
    CHECK(std::all_of(idx.begin(), idx.end(), [](std::int32_t x) { return x == -7; }));
    CHECK(values[0] == -7.0);
    // a masked token's row is not read
    std::vector<std::uint8_t> mask(b.N, 1);
    mask[2] = 0;
    in.token_mask = mask.data();
    CHECK_NOTHROW(mr::cpu::route(r, in, o));
    CHECK(idx[6] == -1);
  }
}
