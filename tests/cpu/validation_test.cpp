// Argument validation: every bad input throws moe_route::error whose message
// names the offending argument, and nothing is written to any output.
#include "reference.hpp"

namespace mr = moe_route;
namespace sel = moe_route::selection;

namespace {

constexpr std::int32_t idx_sentinel = -12345;
constexpr float gate_sentinel = -777.0f;
constexpr std::int64_t counter_sentinel = 424242;

// Outputs pre-filled with sentinels; unchanged() says none was touched.
struct outputs {
  std::vector<std::int32_t> idx;
  std::vector<float> gates;
  std::int64_t counter = counter_sentinel;
  std::vector<float> dz;
  explicit outputs(std::size_t n = 1024)
      : idx(n, idx_sentinel), gates(n, gate_sentinel), dz(n * 8, gate_sentinel) {}
  mr::route_outputs route() {
    mr::route_outputs o;
    o.indices = idx.data();
    o.gates = gates.data();
    o.nonfinite_rows = &counter;
    return o;
  }
  bool unchanged() const {
    for (auto x : idx)
      if (x != idx_sentinel) return false;
    for (auto x : gates)
      if (x != gate_sentinel) return false;
    for (auto x : dz)
      if (x != gate_sentinel) return false;
    return counter == counter_sentinel;
  }
};

// Expects fn() to throw moe_route::error with `needle` in its message.
template <class F>
void expect_error(F&& fn, const std::string& needle) {
  CAPTURE(needle);
  bool thrown = false;
  try {
    fn();
  } catch (const mr::error& e) {
    thrown = true;
    const std::string what = e.what();
    CAPTURE(what);
    CHECK(what.find(needle) != std::string::npos);
  } catch (...) {
    FAIL_CHECK("an exception other than moe_route::error");
    return;
  }
  CHECK_MESSAGE(thrown, "no moe_route::error thrown");
}

// moe_route::error is a std::invalid_argument
static_assert(std::is_base_of_v<std::invalid_argument, mr::error>);

const std::vector<float> logits(8 * 64, 0.5f);
const std::vector<float> bias(4096 + 1, 0.0f);
const std::vector<float> big_logits(2 * 4097, 0.5f);

template <class Router>
void check_route_rejects(const Router& r, std::int64_t N, int E, const std::string& needle,
                         const float* z = logits.data(), const float* b = bias.data()) {
  outputs out;
  mr::route_inputs<float> in;
  in.logits = z;
  in.num_tokens = N;
  in.num_experts = E;
  in.expert_bias = b;
  expect_error([&] { mr::cpu::route(r, in, out.route()); }, needle);
  CHECK(out.unchanged());
  // backward validates the same router and inputs
  std::vector<std::int32_t> idx(1024, 0);
  mr::backward_args args;
  args.indices = idx.data();
  args.grad_gates = out.gates.data();
  args.grad_logits = out.dz.data();
  if (N > 0) {
    expect_error([&] { mr::cpu::backward(r, in, args); }, needle);
    CHECK(out.unchanged());
  }
}

}  // namespace

TEST_CASE("validation: top_k out of range") {
  mr::router<mr::gating::softmax, sel::top_k, 8> r;
  r.top_k = 0;
  check_route_rejects(r, 4, 16, "top_k");
  r.top_k = -1;
  check_route_rejects(r, 4, 16, "top_k");
  r.top_k = 9;  // K > MaxK
  check_route_rejects(r, 4, 16, "top_k");
  r.top_k = 5;  // K > E
  check_route_rejects(r, 4, 4, "top_k");
  check_route_rejects(r, 4, 4, "num_experts");  // the message names both
  r.top_k = 8;  // MaxK itself is fine
  outputs out;
  mr::route_inputs<float> in;
  in.logits = logits.data();
  in.num_tokens = 4;
  in.num_experts = 16;
  CHECK_NOTHROW(mr::cpu::route(r, in, out.route()));
}

TEST_CASE("validation: num_experts out of range, num_tokens negative") {
  mr::router<mr::gating::sigmoid, sel::top_k, 8> r;
  r.top_k = 1;
  check_route_rejects(r, 1, 0, "num_experts");
  check_route_rejects(r, 1, -3, "num_experts");
  check_route_rejects(r, 1, 4097, "num_experts", big_logits.data());
  check_route_rejects(r, -1, 8, "num_tokens");
  // E = 4096 is accepted
  outputs out;
  mr::route_inputs<float> in;
  in.logits = big_logits.data();
  in.num_tokens = 2;
  in.num_experts = 4096;
  CHECK_NOTHROW(mr::cpu::route(r, in, out.route()));
  CHECK(out.idx[0] == 0);
  // N = 0 with a bad router is still an error
  check_route_rejects(r, 0, 0, "num_experts");
}

