// The CUDA backend's forward and backward agents (agent_route.cuh,
// agent_backward.cuh) under the host warp emulator, against the CPU backend,
// bit for bit: every gating, selection and preset over E from 8 to 4096,
// register buckets and the general path, float/bf16/fp16 logits with NaN, inf,
// ties and signed zeros; duplicate and invalid indices in the backward; token
// masks (padding rows of garbage; none, some or every token masked).
#include <doctest/doctest.h>

#include "warp_emulator.hpp"
#include "token_masks.hpp"
#include <moe_route/backend/cuda/detail/agent_backward.cuh>
#include <moe_route/backend/cuda/detail/agent_route.cuh>
#include <moe_route/backend/cuda/detail/tuning.cuh>
#include <moe_route/moe_route.hpp>
#include <cstdio>
#include <random>
#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <type_traits>

namespace mr = moe_route;
namespace cd = moe_route::cuda::detail;
namespace sel = moe_route::selection;
namespace gat = moe_route::gating;

static long g_fail = 0, g_checks = 0;
static int g_rows = 24;
// The expert counts of the sweep: every register bucket's boundary, E not a
// multiple of 32, the general path up to E = 4096.
static const int g_experts[] = {8, 64, 100, 128, 256, 384, 512, 1000, 4096};

template <class T> T make(float x);
template <> float make<float>(float x) { return x; }
template <> mr::bfloat16 make<mr::bfloat16>(float x) { return mr::bfloat16::from_float(x); }
template <> mr::float16 make<mr::float16>(float x) { return mr::float16::from_float(x); }

template <class T>
std::vector<T> gen_logits(std::mt19937& g, std::int64_t N, int E) {
  std::normal_distribution<float> nd(0.f, 2.f);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const float fmax = std::numeric_limits<float>::max();
  std::vector<T> z(N * E);
  for (std::int64_t t = 0; t < N; ++t) {
    int kind = (int)(t % 12);
    for (int e = 0; e < E; ++e) {
      float x = nd(g);
      switch (kind) {
        case 1: if (e % 5 == 1) x = nan; break;
        case 2: if (e == 3 % E) x = inf; if (e == 7 % E) x = -inf; break;
        case 3: x = 0.5f; break;                       // all equal
        case 4: x = std::round(x * 2) / 2; break;       // many ties
        case 5: x = nan; break;                         // all NaN
        case 6: if (e % 4 == 0) x = fmax; else if (e % 4 == 1) x = -fmax; else if (e % 4 == 2) x = inf; break;
        case 7: x = (e % 2) ? 0.0f : -0.0f; break;       // signed zeros
        case 8: x = x * 40.f; break;                    // wide range
        case 9: if (e % 3 == 0) x = -inf; break;
        case 10: x = e == E - 1 ? 3.0f : -100.0f + x; break;
        default: break;
      }
      z[t * E + e] = make<T>(x);
    }
  }
  return z;
}

template <class Router>
const char* gname() { return Router::gating_type::name; }

template <int Slots, class Router, class T>
std::int64_t emu_bucket(const Router& r, const cd::route_params<T>& p) {
  std::vector<std::uint64_t> smem(Slots * 32, 0xdeadbeefdeadbeefull);
  return emu::run<std::int64_t>([&] { return cd::route_rows_bucket<emu::warp, Router, T, Slots>(r, p, 0, 1, smem.data()); });
}
template <class Router, class T>
std::int64_t emu_general(const Router& r, const cd::route_params<T>& p) {
  std::vector<std::uint64_t> smem(p.num_experts, 0xdeadbeefdeadbeefull);
  return emu::run<std::int64_t>([&] { return cd::route_rows_general<emu::warp, Router, T>(r, p, 0, 1, smem.data()); });
}
template <class Router, class T>
std::int64_t emu_dispatch_bucket(const Router& r, const cd::route_params<T>& p) {
  switch (mr::cuda::tuning::bucket_for(p.num_experts)) {
    case 64: return emu_bucket<2>(r, p);
    case 128: return emu_bucket<4>(r, p);
    case 256: return emu_bucket<8>(r, p);
    case 384: return emu_bucket<12>(r, p);
    case 512: return emu_bucket<16>(r, p);
  }
  return -1;
}
template <int Slots, class Router, class T>
void emu_bwd_bucket(const Router& r, const cd::backward_params<T>& p) {
  emu::run<int>([&] { cd::backward_rows_bucket<emu::warp, Router, T, Slots>(r, p, 0, 1); return 0; });
}
template <class Router, class T>
void emu_bwd(const Router& r, const cd::backward_params<T>& p, bool general) {
  if constexpr (Router::gating_type::shape == gat::kind::row_softmax) {
    if (!general) {
      switch (mr::cuda::tuning::bucket_for(p.num_experts)) {
        case 64: return emu_bwd_bucket<2>(r, p);
        case 128: return emu_bwd_bucket<4>(r, p);
        case 256: return emu_bwd_bucket<8>(r, p);
        case 384: return emu_bwd_bucket<12>(r, p);
        case 512: return emu_bwd_bucket<16>(r, p);
      }
    }
  }
  emu::run<int>([&] { cd::backward_rows_general<emu::warp, Router, T>(r, p, 0, 1); return 0; });
}

