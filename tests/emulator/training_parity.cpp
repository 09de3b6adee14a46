// The CUDA backend's training agents (backend/cuda/detail/agent_training.cuh) run
// under the host warp emulator and must give the CPU backend's bits: indices,
// gates, non-finite counts, penalty values and dL/dz, for every prior policy
// and penalty. The small per-call kernels (chunk totals, the shared dL/dp) are
// replayed here with the same shared arithmetic (training/finalize.hpp).
// Every case also runs under token masks (some, every or no token padding), and
// a selection of them under routing replay.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "token_masks.hpp"
#include "warp_emulator.hpp"
#include <moe_route/backend/cuda/detail/agent_expert_choice.cuh>
#include <moe_route/backend/cuda/detail/agent_prior.cuh>
#include <moe_route/backend/cuda/detail/agent_training.cuh>
#include <moe_route/moe_route.hpp>

namespace mr = moe_route;
namespace cd = moe_route::cuda::detail;
namespace pen = moe_route::penalty;
namespace pri = moe_route::prior;

namespace {

using emu::padding;

struct batch {
  std::int64_t N;
  int E;
  std::vector<float> z, expert_bias, prior_bias, prior_probs, load_fractions;
  std::vector<std::int32_t> rows, sequence_ids, expert_rank;
  std::vector<std::uint8_t> mask;  // empty: no mask
  std::vector<std::int32_t> replay;  // empty: no routing replay
  std::int64_t S = 5;
  std::int32_t num_sequences = 3;

  batch(std::int64_t n, int e, std::uint64_t seed, padding kind = padding::unmasked) : N(n), E(e) {
    std::mt19937_64 g(seed);
    // Integer-derived values: the same on every build.
    const auto uniform = [&g](int lo, int hi) { return lo + static_cast<int>(g() % static_cast<std::uint64_t>(hi - lo + 1)); };
    z.resize(N * E);
    for (std::int64_t t = 0; t < N; ++t)
      for (int x = 0; x < E; ++x) z[t * E + x] = uniform(-400, 400) / 128.0f;
    z[3 * E + 1] = std::numeric_limits<float>::quiet_NaN();   // rows left out of the penalties
    z[7 * E + 2] = std::numeric_limits<float>::infinity();
    for (int x = 0; x < E; ++x) z[11 * E + x] = 0.5f;           // a tied row
    expert_bias.resize(E);
    for (auto& b : expert_bias) b = uniform(-8, 8) / 64.0f;
    std::vector<float> pi(S * E);
    for (auto& p : pi) p = uniform(1, 1000) / 1000.0f;
    prior_bias.resize(S * E);
    prior_probs.resize(S * E);
    mr::prior::prepare(pi.data(), S, E, prior_bias.data(), prior_probs.data());
    rows.resize(N);
    for (auto& r : rows) r = uniform(-1, static_cast<int>(S) - 1);
    sequence_ids.resize(N);
    for (std::int64_t t = 0; t < N; ++t) sequence_ids[t] = static_cast<std::int32_t>(t * num_sequences / N);
    load_fractions.assign(E, 1.0f / E);
    expert_rank.resize(E);
    for (int x = 0; x < E; ++x) expert_rank[x] = x % 3;
    mask = emu::make_mask(N, kind);
    for (std::int64_t t = 0; t < static_cast<std::int64_t>(mask.size()); ++t) {
      if (mask[t] != 0) continue;
      // Padding rows hold what no call may read: NaN and inf logits, a prior
      // row and a sequence id out of range.
      for (int x = 0; x < E; ++x)
        z[t * E + x] = x % 2 ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
      rows[t] = 1 << 30;
      sequence_ids[t] = -7;
    }
  }

