// The CUDA backend's admission, expert-choice and dispatch-metadata launch
// sequences (backend/cuda/detail/*_launch.cuh) run step for step on the host
// executor (executor.hpp: warp steps on the 32-lane warp emulator, the radix
// sorts as stable sorts of the same key bits), against the CPU backend, bit for
// bit: indices, status, gates, reports, counts, offsets, permutations and rank
// counts. Every admission policy over presets whose gatings differ (softmax,
// renormalised, sigmoid with groups, softmax after top-k), ties, NaN / inf
// rows, groups (one empty), per-expert capacities, E not a multiple of 32,
// E = 1, K = E, N = 0, bf16 logits; token masks (padding rows of garbage,
// none, some or every token padding; a masked call equals the call on the
// batch with the padding rows removed); and the device-only handling of
// invalid input (dropped and counted), checked against expectations written here.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "admission_cases.hpp"
#include "executor.hpp"
#include "token_masks.hpp"
#include <moe_route/backend/cuda/detail/admission_launch.cuh>
#include <moe_route/backend/cuda/detail/dispatch_launch.cuh>
#include <moe_route/backend/cuda/detail/expert_choice_launch.cuh>
#include <moe_route/moe_route.hpp>

namespace {

namespace mr = moe_route;
namespace ad = moe_route::admission;
namespace cad = moe_route::cuda::admission_detail;
using admission_cases::admission_inputs_of;
using admission_cases::batch;
using admission_cases::expert_choice_case;
using admission_cases::expert_choice_shape;
using admission_cases::make_expert_choice_case;
using admission_cases::make_batch;
using admission_cases::same_bits;
using admission_cases::same_report;

// The most slots any expert holds.
std::int64_t most_held(const std::vector<std::int32_t>& idx, int E) {
  std::vector<std::int64_t> held(E, 0);
  for (const std::int32_t e : idx)
    if (e >= 0 && e < E) ++held[e];
  return E == 0 ? 0 : *std::max_element(held.begin(), held.end());
}

// The emulated cuda::dispatch of `in` against cpu::dispatch of `as_host`
// (default: `in`), the indices a device call must act as when `in` holds data
// the CPU backend rejects.
void check_dispatch(const mr::dispatch_inputs& in, const mr::dispatch_inputs* as_host = nullptr) {
  const emu::executor ex;
  const std::int64_t slots = in.num_tokens * in.slots_per_token;
  const std::int64_t bound =
      mr::dispatch_rows_bound(in.num_tokens, in.slots_per_token, in.num_experts, in.align, in.capacity);
  std::vector<std::int64_t> counts(in.num_experts), offsets(in.num_experts + 1), perm(bound), inv(slots),
      ranks(in.num_ranks);
  mr::cpu::dispatch(as_host != nullptr ? *as_host : in,
                    mr::dispatch_outputs{counts.data(), offsets.data(), perm.data(), inv.data(), ranks.data()});
  std::vector<std::int64_t> ecounts(in.num_experts, 7), eoffsets(in.num_experts + 1, 7), eperm(bound, 7),
      einv(slots, 7), eranks(in.num_ranks, 7);
  const std::size_t bytes =
      cad::make_dispatch_layout(ex, nullptr, static_cast<int>(slots), in.num_experts).bytes;
  std::vector<unsigned char> ws(bytes + 1);
  cad::launch_dispatch(ex, in,
                       mr::dispatch_outputs{ecounts.data(), eoffsets.data(), eperm.data(), einv.data(), eranks.data()},
                       ws.data() + 1, bytes, bytes);  // an unaligned base: the layout keeps the slack
  CHECK(ecounts == counts);
  CHECK(eoffsets == offsets);
  CHECK(eperm == perm);
  CHECK(einv == inv);
  CHECK(eranks == ranks);
}

template <class Router, class Policy>
void check_admit(const Router& r, const Policy& p, const batch& b, const char* what,
                 const std::vector<std::uint8_t>& mask = {}) {
  CAPTURE(what);
  const emu::executor ex;
  const std::int64_t slots = b.N * b.K;
  mr::admission_inputs<float> in = admission_inputs_of(b, b.z.data());
  in.token_mask = mask.empty() ? nullptr : mask.data();
  std::vector<std::int32_t> cidx(slots);
  std::vector<float> cgates(slots);
  std::vector<std::int8_t> cstatus(slots);
  mr::admission_report crep;
  mr::cpu::admit(r, p, in, mr::admission_outputs{cidx.data(), cgates.data(), cstatus.data(), &crep});

  const std::size_t bytes = cad::admit_bytes<emu::executor, Policy>(ex, b.N, b.K, b.E, b.G);
  std::vector<unsigned char> ws(bytes + 1);
  for (int run = 0; run < 2; ++run) {  // twice: a reused workspace gives the same bits
    std::vector<std::int32_t> eidx(slots, 99);
    std::vector<float> egates(slots, 99.0f);
    std::vector<std::int8_t> estatus(slots, 99);
    mr::admission_report erep;
    erep.kept = 12345;
    cad::launch_admit(ex, r, p, in, mr::admission_outputs{eidx.data(), egates.data(), estatus.data(), &erep},
                      ws.data() + run, bytes, bytes);
    CHECK(eidx == cidx);
    CHECK(estatus == cstatus);
    CHECK(same_bits(egates, cgates));
    CHECK(same_report(erep, crep));
  }
  for (int align : {1, 8}) {
    const int R = b.E % 4 == 0 ? 4 : 1;
    check_dispatch(mr::dispatch_inputs{cidx.data(), b.N, b.K, b.E, align, R, nullptr});
    // The fixed E x C layout (capacity admission keeps every expert within its capacity).
    check_dispatch(mr::dispatch_inputs{cidx.data(), b.N, b.K, b.E, align, R, nullptr, most_held(cidx, b.E) + 3});
  }
}

template <class Router>
void all_policies(const Router& r, const batch& b) {
  admission_cases::for_each_policy([&](const auto& p, const char* what) { check_admit(r, p, b, what); });
}

using emu::padding;
using emu::make_mask;

// b with its padding rows holding what no call may read: NaN logits, routed
// indices and group ids out of range, NaN gates, zero norms.
batch with_garbage(batch b, const std::vector<std::uint8_t>& mask) {
  for (std::int64_t t = 0; t < b.N; ++t) {
    if (mask[t] != 0) continue;
    std::fill(b.z.begin() + t * b.E, b.z.begin() + (t + 1) * b.E, std::numeric_limits<float>::quiet_NaN());
    for (int j = 0; j < b.K; ++j) {
      b.routed[t * b.K + j] = j % 2 ? b.E + 3 : -2;
      b.gates[t * b.K + j] = std::numeric_limits<float>::quiet_NaN();
    }
    if (!b.groups.empty()) b.groups[t] = b.G + 5;
    b.xn[t] = 0.0f;
  }
  return b;
}

// The valid rows of b alone.
batch valid_rows(const batch& b, const std::vector<std::uint8_t>& mask) {
  batch v = b;
  v.N = 0;
  v.z.clear(), v.routed.clear(), v.gates.clear(), v.xn.clear(), v.groups.clear();
  for (std::int64_t t = 0; t < b.N; ++t) {
    if (mask[t] == 0) continue;
    ++v.N;
    v.z.insert(v.z.end(), b.z.begin() + t * b.E, b.z.begin() + (t + 1) * b.E);
    v.routed.insert(v.routed.end(), b.routed.begin() + t * b.K, b.routed.begin() + (t + 1) * b.K);
    v.gates.insert(v.gates.end(), b.gates.begin() + t * b.K, b.gates.begin() + (t + 1) * b.K);
    v.xn.push_back(b.xn[t]);
    if (!b.groups.empty()) v.groups.push_back(b.groups[t]);
  }
  return v;
}

// Admission with a token mask: the emulated sequence against cpu::admit (and
// its dispatch), padding slots -1 / 0 / dropped and in no report field, and
// the valid rows equal to admitting the batch without its padding rows.
template <class Router, class Policy>
void check_masked_admit(const Router& r, const Policy& p, const batch& clean, padding kind, const char* what) {
  CAPTURE(static_cast<int>(kind));
  const std::vector<std::uint8_t> mask = make_mask(clean.N, kind);
  const batch b = with_garbage(clean, mask);
  check_admit(r, p, b, what, mask);

  const emu::executor ex;
  const std::int64_t slots = b.N * b.K;
  mr::admission_inputs<float> in = admission_inputs_of(b, b.z.data());
  in.token_mask = mask.data();
  std::vector<std::int32_t> idx(slots);
  std::vector<float> gates(slots);
  std::vector<std::int8_t> status(slots);
  mr::admission_report rep;
  const std::size_t bytes = cad::admit_bytes<emu::executor, Policy>(ex, b.N, b.K, b.E, b.G);
  std::vector<unsigned char> ws(bytes);
  cad::launch_admit(ex, r, p, in, mr::admission_outputs{idx.data(), gates.data(), status.data(), &rep}, ws.data(),
                    bytes, bytes);

  const batch v = valid_rows(clean, mask);
  const std::int64_t vslots = v.N * v.K;
  std::vector<std::int32_t> vidx(vslots);
  std::vector<float> vgates(vslots);
  std::vector<std::int8_t> vstatus(vslots);
  mr::admission_report vrep;
  mr::cpu::admit(r, p, admission_inputs_of(v, v.z.data()),
                 mr::admission_outputs{vidx.data(), vgates.data(), vstatus.data(), &vrep});
  CHECK(same_report(rep, vrep));
  std::int64_t row = 0;
  for (std::int64_t t = 0; t < b.N; ++t) {
    CAPTURE(t);
    for (int j = 0; j < b.K; ++j) {
      const std::int64_t s = t * b.K + j;
      if (mask[t] == 0) {
        CHECK(idx[s] == -1);
        CHECK(emu::fbits(gates[s]) == 0u);
        CHECK(status[s] == static_cast<std::int8_t>(ad::slot_status::dropped));
      } else {
        const std::int64_t o = row * b.K + j;
        CHECK(idx[s] == vidx[o]);
        CHECK(emu::fbits(gates[s]) == emu::fbits(vgates[o]));
        CHECK(status[s] == vstatus[o]);
      }
    }
    row += mask[t] != 0;
  }
}

template <class Router>
void all_policies_masked(const Router& r, const batch& b) {
  for (padding kind : {padding::some, padding::all, padding::none})
    admission_cases::for_each_policy(
        [&](const auto& p, const char* what) { check_masked_admit(r, p, b, kind, what); });
}

}  // namespace