template <class V>
bool same(const std::vector<V>& a, const std::vector<V>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(V)) == 0;
}

template <class Router, class T>
void check(const Router& r, int E, std::mt19937& g, const char* what) {
  const std::int64_t N = g_rows;
  const int K = r.top_k;
  auto z = gen_logits<T>(g, N, E);
  std::vector<float> bias(E);
  std::uniform_int_distribution<int> bi(-8, 8);
  for (auto& b : bias) b = bi(g) / 64.0f;
  const float* bp = Router::selection_type::needs_expert_bias ? bias.data() : nullptr;
  mr::route_inputs<T> in{z.data(), N, E, bp};
  std::vector<std::int32_t> ci(N * K), ei(N * K, -7), gi(N * K, -7);
  std::vector<float> cg(N * K), eg(N * K, -7.f), gg(N * K, -7.f);
  std::int64_t cnf = 0;
  mr::cpu::route(r, in, mr::route_outputs{ci.data(), cg.data(), &cnf});
  cd::route_params<T> p{z.data(), N, E, bp, ei.data(), eg.data(), cd::make_group_layout(r, E), nullptr, nullptr};
  // general path (every E)
  std::int64_t gnf = emu_general(r, p);
  ++g_checks;
  if (!same(ci, ei) || !same(cg, eg) || gnf != cnf) {
    ++g_fail;
    std::printf("FAIL general fwd %s E=%d K=%d: idx %d gates %d nf %lld/%lld\n", what, E, K, (int)same(ci, ei), (int)same(cg, eg), (long long)gnf, (long long)cnf);
    for (std::int64_t i = 0; i < N * K; ++i) if (ci[i] != ei[i] || std::memcmp(&cg[i], &eg[i], 4)) { std::printf("  first diff at %lld: cpu %d %a emu %d %a\n", (long long)i, ci[i], cg[i], ei[i], eg[i]); break; }
  }
  if (E <= 512) {
    cd::route_params<T> q = p;
    q.indices = gi.data();
    q.gates = gg.data();
    std::int64_t bnf = emu_dispatch_bucket(r, q);
    ++g_checks;
    if (!same(ci, gi) || !same(cg, gg) || bnf != cnf) {
      ++g_fail;
      std::printf("FAIL bucket fwd %s E=%d K=%d: idx %d gates %d nf %lld/%lld\n", what, E, K, (int)same(ci, gi), (int)same(cg, gg), (long long)bnf, (long long)cnf);
      for (std::int64_t i = 0; i < N * K; ++i) if (ci[i] != gi[i] || std::memcmp(&cg[i], &gg[i], 4)) { std::printf("  first diff at %lld: cpu %d %a emu %d %a\n", (long long)i, ci[i], cg[i], gi[i], gg[i]); break; }
    }
  }
  // backward
  std::vector<float> dw(N * K);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (std::size_t i = 0; i < dw.size(); ++i) dw[i] = (i % 7 == 3) ? 0.0f : nd(g);
  std::vector<float> cdz(N * E), edz(N * E, -9.f);
  mr::cpu::backward(r, in, mr::backward_args{ci.data(), dw.data(), cdz.data()});
  cd::backward_params<T> bp2{z.data(), N, E, ci.data(), dw.data(), edz.data(), nullptr};
  for (int general = 0; general < 2; ++general) {
    if (general == 0 && !(Router::gating_type::shape == gat::kind::row_softmax && E <= 512)) continue;
    std::fill(edz.begin(), edz.end(), -9.f);
    emu_bwd(r, bp2, general);
    ++g_checks;
    if (!same(cdz, edz)) {
      ++g_fail;
      std::printf("FAIL %s bwd %s E=%d K=%d\n", general ? "general" : "bucket", what, E, K);
      for (std::int64_t i = 0; i < N * E; ++i) if (std::memcmp(&cdz[i], &edz[i], 4)) { std::printf("  first diff at row %lld e %lld: cpu %a emu %a\n", (long long)(i / E), (long long)(i % E), cdz[i], edz[i]); break; }
    }
  }
  // duplicate indices (last wins) and invalid indices (ignored) on the device path
  if (K >= 2) {
    std::vector<std::int32_t> dup = ci;
    for (std::int64_t t = 0; t < N; ++t) dup[t * K + K - 1] = dup[t * K];
    std::vector<float> c2(N * E);
    mr::cpu::backward(r, in, mr::backward_args{dup.data(), dw.data(), c2.data()});
    cd::backward_params<T> b3{z.data(), N, E, dup.data(), dw.data(), edz.data(), nullptr};
    emu_bwd(r, b3, false);
    ++g_checks;
    if (!same(c2, edz)) { ++g_fail; std::printf("FAIL dup bwd %s E=%d K=%d\n", what, E, K); }
    for (std::int64_t t = 0; t < N; ++t) dup[t * K + 1] = (t % 2) ? -1 : E;
    emu_bwd(r, b3, false);  // must not crash / read out of bounds
  }
}

