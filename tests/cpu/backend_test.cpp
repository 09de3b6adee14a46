// CPU backend execution: the parallel path equals the sequential path bit for
// bit (forward, backward and the nonfinite count) for every thread count, and
// repeated calls give identical bits.
#include "reference.hpp"

namespace mr = moe_route;
namespace sel = moe_route::selection;
using ref::fnan;
using ref::finf;

namespace {

template <class T>
std::vector<T> logits_with_specials(ref::rng& g, std::int64_t N, int E) {
  std::vector<T> z(N * E);
  for (std::int64_t t = 0; t < N; ++t)
    for (int e = 0; e < E; ++e) {
      float x = static_cast<float>(g.normal(2.0));
      if (t % 97 == 13) x = e % 3 ? fnan() : x;  // some rows mostly NaN
      if (t % 89 == 1 && e == 5) x = finf();
      if (t % 61 == 2 && e == 0) x = -finf();
      if (t % 53 == 0 && e == 3) x = fnan();
      z[t * E + e] = ref::make<T>(x);
    }
  return z;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

template <class Router, class T>
void check_parallel(const Router& r, std::int64_t N, int E, ref::rng& g) {
  const auto z = logits_with_specials<T>(g, N, E);
  const auto bias = ref::random_bias(g, E, 0.05);
  const float* b = Router::selection_type::needs_expert_bias ? bias.data() : nullptr;
  const auto seq = ref::run(r, z, N, E, b, 1);
  std::vector<float> c(N * r.top_k);
  for (auto& x : c) x = static_cast<float>(g.normal());
  const auto dseq = ref::run_backward(r, z, N, E, b, seq.idx, c, 1);
  for (int threads : {2, 3, 0, 8}) {
    CAPTURE(threads);
    const auto par = ref::run(r, z, N, E, b, threads);
    CHECK(par.idx == seq.idx);
    CHECK(same_bits(par.gates, seq.gates));
    CHECK(par.report == seq.report);
    CHECK(par.counter == seq.counter);
    const auto dpar = ref::run_backward(r, z, N, E, b, seq.idx, c, threads);
    CHECK(same_bits(dpar, dseq));
  }
  // determinism: the same call twice gives the same bits
  const auto again = ref::run(r, z, N, E, b, 1);
  CHECK(again.idx == seq.idx);
  CHECK(same_bits(again.gates, seq.gates));
  CHECK(same_bits(ref::run_backward(r, z, N, E, b, seq.idx, c, 1), dseq));
  // the parallel result is also right, not merely consistent (spot check)
  if (N <= 300) ref::check_route(r, z, N, E, b, seq, E >= 1000 ? 1e-5 : 2e-6);
}

template <class T>
void all_routers(std::int64_t N, int E, ref::rng& g) {
  CAPTURE(N);
  CAPTURE(E);
  CAPTURE(ref::type_name<T>());
  {
    mr::router<mr::gating::softmax, sel::top_k, 8> r;
    r.top_k = 6;
    check_parallel<decltype(r), T>(r, N, E, g);
  }
  {
    mr::router<mr::gating::sigmoid, sel::expert_bias, 8> r;
    r.top_k = 8;
    r.scaling_factor = 2.5f;
    check_parallel<decltype(r), T>(r, N, E, g);
  }
  {
    mr::router<mr::gating::sigmoid, sel::group_limited<sel::expert_bias>, 8> r;
    r.top_k = 8;
    r.selection.groups = 8;
    r.selection.top_groups = 4;
    check_parallel<decltype(r), T>(r, N, E, g);
  }
  {
    mr::router<mr::gating::sqrt_softplus, sel::fixed, 8> r;
    r.top_k = 3;
    check_parallel<decltype(r), T>(r, N, E, g);
  }
  {
    mr::router<mr::gating::softmax_after_topk, sel::group_limited<sel::top_k>, 8> r;
    r.top_k = 2;
    r.selection.groups = 4;
    r.selection.top_groups = 2;
    r.selection.per_group_k = 1;
    check_parallel<decltype(r), T>(r, N, E, g);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("parallel == sequential, bit for bit, for every thread count", T, float, mr::bfloat16,
                   mr::float16) {
  ref::rng g(100);
  for (std::int64_t N : {1, 255, 256, 257, 5000}) all_routers<T>(N, 64, g);
  all_routers<T>(600, 1000, g);
}

TEST_CASE("parallel == sequential with more threads than tokens and odd block splits") {
  ref::rng g(101);
  mr::router<mr::gating::softmax, sel::top_k, 4> r;
  r.top_k = 4;
  for (std::int64_t N : {2, 511, 513, 769, 1025}) {
    CAPTURE(N);
    const auto z = logits_with_specials<float>(g, N, 24);
    const auto seq = ref::run(r, z, N, 24, nullptr, 1);
    for (int threads : {4, 7, 64}) {
      const auto par = ref::run(r, z, N, 24, nullptr, threads);
      CHECK(par.idx == seq.idx);
      CHECK(same_bits(par.gates, seq.gates));
      CHECK(par.report == seq.report);
    }
  }
}

TEST_CASE("the fixed selection uses the token's position in the whole call on every thread") {
  mr::router<mr::gating::softmax, sel::fixed, 4> r;
  r.top_k = 3;
  const int E = 10;
  const std::int64_t N = 2000;
  std::vector<float> z(N * E, 0.0f);
  const auto o = ref::run(r, z, N, E, nullptr, 4);
  for (std::int64_t t = 0; t < N; ++t)
    for (int j = 0; j < 3; ++j) REQUIRE(o.idx[t * 3 + j] == (t * 3 + j) % E);
}

TEST_CASE("instruction sets: execution.isa resolves to a path this CPU runs, or is refused by name") {
  using mr::cpu::instruction_set;
  CHECK(std::string(mr::cpu::name(instruction_set::baseline)) == "baseline");
  CHECK(std::string(mr::cpu::name(instruction_set::x86_64_v3)) == "x86-64-v3");
  CHECK(std::string(mr::cpu::name(instruction_set::best)) == "best");
  CHECK(mr::cpu::isa_of({1, instruction_set::baseline}) == instruction_set::baseline);
  const bool has_v3 = mr::cpu::detail::cpu_has_x86_64_v3();
  if (has_v3) {
    CHECK(mr::cpu::isa_of({1, instruction_set::x86_64_v3}) == instruction_set::x86_64_v3);
  } else {
    CHECK_THROWS_WITH_AS(mr::cpu::isa_of({1, instruction_set::x86_64_v3}), doctest::Contains("execution.isa"),
                         mr::error);
    // A call that asks for it writes nothing.
    mr::router<mr::gating::softmax, sel::top_k, 4> r;
    r.top_k = 2;
    const std::vector<float> z(4 * 8, 1.0f);
    std::vector<std::int32_t> idx(8, 77);
    std::vector<float> gates(8, 7.0f);
    mr::route_inputs<float> in;
    in.logits = z.data();
    in.num_tokens = 4;
    in.num_experts = 8;
    CHECK_THROWS_AS(mr::cpu::route(r, in, mr::route_outputs{idx.data(), gates.data()},
                                   mr::cpu::execution{1, instruction_set::x86_64_v3}),
                    mr::error);
    CHECK(idx == std::vector<std::int32_t>(8, 77));
  }
  // Without MOE_ROUTE_CPU_ISA (as ctest runs this suite), best is the fastest path the CPU runs.
  if (std::getenv("MOE_ROUTE_CPU_ISA") == nullptr)
    CHECK(mr::cpu::isa_of() == (has_v3 ? instruction_set::x86_64_v3 : instruction_set::baseline));
}