  // Routing replay of K distinct experts per token, shuffled from the seed
  // (padding rows: entries no call may read).
  batch& replaying(int K, std::uint64_t seed) {
    std::mt19937_64 g(seed);
    std::vector<std::int32_t> experts(E);
    replay.resize(N * K);
    for (std::int64_t t = 0; t < N; ++t) {
      for (int x = 0; x < E; ++x) experts[x] = x;
      std::shuffle(experts.begin(), experts.end(), g);
      for (int j = 0; j < K; ++j) replay[t * K + j] = padding_row(t) ? (j % 2 ? -3 : 1 << 30) : experts[j];
    }
    return *this;
  }

  mr::route_inputs<float> inputs() const {
    mr::route_inputs<float> in;
    in.logits = z.data();
    in.num_tokens = N;
    in.num_experts = E;
    in.expert_bias = expert_bias.data();
    in.prior_bias = prior_bias.data();
    in.prior_probs = prior_probs.data();
    in.prior_rows = S;
    in.token_prior_row = rows.data();
    in.sequence_ids = sequence_ids.data();
    in.num_sequences = num_sequences;
    in.load_fractions = load_fractions.data();
    in.expert_rank = expert_rank.data();
    in.rank = 1;
    in.token_mask = mask.empty() ? nullptr : mask.data();
    in.replay_indices = replay.empty() ? nullptr : replay.data();
    return in;
  }

  bool padding_row(std::int64_t t) const { return !mask.empty() && mask[t] == 0; }
};

template <class V>
bool same_bits(const std::vector<V>& a, const std::vector<V>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(V)) == 0;
}

// Admitted indices for routed ones: slot j of token t kept, dropped or
// rerouted to an expert the token does not hold, in a fixed pattern.
std::vector<std::int32_t> admit_pattern(const std::vector<std::int32_t>& routed, std::int64_t N, int K, int E) {
  std::vector<std::int32_t> admitted = routed;
  for (std::int64_t t = 0; t < N; ++t) {
    std::int32_t* a = admitted.data() + t * K;
    const std::int32_t* r = routed.data() + t * K;
    for (int j = 0; j < K; ++j) {
      const int kind = static_cast<int>((t * 7 + j * 3) % 4);
      if (kind == 1) a[j] = -1;
      if (kind == 2 && K < E) {
        for (int e = 0; e < E; ++e) {
          const bool held = std::find(r, r + K, e) != r + K || std::find(a, a + K, e) != a + K;
          if (!held) {
            a[j] = e;
            break;
          }
        }
      }
    }
  }
  return admitted;
}