template <class Router, class T>
void sweep_router(Router r, const char* what, std::mt19937& g) {
  using S = typename Router::selection_type;
  for (int E : g_experts) {
    std::vector<int> ks = {1, std::min(E, Router::max_k >= 6 ? 6 : Router::max_k)};
    if (E <= Router::max_k) ks.push_back(E);
    if (Router::max_k >= 8 && E >= 8) ks.push_back(std::min(E, Router::max_k));
    for (int K : ks) {
      r.top_k = K;
      if constexpr (S::shape == sel::kind::grouped) {
        std::vector<std::array<int, 3>> cfg;  // groups, top_groups, per_group_k
        switch (E) {
          case 8: cfg = {{4, 2, 2}, {8, 3, 1}}; break;
          case 64: cfg = {{8, 4, 2}, {2, 1, 3}}; break;
          case 100: cfg = {{5, 2, 2}, {4, 3, 2}}; break;
          case 128: cfg = {{16, 5, 2}}; break;
          case 256: cfg = {{8, 4, 2}, {3 * 0 + 8, 1, 4}}; break;
          case 384: cfg = {{12, 4, 2}, {6, 2, 3}}; break;
          case 512: cfg = {{32, 4, 2}, {8, 3, 2}}; break;
          case 1000: cfg = {{8, 4, 2}, {20, 7, 1}}; break;
          case 4096: cfg = {{32, 4, 2}, {16, 2, 2}}; break;
        }
        for (auto c : cfg) {
          r.selection.groups = c[0];
          r.selection.top_groups = c[1];
          r.selection.per_group_k = c[2];
          const int s = E / c[0];
          if (r.selection.top_groups * s < K) r.selection.top_groups = (K + s - 1) / s;
          if (r.selection.top_groups > c[0]) continue;
          char buf[200];
          std::snprintf(buf, sizeof buf, "%s G=%d top=%d pgk=%d", what, c[0], r.selection.top_groups, c[2]);
          check<Router, T>(r, E, g, buf);
        }
      } else {
        check<Router, T>(r, E, g, what);
      }
    }
  }
}

template <class Gt, class T>
void sweep_gating(std::mt19937& g, const char* gn) {
  char buf[128];
  auto name = [&](const char* s) { std::snprintf(buf, sizeof buf, "%s/%s", gn, s); return buf; };
  { mr::router<Gt, sel::top_k, 8> r; sweep_router<decltype(r), T>(r, name("top_k"), g); }
  { mr::router<Gt, sel::top_k, 8> r; r.normalize = !r.normalize; r.scaling_factor = 2.5f; sweep_router<decltype(r), T>(r, name("top_k-flip-norm"), g); }
  { mr::router<Gt, sel::group_limited<sel::top_k>, 8> r; sweep_router<decltype(r), T>(r, name("gl<top_k>"), g); }
  { mr::router<Gt, sel::fixed, 8> r; sweep_router<decltype(r), T>(r, name("fixed"), g); }
  if constexpr (Gt::shape != gat::kind::selected_softmax) {
    { mr::router<Gt, sel::expert_bias, 8> r; sweep_router<decltype(r), T>(r, name("expert_bias"), g); }
    { mr::router<Gt, sel::group_limited<sel::expert_bias>, 8> r; r.scaling_factor = 2.5f; sweep_router<decltype(r), T>(r, name("gl<expert_bias>"), g); }
    { mr::router<Gt, sel::group_limited<sel::by_score>, 8> r; sweep_router<decltype(r), T>(r, name("gl<by_score>"), g); }
  }
}

