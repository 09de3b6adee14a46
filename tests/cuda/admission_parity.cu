// GPU parity of admission, expert choice and dispatch metadata: cuda:: against
// cpu:: on identical inputs, bit for bit (indices, status, gates, reports,
// counts, offsets, permutations, rank counts). Every case is reported as
// skipped (visibly, in doctest's summary and by a message) when no CUDA device
// is present, and the executable then exits 0.
//
// The routed indices and gates come from cpu::route, so this test depends on
// the CUDA admission / dispatch kernels only. The batches and the policy sweep
// are shared with the emulator's test (tests/admission_cases.hpp).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "admission_cases.hpp"
#include <moe_route/backend/cpu/admit.hpp>
#include <moe_route/backend/cpu/dispatch.hpp>
#include <moe_route/backend/cpu/expert_choice.hpp>
#include <moe_route/backend/cuda/admit.cuh>
#include <moe_route/backend/cuda/dispatch.cuh>
#include <moe_route/backend/cuda/expert_choice.cuh>
#include <moe_route/moe_route.cuh>

namespace {

namespace mr = moe_route;
namespace ad = moe_route::admission;
using admission_cases::admission_inputs_of;
using admission_cases::batch;
using admission_cases::expert_choice_case;
using admission_cases::expert_choice_shape;
using admission_cases::make_expert_choice_case;
using admission_cases::make_batch;
using admission_cases::same_bits;
using admission_cases::same_report;

bool has_device() {
  static const bool present = [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  }();
  return present;
}

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

template <class T>
class device_vector {
 public:
  explicit device_vector(std::size_t n) : n_(n) { cuda_ok(cudaMalloc(&p_, n * sizeof(T) + 16), "cudaMalloc"); }
  explicit device_vector(const std::vector<T>& v) : device_vector(v.size()) { upload(v); }
  ~device_vector() { cudaFree(p_); }
  device_vector(const device_vector&) = delete;
  device_vector& operator=(const device_vector&) = delete;
  void upload(const std::vector<T>& v) {
    cuda_ok(cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  }
  std::vector<T> download() const {
    std::vector<T> v(n_);
    cuda_ok(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    return v;
  }
  T* get() const { return p_; }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

template <class T>
T* ptr_or_null(const std::vector<T>& host, device_vector<T>& dev) {
  return host.empty() ? nullptr : dev.get();
}

template <class Router, class Policy>
void check_admit(const Router& r, const Policy& p, const batch& b, const char* what) {
  CAPTURE(what);
  const std::int64_t slots = b.N * b.K;
  // CPU
  const mr::admission_inputs<float> hin = admission_inputs_of(b, b.z.data());
  std::vector<std::int32_t> cidx(slots);
  std::vector<float> cgates(slots);
  std::vector<std::int8_t> cstatus(slots);
  mr::admission_report crep;
  mr::cpu::admit(r, p, hin, mr::admission_outputs{cidx.data(), cgates.data(), cstatus.data(), &crep});
  // CUDA
  device_vector<float> z(b.z), gates(b.gates), xn(b.xn), wn(b.wn);
  device_vector<std::int32_t> routed(b.routed), groups(b.groups.empty() ? std::vector<std::int32_t>{0} : b.groups);
  device_vector<std::int64_t> cap(b.capacity.empty() ? std::vector<std::int64_t>{0} : b.capacity);
  device_vector<std::int32_t> didx(slots);
  device_vector<float> dgates(slots);
  device_vector<std::int8_t> dstatus(slots);
  device_vector<mr::admission_report> drep(1);
  mr::admission_inputs<float> din = hin;
  din.logits = z.get();
  din.routed_indices = routed.get();
  din.routed_gates = gates.get();
  din.hidden_norms = xn.get();
  din.weight_norms = wn.get();
  din.group_ids = ptr_or_null(b.groups, groups);
  din.capacity = ptr_or_null(b.capacity, cap);
  const std::size_t bytes = mr::cuda::admit_workspace_bytes(r, p, b.N, b.E, b.G);
  device_vector<unsigned char> ws(bytes + 1);
  cudaStream_t stream;
  cuda_ok(cudaStreamCreate(&stream), "cudaStreamCreate");
  for (int rep = 0; rep < 2; ++rep) {  // twice: run-to-run determinism on a reused workspace
    mr::cuda::admit(r, p, din, mr::admission_outputs{didx.get(), dgates.get(), dstatus.get(), drep.get()}, ws.get(),
                    bytes, stream);
    cuda_ok(cudaStreamSynchronize(stream), "admit");
    CHECK(didx.download() == cidx);
    CHECK(dstatus.download() == cstatus);
    CHECK(same_bits(dgates.download(), cgates));
    CHECK(same_report(drep.download()[0], crep));
  }
  // Backward of the admitted gates: cuda::backward with admitted_indices == cpu::admission_backward.
  {
    std::vector<float> dg(slots), cdz(b.N * b.E);
    for (std::int64_t i = 0; i < slots; ++i) dg[i] = static_cast<float>(static_cast<int>(i % 11) - 5) / 4.0f;
    const mr::route_inputs<float> rin{b.z.data(), b.N, b.E, b.bias.data()};
    mr::cpu::admission_backward(r, p, rin, mr::admission_backward_args{b.routed.data(), cidx.data(), dg.data(), cdz.data()});
    device_vector<float> ddg(dg), ddz(b.N * b.E), dbias(b.bias);
    device_vector<std::int32_t> dadmitted(cidx);
    mr::backward_args args{routed.get(), ddg.get(), ddz.get()};
    args.admitted_indices = dadmitted.get();
    args.renormalize = mr::admission::renormalizes(p);
    mr::cuda::backward(r, mr::route_inputs<float>{z.get(), b.N, b.E, dbias.get()}, args, stream);
    cuda_ok(cudaStreamSynchronize(stream), "backward");
    CHECK(same_bits(ddz.download(), cdz));
  }
  cudaStreamDestroy(stream);
  // Dispatch of the admitted result, with padding, ranks and the fixed E x C layout.
  std::vector<std::int64_t> held(b.E, 0);
  for (const std::int32_t e : cidx)
    if (e >= 0) ++held[e];
  const std::int64_t fixed = *std::max_element(held.begin(), held.end()) + 3;
  for (const auto& [align, capacity] : {std::pair<int, std::int64_t>{1, 0}, {8, 0}, {1, fixed}, {8, fixed}}) {
    const int R = b.E % 4 == 0 ? 4 : 1;
    const std::int64_t bound = mr::dispatch_rows_bound(b.N, b.K, b.E, align, capacity);
    std::vector<std::int64_t> counts(b.E), offsets(b.E + 1), perm(bound), inv(slots), ranks(R);
    mr::dispatch_inputs hd{cidx.data(), b.N, b.K, b.E, align, R, nullptr, capacity};
    mr::cpu::dispatch(hd, mr::dispatch_outputs{counts.data(), offsets.data(), perm.data(), inv.data(), ranks.data()});
    device_vector<std::int64_t> dcounts(b.E), doffsets(b.E + 1), dperm(bound), dinv(slots), dranks(R);
    mr::dispatch_inputs dd = hd;
    dd.indices = didx.get();
    const std::size_t dbytes = mr::cuda::dispatch_workspace_bytes(b.N, b.K, b.E);
    device_vector<unsigned char> dws(dbytes + 1);
    mr::cuda::dispatch(dd, mr::dispatch_outputs{dcounts.get(), doffsets.get(), dperm.get(), dinv.get(), dranks.get()},
                       dws.get(), dbytes, nullptr);
    cuda_ok(cudaDeviceSynchronize(), "dispatch");
    CHECK(dcounts.download() == counts);
    CHECK(doffsets.download() == offsets);
    CHECK(dperm.download() == perm);
    CHECK(dinv.download() == inv);
    CHECK(dranks.download() == ranks);
  }
}

template <class Router>
void all_policies(const Router& r, const batch& b) {
  admission_cases::for_each_policy([&](const auto& p, const char* what) { check_admit(r, p, b, what); });
}

template <class T>
std::vector<T> as_storage(const std::vector<float>& v);
template <>
std::vector<mr::bfloat16> as_storage(const std::vector<float>& v) {
  std::vector<mr::bfloat16> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = mr::bfloat16::from_float(v[i]);
  return out;
}

}  // namespace

TEST_CASE("cuda admission == cpu admission, every preset and policy" * doctest::skip(!has_device())) {
  {
    auto r = mr::presets::qwen3();
    all_policies(r, make_batch(r, 1, 2000, 128, 0, 1, false));
    all_policies(r, make_batch(r, 2, 1500, 128, 2, 4, false));  // ties, groups (one empty)
    all_policies(r, make_batch(r, 3, 1200, 128, 0, 3, true));   // per-expert capacities
  }
  {
    auto r = mr::presets::deepseek_v2_lite();
    all_policies(r, make_batch(r, 4, 3000, 64, 0, 2, false));
  }
  {
    auto r = mr::presets::deepseek_v3();
    all_policies(r, make_batch(r, 5, 4096, 256, 0, 1, false));
  }
  {
    auto r = mr::presets::deepseek_v4();
    all_policies(r, make_batch(r, 6, 2048, 256, 1, 2, false));
  }
  {
    auto r = mr::presets::mixtral();
    all_policies(r, make_batch(r, 7, 1000, 8, 0, 1, false));
    all_policies(r, make_batch(r, 8, 999, 8, 1, 3, true));
  }
  {  // Large E (several shared-memory words per warp), K = 8.
    mr::router<mr::gating::sigmoid, mr::selection::top_k, 8> r;
    r.top_k = 8;
    all_policies(r, make_batch(r, 9, 300, 1000, 0, 1, false));
  }
  {  // E = 1 and K = E.
    mr::router<mr::gating::softmax, mr::selection::top_k, 8> r;
    r.top_k = 1;
    all_policies(r, make_batch(r, 10, 50, 1, 0, 1, false));
    r.top_k = 6;
    all_policies(r, make_batch(r, 11, 70, 6, 0, 1, false));
  }
}

TEST_CASE("cuda admission == cpu admission with bf16 logits" * doctest::skip(!has_device())) {
  auto r = mr::presets::deepseek_v3();
  const batch b = make_batch(r, 12, 1024, 256, 0, 1, false);
  const std::vector<mr::bfloat16> zb = as_storage<mr::bfloat16>(b.z);
  std::vector<std::int32_t> routed(b.N * 8), cidx(b.N * 8);
  std::vector<float> gates(b.N * 8), cgates(b.N * 8);
  mr::cpu::route(r, mr::route_inputs<mr::bfloat16>{zb.data(), b.N, b.E, b.bias.data()},
                 mr::route_outputs{routed.data(), gates.data()});
  const auto p = ad::cipher_reroute(0.0f, 1.0, 1.0);
  mr::admission_inputs<mr::bfloat16> hin;
  hin.logits = zb.data();
  hin.num_tokens = b.N;
  hin.num_experts = b.E;
  hin.routed_indices = routed.data();
  hin.routed_gates = gates.data();
  hin.hidden_norms = b.xn.data();
  hin.weight_norms = b.wn.data();
  mr::cpu::admit(r, p, hin, mr::admission_outputs{cidx.data(), cgates.data()});
  device_vector<mr::bfloat16> z(zb);
  device_vector<std::int32_t> droute(routed), didx(b.N * 8);
  device_vector<float> dgates_in(gates), dgates(b.N * 8), xn(b.xn), wn(b.wn);
  mr::admission_inputs<__nv_bfloat16> din;
  din.logits = reinterpret_cast<const __nv_bfloat16*>(z.get());
  din.num_tokens = b.N;
  din.num_experts = b.E;
  din.routed_indices = droute.get();
  din.routed_gates = dgates_in.get();
  din.hidden_norms = xn.get();
  din.weight_norms = wn.get();
  const std::size_t bytes = mr::cuda::admit_workspace_bytes(r, p, b.N, b.E);
  device_vector<unsigned char> ws(bytes);
  mr::cuda::admit(r, p, din, mr::admission_outputs{didx.get(), dgates.get()}, ws.get(), bytes);
  cuda_ok(cudaDeviceSynchronize(), "admit bf16");
  CHECK(didx.download() == cidx);
  CHECK(same_bits(dgates.download(), cgates));
}

TEST_CASE("cuda expert_choice == cpu expert_choice, and its dispatch" * doctest::skip(!has_device())) {
  const expert_choice_shape shapes[] = {
      {2000, 64, 0, 1, false, 1.0},
      {1500, 128, 2, 3, false, 1.5},
      {700, 32, 1, 2, true, 1.0},
      {64, 1, 0, 1, false, 0.5},
      {333, 256, 0, 1, false, 0.0},
  };
  for (const expert_choice_shape& s : shapes) {
    CAPTURE(s.E);
    const expert_choice_case c = make_expert_choice_case(s);
    const batch& b = c.b;
    const mr::selection::expert_choice& p = c.policy;
    const mr::expert_choice_inputs<float>& hin = c.in;
    const std::vector<std::int32_t>& cidx = c.indices;
    const std::int64_t pairs = b.N * b.E;
    device_vector<float> z(b.z);
    device_vector<std::int32_t> groups(b.groups.empty() ? std::vector<std::int32_t>{0} : b.groups);
    device_vector<std::int64_t> cap(b.capacity.empty() ? std::vector<std::int64_t>{0} : b.capacity);
    device_vector<std::int32_t> didx(pairs), dper(b.N);
    device_vector<float> dgates(pairs);
    device_vector<mr::expert_choice_report> drep(1);
    mr::expert_choice_inputs<float> din = hin;
    din.logits = z.get();
    din.group_ids = ptr_or_null(b.groups, groups);
    din.capacity = ptr_or_null(b.capacity, cap);
    const std::size_t bytes = mr::cuda::expert_choice_workspace_bytes(p, b.N, b.E, b.G);
    device_vector<unsigned char> ws(bytes);
    mr::cuda::expert_choice(p, din, mr::expert_choice_outputs{didx.get(), dgates.get(), dper.get(), drep.get()},
                            ws.get(), bytes);
    cuda_ok(cudaDeviceSynchronize(), "expert_choice");
    CHECK(didx.download() == cidx);
    CHECK(dper.download() == c.experts_per_token);
    CHECK(same_bits(dgates.download(), c.gates));
    const auto dr = drep.download()[0];
    CHECK(dr.assignments == c.report.assignments);
    CHECK(dr.tokens_without_experts == c.report.tokens_without_experts);
    CHECK(dr.max_experts_per_token == c.report.max_experts_per_token);
    CHECK(dr.invalid == 0);
    // Backward of the expert-choice gates.
    {
      std::vector<float> dg(pairs), cdz(pairs);
      for (std::int64_t i = 0; i < pairs; ++i) dg[i] = static_cast<float>(static_cast<int>(i % 9) - 4) / 8.0f;
      mr::cpu::expert_choice_backward(hin, cidx.data(), dg.data(), cdz.data());
      device_vector<float> ddg(dg), ddz(pairs);
      mr::cuda::expert_choice_backward(din, didx.get(), ddg.get(), ddz.get());
      cuda_ok(cudaDeviceSynchronize(), "expert_choice_backward");
      CHECK(same_bits(ddz.download(), cdz));
    }
    // Dispatch with S = E.
    const std::int64_t bound = mr::dispatch_rows_bound(b.N, b.E, b.E, 16);
    std::vector<std::int64_t> counts(b.E), offsets(b.E + 1), perm(bound), inv(pairs);
    mr::dispatch_inputs hd{cidx.data(), b.N, b.E, b.E, 16, 1, nullptr};
    mr::cpu::dispatch(hd, mr::dispatch_outputs{counts.data(), offsets.data(), perm.data(), inv.data()});
    device_vector<std::int64_t> dcounts(b.E), doffsets(b.E + 1), dperm(bound), dinv(pairs);
    mr::dispatch_inputs dd = hd;
    dd.indices = didx.get();
    const std::size_t dbytes = mr::cuda::dispatch_workspace_bytes(b.N, b.E, b.E);
    device_vector<unsigned char> dws(dbytes);
    mr::cuda::dispatch(dd, mr::dispatch_outputs{dcounts.get(), doffsets.get(), dperm.get(), dinv.get()}, dws.get(),
                       dbytes);
    cuda_ok(cudaDeviceSynchronize(), "dispatch (expert choice)");
    CHECK(dcounts.download() == counts);
    CHECK(doffsets.download() == offsets);
    CHECK(dperm.download() == perm);
    CHECK(dinv.download() == inv);
  }
}

TEST_CASE("cuda dispatch == cpu dispatch: custom rank map, everything dropped, N = 0" * doctest::skip(!has_device())) {
  std::mt19937 rng(31);
  const std::int64_t N = 5000;
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
    const std::int64_t bound = mr::dispatch_rows_bound(n_tokens, S, E, 128);
    std::vector<std::int64_t> counts(E), offsets(E + 1), perm(bound + 1), inv(n_tokens * S + 1), ranks(5);
    mr::dispatch_inputs hd{in.data(), n_tokens, S, E, 128, 5, map.data()};
    mr::cpu::dispatch(hd, mr::dispatch_outputs{counts.data(), offsets.data(), perm.data(), inv.data(), ranks.data()});
    device_vector<std::int32_t> din(in), dmap(map);
    device_vector<std::int64_t> dcounts(E), doffsets(E + 1), dperm(bound + 1), dinv(n_tokens * S + 1), dranks(5);
    cuda_ok(cudaMemset(dperm.get(), 0, (bound + 1) * sizeof(std::int64_t)), "memset");
    cuda_ok(cudaMemset(dinv.get(), 0, (n_tokens * S + 1) * sizeof(std::int64_t)), "memset");
    perm[bound] = 0;
    inv[n_tokens * S] = 0;
    mr::dispatch_inputs dd = hd;
    dd.indices = din.get();
    dd.expert_rank = dmap.get();
    const std::size_t bytes = mr::cuda::dispatch_workspace_bytes(n_tokens, S, E);
    device_vector<unsigned char> ws(bytes + 1);
    mr::cuda::dispatch(dd, mr::dispatch_outputs{dcounts.get(), doffsets.get(), dperm.get(), dinv.get(), dranks.get()},
                       ws.get(), bytes);
    cuda_ok(cudaDeviceSynchronize(), "dispatch");
    CHECK(dcounts.download() == counts);
    CHECK(doffsets.download() == offsets);
    CHECK(dperm.download() == perm);  // includes one guard entry past the bound: untouched
    CHECK(dinv.download() == inv);
    CHECK(dranks.download() == ranks);
  }
}

TEST_CASE("cuda admission: host-side argument errors" * doctest::skip(!has_device())) {
  auto r = mr::presets::qwen3();
  const batch b = make_batch(r, 40, 100, 128, 0, 1, false);
  device_vector<float> z(b.z), gates(b.gates);
  device_vector<std::int32_t> routed(b.routed), idx(b.N * 8);
  device_vector<float> out_gates(b.N * 8);
  mr::admission_inputs<float> din;
  din.logits = z.get();
  din.num_tokens = b.N;
  din.num_experts = b.E;
  din.routed_indices = routed.get();
  din.routed_gates = gates.get();
  const auto p = ad::capacity_probs(1.0);
  const std::size_t bytes = mr::cuda::admit_workspace_bytes(r, p, b.N, b.E);
  device_vector<unsigned char> ws(bytes);
  const mr::admission_outputs out{idx.get(), out_gates.get()};
  CHECK_THROWS_WITH_AS(mr::cuda::admit(r, p, din, out, ws.get(), bytes - 1), doctest::Contains("workspace_bytes"),
                       mr::error);
  CHECK_THROWS_WITH_AS(mr::cuda::admit(r, ad::cipher_strict(0.0f), din, out, ws.get(), bytes),
                       doctest::Contains("hidden_norms is null"), mr::error);
  CHECK_THROWS_AS(mr::cuda::admit(r, ad::capacity_probs(-1.0), din, out, ws.get(), bytes), mr::error);
  CHECK_THROWS_AS(mr::cuda::dispatch(mr::dispatch_inputs{routed.get(), b.N, 8, b.E, 0, 1, nullptr},
                                     mr::dispatch_outputs{nullptr, nullptr}, ws.get(), bytes),
                  mr::error);
}

TEST_CASE("cuda admission parity: device presence") {
  if (!has_device())
    MESSAGE("no CUDA device: the GPU parity cases of this executable are skipped");
  else
    MESSAGE("CUDA device present: GPU parity cases ran");
}