TEST_CASE("emulated CUDA admission: every policy, bit-identical to cpu::admit, and its dispatch") {
  {
    auto r = mr::presets::qwen3();
    all_policies(r, make_batch(r, 1, 96, 128, 0, 1, false));
    all_policies(r, make_batch(r, 2, 80, 128, 2, 4, false));  // ties, groups (one empty)
    all_policies(r, make_batch(r, 3, 70, 128, 0, 3, true));   // per-expert capacities
  }
  {
    auto r = mr::presets::deepseek_v3();  // sigmoid, group-limited
    all_policies(r, make_batch(r, 5, 64, 256, 1, 2, false));
  }
  {
    auto r = mr::presets::mixtral();  // softmax after top-k
    all_policies(r, make_batch(r, 8, 99, 8, 1, 3, true));
  }
  {  // E not a multiple of 32 and several scratch words per warp, K = 8.
    mr::router<mr::gating::sigmoid, mr::selection::top_k, 8> r;
    r.top_k = 8;
    all_policies(r, make_batch(r, 9, 40, 100, 0, 1, false));
  }
  {  // E = 1 and K = E.
    mr::router<mr::gating::softmax, mr::selection::top_k, 8> r;
    r.top_k = 1;
    all_policies(r, make_batch(r, 10, 20, 1, 0, 1, false));
    r.top_k = 6;
    all_policies(r, make_batch(r, 11, 30, 6, 0, 1, false));
  }
  {  // N = 0: the report is zeroed, nothing else written.
    auto r = mr::presets::qwen3();
    all_policies(r, make_batch(r, 12, 0, 128, 0, 1, false));
  }
}

