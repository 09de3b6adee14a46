// Presets carry the published parameters cited in presets.hpp and route their
// model's E correctly; expert_bias::update follows docs/policies.md section 2.
#include "reference.hpp"

namespace mr = moe_route;
namespace sel = moe_route::selection;
namespace gat = moe_route::gating;
namespace presets = moe_route::presets;

namespace {

template <class Router>
void route_model_batch(const Router& r, int E, std::uint64_t seed) {
  ref::rng g(seed);
  const std::int64_t N = 200;
  const auto z = ref::random_logits<float>(g, N, E, 1.5);
  const auto zb = ref::random_logits<mr::bfloat16>(g, N, E, 1.5);
  const auto b = ref::random_bias(g, E, 0.02);
  const float* bias = Router::selection_type::needs_expert_bias ? b.data() : nullptr;
  const auto st = ref::route_and_check(r, z, N, E, bias);
  CHECK(st.ambiguous_rows <= 2);
  ref::route_and_check(r, zb, N, E, bias);
  // gates sum to the scaling factor when normalised (or under softmax_after_topk)
  if (r.normalize || std::is_same_v<typename Router::gating_type, gat::softmax_after_topk>) {
    const auto o = ref::run(r, z, N, E, bias);
    for (std::int64_t t = 0; t < N; ++t) {
      double sum = 0;
      for (int j = 0; j < r.top_k; ++j) sum += o.gates[t * r.top_k + j];
      CHECK(sum == doctest::Approx(r.scaling_factor).epsilon(1e-5));
    }
  }
}

}  // namespace

TEST_CASE("preset deepseek_v2_lite: softmax, greedy top-6 of 64, not normalised, scaling 1") {
  const auto r = presets::deepseek_v2_lite();
  static_assert(std::is_same_v<decltype(r)::gating_type, gat::softmax>);
  static_assert(std::is_same_v<decltype(r)::selection_type, sel::top_k>);
  CHECK(presets::deepseek_v2_lite_experts == 64);
  CHECK(r.top_k == 6);
  CHECK_FALSE(r.normalize);
  CHECK(r.scaling_factor == 1.0f);
  route_model_batch(r, presets::deepseek_v2_lite_experts, 1);
}

TEST_CASE("preset moonlight: sigmoid + expert bias (noaux_tc, 1 group), top-6 of 64, normalised, 2.446") {
  const auto r = presets::moonlight();
  static_assert(std::is_same_v<decltype(r)::gating_type, gat::sigmoid>);
  static_assert(std::is_same_v<decltype(r)::selection_type, sel::expert_bias>);
  CHECK(presets::moonlight_experts == 64);
  CHECK(r.top_k == 6);
  CHECK(r.normalize);
  CHECK(r.scaling_factor == 2.446f);
  route_model_batch(r, presets::moonlight_experts, 2);
}

TEST_CASE("preset deepseek_v3: sigmoid + group-limited expert bias, 8 groups keep 4, top-8 of 256, 2.5") {
  const auto r = presets::deepseek_v3();
  static_assert(std::is_same_v<decltype(r)::gating_type, gat::sigmoid>);
  static_assert(std::is_same_v<decltype(r)::selection_type, sel::group_limited<sel::expert_bias>>);
  CHECK(presets::deepseek_v3_experts == 256);
  CHECK(r.top_k == 8);
  CHECK(r.selection.groups == 8);
  CHECK(r.selection.top_groups == 4);
  CHECK(r.selection.per_group_k == 2);
  CHECK(r.normalize);
  CHECK(r.scaling_factor == 2.5f);
  route_model_batch(r, presets::deepseek_v3_experts, 3);
}

TEST_CASE("preset qwen3: softmax top-8 of 128, normalised (norm_topk_prob), scaling 1") {
  const auto r = presets::qwen3();
  static_assert(std::is_same_v<decltype(r)::gating_type, gat::softmax>);
  static_assert(std::is_same_v<decltype(r)::selection_type, sel::top_k>);
  CHECK(presets::qwen3_experts == 128);
  CHECK(r.top_k == 8);
  CHECK(r.normalize);
  CHECK(r.scaling_factor == 1.0f);
  route_model_batch(r, presets::qwen3_experts, 4);
}

TEST_CASE("preset mixtral: top-2 of 8 logits, softmax over the two") {
  const auto r = presets::mixtral();
  static_assert(std::is_same_v<decltype(r)::gating_type, gat::softmax_after_topk>);
  static_assert(std::is_same_v<decltype(r)::selection_type, sel::top_k>);
  CHECK(presets::mixtral_experts == 8);
  CHECK(r.top_k == 2);
  CHECK(r.scaling_factor == 1.0f);
  route_model_batch(r, presets::mixtral_experts, 5);
}

