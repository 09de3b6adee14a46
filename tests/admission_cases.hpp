// Shared by the two parity tests of the CUDA admission side (the host
// emulator's, tests/emulator/admission_parity.cpp, and the GPU's,
// tests/cuda/admission_parity.cu): the batches, their inputs, the
// expert-choice shapes and every admission policy the tests sweep. The CPU
// admission test uses the batch type and its inputs. Host code only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <moe_route/admission/admission.hpp>
#include <moe_route/backend/cpu/expert_choice.hpp>
#include <moe_route/backend/cpu/route.hpp>
#include <moe_route/gating/softmax.hpp>
#include <moe_route/router.hpp>
#include <moe_route/selection/expert_choice.hpp>
#include <moe_route/selection/top_k.hpp>
#include <moe_route/types.hpp>

namespace admission_cases {

namespace mr = moe_route;
namespace ad = moe_route::admission;

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

inline bool same_report(const mr::admission_report& a, const mr::admission_report& b) {
  return a.offered == b.offered && a.kept == b.kept && a.rerouted == b.rerouted && a.dropped == b.dropped &&
         a.below_threshold == b.below_threshold && a.over_capacity == b.over_capacity &&
         a.tokens_without_experts == b.tokens_without_experts && a.invalid == b.invalid;
}

// A batch: logits with a hot quarter of experts, optional quantisation (ties),
// repeated rows, an all-NaN row and a row with +-inf, routed on the CPU.
struct batch {
  std::int64_t N = 0;
  int E = 0, K = 0, G = 1;
  std::vector<float> z, bias, gates, xn, wn;
  std::vector<std::int32_t> routed, groups;
  std::vector<std::int64_t> capacity;
};

template <class Router>
batch make_batch(const Router& r, std::uint32_t seed, std::int64_t N, int E, int levels, int G, bool cap_array) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.5f);
  std::uniform_real_distribution<float> u(0.5f, 2.0f);
  batch b;
  b.N = N, b.E = E, b.K = r.top_k, b.G = G;
  b.z.resize(N * E);
  for (auto& x : b.z) {
    x = nd(rng);
    if (levels > 0) x = std::round(x * levels) / levels;
  }
  for (std::int64_t t = 0; t < N; ++t) {
    for (int e = 0; e < (E + 3) / 4; ++e) b.z[t * E + e] += 1.5f;
    if (t % 7 == 6) std::copy(b.z.begin() + (t - 1) * E, b.z.begin() + t * E, b.z.begin() + t * E);
  }
  if (N > 10) {
    std::fill(b.z.begin() + 4 * E, b.z.begin() + 5 * E, std::numeric_limits<float>::quiet_NaN());
    b.z[9 * E] = std::numeric_limits<float>::infinity();
    b.z[9 * E + E - 1] = -std::numeric_limits<float>::infinity();
  }
  b.bias.resize(E);
  for (auto& x : b.bias) x = 0.01f * nd(rng);
  b.xn.resize(N);
  b.wn.resize(E);
  for (auto& x : b.xn) x = u(rng);
  for (auto& x : b.wn) x = u(rng);
  if (G > 1) {
    b.groups.resize(N);
    for (std::int64_t t = 0; t < N; ++t) b.groups[t] = static_cast<std::int32_t>((t * 2654435761u >> 7) % G);
    for (auto& g : b.groups)  // leave the last group empty
      if (g == G - 1) g = 0;
  }
  if (cap_array) {
    b.capacity.resize(E);
    std::uniform_int_distribution<int> c(0, static_cast<int>(2 * N * b.K / E / std::max(G, 1)) + 1);
    for (auto& x : b.capacity) x = c(rng);
  }
  b.routed.resize(N * b.K);
  b.gates.resize(N * b.K);
  mr::cpu::route(r, mr::route_inputs<float>{b.z.data(), N, E, b.bias.data()},
                 mr::route_outputs{b.routed.data(), b.gates.data()});
  return b;
}

template <class T>
mr::admission_inputs<T> admission_inputs_of(const batch& b, const T* logits) {
  mr::admission_inputs<T> in;
  in.logits = logits;
  in.num_tokens = b.N;
  in.num_experts = b.E;
  in.routed_indices = b.routed.data();
  in.routed_gates = b.gates.data();
  in.hidden_norms = b.xn.data();
  in.weight_norms = b.wn.data();
  in.group_ids = b.groups.empty() ? nullptr : b.groups.data();
  in.num_groups = b.G;
  in.capacity = b.capacity.empty() ? nullptr : b.capacity.data();
  return in;
}