TEST_CASE("emulated CUDA admission with a token mask == cpu::admit == admission of the valid rows alone") {
  {
    auto r = mr::presets::qwen3();
    all_policies_masked(r, make_batch(r, 31, 96, 128, 0, 1, false));
    all_policies_masked(r, make_batch(r, 32, 80, 128, 2, 4, false));  // ties, groups (one empty)
    all_policies_masked(r, make_batch(r, 33, 70, 128, 0, 3, true));   // per-expert capacities
  }
  {
    auto r = mr::presets::deepseek_v3();  // sigmoid, group-limited
    all_policies_masked(r, make_batch(r, 35, 64, 256, 1, 2, false));
  }
  {  // E not a multiple of 32, K = 8.
    mr::router<mr::gating::sigmoid, mr::selection::top_k, 8> r;
    r.top_k = 8;
    all_policies_masked(r, make_batch(r, 39, 40, 100, 0, 1, false));
  }
  {  // K = E.
    mr::router<mr::gating::softmax, mr::selection::top_k, 8> r;
    r.top_k = 6;
    all_policies_masked(r, make_batch(r, 41, 30, 6, 0, 2, false));
  }
}

TEST_CASE("emulated CUDA admission with bf16 logits == cpu::admit") {
  auto r = mr::presets::deepseek_v3();
  batch b = make_batch(r, 13, 48, 256, 0, 1, false);
  std::vector<mr::bfloat16> zb(b.z.size());
  for (std::size_t i = 0; i < zb.size(); ++i) zb[i] = mr::bfloat16::from_float(b.z[i]);
  mr::cpu::route(r, mr::route_inputs<mr::bfloat16>{zb.data(), b.N, b.E, b.bias.data()},
                 mr::route_outputs{b.routed.data(), b.gates.data()});
  const emu::executor ex;
  for (int variant = 0; variant < 2; ++variant) {
    const auto p = variant == 0 ? ad::cipher_reroute(0.0f, 1.0, 1.0) : ad::cipher_reroute(0.01f, 0.5, 1.0);
    const mr::admission_inputs<mr::bfloat16> in = admission_inputs_of(b, zb.data());
    const std::int64_t slots = b.N * b.K;
    std::vector<std::int32_t> cidx(slots), eidx(slots);
    std::vector<float> cgates(slots), egates(slots);
    mr::cpu::admit(r, p, in, mr::admission_outputs{cidx.data(), cgates.data()});
    const std::size_t bytes = cad::admit_bytes<emu::executor, decltype(p)>(ex, b.N, b.K, b.E, 1);
    std::vector<unsigned char> ws(bytes);
    cad::launch_admit(ex, r, p, in, mr::admission_outputs{eidx.data(), egates.data()}, ws.data(), bytes, bytes);
    CHECK(eidx == cidx);
    CHECK(same_bits(egates, cgates));
  }
}

