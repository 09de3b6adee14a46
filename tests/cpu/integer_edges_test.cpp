// Integer edges (docs/reliability.md): the CPU backend's token offsets are 64-bit,
// so a batch whose N·E passes 2^31 routes and admits exactly as its rows do alone;
// the per-call limits of admission and expert choice (N·K and N·E < 2^31 − 1,
// docs/policies.md) are refused by name, also for an N whose product would
// overflow 64 bits. The batch past 2^31 needs about 9 GB and up to a minute on
// two cores, so it is a test suite of its own, run by its own ctest entry
// (cpu_tests_past_2_31) and left out of cpu_tests.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <moe_route/admission/admission.hpp>
#include <moe_route/backend/cpu/admit.hpp>
#include <moe_route/backend/cpu/expert_choice.hpp>
#include <moe_route/moe_route.hpp>
#include <moe_route/selection/expert_choice.hpp>

#include "reference.hpp"

namespace mr = moe_route;

namespace {

using router_type = mr::router<mr::gating::softmax, mr::selection::top_k, 2>;

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

}  // namespace

TEST_CASE("admission and expert choice refuse N·K and N·E from 2^31 - 1, without overflowing") {
  constexpr std::int64_t int64_max = std::numeric_limits<std::int64_t>::max();
  router_type r;
  r.top_k = 2;
  const auto policy = mr::admission::capacity_position(1.0);
  for (const std::int64_t n : {std::int64_t{1} << 30, int64_max / 2 + 1, int64_max}) {
    CAPTURE(n);
    mr::admission_inputs<float> in;
    in.num_tokens = n;
    in.num_experts = 8;
    const std::string tokens = "num_tokens (= " + std::to_string(n) + ") * ";
    const std::string admit_error = tokens + "top_k (= 2) must be < 2^31 - 1 for admission";
    CHECK_THROWS_WITH_AS(mr::cpu::admit(r, policy, in, mr::admission_outputs{}), doctest::Contains(admit_error.c_str()),
                         mr::error);
    const std::string choice_error = tokens + "num_experts (= 8) must be < 2^31 - 1 for expert_choice";
    mr::selection::expert_choice p;
    CHECK_THROWS_WITH_AS(mr::cpu::expert_choice(p, mr::expert_choice_inputs<float>{nullptr, n, 8},
                                                mr::expert_choice_outputs{}),
                         doctest::Contains(choice_error.c_str()), mr::error);
  }
  // The largest products allowed pass the check and stop at the next one, the null logits.
  mr::admission_inputs<float> in;
  in.num_tokens = (std::int64_t{1} << 30) - 1;  // N·K = 2^31 - 2
  in.num_experts = 8;
  CHECK_THROWS_WITH_AS(mr::cpu::admit(r, policy, in, mr::admission_outputs{}), doctest::Contains("logits is null"), mr::error);
  mr::selection::expert_choice p;
  CHECK_THROWS_WITH_AS(mr::cpu::expert_choice(p, mr::expert_choice_inputs<float>{nullptr, (std::int64_t{1} << 28) - 1, 8},
                                              mr::expert_choice_outputs{}),
                       doctest::Contains("logits is null"), mr::error);
}

TEST_SUITE("past_2_31") {
  TEST_CASE("route and admit a batch whose N·E passes 2^31 as its rows alone") {
    const int E = 17;
    const std::int64_t N = ((std::int64_t{1} << 31) + (std::int64_t{1} << 20)) / E + 1;  // N·E > 2^31 + 2^20
    REQUIRE(N % E != 0);  // so the capacity ceil(N·K/E) has no rounding question
    std::vector<mr::bfloat16> z(static_cast<std::size_t>(N * E));  // zeros: one common routing
    // Random rows: those around the element 2^31, the last ones and every 2^24-th.
    std::vector<std::int64_t> probes;
    const std::int64_t crossing = (std::int64_t{1} << 31) / E;
    for (std::int64_t t = crossing - 2; t <= crossing + 2; ++t) probes.push_back(t);
    for (std::int64_t t = 0; t < N; t += std::int64_t{1} << 24) probes.push_back(t);
    for (std::int64_t t = N - 3; t < N; ++t) probes.push_back(t);
    std::sort(probes.begin(), probes.end());
    probes.erase(std::unique(probes.begin(), probes.end()), probes.end());
    const auto P = static_cast<std::int64_t>(probes.size());
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::vector<mr::bfloat16> alone(static_cast<std::size_t>((P + 1) * E));  // the probes, then a zero row
    for (std::int64_t i = 0; i < P; ++i)
      for (int e = 0; e < E; ++e) alone[i * E + e] = z[probes[i] * E + e] = ref::make<mr::bfloat16>(normal(rng));

    router_type r;
    r.top_k = 1;
    std::vector<std::int32_t> idx(static_cast<std::size_t>(N));
    std::vector<float> gates(static_cast<std::size_t>(N));
    mr::cpu::route(r, mr::route_inputs<mr::bfloat16>{z.data(), N, E}, mr::route_outputs{idx.data(), gates.data()},
                   mr::cpu::execution{0});
    std::vector<std::int32_t> idx_alone(static_cast<std::size_t>(P + 1));
    std::vector<float> gates_alone(static_cast<std::size_t>(P + 1));
    mr::cpu::route(r, mr::route_inputs<mr::bfloat16>{alone.data(), P + 1, E},
                   mr::route_outputs{idx_alone.data(), gates_alone.data()});
    std::int64_t mismatches = 0;
    for (std::int64_t t = 0, i = 0; t < N; ++t) {
      const std::int64_t a = i < P && probes[i] == t ? i++ : P;
      mismatches += idx[t] != idx_alone[a] || !same_bits(gates[t], gates_alone[a]);
    }
    CHECK(mismatches == 0);

    // Position admission: each expert keeps the first C = ceil(N·K/E) slots offered to it, in token order.
    const std::int64_t C = (N + E - 1) / E;
    std::vector<std::int32_t> admitted(static_cast<std::size_t>(N));
    std::vector<float> admitted_gates(static_cast<std::size_t>(N));
    mr::admission_inputs<mr::bfloat16> ain;
    ain.logits = z.data();
    ain.num_tokens = N;
    ain.num_experts = E;
    ain.routed_indices = idx.data();
    ain.routed_gates = gates.data();
    const mr::admission_report rep =
        mr::cpu::admit(r, mr::admission::capacity_position(1.0), ain,
                       mr::admission_outputs{admitted.data(), admitted_gates.data()}, mr::cpu::execution{0});
    std::vector<std::int64_t> load(E, 0);
    std::int64_t kept = 0, wrong = 0;
    for (std::int64_t t = 0; t < N; ++t) {
      const bool keep = load[idx[t]]++ < C;
      kept += keep;
      wrong += admitted[t] != (keep ? idx[t] : -1) || (!keep && admitted_gates[t] != 0.0f);
    }
    CHECK(wrong == 0);
    CHECK(rep.offered == N);
    CHECK(rep.kept == kept);
    CHECK(rep.dropped == N - kept);
    CHECK(kept < N);  // the zero rows overfill one expert: the capacity binds
  }
}