void invalid_index_check() {
  auto r = mr::presets::deepseek_v2_lite();
  const int E = 128, K = r.top_k;
  const std::int64_t N = 40;
  std::mt19937 g(5);
  auto z = gen_logits<float>(g, N, E);
  std::vector<float> grad(N * K);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& x : grad) x = nd(g);
  std::vector<std::int32_t> idx(N * K), bad;
  for (std::int64_t t = 0; t < N; ++t)
    for (int j = 0; j < K; ++j) idx[t * K + j] = (int(t) * 7 + j * 11) % E;
  bad = idx;
  for (std::int64_t t = 0; t < N; ++t) {
    bad[t * K + 1] = t % 3 == 0 ? -1 : t % 3 == 1 ? E : E + 1000 * int(t);
    idx[t * K + 1] = idx[t * K + K - 1];
  }
  auto cg = grad;
  for (std::int64_t t = 0; t < N; ++t) cg[t * K + 1] = 0.0f;
  std::vector<float> cdz(N * E), edz(N * E, -9.f);
  mr::cpu::backward(r, mr::route_inputs<float>{z.data(), N, E}, mr::backward_args{idx.data(), cg.data(), cdz.data()});
  cd::backward_params<float> p{z.data(), N, E, bad.data(), grad.data(), edz.data(), nullptr};
  for (int general = 0; general < 2; ++general) {
    std::fill(edz.begin(), edz.end(), -9.f);
    emu_bwd(r, p, general);
    ++g_checks;
    if (!same(cdz, edz)) { ++g_fail; std::printf("FAIL invalid-index equivalence general=%d\n", general); }
  }
}

using emu::padding;
using emu::make_mask;