template <class Router>
void check_parity(const Router& r, const batch& b, bool admitted_gates = false, bool renormalize = false) {
  const auto in = b.inputs();
  const int K = r.top_k, E = b.E;
  const std::int64_t N = b.N;
  const int P = Router::num_penalties > 0 ? Router::num_penalties : 1;
  std::vector<float> grad_gates(N * K);
  for (std::size_t i = 0; i < grad_gates.size(); ++i) grad_gates[i] = static_cast<float>(static_cast<int>(i % 13) - 6) / 4.0f;
  std::vector<float> upstream = {1.5f, 0.5f, 2.0f, 1.0f, 0.75f};
  const std::size_t bytes = pen::training_workspace_bytes(r, N, E, b.num_sequences);

  // The CPU backend.
  struct cpu_result {
    std::vector<std::int32_t> idx, admitted;
    std::vector<float> gates, dz;
    std::vector<double> values;
    std::int64_t nonfinite = 0;
  };
  const auto run_cpu = [&](const mr::route_inputs<float>& cin) {
    cpu_result c{std::vector<std::int32_t>(N * K), {}, std::vector<float>(N * K), std::vector<float>(N * E),
                 std::vector<double>(P)};
    std::vector<unsigned char> cpu_ws(bytes);
    mr::route_outputs o;
    o.indices = c.idx.data();
    o.gates = c.gates.data();
    o.nonfinite_rows = &c.nonfinite;
    o.penalty_values = c.values.data();
    o.workspace = cpu_ws.data();
    o.workspace_bytes = bytes;
    mr::cpu::route(r, cin, o);
    if (admitted_gates) c.admitted = admit_pattern(c.idx, N, K, E);
    mr::backward_args a;
    a.admitted_indices = admitted_gates ? c.admitted.data() : nullptr;
    a.renormalize = renormalize;
    a.indices = c.idx.data();
    a.grad_gates = grad_gates.data();
    a.grad_logits = c.dz.data();
    a.workspace = cpu_ws.data();
    a.workspace_bytes = bytes;
    a.penalty_grads = upstream.data();
    mr::cpu::backward(r, cin, a);
    return c;
  };
  const cpu_result cpu = run_cpu(in);
  const std::vector<std::int32_t>& cpu_idx = cpu.idx;
  const std::vector<std::int32_t>& admitted = cpu.admitted;
  for (std::int64_t t = 0; t < N; ++t) {
    if (!b.padding_row(t)) continue;
    CAPTURE(t);
    for (int j = 0; j < K; ++j) CHECK((cpu_idx[t * K + j] == -1 && cpu.gates[t * K + j] == 0.0f));
    for (int e = 0; e < E; ++e) CHECK(emu::fbits(cpu.dz[t * E + e]) == 0u);
  }
  if (!b.mask.empty() && std::none_of(b.mask.begin(), b.mask.end(), [](std::uint8_t m) { return m == 0; })) {
    mr::route_inputs<float> unmasked = in;  // a mask of valid tokens is no mask
    unmasked.token_mask = nullptr;
    const cpu_result u = run_cpu(unmasked);
    CHECK(same_bits(u.idx, cpu.idx));
    CHECK(same_bits(u.gates, cpu.gates));
    CHECK(u.nonfinite == cpu.nonfinite);
    CHECK(same_bits(u.values, cpu.values));
    CHECK(same_bits(u.dz, cpu.dz));
  }

  // The device path under the emulator.
  const auto layout = pen::training_layout<Router>(N, E, b.num_sequences);
  std::vector<std::uint64_t> ws_storage((layout.bytes + 7) / 8 + 1, 0);
  const pen::switches on = pen::active(r, in);
  pen::workspace_view ws(ws_storage.data(), layout);
  std::vector<std::int32_t> idx(N * K, -7);
  std::vector<float> gates(N * K, -7.0f), dz(N * E, -7.0f);
  std::vector<double> values(P, 0.0);
  auto p = cd::make_training_params(r, in, in.logits, on, &ws);
  p.indices = idx.data();
  p.gates = gates.data();
  std::vector<std::uint64_t> keys(E);
  std::vector<std::int64_t> sums(E, 0), tokens(2, 0);
  std::vector<int> counts(E, 0);
  std::int64_t nonfinite = 0;
  for (std::int64_t t = 0; t < N; ++t)
    nonfinite += emu::run<int>([&] {
      return cd::route_training_row<emu::warp>(r, p, t, keys.data(), sums.data(), counts.data(), tokens.data()) ? 1 : 0;
    });
  if constexpr (Router::has_penalties) {
    constexpr int columns = pen::penalty_traits<Router>::scalar_penalties;
    if (on.distribution)
      for (int e = 0; e < E; ++e) {
        ws.distribution_sums[e] += sums[e];
        if (p.counting) ws.counts[e] += counts[e];
      }
    ws.header->valid_tokens += tokens[0];
    ws.header->prior_tokens += tokens[1];
    for (std::int64_t c = 0; c * pen::value_chunk < N; ++c)  // chunk_totals_kernel
      for (int col = 0; col < columns; ++col) {
        double total = 0.0;
        for (std::int64_t t = c * pen::value_chunk; t < std::min(N, (c + 1) * pen::value_chunk); ++t)
          total += ws.token_values[t * columns + col];
        ws.chunk_values[c * columns + col] = total;
      }
    pen::values(r, ws.state(r, in), values.data());
  }
  pen::upstream_grads up;
  for (int j = 0; j < Router::num_penalties; ++j) up.value[j] = upstream[j];
  auto q = cd::make_training_params(r, in, in.logits, on, &ws);
  if constexpr (Router::has_penalties) {
    const pen::training_state s = ws.state(r, in);
    if (on.distribution) {  // distribution_grads_kernel
      const int local = pen::penalty_traits<Router>::locality ? pen::detail::local_experts(s) : 0;
      for (int e = 0; e < E; ++e) ws.expert_grad[e] = pen::expert_grad(r, s, up, local, e);
      if (pen::over_sequences(r)) {
        const std::int64_t sequences = pen::averaged_sequences(r, s);
        for (std::int32_t c = 0; c < b.num_sequences; ++c)
          for (int e = 0; e < E; ++e) ws.sequence_grad[c * E + e] = pen::sequence_grad(r, s, up, sequences, c, e);
      }
    }
    q.weights = pen::weights(r, *ws.header, up);
  }
  q.admitted_indices = admitted_gates ? admitted.data() : nullptr;
  q.renormalize = renormalize;
  q.grad_indices = cpu_idx.data();
  q.grad_gates = grad_gates.data();
  q.grad_logits = dz.data();
  for (std::int64_t t = 0; t < N; ++t) emu::run<int>([&] { cd::backward_training_row<emu::warp>(r, q, t); return 0; });

  CHECK(same_bits(idx, cpu_idx));
  CHECK(same_bits(gates, cpu.gates));
  CHECK(nonfinite == cpu.nonfinite);
  if (Router::has_penalties) CHECK(same_bits(values, cpu.values));
  CHECK(same_bits(dz, cpu.dz));
}

}  // namespace