TEST_CASE("emulated CUDA admission: invalid input is dropped and counted, the rest admitted") {
  // The CPU backend rejects these inputs; the device reads no array on the
  // host, so it drops the slot and counts it. With room for everything and
  // tau below every affinity, every other slot is kept.
  auto r = mr::presets::qwen3();
  batch b = make_batch(r, 14, 40, 128, 0, 3, false);
  b.routed[5 * b.K + 2] = b.E;  // expert out of range
  b.groups[11] = 7;             // group out of range: all K slots of token 11
  b.xn[20] = 0.0f;              // cosine: a norm that is not > 0
  for (const std::int64_t t : {4, 9})  // finite affinities everywhere (rows 4 and 9 hold NaN and +-inf)
    std::fill(b.z.begin() + t * b.E, b.z.begin() + (t + 1) * b.E, 0.25f);
  const auto p = ad::cipher_strict(-1.0e30f, 100.0);
  const emu::executor ex;
  const mr::admission_inputs<float> in = admission_inputs_of(b, b.z.data());
  const std::int64_t slots = b.N * b.K;
  std::vector<std::int32_t> idx(slots);
  std::vector<float> gates(slots);
  std::vector<std::int8_t> status(slots);
  mr::admission_report rep;
  const std::size_t bytes = cad::admit_bytes<emu::executor, decltype(p)>(ex, b.N, b.K, b.E, b.G);
  std::vector<unsigned char> ws(bytes);
  cad::launch_admit(ex, r, p, in, mr::admission_outputs{idx.data(), gates.data(), status.data(), &rep}, ws.data(),
                    bytes, bytes);
  const auto invalid_slot = [&](std::int64_t s) { return s == 5 * b.K + 2 || s / b.K == 11 || s / b.K == 20; };
  std::int64_t expected_invalid = 0;
  for (std::int64_t s = 0; s < slots; ++s) {
    CAPTURE(s);
    if (invalid_slot(s)) {
      ++expected_invalid;
      CHECK(idx[s] == -1);
      CHECK(status[s] == static_cast<std::int8_t>(ad::slot_status::dropped));
    } else {
      CHECK(idx[s] == b.routed[s]);
      CHECK(status[s] == static_cast<std::int8_t>(ad::slot_status::kept));
    }
  }
  CHECK(rep.invalid == expected_invalid);
  CHECK(rep.kept == slots - expected_invalid);
  CHECK(rep.dropped == expected_invalid);
  CHECK(rep.tokens_without_experts == 2);  // tokens 11 and 20
}