TEST_CASE("validation: null pointers") {
  mr::router<mr::gating::softmax, sel::expert_bias, 8> r;
  r.top_k = 2;
  check_route_rejects(r, 3, 8, "logits", nullptr);
  check_route_rejects(r, 3, 8, "expert_bias", logits.data(), nullptr);
  SUBCASE("indices and gates outputs") {
    outputs out;
    mr::route_inputs<float> in;
    in.logits = logits.data();
    in.num_tokens = 3;
    in.num_experts = 8;
    in.expert_bias = bias.data();
    auto o = out.route();
    o.indices = nullptr;
    expect_error([&] { mr::cpu::route(r, in, o); }, "indices");
    CHECK(out.unchanged());
    o = out.route();
    o.gates = nullptr;
    expect_error([&] { mr::cpu::route(r, in, o); }, "gates");
    CHECK(out.unchanged());
  }
  SUBCASE("backward arguments") {
    outputs out;
    std::vector<std::int32_t> idx(1024, 0);
    std::vector<float> gg(1024, 1.0f);
    mr::route_inputs<float> in;
    in.logits = logits.data();
    in.num_tokens = 3;
    in.num_experts = 8;
    in.expert_bias = bias.data();
    mr::backward_args a;
    a.indices = nullptr;
    a.grad_gates = gg.data();
    a.grad_logits = out.dz.data();
    expect_error([&] { mr::cpu::backward(r, in, a); }, "indices");
    a.indices = idx.data();
    a.grad_gates = nullptr;
    expect_error([&] { mr::cpu::backward(r, in, a); }, "grad_gates");
    a.grad_gates = gg.data();
    a.grad_logits = nullptr;
    expect_error([&] { mr::cpu::backward(r, in, a); }, "grad_logits");
    CHECK(out.unchanged());
  }
}

TEST_CASE("validation: group_limited parameters") {
  mr::router<mr::gating::sigmoid, sel::group_limited<sel::expert_bias>, 8> r;
  r.top_k = 4;
  r.selection.groups = 3;  // does not divide 16
  r.selection.top_groups = 1;
  check_route_rejects(r, 2, 16, "selection.groups");
  r.selection.groups = 0;
  check_route_rejects(r, 2, 16, "selection.groups");
  r.selection.groups = 64;  // more than 32 groups
  check_route_rejects(r, 2, 64, "selection.groups");
  r.selection.groups = 4;
  r.selection.top_groups = 0;
  check_route_rejects(r, 2, 16, "selection.top_groups");
  r.selection.top_groups = 5;
  check_route_rejects(r, 2, 16, "selection.top_groups");
  r.selection.top_groups = 1;  // 1 group of 4 experts cannot supply K = 5
  r.top_k = 5;
  check_route_rejects(r, 2, 16, "top_k");
  r.top_k = 4;
  r.selection.per_group_k = 0;
  check_route_rejects(r, 2, 16, "selection.per_group_k");
  r.selection.per_group_k = 5;  // groups of 4
  check_route_rejects(r, 2, 16, "selection.per_group_k");
  r.selection.per_group_k = 4;
  outputs out;
  mr::route_inputs<float> in;
  in.logits = logits.data();
  in.num_tokens = 2;
  in.num_experts = 16;
  in.expert_bias = bias.data();
  CHECK_NOTHROW(mr::cpu::route(r, in, out.route()));
}

TEST_CASE("validation: non-finite scaling_factor") {
  mr::router<mr::gating::softmax, sel::top_k, 8> r;
  r.top_k = 2;
  r.scaling_factor = ref::fnan();
  check_route_rejects(r, 2, 8, "scaling_factor");
  r.scaling_factor = ref::finf();
  check_route_rejects(r, 2, 8, "scaling_factor");
}

TEST_CASE("validation: backward with an index out of range writes nothing") {
  mr::router<mr::gating::softmax, sel::top_k, 8> r;
  r.top_k = 2;
  const int E = 8;
  const std::int64_t N = 4;
  for (std::int32_t bad : {-1, 8, 1000, std::numeric_limits<std::int32_t>::min()}) {
    for (int where : {0, 3, 7}) {  // first, middle and last entry
      CAPTURE(bad);
      CAPTURE(where);
      std::vector<std::int32_t> idx = {0, 1, 2, 3, 4, 5, 6, 7};
      idx[where] = bad;
      std::vector<float> gg(N * 2, 1.0f);
      std::vector<float> dz(N * E, gate_sentinel);
      mr::route_inputs<float> in;
      in.logits = logits.data();
      in.num_tokens = N;
      in.num_experts = E;
      mr::backward_args a;
      a.indices = idx.data();
      a.grad_gates = gg.data();
      a.grad_logits = dz.data();
      for (int threads : {1, 2})
        expect_error([&] { mr::cpu::backward(r, in, a, mr::cpu::execution{threads}); }, "indices");
      MOE_CHECK_VEC(dz, (std::vector<float>(N * E, gate_sentinel)));
    }
  }
}

TEST_CASE("validation: expert_bias::update rejects bad arguments") {
  sel::expert_bias eb;
  std::vector<float> b(4, 0.0f);
  const std::vector<int> loads = {1, 2, 3, 4};
  expect_error([&] { eb.update(b.data(), loads.data(), 0); }, "num_experts");
  expect_error([&] { eb.update(static_cast<float*>(nullptr), loads.data(), 4); }, "bias");
  expect_error([&] { eb.update(b.data(), static_cast<const int*>(nullptr), 4); }, "loads");
  MOE_CHECK_VEC(b, (std::vector<float>(4, 0.0f)));
}
