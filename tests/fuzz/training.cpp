// Fuzz target: a training step of a runtime router (runtime::route and
// backward, docs/policies.md sections 3 and 5) with every penalty, prior and
// load-balance scope chosen by the fuzzer, against the test suite's double
// reference (tests/cpu/training_reference.hpp):
//  - the indices (the prior's or the replayed experts where they act), gates
//    and the five penalty values, in training and evaluation mode;
//  - the fused backward against central differences of the reference loss;
//  - a token mask: every output equals the call on the batch without the
//    masked rows (bit for bit; penalty values to rounding);
//  - the same bits on 1 and n threads (one case in eight is repeated to 600
//    tokens, where the backend splits a call; those skip the finite
//    differences, which grow with the square of the batch).
// Logits are moderate (|z| <= 40, ties, signed zeros) with now and then a NaN
// or an infinity, which takes its row out of the penalties; the configurations
// are valid by construction, so any exception is a finding.
#define DOCTEST_CONFIG_DISABLE
#include <moe_route/runtime/instantiate.hpp>

#include "cpu/training_reference.hpp"
#include "fuzz_input.hpp"
#include "router_choice.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

namespace {

namespace mr = moe_route;
namespace rt = moe_route::runtime;
namespace pen = moe_route::penalty;

constexpr std::int64_t threaded_tokens = 600;

struct training_case {
  rt::router_config config;
  tref::batch batch;
  int threads = 1;
  bool repeated = false;                // rows repeated to threaded_tokens
  std::vector<std::int32_t> replay;     // empty: the router selects
  std::vector<std::uint8_t> mask;       // empty: every token valid
  std::vector<float> grad_gates, penalty_grads;
};

// A logit of a training batch: moderate values, ties and signed zeros, and
// one in 16 not finite.
float training_logit(fuzz::input& in, float& last) {
  const std::uint8_t kind = in.byte();
  float v;
  switch (kind % 16) {
    case 0: v = last; break;
    case 1: v = 0.0f; break;
    case 2: v = -0.0f; break;
    case 3: v = static_cast<float>(static_cast<int>(in.byte() % 9) - 4); break;
    case 4: v = static_cast<float>(static_cast<int>(in.byte()) - 128) * (40.0f / 128.0f); break;
    case 5: {
      const float specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                                -std::numeric_limits<float>::infinity()};
      v = specials[in.byte() % 3];
      break;
    }
    default: v = static_cast<float>(static_cast<int>(in.u32() % 16001) - 8000) / 1000.0f;  // [-8, 8]
  }
  if (std::isfinite(v)) last = v;
  return v;
}

float choose(fuzz::input& in, std::initializer_list<float> values) {
  return values.begin()[in.in(0, static_cast<int>(values.size()) - 1)];
}

void decode_policies(fuzz::input& in, rt::router_config& r) {
  r.prior = static_cast<rt::prior_kind>(in.in(0, 2));
  r.prior_bias.beta = choose(in, {1.0f, 0.0f, 0.25f, 3.0f});
  r.prior_bias.bias_gates = in.flag();
  const auto coefficient = [&] { return in.flag() ? 0.0f : choose(in, {1.0f, 1e-3f, 0.1f, 2.5f, 0.5f}); };
  r.load_balance.coefficient = coefficient();
  r.load_balance.over = static_cast<pen::load_balance::scope>(in.in(0, 2));
  if (r.load_balance.over != pen::load_balance::scope::global_batch && in.flag())
    r.load_balance.counts = pen::load_balance::count::top_k;
  if (r.load_balance.over == pen::load_balance::scope::sequence && in.flag())
    r.load_balance.sequence_length = pen::load_balance::length::batch_mean;
  r.z_loss.coefficient = coefficient();
  r.kl_to_base.coefficient = coefficient();
  r.logit_l2.coefficient = coefficient();
  r.locality.coefficient = coefficient();
  r.locality.epsilon = choose(in, {1e-3f, 0.999f, 0.1f, 0.5f});
}