TEST_CASE("emulated CUDA expert_choice == cpu::expert_choice, its backward and its dispatch") {
  const emu::executor ex;
  const expert_choice_shape shapes[] = {
      {100, 64, 0, 1, false, 1.0},
      {90, 128, 2, 3, false, 1.5},
      {70, 32, 1, 2, true, 1.0},
      {40, 1, 0, 1, false, 0.5},
      {33, 100, 0, 1, false, 0.0},
  };
  for (const expert_choice_shape& s : shapes) {
    CAPTURE(s.E);
    const expert_choice_case c = make_expert_choice_case(s);
    const batch& b = c.b;
    const mr::selection::expert_choice& p = c.policy;
    const mr::expert_choice_inputs<float>& in = c.in;
    const std::vector<std::int32_t>& cidx = c.indices;
    const std::int64_t pairs = b.N * b.E;
    std::vector<std::int32_t> eidx(pairs, 9), eper(b.N, 9);
    std::vector<float> egates(pairs, 9.0f);
    mr::expert_choice_report erep;
    erep.assignments = 777;
    const std::size_t bytes = cad::make_ec_layout(ex, nullptr, b.N, b.E, b.G).bytes;
    std::vector<unsigned char> ws(bytes);
    cad::launch_expert_choice(ex, p, in, mr::expert_choice_outputs{eidx.data(), egates.data(), eper.data(), &erep},
                              ws.data(), bytes);
    CHECK(eidx == cidx);
    CHECK(eper == c.experts_per_token);
    CHECK(same_bits(egates, c.gates));
    CHECK(erep.assignments == c.report.assignments);
    CHECK(erep.tokens_without_experts == c.report.tokens_without_experts);
    CHECK(erep.max_experts_per_token == c.report.max_experts_per_token);
    CHECK(erep.invalid == 0);

    std::vector<float> dg(pairs), cdz(pairs), edz(pairs, 9.0f);
    for (std::int64_t i = 0; i < pairs; ++i) dg[i] = static_cast<float>(static_cast<int>(i % 9) - 4) / 8.0f;
    mr::cpu::expert_choice_backward(in, cidx.data(), dg.data(), cdz.data());
    cad::launch_expert_choice_backward(ex, in, cidx.data(), dg.data(), edz.data());
    CHECK(same_bits(edz, cdz));

    check_dispatch(mr::dispatch_inputs{cidx.data(), b.N, b.E, b.E, 16, 1, nullptr});
  }
}