// Route and backward with a token mask, emulated against the CPU backend.
// Padding rows hold NaN, inf and huge logits, out-of-range indices and NaN
// upstream gradients: none of it may be read.
template <class Router, class T = float>
void check_masked(const Router& r, int E, std::mt19937& g, padding kind, const char* what) {
  CAPTURE(what);
  CAPTURE(E);
  CAPTURE(static_cast<int>(kind));
  const std::int64_t N = 24;
  const int K = r.top_k;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto z = gen_logits<T>(g, N, E);
  const std::vector<std::uint8_t> mask = make_mask(N, kind);
  for (std::int64_t t = 0; t < N; ++t)
    if (mask[t] == 0)
      for (int e = 0; e < E; ++e)
        z[t * E + e] = make<T>(e % 3 == 0 ? nan : e % 3 == 1 ? std::numeric_limits<float>::infinity() : 1.0e30f);
  std::vector<float> bias(E);
  for (int e = 0; e < E; ++e) bias[e] = static_cast<float>((e * 5) % 17 - 8) / 64.0f;
  const float* bp = Router::selection_type::needs_expert_bias ? bias.data() : nullptr;
  mr::route_inputs<T> in{z.data(), N, E, bp};
  in.token_mask = mask.data();

  std::vector<std::int32_t> ci(N * K);
  std::vector<float> cg(N * K);
  std::int64_t cnf = 0;
  mr::cpu::route(r, in, mr::route_outputs{ci.data(), cg.data(), &cnf});
  for (std::int64_t s = 0; s < N * K; ++s) {
    if (mask[s / K] != 0) continue;
    CHECK(ci[s] == -1);
    CHECK(emu::fbits(cg[s]) == 0u);
  }
  if (kind == padding::none) {  // a mask of valid tokens routes as no mask
    std::vector<std::int32_t> ui(N * K);
    std::vector<float> ug(N * K);
    std::int64_t unf = 0;
    mr::cpu::route(r, mr::route_inputs<T>{z.data(), N, E, bp}, mr::route_outputs{ui.data(), ug.data(), &unf});
    CHECK(same(ui, ci));
    CHECK(same(ug, cg));
    CHECK(unf == cnf);
  }
  for (int general = 0; general < 2; ++general) {
    if (general == 0 && E > 512) continue;
    std::vector<std::int32_t> ei(N * K, -7);
    std::vector<float> eg(N * K, -7.0f);
    const cd::route_params<T> p{z.data(), N, E, bp, ei.data(), eg.data(), cd::make_group_layout(r, E),
                                mask.data(), nullptr};
    const std::int64_t enf = general ? emu_general(r, p) : emu_dispatch_bucket(r, p);
    CAPTURE(general);
    CHECK(same(ei, ci));
    CHECK(same(eg, cg));
    CHECK(enf == cnf);
  }

  std::vector<std::int32_t> idx = ci;
  std::vector<float> dw(N * K);
  for (std::int64_t s = 0; s < N * K; ++s) {
    const bool pad = mask[s / K] == 0;
    if (pad) idx[s] = s % 2 ? E + 1000 : -5;
    dw[s] = pad ? nan : static_cast<float>(static_cast<int>(s % 11) - 5) / 4.0f;
  }
  std::vector<float> cdz(N * E, -9.0f);
  mr::cpu::backward(r, in, mr::backward_args{idx.data(), dw.data(), cdz.data()});
  for (std::int64_t i = 0; i < N * E; ++i)
    if (mask[i / E] == 0) REQUIRE(emu::fbits(cdz[i]) == 0u);
  const cd::backward_params<T> bp2{z.data(), N, E, idx.data(), dw.data(), nullptr, mask.data()};
  for (int general = 0; general < 2; ++general) {
    if (general == 0 && !(Router::gating_type::shape == gat::kind::row_softmax && E <= 512)) continue;
    std::vector<float> edz(N * E, -9.0f);
    cd::backward_params<T> q = bp2;
    q.grad_logits = edz.data();
    emu_bwd(r, q, general != 0);
    CAPTURE(general);
    CHECK(same(edz, cdz));
  }
}

template <class Router, class T = float>
void sweep_masked(Router r, std::initializer_list<int> experts, int typical_k, std::mt19937& g, const char* what) {
  for (int E : experts) {
    std::vector<int> ks{1, std::min({typical_k, E, Router::max_k})};
    if (E <= Router::max_k) ks.push_back(E);  // K = E
    for (int K : ks) {
      r.top_k = K;
      for (padding kind : {padding::some, padding::all, padding::none}) check_masked<Router, T>(r, E, g, kind, what);
    }
  }
}

TEST_CASE("emulated CUDA route and backward agents with a token mask: bit-identical to the CPU backend") {
  std::mt19937 g(777);
  const auto all_e = {8, 100, 384, 1000, 4096};  // buckets, E not a multiple of 32, the general path
  sweep_masked(mr::router<gat::softmax, sel::top_k, 8>{}, all_e, 6, g, "softmax/top_k");
  sweep_masked(mr::router<gat::sigmoid, sel::expert_bias, 8>{}, {8, 100, 1000}, 6, g, "sigmoid/expert_bias");
  sweep_masked(mr::router<gat::sqrt_softplus, sel::top_k, 8>{}, {8, 100, 1000}, 6, g, "sqrt_softplus/top_k");
  sweep_masked(mr::router<gat::softmax_after_topk, sel::top_k, 8>{}, {8, 100, 1000}, 2, g, "softmax_after_topk/top_k");
  sweep_masked(mr::router<gat::softmax, sel::fixed, 8>{}, {8, 100, 1000}, 6, g, "softmax/fixed");
  {
    auto r = mr::presets::deepseek_v3();  // sigmoid, group-limited expert bias: 8 groups, 4 kept
    for (padding kind : {padding::some, padding::all, padding::none}) check_masked(r, 256, g, kind, "deepseek_v3");
  }
  {
    mr::router<gat::softmax, sel::group_limited<sel::top_k>, 8> r;  // grouped on the general path
    r.top_k = 6;
    r.selection.groups = 8;
    r.selection.top_groups = 3;
    r.selection.per_group_k = 2;
    for (padding kind : {padding::some, padding::all, padding::none}) check_masked(r, 1000, g, kind, "gl<top_k>");
  }
  for (padding kind : {padding::some, padding::all})
    check_masked<mr::presets::moonlight_router, mr::bfloat16>(mr::presets::moonlight(), 64, g, kind, "moonlight-bf16");
  for (padding kind : {padding::some, padding::all})
    check_masked<mr::presets::qwen3_router, mr::float16>(mr::presets::qwen3(), 128, g, kind, "qwen3-fp16");
}