training_case decode(fuzz::input& in) {
  training_case c;
  int E = 1;
  c.config = fuzz::decode_router(in, 24, E);
  decode_policies(in, c.config);
  const int K = c.config.top_k;
  tref::batch& b = c.batch;
  b.E = E;
  b.N = in.in(0, 8);
  b.mode = in.in(0, 7) == 0 ? mr::mode::eval : mr::mode::train;
  c.threads = in.in(1, 3);
  float last = 1.0f;
  b.z.resize(static_cast<std::size_t>(b.N) * E);
  for (float& z : b.z) z = training_logit(in, last);
  // The prior table (RPB eq. 3 of positive weights), each token's row or -1.
  b.S = in.in(1, 4);
  std::vector<double> pi(static_cast<std::size_t>(b.S) * E);
  for (double& p : pi) p = 1 + in.byte() % 64;
  tref::prepare_reference(pi, E, choose(in, {0.05f, 0.01f, 0.5f}), choose(in, {5.0f, 2.0f, 100.0f}), b.bias, b.probs);
  for (std::int64_t t = 0; t < b.N; ++t) b.rows.push_back(in.in(-1, static_cast<int>(b.S) - 1));
  b.num_sequences = in.in(1, 4);
  for (std::int64_t t = 0; t < b.N; ++t) b.sequence_ids.push_back(in.in(0, b.num_sequences - 1));
  double total = 0;
  for (int e = 0; e < E; ++e) total += b.load_fractions.emplace_back(static_cast<float>(1 + in.byte() % 32));
  for (float& f : b.load_fractions) f = static_cast<float>(f / total);
  const int ranks = in.in(1, 4);
  for (int e = 0; e < E; ++e) b.expert_rank.push_back(in.in(0, ranks - 1));
  b.rank = b.expert_rank[in.in(0, E - 1)];  // locality needs an expert on this rank
  if (rt::selection_uses_bias(c.config.selection))
    for (int e = 0; e < E; ++e) b.expert_bias.push_back(in.moderate_float());

  // One case in six replays experts chosen here: K distinct per token.
  if (in.in(0, 5) == 0) {
    std::vector<std::int32_t> all(E);
    for (std::int64_t t = 0; t < b.N; ++t) {
      std::iota(all.begin(), all.end(), 0);
      for (int j = 0; j < K; ++j) std::swap(all[j], all[j + in.in(0, E - 1 - j)]);
      c.replay.insert(c.replay.end(), all.begin(), all.begin() + K);
    }
  }
  // One case in eight repeats its rows (and their prior rows and sequences).
  if (b.N > 0 && in.in(0, 7) == 0) {
    const std::int64_t copies = (threaded_tokens + b.N - 1) / b.N;
    const tref::batch one = b;
    const std::vector<std::int32_t> replay = c.replay;
    for (std::int64_t i = 1; i < copies; ++i) {
      b.z.insert(b.z.end(), one.z.begin(), one.z.end());
      b.rows.insert(b.rows.end(), one.rows.begin(), one.rows.end());
      b.sequence_ids.insert(b.sequence_ids.end(), one.sequence_ids.begin(), one.sequence_ids.end());
      c.replay.insert(c.replay.end(), replay.begin(), replay.end());
    }
    b.N *= copies;
    c.repeated = true;
  }
  // One case in six masks some tokens, and fills their rows with what a
  // padded batch may hold, none of which may be read. (Not under a fixed
  // selection without replay: its experts follow the position, which the
  // batch without the masked rows changes; docs/policies.md, "Token mask".)
  const bool positional = c.config.selection == rt::selection_kind::fixed && c.replay.empty();
  if (in.in(0, 5) == 0 && !positional)
    for (std::int64_t t = 0; t < b.N; ++t) {
      c.mask.push_back(in.in(0, 2) != 0);
      if (c.mask[t] != 0) continue;
      for (int e = 0; e < E; ++e) b.z[t * E + e] = e % 2 ? std::numeric_limits<float>::quiet_NaN() : -0.0f;
      b.rows[t] = 1 << 30;
      b.sequence_ids[t] = -5;
      if (!c.replay.empty()) std::fill_n(c.replay.begin() + t * K, K, -5);
    }
  for (std::int64_t i = 0; i < b.N * K; ++i)
    c.grad_gates.push_back(static_cast<float>(static_cast<int>(in.byte()) - 128) / 32.0f);
  for (int j = 0; j < rt::num_penalties; ++j) c.penalty_grads.push_back(choose(in, {1.0f, 0.5f, 2.0f, 0.0f, -1.0f}));
  return c;
}