TEST_CASE("emulated CUDA expert_choice with a token mask == cpu::expert_choice == the valid rows alone") {
  const emu::executor ex;
  const expert_choice_shape shapes[] = {
      {100, 64, 0, 1, false, 1.0},
      {90, 128, 2, 3, false, 1.5},
      {70, 32, 1, 2, true, 1.0},
      {33, 100, 0, 1, false, 0.0},
  };
  for (const expert_choice_shape& shape : shapes) {
    for (padding kind : {padding::some, padding::all, padding::none}) {
      CAPTURE(shape.E);
      CAPTURE(static_cast<int>(kind));
      const expert_choice_case c = make_expert_choice_case(shape);
      const std::vector<std::uint8_t> mask = make_mask(c.b.N, kind);
      const batch b = with_garbage(c.b, mask);
      mr::expert_choice_inputs<float> in = admission_cases::expert_choice_inputs_of(b);
      in.token_mask = mask.data();
      const std::int64_t pairs = b.N * b.E;
      std::vector<std::int32_t> cidx(pairs), cper(b.N), eidx(pairs, 9), eper(b.N, 9);
      std::vector<float> cgates(pairs), egates(pairs, 9.0f);
      mr::expert_choice_report crep, erep;
      mr::cpu::expert_choice(c.policy, in,
                             mr::expert_choice_outputs{cidx.data(), cgates.data(), cper.data(), &crep});
      const std::size_t bytes = cad::make_ec_layout(ex, nullptr, b.N, b.E, b.G).bytes;
      std::vector<unsigned char> ws(bytes);
      cad::launch_expert_choice(ex, c.policy, in,
                                mr::expert_choice_outputs{eidx.data(), egates.data(), eper.data(), &erep}, ws.data(),
                                bytes);
      CHECK(eidx == cidx);
      CHECK(eper == cper);
      CHECK(same_bits(egates, cgates));
      CHECK(erep.assignments == crep.assignments);
      CHECK(erep.tokens_without_experts == crep.tokens_without_experts);
      CHECK(erep.max_experts_per_token == crep.max_experts_per_token);
      CHECK(erep.invalid == crep.invalid);

      // The valid rows alone give the same rows and report.
      const batch v = valid_rows(c.b, mask);
      const mr::expert_choice_inputs<float> vin = admission_cases::expert_choice_inputs_of(v);
      std::vector<std::int32_t> vidx(v.N * v.E), vper(v.N);
      std::vector<float> vgates(v.N * v.E);
      mr::expert_choice_report vrep;
      mr::cpu::expert_choice(c.policy, vin,
                             mr::expert_choice_outputs{vidx.data(), vgates.data(), vper.data(), &vrep});
      CHECK(erep.assignments == vrep.assignments);
      CHECK(erep.tokens_without_experts == vrep.tokens_without_experts);
      CHECK(erep.max_experts_per_token == vrep.max_experts_per_token);
      CHECK(erep.invalid == 0);
      std::int64_t row = 0;
      for (std::int64_t t = 0; t < b.N; ++t) {
        CAPTURE(t);
        const bool pad = mask[t] == 0;
        CHECK(eper[t] == (pad ? 0 : vper[row]));
        for (int j = 0; j < b.E; ++j) {
          CHECK(eidx[t * b.E + j] == (pad ? -1 : vidx[row * b.E + j]));
          CHECK(emu::fbits(egates[t * b.E + j]) == (pad ? 0u : emu::fbits(vgates[row * b.E + j])));
        }
        row += !pad;
      }

      // The backward: padding rows are zero, their indices and gradients unread.
      std::vector<float> dg(pairs), cdz(pairs), edz(pairs, 9.0f);
      for (std::int64_t i = 0; i < pairs; ++i)
        dg[i] = mask[i / b.E] == 0 ? std::numeric_limits<float>::quiet_NaN()
                                   : static_cast<float>(static_cast<int>(i % 9) - 4) / 8.0f;
      std::vector<std::int32_t> bidx = cidx;
      for (std::int64_t i = 0; i < pairs; ++i)
        if (mask[i / b.E] == 0) bidx[i] = b.E + 7;
      mr::cpu::expert_choice_backward(in, bidx.data(), dg.data(), cdz.data());
      cad::launch_expert_choice_backward(ex, in, bidx.data(), dg.data(), edz.data());
      CHECK(same_bits(edz, cdz));
      for (std::int64_t i = 0; i < pairs; ++i)
        if (mask[i / b.E] == 0) REQUIRE(emu::fbits(edz[i]) == 0u);

      check_dispatch(mr::dispatch_inputs{eidx.data(), b.N, b.E, b.E, 16, 1, nullptr});
    }
  }
}