TEST_CASE("preset deepseek_v4: sqrt-softplus + expert bias, top-6 of 256, normalised, 1.5") {
  const auto r = presets::deepseek_v4();
  static_assert(std::is_same_v<decltype(r)::gating_type, gat::sqrt_softplus>);
  static_assert(std::is_same_v<decltype(r)::selection_type, sel::expert_bias>);
  CHECK(presets::deepseek_v4_experts == 256);
  CHECK(r.top_k == 6);
  CHECK(r.normalize);
  CHECK(r.scaling_factor == 1.5f);
  route_model_batch(r, presets::deepseek_v4_experts, 6);
}

TEST_CASE("presets are plain values: fields can be changed afterwards") {
  auto r = presets::deepseek_v3();
  r.top_k = 4;
  r.selection.top_groups = 2;
  r.scaling_factor = 1.0f;
  route_model_batch(r, presets::deepseek_v3_experts, 7);
}

// ---------------------------------------------------------------------------
// expert_bias::update: b_e += u * sign(mean load - load_e)

TEST_CASE("expert_bias::update with integer loads: under, over and at the mean") {
  sel::expert_bias eb;
  CHECK(eb.update_rate == 1e-3f);  // the documented default u
  std::vector<float> b = {0.0f, 0.0f, 0.0f, 0.0f};
  const std::vector<int> loads = {1, 3, 2, 2};  // mean 2
  eb.update(b.data(), loads.data(), 4);
  CHECK(b[0] == 1e-3f);   // underloaded: gains
  CHECK(b[1] == -1e-3f);  // overloaded: loses
  CHECK(b[2] == 0.0f);    // at the mean: unchanged
  CHECK(b[3] == 0.0f);
  // a second step accumulates in fp32
  eb.update(b.data(), loads.data(), 4);
  CHECK(b[0] == 1e-3f + 1e-3f);
  CHECK(b[1] == -1e-3f - 1e-3f);
}

TEST_CASE("expert_bias::update: non-integral mean, custom rate, existing bias, 64-bit and float loads") {
  sel::expert_bias eb;
  eb.update_rate = 0.25f;
  {
    std::vector<float> b = {1.0f, -1.0f, 0.5f};
    const std::vector<std::int64_t> loads = {1, 2, 2};  // mean 5/3
    eb.update(b.data(), loads.data(), 3);
    MOE_CHECK_VEC(b, (std::vector<float>{1.25f, -1.25f, 0.25f}));
  }
  {
    std::vector<float> b(5, 0.0f);
    const std::vector<float> loads = {0.5f, 1.5f, 1.0f, 1.0f, 1.0f};  // mean 1.0
    eb.update(b.data(), loads.data(), 5);
    MOE_CHECK_VEC(b, (std::vector<float>{0.25f, -0.25f, 0.0f, 0.0f, 0.0f}));
  }
  {
    // all loads equal: nothing moves
    std::vector<float> b(7, 0.125f);
    const std::vector<double> loads(7, 3.0);
    eb.update(b.data(), loads.data(), 7);
    MOE_CHECK_VEC(b, (std::vector<float>(7, 0.125f)));
  }
  {
    // one expert takes everything: it loses, all others gain
    std::vector<float> b(64, 0.0f);
    std::vector<std::uint32_t> loads(64, 0);
    loads[17] = 4096;
    sel::expert_bias d;
    d.update(b.data(), loads.data(), 64);
    for (int e = 0; e < 64; ++e) CHECK(b[e] == (e == 17 ? -1e-3f : 1e-3f));
  }
}

TEST_CASE("expert_bias::update then route: balancing moves the selection toward the underloaded") {
  // Two experts with equal logits except expert 0 slightly ahead: every token
  // picks expert 0 until the bias lifts expert 1 past it.
  mr::router<gat::sigmoid, sel::expert_bias, 2> r;
  r.top_k = 1;
  const int E = 2;
  const std::int64_t N = 8;
  std::vector<float> z(N * E);
  for (std::int64_t t = 0; t < N; ++t) {
    z[t * E] = 0.001f;
    z[t * E + 1] = 0.0f;
  }
  std::vector<float> bias = {0.0f, 0.0f};
  sel::expert_bias eb;
  int steps_until_switch = -1;
  for (int step = 0; step < 10; ++step) {
    const auto o = ref::run(r, z, N, E, bias.data());
    std::vector<int> loads(E, 0);
    for (auto i : o.idx) ++loads[i];
    if (loads[1] == N) {
      steps_until_switch = step;
      break;
    }
    CHECK(loads[0] == N);
    eb.update(bias.data(), loads.data(), E);
  }
  // sigmoid'(0) = 1/4: the score gap is ~2.5e-4 < u = 1e-3, so one step flips it
  CHECK(steps_until_switch == 1);
}