TEST_CASE("emulated CUDA training agents: every prior policy and penalty, bit-identical to the CPU backend") {
  for (const padding kind : {padding::unmasked, padding::some, padding::all, padding::none}) {
    for (int E : {8, 45, 70}) {
      CAPTURE(static_cast<int>(kind));
      CAPTURE(E);
      const batch b(24, E, 1000 + E, kind);
      SUBCASE("softmax, log_prior_bias, every penalty") {
        auto r = mr::with_policies(mr::router<mr::gating::softmax, mr::selection::top_k, 8>{}, pri::log_prior_bias{0.7f},
                                   pen::load_balance{0.3f}, pen::z_loss{0.01f}, pen::kl_to_base{0.2f}, pen::logit_l2{0.1f},
                                   pen::locality{0.4f});
        r.top_k = 3;
        check_parity(r, b);
      }
      SUBCASE("sigmoid + expert bias, gates from z, load balance over sequences") {
        auto r = mr::with_policies(mr::router<mr::gating::sigmoid, mr::selection::expert_bias, 8>{},
                                   pri::log_prior_bias{1.5f, false},
                                   pen::load_balance{0.3f, pen::load_balance::scope::sequence}, pen::kl_to_base{0.2f});
        r.top_k = 4;
        check_parity(r, b);
      }
      SUBCASE("sqrt_softplus, prior_override, kl_to_base and logit_l2") {
        auto r = mr::with_policies(mr::router<mr::gating::sqrt_softplus, mr::selection::top_k, 8>{}, pri::prior_override{},
                                   pen::kl_to_base{0.5f}, pen::logit_l2{0.05f}, pen::z_loss{0.02f});
        r.top_k = 2;
        check_parity(r, b);
      }
      SUBCASE("softmax_after_topk, global-batch load balance and z-loss") {
        auto r = mr::with_policies(mr::router<mr::gating::softmax_after_topk, mr::selection::top_k, 4>{},
                                   pen::load_balance{0.5f, pen::load_balance::scope::global_batch}, pen::z_loss{0.01f});
        r.top_k = 2;
        check_parity(r, b);
      }
      SUBCASE("admitted gates: plain router, with renormalisation") {
        mr::router<mr::gating::softmax, mr::selection::top_k, 8> r;
        r.top_k = 4;
        r.normalize = true;
        check_parity(r, b, true, true);
      }
      SUBCASE("admitted gates under the prior and penalties, every gating") {
        auto soft = mr::with_policies(mr::router<mr::gating::softmax, mr::selection::top_k, 8>{}, pri::log_prior_bias{0.7f},
                                      pen::load_balance{0.3f}, pen::z_loss{0.01f});
        soft.top_k = 3;
        check_parity(soft, b, true, false);
        auto sig = mr::with_policies(mr::router<mr::gating::sigmoid, mr::selection::top_k, 8>{}, pen::kl_to_base{0.2f});
        sig.top_k = 3;
        check_parity(sig, b, true, true);
        auto satk = mr::with_policies(mr::router<mr::gating::softmax_after_topk, mr::selection::top_k, 4>{},
                                      pri::prior_override{});
        satk.top_k = 2;
        check_parity(satk, b, true, false);
      }
      SUBCASE("load counts from the plain top-K under the expert bias, batch and sequence scopes") {
        for (const auto over : {pen::load_balance::scope::batch, pen::load_balance::scope::sequence}) {
          pen::load_balance lb{0.3f, over};
          lb.counts = pen::load_balance::count::top_k;
          auto r = mr::with_policies(mr::router<mr::gating::sigmoid, mr::selection::expert_bias, 8>{}, lb,
                                     pen::z_loss{0.01f});
          r.top_k = 3;
          check_parity(r, b);
        }
      }
      SUBCASE("load balance over sequences normalised by the batch's mean valid length") {
        pen::load_balance lb{0.3f, pen::load_balance::scope::sequence};
        lb.sequence_length = pen::load_balance::length::batch_mean;
        auto r = mr::with_policies(mr::router<mr::gating::softmax, mr::selection::top_k, 8>{}, lb);
        r.top_k = 4;
        check_parity(r, b);
      }
      SUBCASE("fixed selection with prior_override") {
        auto r = mr::with_policies(mr::router<mr::gating::softmax, mr::selection::fixed, 4>{}, pri::prior_override{});
        r.top_k = 2;
        check_parity(r, b);
      }
    }
  }
  SUBCASE("group-limited selection with the prior bias") {
    auto r = mr::with_policies(mr::presets::deepseek_v3(), pri::log_prior_bias{1.0f}, pen::load_balance{0.2f});
    check_parity(r, batch(20, 256, 78));
    check_parity(r, batch(20, 256, 79, padding::some));
    mr::get<pen::load_balance>(r).counts = pen::load_balance::count::top_k;  // Megatron's aux-loss counts
    check_parity(r, batch(20, 256, 80, padding::some));
  }
}