// Route under routing replay, emulated against the CPU backend: each token's
// K distinct experts shuffled from g, over rows with NaN, inf and ties.
template <class Router, class T = float>
void check_replay(const Router& r, int E, std::mt19937& g, const char* what) {
  CAPTURE(what);
  CAPTURE(E);
  CAPTURE(r.top_k);
  const std::int64_t N = 24;
  const int K = r.top_k;
  auto z = gen_logits<T>(g, N, E);
  std::vector<float> bias(E);
  for (int e = 0; e < E; ++e) bias[e] = static_cast<float>((e * 5) % 17 - 8) / 64.0f;
  const float* bp = Router::selection_type::needs_expert_bias ? bias.data() : nullptr;
  std::vector<std::int32_t> replay(N * K), experts(E);
  for (std::int64_t t = 0; t < N; ++t) {
    for (int e = 0; e < E; ++e) experts[e] = e;
    std::shuffle(experts.begin(), experts.end(), g);
    std::copy_n(experts.begin(), K, replay.begin() + t * K);
  }
  mr::route_inputs<T> in{z.data(), N, E, bp};
  in.replay_indices = replay.data();
  std::vector<std::int32_t> ci(N * K);
  std::vector<float> cg(N * K);
  std::int64_t cnf = 0;
  mr::cpu::route(r, in, mr::route_outputs{ci.data(), cg.data(), &cnf});
  REQUIRE(same(ci, replay));
  for (int general = 0; general < 2; ++general) {
    if (general == 0 && E > 512) continue;
    CAPTURE(general);
    std::vector<std::int32_t> ei(N * K, -7);
    std::vector<float> eg(N * K, -7.0f);
    cd::route_params<T> p{z.data(), N, E, bp, ei.data(), eg.data(), cd::make_group_layout(r, E), nullptr,
                          replay.data()};
    const std::int64_t enf = general ? emu_general(r, p) : emu_dispatch_bucket(r, p);
    CHECK(same(ei, ci));
    CHECK(same(eg, cg));
    CHECK(enf == cnf);
  }
}

template <class Router, class T = float>
void sweep_replay(Router r, std::initializer_list<int> experts, int typical_k, std::mt19937& g, const char* what) {
  for (int E : experts) {
    std::vector<int> ks{1, std::min({typical_k, E, Router::max_k})};
    if (E <= Router::max_k) ks.push_back(E);  // K = E
    for (int K : ks) {
      r.top_k = K;
      check_replay<Router, T>(r, E, g, what);
    }
  }
}

TEST_CASE("emulated CUDA route agents under routing replay: bit-identical to the CPU backend") {
  std::mt19937 g(4242);
  const auto all_e = {8, 100, 384, 1000, 4096};
  sweep_replay(mr::router<gat::softmax, sel::top_k, 8>{}, all_e, 6, g, "softmax/top_k");
  {
    mr::router<gat::softmax, sel::top_k, 8> r;
    r.normalize = true;
    sweep_replay(r, {8, 100, 1000}, 6, g, "softmax/top_k normalized");
  }
  sweep_replay(mr::router<gat::sigmoid, sel::expert_bias, 8>{}, {8, 100, 1000}, 6, g, "sigmoid/expert_bias");
  sweep_replay(mr::router<gat::sqrt_softplus, sel::top_k, 8>{}, {8, 100}, 6, g, "sqrt_softplus/top_k");
  sweep_replay(mr::router<gat::softmax_after_topk, sel::top_k, 8>{}, {8, 100, 1000}, 2, g, "softmax_after_topk/top_k");
  sweep_replay(mr::router<gat::softmax, sel::fixed, 8>{}, {8, 100}, 6, g, "softmax/fixed");
  check_replay(mr::presets::deepseek_v3(), 256, g, "deepseek_v3");
  check_replay<mr::presets::moonlight_router, mr::bfloat16>(mr::presets::moonlight(), 64, g, "moonlight-bf16");
  check_replay<mr::presets::qwen3_router, mr::float16>(mr::presets::qwen3(), 128, g, "qwen3-fp16");
}