TEST_CASE("emulated CUDA expert_choice: tokens of an invalid group are never picked and are counted") {
  const std::int64_t N = 30;
  const int E = 16;
  std::vector<float> z(N * E);
  for (std::size_t i = 0; i < z.size(); ++i) z[i] = static_cast<float>((i * 37) % 11) / 4.0f;
  std::vector<std::int32_t> groups(N, 0);
  groups[3] = -1;
  groups[17] = 2;
  mr::selection::expert_choice p;
  p.capacity_factor = 100.0;  // room for every valid token
  mr::expert_choice_inputs<float> in;
  in.logits = z.data();
  in.num_tokens = N;
  in.num_experts = E;
  in.group_ids = groups.data();
  in.num_groups = 2;
  const emu::executor ex;
  std::vector<std::int32_t> idx(N * E), per(N);
  std::vector<float> gates(N * E);
  mr::expert_choice_report rep;
  const std::size_t bytes = cad::make_ec_layout(ex, nullptr, N, E, 2).bytes;
  std::vector<unsigned char> ws(bytes);
  cad::launch_expert_choice(ex, p, in, mr::expert_choice_outputs{idx.data(), gates.data(), per.data(), &rep},
                            ws.data(), bytes);
  for (std::int64_t t = 0; t < N; ++t) {
    CAPTURE(t);
    const bool invalid = t == 3 || t == 17;
    CHECK(per[t] == (invalid ? 0 : E));
    for (int j = 0; j < E; ++j) CHECK(idx[t * E + j] == (invalid ? -1 : j));
  }
  CHECK(rep.invalid == 2);
  CHECK(rep.tokens_without_experts == 2);
  CHECK(rep.assignments == (N - 2) * E);
  CHECK(rep.max_experts_per_token == E);
}

TEST_CASE("emulated CUDA dispatch == cpu::dispatch: rank map, fixed capacity, everything dropped, N = 0, invalid entries") {
  std::mt19937 rng(31);
  const std::int64_t N = 300;
  const int E = 96, S = 6;
  std::vector<std::int32_t> idx(N * S);
  std::uniform_int_distribution<int> ue(-1, E - 1);
  for (auto& x : idx) x = ue(rng);  // duplicates within a token are fine for dispatch
  std::vector<std::int32_t> map(E);
  for (int e = 0; e < E; ++e) map[e] = (e * 7) % 5;
  for (int variant = 0; variant < 3; ++variant) {
    CAPTURE(variant);
    std::vector<std::int32_t> in = idx;
    if (variant == 1) std::fill(in.begin(), in.end(), -1);
    const std::int64_t n_tokens = variant == 2 ? 0 : N;
    check_dispatch(mr::dispatch_inputs{in.data(), n_tokens, S, E, 128, 5, map.data()});
    check_dispatch(mr::dispatch_inputs{in.data(), n_tokens, S, E, 1, 3, nullptr});
    const std::int64_t most = most_held(in, E);
    check_dispatch(mr::dispatch_inputs{in.data(), n_tokens, S, E, 1, 3, nullptr, std::max<std::int64_t>(most, 1)});
    check_dispatch(mr::dispatch_inputs{in.data(), n_tokens, S, E, 8, 5, map.data(), most + 5});
  }
  // Over a fixed capacity (the CPU backend rejects it) the device keeps each
  // expert's first C slots in slot order: the CPU's layout of those alone.
  {
    const std::int64_t capacity = most_held(idx, E) / 2;
    std::vector<std::int32_t> kept = idx;
    std::vector<std::int64_t> held(E, 0);
    for (auto& e : kept)
      if (e >= 0 && ++held[e] > capacity) e = -1;
    const mr::dispatch_inputs host{kept.data(), N, S, E, 2, 1, nullptr, capacity};
    check_dispatch(mr::dispatch_inputs{idx.data(), N, S, E, 2, 1, nullptr, capacity}, &host);
  }
  // Entries outside [-1, E) (the CPU backend rejects them) are dispatched as -1.
  std::vector<std::int32_t> bad = idx, clean = idx;
  for (std::size_t i = 0; i < bad.size(); i += 13) {
    bad[i] = i % 2 ? E + 5 : -9;
    clean[i] = -1;
  }
  const mr::dispatch_inputs host{clean.data(), N, S, E, 4, 1, nullptr};
  check_dispatch(mr::dispatch_inputs{bad.data(), N, S, E, 4, 1, nullptr}, &host);
}