TEST_CASE("emulated CUDA training agents under routing replay: bit-identical to the CPU backend") {
  for (const padding kind : {padding::unmasked, padding::some}) {
    for (int E : {8, 45}) {
      CAPTURE(static_cast<int>(kind));
      CAPTURE(E);
      SUBCASE("softmax, log_prior_bias (gates from z'), every penalty") {
        auto r = mr::with_policies(mr::router<mr::gating::softmax, mr::selection::top_k, 8>{}, pri::log_prior_bias{0.7f},
                                   pen::load_balance{0.3f}, pen::z_loss{0.01f}, pen::kl_to_base{0.2f}, pen::logit_l2{0.1f});
        r.top_k = 3;
        check_parity(r, batch(24, E, 2000 + E, kind).replaying(3, 5 + E));
      }
      SUBCASE("sigmoid + expert bias, gates from z, load balance over sequences") {
        auto r = mr::with_policies(mr::router<mr::gating::sigmoid, mr::selection::expert_bias, 8>{},
                                   pri::log_prior_bias{1.5f, false},
                                   pen::load_balance{0.3f, pen::load_balance::scope::sequence});
        r.top_k = 4;
        r.normalize = true;
        check_parity(r, batch(24, E, 2100 + E, kind).replaying(4, 6 + E));
      }
      SUBCASE("softmax_after_topk and fixed selection, prior_override") {
        auto satk = mr::with_policies(mr::router<mr::gating::softmax_after_topk, mr::selection::top_k, 4>{},
                                      pri::prior_override{}, pen::z_loss{0.01f});
        satk.top_k = 2;
        check_parity(satk, batch(24, E, 2200 + E, kind).replaying(2, 7 + E));
        auto fixed = mr::with_policies(mr::router<mr::gating::softmax, mr::selection::fixed, 4>{}, pen::load_balance{0.3f});
        fixed.top_k = 2;
        check_parity(fixed, batch(24, E, 2300 + E, kind).replaying(2, 8 + E), true, true);
      }
    }
  }
  SUBCASE("load counts from the plain top-K, not the replayed experts") {
    pen::load_balance lb{0.3f, pen::load_balance::scope::sequence};
    lb.counts = pen::load_balance::count::top_k;
    auto r = mr::with_policies(mr::router<mr::gating::softmax_after_topk, mr::selection::top_k, 8>{}, lb);
    r.top_k = 2;
    check_parity(r, batch(24, 45, 2400, padding::some).replaying(2, 17));
  }
  SUBCASE("group-limited selection with the prior bias, K = E") {
    auto r = mr::with_policies(mr::router<mr::gating::softmax, mr::selection::top_k, 8>{}, pri::log_prior_bias{1.0f},
                               pen::load_balance{0.2f});
    r.top_k = 8;
    check_parity(r, batch(20, 8, 90).replaying(8, 91));
    auto d = mr::with_policies(mr::presets::deepseek_v3(), pri::log_prior_bias{1.0f}, pen::load_balance{0.2f});
    check_parity(d, batch(20, 256, 92, padding::some).replaying(d.top_k, 93));
  }
}