tref::policies policies_of(const rt::router_config& r) {
  tref::policies p;
  p.prior_soft = r.prior != rt::prior_kind::prior_override;  // none: beta 0
  p.prior_hard = r.prior == rt::prior_kind::prior_override;
  p.beta = r.prior == rt::prior_kind::log_prior_bias ? r.prior_bias.beta : 0.0f;
  p.bias_gates = r.prior_bias.bias_gates;
  p.lb = p.z = p.kl = p.l2 = p.loc = true;  // a runtime router carries every penalty
  p.lb_c = r.load_balance.coefficient;
  p.lb_scope = r.load_balance.over;
  p.lb_top_k = r.load_balance.counts == pen::load_balance::count::top_k;
  p.lb_batch_mean = r.load_balance.sequence_length == pen::load_balance::length::batch_mean;
  p.z_c = r.z_loss.coefficient;
  p.kl_c = r.kl_to_base.coefficient;
  p.l2_c = r.logit_l2.coefficient;
  p.loc_c = r.locality.coefficient;
  p.loc_eps = r.locality.epsilon;
  return p;
}

// The step through the runtime library.
tref::lib_run run(const training_case& c, const tref::batch& b, const std::vector<std::uint8_t>& mask,
                  const std::vector<std::int32_t>& replay, const std::vector<float>& grad_gates, int threads) {
  auto in = b.inputs();
  in.token_mask = mask.empty() ? nullptr : mask.data();
  in.replay_indices = replay.empty() ? nullptr : replay.data();
  const mr::cpu::execution ex = ref::on_threads(threads);
  return tref::run_step(
      in, c.config.top_k, rt::num_penalties, rt::workspace_bytes(c.config, b.N, b.E, b.num_sequences), grad_gates,
      c.penalty_grads, [&](const auto& i, const auto& o) { rt::route(c.config, i, o, ex); },
      [&](const auto& i, const auto& a) { rt::backward(c.config, i, a, ex); });
}

bool same_run(const tref::lib_run& a, const tref::lib_run& b) {
  return fuzz::same_bits(a.idx, b.idx) && fuzz::same_bits(a.gates, b.gates) && fuzz::same_bits(a.values, b.values) &&
         fuzz::same_bits(a.dz, b.dz);
}

std::string describe(const training_case& c) {
  const rt::router_config& r = c.config;
  return "E=" + std::to_string(c.batch.E) + " N=" + std::to_string(c.batch.N) + " K=" + std::to_string(r.top_k) +
         " gating " + std::to_string(static_cast<int>(r.gating)) + " selection " +
         std::to_string(static_cast<int>(r.selection)) + " prior " + std::to_string(static_cast<int>(r.prior)) +
         (c.batch.mode == mr::mode::eval ? " eval" : "") + (c.replay.empty() ? "" : " replay") +
         (c.mask.empty() ? "" : " masked");
}

std::string policies_text(const rt::router_config& r) {
  const auto f = [](double x) { return ref::precise(x); };
  return "prior beta " + f(r.prior_bias.beta) + (r.prior_bias.bias_gates ? " (gates)" : "") + ", load_balance " +
         f(r.load_balance.coefficient) + " scope " + std::to_string(static_cast<int>(r.load_balance.over)) +
         " counts " + std::to_string(static_cast<int>(r.load_balance.counts)) + " length " +
         std::to_string(static_cast<int>(r.load_balance.sequence_length)) + ", z_loss " + f(r.z_loss.coefficient) +
         ", kl_to_base " + f(r.kl_to_base.coefficient) + ", logit_l2 " + f(r.logit_l2.coefficient) + ", locality " +
         f(r.locality.coefficient) + " eps " + f(r.locality.epsilon) + ", normalize " + std::to_string(r.normalize) +
         " scale " + f(r.scaling_factor);
}

// The rows of a masked case that are valid, as a batch of their own (with
// their gate gradients and replayed experts).
struct compact_case {
  tref::batch batch;
  std::vector<std::int32_t> replay;
  std::vector<float> grad_gates;
};

