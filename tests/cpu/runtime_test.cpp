// runtime/cpu.hpp: a router configured at run time routes, admits and
// differentiates exactly as the router written as a type, fills the inputs of
// policies that are off, and names the bad field or the missing input.
#include <moe_route/runtime/instantiate.hpp>  // the runtime calls come compiled (moe_route::runtime)

#include <moe_route/adapters/detail/config_text.hpp>

#include <cstring>
#include <optional>

#include "reference.hpp"

namespace mr = moe_route;
namespace rt = moe_route::runtime;

namespace {

struct typed_run {
  std::vector<std::int32_t> indices;
  std::vector<float> gates, grad;
};

template <class Router>
typed_run run_typed(const Router& r, const mr::route_inputs<float>& in, const std::vector<float>& dw) {
  typed_run o;
  o.indices.resize(static_cast<std::size_t>(in.num_tokens * r.top_k));
  o.gates.resize(o.indices.size());
  o.grad.resize(static_cast<std::size_t>(in.num_tokens * in.num_experts));
  mr::cpu::route(r, in, mr::route_outputs{o.indices.data(), o.gates.data()});
  mr::cpu::backward(r, in, mr::backward_args{o.indices.data(), dw.data(), o.grad.data()});
  return o;
}

template <class Gating>
typed_run run_runtime(const rt::router_config& c, const mr::route_inputs<float>& in, const std::vector<float>& dw,
                      std::vector<double>* values = nullptr) {
  typed_run o;
  o.indices.resize(static_cast<std::size_t>(in.num_tokens * c.top_k));
  o.gates.resize(o.indices.size());
  o.grad.resize(static_cast<std::size_t>(in.num_tokens * in.num_experts));
  std::vector<double> v(rt::num_penalties);
  std::vector<unsigned char> ws(rt::workspace_bytes(c, in.num_tokens, in.num_experts));
  mr::route_outputs out{o.indices.data(), o.gates.data()};
  out.penalty_values = v.data();
  out.workspace = ws.data();
  out.workspace_bytes = ws.size();
  rt::route_with<Gating>(c, in, out, {});
  mr::backward_args b{o.indices.data(), dw.data(), o.grad.data()};
  b.workspace = ws.data();
  b.workspace_bytes = ws.size();
  rt::backward_with<Gating>(c, in, b, {});
  if (values) *values = v;
  return o;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Indices, gates and dL/dz of two runs, bit for bit.
void check_same(const typed_run& a, const typed_run& b) {
  CHECK(a.indices == b.indices);
  CHECK(same_bits(a.gates, b.gates));
  CHECK(same_bits(a.grad, b.grad));
}

}  // namespace

TEST_CASE("runtime router: every selection and prior kind routes and differentiates as the typed router") {
  ref::rng g(71);
  const std::int64_t N = 97;
  const int E = 48;
  const auto z = ref::random_logits<float>(g, N, E, 1.5);
  const auto bias = ref::random_bias(g, E, 0.05);
  const auto dw = ref::random_logits<float>(g, N, 3, 1.0);
  mr::route_inputs<float> in{z.data(), N, E, bias.data()};

  rt::router_config c;
  c.gating = rt::gating_kind::sigmoid;
  c.top_k = 3;
  c.normalize = true;
  c.scaling_factor = 2.5f;
  c.groups = 8;
  c.top_groups = 3;
  c.per_group_k = 2;

  SUBCASE("top_k") {
    c.selection = rt::selection_kind::top_k;
    mr::router<mr::gating::sigmoid, mr::selection::top_k, 8> r;
    r.top_k = 3, r.normalize = true, r.scaling_factor = 2.5f;
    const auto a = run_typed(r, in, dw);
    const auto b = run_runtime<mr::gating::sigmoid>(c, in, dw);
    check_same(a, b);
  }
  SUBCASE("group_limited_bias (DeepSeek-V3 shape)") {
    c.selection = rt::selection_kind::group_limited_bias;
    auto r = mr::presets::deepseek_v3();
    r.top_k = 3;
    r.selection.groups = 8, r.selection.top_groups = 3;
    const auto a = run_typed(r, in, dw);
    const auto b = run_runtime<mr::gating::sigmoid>(c, in, dw);
    check_same(a, b);
  }
  SUBCASE("fixed") {
    c.selection = rt::selection_kind::fixed;
    mr::router<mr::gating::sigmoid, mr::selection::fixed, 4> r;
    r.top_k = 3, r.normalize = true, r.scaling_factor = 2.5f;
    const auto a = run_typed(r, in, dw);
    const auto b = run_runtime<mr::gating::sigmoid>(c, in, dw);
    check_same(a, b);
  }
}

TEST_CASE("runtime router: penalties and the prior match the typed router with the same policies") {
  ref::rng g(72);
  const std::int64_t N = 64;
  const int E = 37;  // not a multiple of 32
  const auto z = ref::random_logits<float>(g, N, E, 2.0);
  const auto dw = ref::random_logits<float>(g, N, 2, 1.0);
  std::vector<float> pi(2 * E);
  for (auto& p : pi) p = static_cast<float>(g.uniform(0.1, 1.1));
  std::vector<float> pb(pi.size()), pp(pi.size());
  mr::prior::prepare(pi.data(), 2, E, pb.data(), pp.data());
  std::vector<std::int32_t> rows(N);
  for (std::int64_t t = 0; t < N; ++t) rows[t] = static_cast<std::int32_t>(t % 3) - 1;  // -1, 0, 1

  mr::route_inputs<float> in{z.data(), N, E};
  in.prior_bias = pb.data();
  in.prior_probs = pp.data();
  in.prior_rows = 2;
  in.token_prior_row = rows.data();

  rt::router_config c;
  c.top_k = 2;
  c.prior = rt::prior_kind::log_prior_bias;
  c.prior_bias.beta = 0.7f;
  c.z_loss.coefficient = 1e-3f;
  c.kl_to_base.coefficient = 1e-2f;

  auto r = mr::with_policies(mr::router<mr::gating::softmax, mr::selection::top_k, 16>{},
                             mr::prior::log_prior_bias{0.7f, true}, mr::penalty::z_loss{1e-3f},
                             mr::penalty::kl_to_base{1e-2f});
  r.top_k = 2;
  std::vector<std::int32_t> idx(N * 2);
  std::vector<float> gates(N * 2), grad(N * E);
  std::vector<double> values(2);
  std::vector<unsigned char> ws(mr::penalty::training_workspace_bytes(r, N, E));
  mr::route_outputs out{idx.data(), gates.data()};
  out.penalty_values = values.data();
  out.workspace = ws.data();
  out.workspace_bytes = ws.size();
  mr::cpu::route(r, in, out);
  mr::backward_args b{idx.data(), dw.data(), grad.data()};
  b.workspace = ws.data();
  b.workspace_bytes = ws.size();
  mr::cpu::backward(r, in, b);

  std::vector<double> rv;
  const auto o = run_runtime<mr::gating::softmax>(c, in, dw, &rv);
  CHECK(o.indices == idx);
  CHECK(same_bits(o.gates, gates));
  CHECK(same_bits(o.grad, grad));
  CHECK(rv[1] == values[0]);  // z_loss
  CHECK(rv[2] == values[1]);  // kl_to_base
  CHECK(rv[0] == 0.0);        // load_balance off
  CHECK(rv[3] == 0.0);
  CHECK(rv[4] == 0.0);

  SUBCASE("prior none routes as the plain router, with no prior inputs at all") {
    rt::router_config plain;
    plain.top_k = 2;
    mr::route_inputs<float> bare{z.data(), N, E};
    mr::router<mr::gating::softmax, mr::selection::top_k, 2> p;
    p.top_k = 2;
    const auto a = run_typed(p, bare, dw);
    const auto q = run_runtime<mr::gating::softmax>(plain, bare, dw);
    check_same(a, q);
  }
}

TEST_CASE("runtime admission equals cpu::admit with the typed policy") {
  ref::rng g(73);
  const std::int64_t N = 120;
  const int E = 16;
  const auto z = ref::random_logits<float>(g, N, E, 1.5);
  auto r = mr::presets::qwen3();
  r.top_k = 4;
  std::vector<std::int32_t> idx(N * 4);
  std::vector<float> gates(N * 4);
  mr::cpu::route(r, mr::route_inputs<float>{z.data(), N, E}, mr::route_outputs{idx.data(), gates.data()});
  mr::admission_inputs<float> in;
  in.logits = z.data(), in.num_tokens = N, in.num_experts = E;
  in.routed_indices = idx.data(), in.routed_gates = gates.data();

  rt::router_config c;
  c.top_k = 4;
  c.normalize = true;
  rt::admission_config a;
  a.dropless = false;
  a.affinity = rt::affinity_kind::probability;
  a.overflow = rt::overflow_kind::reroute;
  a.capacity_factor = 0.8;
  a.fill_factor = 1.0;

  std::vector<std::int32_t> i1(N * 4), i2(N * 4);
  std::vector<float> g1(N * 4), g2(N * 4);
  mr::admission::policy<mr::admission::probability, mr::admission::reroute> p;
  p.capacity_factor = 0.8;
  p.overflow.fill_factor = 1.0;
  const auto r1 = mr::cpu::admit(r, p, in, mr::admission_outputs{i1.data(), g1.data()});
  const auto r2 = rt::admit_with<mr::gating::softmax>(c, a, in, mr::admission_outputs{i2.data(), g2.data()}, {});
  CHECK(r1.rerouted > 0);
  CHECK(r1.dropped == r2.dropped);
  CHECK(r1.rerouted == r2.rerouted);
  CHECK(i1 == i2);
  CHECK(same_bits(g1, g2));
}

TEST_CASE("runtime configuration errors name the field or the missing input") {
  ref::rng g(74);
  const auto z = ref::random_logits<float>(g, 8, 16, 1.0);
  const auto dw = ref::random_logits<float>(g, 8, 2, 1.0);
  mr::route_inputs<float> in{z.data(), 8, 16};
  rt::router_config c;
  c.top_k = 17;
  CHECK_THROWS_WITH_AS(rt::validate(c), doctest::Contains("router_config.top_k"), mr::error);
  c.top_k = 2;
  c.gating = rt::gating_kind::softmax_after_topk;
  c.selection = rt::selection_kind::expert_bias;
  CHECK_THROWS_WITH_AS(rt::validate(c), doctest::Contains("router_config.selection"), mr::error);
  c = rt::router_config{};
  c.selection = rt::selection_kind::group_limited;
  c.groups = 4;
  c.top_groups = 5;
  CHECK_THROWS_WITH_AS(rt::validate(c), doctest::Contains("router_config.top_groups"), mr::error);
  c.groups = 33;  // no E makes it route (found by tests/fuzz/config.cpp)
  c.top_groups = 1;
  CHECK_THROWS_WITH_AS(rt::validate(c), doctest::Contains("router_config.groups (= 33) must be in [1, 32]"), mr::error);
  c = rt::router_config{};
  c.z_loss.coefficient = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH_AS(rt::validate(c), doctest::Contains("z_loss.coefficient"), mr::error);
  c = rt::router_config{};
  // Once accepted here and refused by the backend at the first routing (the training fuzz target).
  c.locality.epsilon = 0.0f;
  CHECK_THROWS_WITH_AS(rt::validate(c), doctest::Contains("router_config.locality.epsilon must be in (0, 1)"), mr::error);

  c = rt::router_config{};
  c.kl_to_base.coefficient = 1e-2f;
  CHECK_THROWS_WITH_AS(run_runtime<mr::gating::softmax>(c, in, dw), doctest::Contains("token_prior_row is null"),
                       mr::error);
  c = rt::router_config{};
  c.load_balance.coefficient = 1e-2f;
  c.load_balance.over = mr::penalty::load_balance::scope::global_batch;
  CHECK_THROWS_WITH_AS(run_runtime<mr::gating::softmax>(c, in, dw), doctest::Contains("load_fractions is null"),
                       mr::error);
  // the same configuration in evaluation needs nothing: every policy is off
  in.mode = mr::mode::eval;
  CHECK_NOTHROW(run_runtime<mr::gating::softmax>(c, in, dw));
  // and an empty batch needs nothing either, as a typed router's call does not
  in.mode = mr::mode::train;
  in.num_tokens = 0;
  c = rt::router_config{};
  c.kl_to_base.coefficient = 1e-2f;
  c.prior = rt::prior_kind::log_prior_bias;
  CHECK_NOTHROW(run_runtime<mr::gating::softmax>(c, in, dw));
  mr::route_inputs<float> typed_in = in;
  const auto typed = rt::make_router<mr::gating::softmax, mr::selection::top_k, mr::prior::log_prior_bias>(c);
  std::vector<double> typed_values(rt::num_penalties, -1.0);
  mr::route_outputs typed_out{nullptr, nullptr};
  typed_out.penalty_values = typed_values.data();
  CHECK_NOTHROW(mr::cpu::route(typed, typed_in, typed_out));
  in.num_tokens = 8;

  rt::admission_config a;
  a.dropless = false;
  a.affinity = rt::affinity_kind::position;
  a.overflow = rt::overflow_kind::reroute;
  CHECK_THROWS_WITH_AS(rt::validate(a), doctest::Contains("admission_config.overflow"), mr::error);
  a.overflow = rt::overflow_kind::drop;
  a.capacity_factor = 0.0;
  CHECK_THROWS_WITH_AS(rt::validate(a), doctest::Contains("admission_config.capacity_factor"), mr::error);
  // The configuration accepted these and the backend refused them (found by tests/fuzz/config.cpp).
  a.capacity_factor = 1.0;
  a.affinity = rt::affinity_kind::cosine;
  a.overflow = rt::overflow_kind::reroute;
  a.max_rounds = -2;
  CHECK_THROWS_WITH_AS(rt::validate(a), doctest::Contains("admission_config.max_rounds (= -2)"), mr::error);
  a.max_rounds = -1;
  a.fill_factor = std::numeric_limits<double>::infinity();
  CHECK_THROWS_WITH_AS(rt::validate(a), doctest::Contains("admission_config.fill_factor"), mr::error);
}

TEST_CASE("workspace_shape_of gives workspace_bytes as its affine form in N") {
  rt::router_config c;
  const int E = 37;
  // A runtime router carries every penalty (coefficient 0: off), so its workspace always holds one double
  // per token for each of z-loss, KL and logit-L2.
  CHECK(rt::workspace_shape_of(c, E).per_value == 3 * sizeof(double));
  c.load_balance.coefficient = 1e-2f;
  c.z_loss.coefficient = 1e-3f;
  c.kl_to_base.coefficient = 1e-1f;
  c.prior = rt::prior_kind::log_prior_bias;
  for (const std::int32_t sequences : {0, 1, 7}) {
    c.load_balance.over = sequences ? mr::penalty::load_balance::scope::sequence : mr::penalty::load_balance::scope::batch;
    const rt::workspace_shape w = rt::workspace_shape_of(c, E, sequences);
    CHECK(w.per_value == 3 * sizeof(double));
    for (const std::int64_t n : {0, 1, 2, 1023, 1024, 1025, 4096, 100003}) {
      const std::int64_t chunks = (n + w.chunk - 1) / w.chunk;
      CHECK(rt::workspace_bytes(c, n, E, sequences) == w.fixed + w.per_value * static_cast<std::size_t>(n + chunks));
    }
  }
}

TEST_CASE("configuration text: fields, presets and errors (adapters/detail/config_text.hpp)") {
  namespace text = moe_route::adapters::detail;
  const rt::router_config c = text::router_config_of(
      "gating=sigmoid;selection=expert_bias;top_k=6;scaling_factor=2.446;load_balance=0.001;z_loss=1e-05;"
      "load_balance_scope=sequence;bias_update_rate=0.0001");
  CHECK(c.gating == rt::gating_kind::sigmoid);
  CHECK(c.selection == rt::selection_kind::expert_bias);
  CHECK(c.top_k == 6);
  CHECK(c.normalize);  // absent: the gating's default (sigmoid normalises)
  CHECK(c.scaling_factor == 2.446f);
  CHECK(c.z_loss.coefficient == 1e-05f);
  CHECK(c.load_balance.over == mr::penalty::load_balance::scope::sequence);
  CHECK_FALSE(text::router_config_of("gating=softmax;normalize=0").normalize);
  // the presets read back as the C++ presets
  const rt::router_config v3 = text::router_config_of(text::preset_of("deepseek_v3").text);
  CHECK(v3.top_k == mr::presets::deepseek_v3().top_k);
  CHECK(v3.groups == mr::presets::deepseek_v3().selection.groups);
  CHECK(v3.scaling_factor == mr::presets::deepseek_v3().scaling_factor);
  CHECK(text::preset_of("deepseek_v3").num_experts == mr::presets::deepseek_v3_experts);
  // every admission preset survives its text form bit for bit
  for (const char* name :
       {"dropless", "cipher_strict", "cipher_reroute", "locmoe", "capacity_position", "capacity_probs"}) {
    const rt::admission_config a = text::admission_preset_of(name, 1.25, 3.0, std::nullopt);
    const rt::admission_config b = text::admission_config_of(text::text_of(a));
    CHECK(b.dropless == a.dropless);
    CHECK(b.affinity == a.affinity);
    CHECK(b.overflow == a.overflow);
    CHECK(std::memcmp(&b.threshold, &a.threshold, sizeof(float)) == 0);
    CHECK(b.capacity_factor == a.capacity_factor);
    CHECK(b.fill_factor == a.fill_factor);
    CHECK(b.max_rounds == a.max_rounds);
  }
  CHECK(text::admission_preset_of("locmoe", 2.0, 4.0, std::nullopt).threshold == 0.01f);
  CHECK(text::admission_preset_of("cipher_strict", 2.0, 4.0, 0.2f).threshold == 0.2f);
  CHECK(text::admission_config_of("").dropless);
  CHECK_THROWS_WITH_AS(text::router_config_of("top_k=2;topk=3"), doctest::Contains("RouterConfig has no field 'topk'"),
                       mr::error);
  CHECK_THROWS_WITH_AS(text::router_config_of("top_k=2.5"), doctest::Contains("top_k = '2.5' is not a whole number"),
                       mr::error);
  CHECK_THROWS_WITH_AS(text::router_config_of("top_k"), doctest::Contains("'top_k' is not field=value"), mr::error);
  CHECK_THROWS_WITH_AS(text::router_config_of("normalize=yes"), doctest::Contains("is not a boolean"), mr::error);
  CHECK_THROWS_WITH_AS(text::admission_config_of("kind=capacity;affinity=distance"),
                       doctest::Contains("affinity = 'distance' is not one of: position, probability"), mr::error);
  CHECK_THROWS_WITH_AS(text::admission_preset_of("bounded", 1.0, 4.0, std::nullopt),
                       doctest::Contains("no admission preset named 'bounded'"), mr::error);
  CHECK_THROWS_WITH_AS(text::preset_of("gpt5"), doctest::Contains("no preset named 'gpt5'"), mr::error);
}