TEST_CASE("emulated CUDA prior builder: bit-identical to prior::build") {
  for (int E : {8, 45, 130}) {
    const batch b(60, E, 300 + E);
    const std::int64_t S = b.S;
    std::vector<float> cpu(S * E);
    mr::prior::build<mr::gating::softmax>(b.inputs(), b.rows.data(), S, cpu.data());
    std::vector<std::int64_t> sums(S * E, 0), tokens(S, 0);
    const cd::prior_build_params<float> p{b.z.data(), b.N, E, b.rows.data(), S, sums.data(), tokens.data()};
    for (std::int64_t t = 0; t < b.N; ++t)
      emu::run<int>([&] { cd::build_prior_row<emu::warp, mr::gating::softmax>(p, t); return 0; });
    std::vector<float> device(S * E);
    for (std::int64_t i = 0; i < S * E; ++i) device[i] = mr::penalty::fixed_point_mean(sums[i], tokens[i / E]);
    CHECK(same_bits(device, cpu));
  }
}

TEST_CASE("emulated CUDA expert-choice backward: bit-identical to cpu::expert_choice_backward") {
  for (int E : {8, 45, 130}) {
    const batch b(40, E, 500 + E);
    mr::selection::expert_choice policy;
    policy.top_k = 2;
    const mr::expert_choice_inputs<float> in{b.z.data(), b.N, E};
    std::vector<std::int32_t> idx(b.N * E);
    std::vector<float> gates(b.N * E);
    mr::cpu::expert_choice(policy, in, mr::expert_choice_outputs{idx.data(), gates.data()});
    std::vector<float> dg(b.N * E), cpu(b.N * E), device(b.N * E, -7.0f);
    for (std::size_t i = 0; i < dg.size(); ++i) dg[i] = static_cast<float>(static_cast<int>(i % 9) - 4) / 8.0f;
    mr::cpu::expert_choice_backward(in, idx.data(), dg.data(), cpu.data());
    for (std::int64_t t = 0; t < b.N; ++t)
      emu::run<int>([&] {
        cd::expert_choice_backward_row<emu::warp>(b.z.data() + t * E, idx.data() + t * E, dg.data() + t * E, E,
                                                  device.data() + t * E);
        return 0;
      });
    CHECK(same_bits(device, cpu));
  }
}