// Replay entries the device cannot check (outside [0, E)) are written as -1
// and gated as a -inf logit: the other slots keep the gates of a valid replay.
TEST_CASE("emulated CUDA route agents: replay entries outside [0, E) route nowhere") {
  const int E = 40, K = 3;
  const std::int64_t N = 4;
  std::mt19937 g(9);
  const auto z = gen_logits<float>(g, N, E);
  std::vector<std::int32_t> good(N * K), bad(N * K);
  for (std::int64_t s = 0; s < N * K; ++s) good[s] = bad[s] = static_cast<std::int32_t>((s * 7) % E);
  for (std::int64_t t = 0; t < N; ++t) bad[t * K + 1] = t % 2 ? E + 3 : -2;
  const auto run = [&](const auto& r, const std::vector<std::int32_t>& replay, std::vector<std::int32_t>& idx,
                       std::vector<float>& gates, bool general) {
    using R = std::decay_t<decltype(r)>;
    idx.assign(N * K, -7);
    gates.assign(N * K, -7.0f);
    cd::route_params<float> p{z.data(), N, E, nullptr, idx.data(), gates.data(), cd::make_group_layout(r, E),
                              nullptr, replay.data()};
    if (general) emu_general<R, float>(r, p); else emu_dispatch_bucket<R, float>(r, p);
  };
  mr::router<gat::softmax, sel::top_k, 8> softmax;
  softmax.top_k = K;
  mr::router<gat::softmax_after_topk, sel::top_k, 8> after;
  after.top_k = K;
  for (int general = 0; general < 2; ++general) {
    CAPTURE(general);
    std::vector<std::int32_t> gi, bi;
    std::vector<float> gg, bg;
    run(softmax, good, gi, gg, general != 0);
    run(softmax, bad, bi, bg, general != 0);
    for (std::int64_t s = 0; s < N * K; ++s) {
      CAPTURE(s);
      CHECK(bi[s] == (s % K == 1 ? -1 : gi[s]));
      if (s % K == 1) CHECK(bg[s] == 0.0f);
      else CHECK(emu::fbits(bg[s]) == emu::fbits(gg[s]));
    }
    run(after, bad, bi, bg, general != 0);  // softmax over the other two slots
    for (std::int64_t t = 0; t < N; ++t) {
      const float a = bg[t * K], c = bg[t * K + 2];
      CHECK(bg[t * K + 1] == 0.0f);
      if (std::isfinite(a) && std::isfinite(c)) CHECK(std::fabs(a + c - 1.0f) < 1e-6f);
    }
  }
}

TEST_CASE("emulated CUDA route and backward agents: bit-identical to the CPU backend") {
  invalid_index_check();
  g_rows = 12;  // one row of each kind (NaN, inf, ties, signed zeros, ...)
  // The magic division of the group layout, exhaustively.
  for (int size = 1; size <= 4096; ++size) {
    cd::group_layout gl;
    gl.size = size;
    gl.magic = size > 1 ? (std::uint32_t)(((std::uint64_t{1} << 32) + size - 1) / size) : 0u;
    const int groups_max = std::min(32, 4096 / size);
    for (int e = 0; e < size * groups_max; ++e) REQUIRE(gl.group_of(e) == e / size);
  }
  std::mt19937 g(12345);
  sweep_gating<gat::softmax, float>(g, "softmax");
  sweep_gating<gat::sigmoid, float>(g, "sigmoid");
  sweep_gating<gat::sqrt_softplus, float>(g, "sqrt_softplus");
  sweep_gating<gat::softmax_after_topk, float>(g, "softmax_after_topk");
  sweep_router<mr::presets::moonlight_router, mr::bfloat16>(mr::presets::moonlight(), "moonlight-bf16", g);
  sweep_router<mr::presets::qwen3_router, mr::float16>(mr::presets::qwen3(), "qwen3-fp16", g);
  {
    mr::router<gat::softmax, sel::top_k, 32> r;
    sweep_router<decltype(r), float>(r, "softmax-k32", g);
  }
  sweep_router<mr::presets::deepseek_v3_router, float>(mr::presets::deepseek_v3(), "deepseek_v3", g);
  sweep_router<mr::presets::mixtral_router, float>(mr::presets::mixtral(), "mixtral", g);
  MESSAGE(g_checks, " emulated configurations compared");
  CHECK(g_fail == 0);
}