compact_case valid_rows(const training_case& c) {
  const tref::batch& b = c.batch;
  const int K = c.config.top_k, E = b.E;
  compact_case v{b, {}, {}};
  v.batch.z.clear();
  v.batch.rows.clear();
  v.batch.sequence_ids.clear();
  for (std::int64_t t = 0; t < b.N; ++t) {
    if (c.mask[t] == 0) continue;
    v.batch.z.insert(v.batch.z.end(), b.z.begin() + t * E, b.z.begin() + (t + 1) * E);
    v.batch.rows.push_back(b.rows[t]);
    v.batch.sequence_ids.push_back(b.sequence_ids[t]);
    v.grad_gates.insert(v.grad_gates.end(), c.grad_gates.begin() + t * K, c.grad_gates.begin() + (t + 1) * K);
    if (!c.replay.empty()) v.replay.insert(v.replay.end(), c.replay.begin() + t * K, c.replay.begin() + (t + 1) * K);
  }
  v.batch.N = static_cast<std::int64_t>(v.batch.rows.size());
  return v;
}

std::string row_text(const compact_case& v, const tref::lib_run& lib, int K, std::int64_t t) {
  const int E = v.batch.E;
  std::string s = "row " + std::to_string(t) + " (prior row " + std::to_string(v.batch.rows[t]) + ", sequence " +
                  std::to_string(v.batch.sequence_ids[t]) + "): z";
  for (int e = 0; e < E; ++e) s += " " + ref::precise(v.batch.z[t * E + e]);
  s += "; experts";
  for (int j = 0; j < K; ++j) s += " " + std::to_string(lib.idx[t * K + j]);
  s += "; dL/dgates";
  for (int j = 0; j < K; ++j) s += " " + ref::precise(v.grad_gates[t * K + j]);
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::input in(data, size);
  const training_case c = decode(in);
  const tref::batch& b = c.batch;
  const int K = c.config.top_k, E = b.E;
  const tref::lib_run got = run(c, b, c.mask, c.replay, c.grad_gates, c.threads);
  if (c.threads > 1)
    FUZZ_CHECK(same_run(got, run(c, b, c.mask, c.replay, c.grad_gates, 1)),
               "different bits on " + std::to_string(c.threads) + " threads and on 1; " + describe(c));

  // The reference sees the valid rows only; the masked call must equal the
  // library's call on them, and write -1 / 0 into the padding.
  const compact_case v = c.mask.empty() ? compact_case{b, c.replay, c.grad_gates} : valid_rows(c);
  const tref::lib_run want = c.mask.empty() ? got : run(c, v.batch, {}, v.replay, v.grad_gates, 1);
  if (!c.mask.empty()) {
    std::int64_t row = 0;
    for (std::int64_t t = 0; t < b.N; ++t) {
      const std::string at = "token " + std::to_string(t) + " of a masked batch; " + describe(c);
      if (c.mask[t] == 0) {
        for (int j = 0; j < K; ++j)
          FUZZ_CHECK(got.idx[t * K + j] == -1 && ref::bits(got.gates[t * K + j]) == 0, at);
        for (int e = 0; e < E; ++e) FUZZ_CHECK(ref::bits(got.dz[t * E + e]) == 0, at);
        continue;
      }
      FUZZ_CHECK(std::memcmp(&got.idx[t * K], &want.idx[row * K], K * sizeof(std::int32_t)) == 0 &&
                     std::memcmp(&got.gates[t * K], &want.gates[row * K], K * sizeof(float)) == 0 &&
                     std::memcmp(&got.dz[t * E], &want.dz[row * E], E * sizeof(float)) == 0,
                 at + " differs from the batch without the masked rows");
      ++row;
    }
    // Per-token terms are summed in chunks of positions, which padding shifts.
    for (int j = 0; j < rt::num_penalties; ++j)
      FUZZ_CHECK(ref::close(got.values[j], want.values[j], 1e-12, 1e-15),
                 "penalty " + std::to_string(j) + " of a masked batch; " + describe(c));
  }
  const auto problems = tref::compare_step(policies_of(c.config), fuzz::spec_of(c.config), rt::num_penalties,
                                           v.batch, want, v.grad_gates, c.penalty_grads,
                                           v.replay.empty() ? nullptr : &v.replay, !c.repeated);
  if (!problems.empty()) {
    std::string all = describe(c) + "\n" + policies_text(c.config);
    for (std::int64_t t = 0; t < v.batch.N && t < 16; ++t) all += "\n" + row_text(v, want, K, t);
    for (const std::string& p : problems) all += "\n  " + p;
    fuzz::finding(all);
  }
  return 0;
}