inline mr::expert_choice_inputs<float> expert_choice_inputs_of(const batch& b) {
  mr::expert_choice_inputs<float> in;
  in.logits = b.z.data();
  in.num_tokens = b.N;
  in.num_experts = b.E;
  in.group_ids = b.groups.empty() ? nullptr : b.groups.data();
  in.num_groups = b.G;
  in.capacity = b.capacity.empty() ? nullptr : b.capacity.data();
  return in;
}

// An expert-choice case: make_batch's shape, whether capacities come as an
// array, and the capacity factor (0: min_capacity 3 decides).
struct expert_choice_shape {
  std::int64_t N;
  int E, levels, G;
  bool cap;
  double factor;
};

// An expert-choice case: its batch, policy and inputs, and the CPU outputs
// (the reference of both parity tests).
struct expert_choice_case {
  batch b;
  mr::selection::expert_choice policy;
  mr::expert_choice_inputs<float> in;
  std::vector<std::int32_t> indices, experts_per_token;
  std::vector<float> gates;
  mr::expert_choice_report report;
};

inline expert_choice_case make_expert_choice_case(const expert_choice_shape& s) {
  expert_choice_case c;
  mr::router<mr::gating::softmax, mr::selection::top_k, 8> r;
  r.top_k = 1;
  c.b = make_batch(r, 20 + s.E, s.N, s.E, s.levels, s.G, s.cap);
  c.policy.capacity_factor = s.factor;
  c.policy.min_capacity = s.factor == 0.0 ? 3 : 0;
  c.in = expert_choice_inputs_of(c.b);
  const std::int64_t pairs = s.N * s.E;
  c.indices.resize(pairs);
  c.gates.resize(pairs);
  c.experts_per_token.resize(s.N);
  mr::cpu::expert_choice(c.policy, c.in,
                         mr::expert_choice_outputs{c.indices.data(), c.gates.data(), c.experts_per_token.data(), &c.report});
  return c;
}

// Calls check(policy, name) for every admission policy of the sweep.
template <class Check>
void for_each_policy(Check check) {
  check(ad::cipher_strict(0.02f, 1.0), "cipher_strict");
  check(ad::cipher_strict(0.05f), "cipher_strict, factor 8");
  check(ad::cipher_reroute(0.0f, 1.0, 1.0), "cipher_reroute, fill = capacity");
  check(ad::cipher_reroute(0.02f, 1.25, 0.9), "cipher_reroute");
  check(ad::cipher_reroute(0.02f), "cipher_reroute, factors 8 / 4");
  check(ad::locmoe(1.0), "locmoe");
  check(ad::capacity_position(0.8), "capacity_position");
  check(ad::capacity_position(0.5, 5), "capacity_position, min_capacity");
  check(ad::capacity_probs(0.8), "capacity_probs");
  auto renorm = ad::capacity_probs(0.7);
  renorm.overflow.renormalize = true;
  check(renorm, "capacity_probs, renormalize");
  check(ad::capacity_gate(0.8), "capacity_gate");
  auto gate_threshold = ad::capacity_gate(1.0);
  gate_threshold.threshold = 0.2f;
  check(gate_threshold, "capacity_gate, threshold");
  check(ad::dropless(), "dropless");
  auto logit = ad::policy<ad::logit, ad::reroute>{};
  logit.threshold = -1.0f;
  logit.capacity_factor = 1.0;
  logit.overflow.fill_factor = 1.5;
  check(logit, "logit, reroute");
  auto prob = ad::policy<ad::probability, ad::reroute>{};
  prob.capacity_factor = 0.9;
  prob.overflow.fill_factor = 1.2;
  prob.overflow.max_rounds = 3;
  check(prob, "probability, reroute, 3 rounds");
  check(ad::cipher_strict(1.0e30f, 1.0), "tau above every affinity");
  check(ad::cipher_reroute(-1.0e30f, 0.0, 4.0), "capacity 0");
}

}  // namespace admission_cases
