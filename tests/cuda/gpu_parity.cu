// GPU parity tests: moe_route::cuda against moe_route::cpu on identical inputs.
// Indices, gates and grad_logits must be equal bit for bit (memcmp), non-finite
// row counts equal. Without a CUDA device every GPU test case is skipped
// (doctest skip, reported in the summary and by one printed line); the host-only
// checks (argument validation, error type) run everywhere.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <moe_route/moe_route.cuh>
#include <moe_route/runtime/detail/cuda.cuh>
#ifdef MOE_ROUTE_TEST_CUDA_RUNTIME
#include <moe_route/runtime/detail/cuda_instantiate.cuh>
#include <moe_route/runtime/instantiate.hpp>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <memory>
#include <string>
#include <vector>

namespace mr = moe_route;
namespace sel = moe_route::selection;
namespace gat = moe_route::gating;

namespace {

bool has_device() {
  static const bool present = [] {
    int n = 0;
    const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
    cudaGetLastError();  // clear the error of a machine without a driver or device
    return ok;
  }();
  return present;
}

int& gpu_case_count() {
  static int n = 0;
  return n;
}
int count_gpu_case() { return ++gpu_case_count(); }

}  // namespace

// A test case that needs a CUDA device: skipped, visibly, without one.
#define GPU_TEST_CASE(name)                                                  \
  static const int DOCTEST_ANONYMOUS(moe_route_gpu_case_) = count_gpu_case(); \
  TEST_CASE(name * doctest::skip(!has_device()))

#define CUDA_REQUIRE(call)                                                                  \
  do {                                                                                      \
    const cudaError_t moe_route_status_ = (call);                                           \
    INFO(#call << ": " << cudaGetErrorString(moe_route_status_));                           \
    REQUIRE(moe_route_status_ == cudaSuccess);                                              \
  } while (0)

namespace {

// ---------------------------------------------------------------- buffers

template <class T>
class device_buffer {
 public:
  explicit device_buffer(std::size_t n) : n_(n) {
    if (n_ > 0) CUDA_REQUIRE(cudaMalloc(&ptr_, n_ * sizeof(T)));
  }
  explicit device_buffer(const std::vector<T>& host) : device_buffer(host.size()) {
    if (n_ > 0) CUDA_REQUIRE(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~device_buffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;

  T* get() const { return ptr_; }
  std::vector<T> to_host() const {
    std::vector<T> h(n_);
    if (n_ > 0) CUDA_REQUIRE(cudaMemcpy(h.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  // Fills every byte with `byte` (a sentinel the kernels must overwrite).
  void poison(int byte = 0x7f) {
    if (n_ > 0) CUDA_REQUIRE(cudaMemset(ptr_, byte, n_ * sizeof(T)));
    CUDA_REQUIRE(cudaDeviceSynchronize());
  }

 private:
  T* ptr_ = nullptr;
  std::size_t n_;
};

class stream_guard {
 public:
  // A blocking stream: ordered with the synchronous copies on the legacy default stream.
  stream_guard() { CUDA_REQUIRE(cudaStreamCreate(&s_)); }
  ~stream_guard() { cudaStreamDestroy(s_); }
  stream_guard(const stream_guard&) = delete;
  stream_guard& operator=(const stream_guard&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_{};
};

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Index of the first differing element, or -1.
template <class T>
std::int64_t first_difference(const std::vector<T>& a, const std::vector<T>& b) {
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<std::int64_t>(i);
  return a.size() == b.size() ? -1 : static_cast<std::int64_t>(std::min(a.size(), b.size()));
}

// ---------------------------------------------------------------- inputs

template <class T>
T make(float x);
template <>
float make<float>(float x) {
  return x;
}
template <>
mr::bfloat16 make<mr::bfloat16>(float x) {
  return mr::bfloat16::from_float(x);
}
template <>
mr::float16 make<mr::float16>(float x) {
  return mr::float16::from_float(x);
}

// A small fast generator (splitmix64): the large sweeps make many rows.
struct fast_rng {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t x = (state += 0x9e3779b97f4a7c15ull);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  }
  // Roughly normal (sum of four uniforms), scale about 2.
  float normalish() {
    const std::uint64_t x = next();
    const int s = static_cast<int>(x & 0xffff) + static_cast<int>((x >> 16) & 0xffff) +
                  static_cast<int>((x >> 32) & 0xffff) + static_cast<int>(x >> 48) - 2 * 65535;
    return static_cast<float>(s) * (2.0f / 37837.0f);
  }
};

// Random rows plus adversarial ones, cycling through kinds by row: NaN,
// +-inf, all equal, many ties, all NaN, +-FLT_MAX, signed zeros, wide range,
// -inf, one clear winner.
template <class T>
std::vector<T> make_logits(std::mt19937& g, std::int64_t N, int E) {
  fast_rng rng{g()};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const float big = std::numeric_limits<float>::max();
  std::vector<T> z(static_cast<std::size_t>(N) * E);
  for (std::int64_t t = 0; t < N; ++t) {
    const int kind = static_cast<int>(t % 12);
    for (int e = 0; e < E; ++e) {
      float x = rng.normalish();
      switch (kind) {
        case 1: if (e % 5 == 1) x = nan; break;
        case 2: if (e == 3 % E) x = inf; if (e == 7 % E) x = -inf; break;
        case 3: x = 0.5f; break;
        case 4: x = std::round(x * 2.0f) / 2.0f; break;
        case 5: x = nan; break;
        case 6: x = e % 4 == 0 ? big : e % 4 == 1 ? -big : e % 4 == 2 ? inf : x; break;
        case 7: x = e % 2 ? 0.0f : -0.0f; break;
        case 8: x *= 40.0f; break;
        case 9: if (e % 3 == 0) x = -inf; break;
        case 10: x = e == E - 1 ? 3.0f : x - 100.0f; break;
        default: break;
      }
      z[static_cast<std::size_t>(t) * E + e] = make<T>(x);
    }
  }
  return z;
}

// Small biases on a 1/64 grid, so biased keys tie now and then.
std::vector<float> make_bias(std::mt19937& g, int E) {
  std::uniform_int_distribution<int> step(-8, 8);
  std::vector<float> b(E);
  for (float& x : b) x = static_cast<float>(step(g)) / 64.0f;
  return b;
}

std::vector<float> make_grad(std::mt19937& g, std::size_t n) {
  fast_rng rng{g()};
  std::vector<float> d(n);
  for (std::size_t i = 0; i < n; ++i) d[i] = i % 7 == 3 ? 0.0f : 0.5f * rng.normalish();
  return d;
}

// ---------------------------------------------------------------- parity

// Runs cpu:: and cuda:: forward and backward on the same inputs and requires
// identical bits.
template <class Router, class T>
void check_parity(const Router& r, int E, std::int64_t N, std::mt19937& g, cudaStream_t stream,
                  const std::string& what) {
  CAPTURE(what);
  CAPTURE(E);
  CAPTURE(N);
  CAPTURE(r.top_k);
  const int K = r.top_k;
  const std::size_t nk = static_cast<std::size_t>(N) * K, ne = static_cast<std::size_t>(N) * E;
  const auto z = make_logits<T>(g, N, E);
  const auto bias = make_bias(g, E);
  const bool needs_bias = Router::selection_type::needs_expert_bias;

  // CPU reference (all host threads; bit-identical to the sequential path).
  std::vector<std::int32_t> cpu_idx(nk);
  std::vector<float> cpu_gates(nk);
  const mr::route_inputs<T> host_in{z.data(), N, E, needs_bias ? bias.data() : nullptr};
  const mr::route_report report =
      mr::cpu::route(r, host_in, mr::route_outputs{cpu_idx.data(), cpu_gates.data()}, mr::cpu::execution{0});
  const auto grad = make_grad(g, nk);
  std::vector<float> cpu_dz(ne);
  mr::cpu::backward(r, host_in, mr::backward_args{cpu_idx.data(), grad.data(), cpu_dz.data()},
                    mr::cpu::execution{0});

  // GPU.
  device_buffer<T> dz_in(z);
  device_buffer<float> dbias(bias);
  device_buffer<std::int32_t> didx(nk);
  device_buffer<float> dgates(nk);
  device_buffer<std::int64_t> dcount(1);
  didx.poison();
  dgates.poison();
  CUDA_REQUIRE(cudaMemsetAsync(dcount.get(), 0, sizeof(std::int64_t), stream));
  const mr::route_inputs<T> dev_in{dz_in.get(), N, E, needs_bias ? dbias.get() : nullptr};
  mr::cuda::route(r, dev_in, mr::route_outputs{didx.get(), dgates.get(), dcount.get()}, stream);
  CUDA_REQUIRE(cudaStreamSynchronize(stream));
  const auto gpu_idx = didx.to_host();
  const auto gpu_gates = dgates.to_host();
  const auto gpu_count = dcount.to_host();
  CHECK_MESSAGE(same_bits(gpu_idx, cpu_idx), "indices differ first at " << first_difference(gpu_idx, cpu_idx));
  CHECK_MESSAGE(same_bits(gpu_gates, cpu_gates), "gates differ first at " << first_difference(gpu_gates, cpu_gates));
  CHECK(gpu_count[0] == report.nonfinite_rows);

  device_buffer<std::int32_t> bidx(cpu_idx);
  device_buffer<float> dgrad(grad);
  device_buffer<float> ddz(ne);
  ddz.poison();
  mr::cuda::backward(r, dev_in, mr::backward_args{bidx.get(), dgrad.get(), ddz.get()}, stream);
  CUDA_REQUIRE(cudaStreamSynchronize(stream));
  const auto gpu_dz = ddz.to_host();
  CHECK_MESSAGE(same_bits(gpu_dz, cpu_dz), "grad_logits differ first at " << first_difference(gpu_dz, cpu_dz));

  // Determinism: a second forward gives the same bits.
  mr::cuda::route(r, dev_in, mr::route_outputs{didx.get(), dgates.get()}, stream);
  CUDA_REQUIRE(cudaStreamSynchronize(stream));
  CHECK(same_bits(didx.to_host(), gpu_idx));
  CHECK(same_bits(dgates.to_host(), gpu_gates));
}

// Group configurations (groups, top_groups, per_group_k) tried for each E.
std::vector<std::array<int, 3>> group_configs(int E) {
  switch (E) {
    case 8: return {{4, 2, 2}, {8, 3, 1}};
    case 64: return {{8, 4, 2}, {2, 1, 3}};
    case 100: return {{5, 2, 2}, {4, 3, 2}};
    case 128: return {{16, 5, 2}};
    case 256: return {{8, 4, 2}, {8, 1, 4}};
    case 384: return {{12, 4, 2}, {6, 2, 3}};
    case 512: return {{32, 4, 2}, {8, 3, 2}};
    case 1000: return {{8, 4, 2}, {20, 7, 1}};
    case 4096: return {{32, 4, 2}, {16, 2, 2}};
    default: return {{1, 1, 1}};
  }
}

constexpr int experts_sweep[] = {8, 64, 100, 128, 256, 384, 512, 1000, 4096};
constexpr std::int64_t tokens_sweep[] = {0, 1, 7, 4099};

// Every E, K in {1, typical, E when E <= MaxK}, N in {0, 1, 7, 4099}, and for
// group-limited selection each group configuration of the E.
template <class T, class Router>
void sweep(Router r, int typical_k, std::mt19937& g, cudaStream_t stream, const std::string& what) {
  using S = typename Router::selection_type;
  for (int E : experts_sweep) {
    std::vector<int> ks{1, std::min({typical_k, E, Router::max_k})};
    if (E <= Router::max_k) ks.push_back(E);
    std::sort(ks.begin(), ks.end());
    ks.erase(std::unique(ks.begin(), ks.end()), ks.end());
    for (int K : ks) {
      r.top_k = K;
      for (std::int64_t N : tokens_sweep) {
        if constexpr (S::shape == sel::kind::grouped) {
          for (const auto& c : group_configs(E)) {
            const int size = E / c[0];
            r.selection.groups = c[0];
            r.selection.top_groups = std::max(c[1], (K + size - 1) / size);
            r.selection.per_group_k = c[2];
            if (r.selection.top_groups > c[0]) continue;
            check_parity<Router, T>(r, E, N, g, stream,
                                    what + " groups=" + std::to_string(c[0]) + " top_groups=" +
                                        std::to_string(r.selection.top_groups) + " per_group_k=" + std::to_string(c[2]));
          }
        } else {
          check_parity<Router, T>(r, E, N, g, stream, what);
        }
      }
    }
  }
}

template <class Gating>
void sweep_selections(std::mt19937& g, cudaStream_t stream, const std::string& gating) {
  sweep<float>(mr::router<Gating, sel::top_k, 8>{}, 6, g, stream, gating + " + top_k");
  {
    mr::router<Gating, sel::top_k, 8> r;  // the other normalisation and a scaling factor
    r.normalize = !r.normalize;
    r.scaling_factor = 2.5f;
    sweep<float>(r, 8, g, stream, gating + " + top_k (normalize flipped, scale 2.5)");
  }
  sweep<float>(mr::router<Gating, sel::group_limited<sel::top_k>, 8>{}, 8, g, stream, gating + " + group_limited<top_k>");
  sweep<float>(mr::router<Gating, sel::fixed, 8>{}, 6, g, stream, gating + " + fixed");
  if constexpr (Gating::shape != gat::kind::selected_softmax) {
    sweep<float>(mr::router<Gating, sel::expert_bias, 8>{}, 6, g, stream, gating + " + expert_bias");
    sweep<float>(mr::router<Gating, sel::group_limited<sel::expert_bias>, 8>{}, 8, g, stream,
                 gating + " + group_limited<expert_bias>");
  }
}

}  // namespace

// ---------------------------------------------------------------- GPU cases

GPU_TEST_CASE("presets: cuda equals cpu bit for bit (fp32; also bf16 and fp16 for deepseek_v3, bf16 for qwen3)") {
  std::mt19937 g(101);
  stream_guard s;
  sweep<float>(mr::presets::deepseek_v3(), 8, g, s.get(), "deepseek_v3 fp32");
  sweep<mr::bfloat16>(mr::presets::deepseek_v3(), 8, g, s.get(), "deepseek_v3 bf16");
  sweep<mr::float16>(mr::presets::deepseek_v3(), 8, g, s.get(), "deepseek_v3 fp16");
  sweep<float>(mr::presets::qwen3(), 8, g, s.get(), "qwen3 fp32");
  sweep<mr::bfloat16>(mr::presets::qwen3(), 8, g, s.get(), "qwen3 bf16");
  sweep<float>(mr::presets::deepseek_v2_lite(), 6, g, s.get(), "deepseek_v2_lite");
  sweep<float>(mr::presets::moonlight(), 6, g, s.get(), "moonlight");
  sweep<float>(mr::presets::mixtral(), 2, g, s.get(), "mixtral");
  sweep<float>(mr::presets::deepseek_v4(), 6, g, s.get(), "deepseek_v4");
  // Each preset at its own E with its own K.
  check_parity<mr::presets::deepseek_v3_router, float>(mr::presets::deepseek_v3(), mr::presets::deepseek_v3_experts,
                                                        4099, g, s.get(), "deepseek_v3 native");
  check_parity<mr::presets::moonlight_router, float>(mr::presets::moonlight(), mr::presets::moonlight_experts, 4099,
                                                      g, s.get(), "moonlight native");
  check_parity<mr::presets::mixtral_router, float>(mr::presets::mixtral(), mr::presets::mixtral_experts, 4099, g,
                                                    s.get(), "mixtral native");
}

GPU_TEST_CASE("softmax gating x every selection: cuda equals cpu (fp32)") {
  std::mt19937 g(202);
  stream_guard s;
  sweep_selections<gat::softmax>(g, s.get(), "softmax");
}

GPU_TEST_CASE("sigmoid gating x every selection: cuda equals cpu (fp32)") {
  std::mt19937 g(303);
  stream_guard s;
  sweep_selections<gat::sigmoid>(g, s.get(), "sigmoid");
}

GPU_TEST_CASE("sqrt_softplus gating x every selection: cuda equals cpu (fp32)") {
  std::mt19937 g(404);
  stream_guard s;
  sweep_selections<gat::sqrt_softplus>(g, s.get(), "sqrt_softplus");
}

GPU_TEST_CASE("softmax_after_topk gating x every selection it allows: cuda equals cpu (fp32)") {
  std::mt19937 g(505);
  stream_guard s;
  sweep_selections<gat::softmax_after_topk>(g, s.get(), "softmax_after_topk");
}

GPU_TEST_CASE("K up to 32 (MaxK = 32): cuda equals cpu") {
  std::mt19937 g(606);
  stream_guard s;
  sweep<float>(mr::router<gat::softmax, sel::top_k, 32>{}, 32, g, s.get(), "softmax + top_k, MaxK 32");
}

GPU_TEST_CASE("route_inputs<__nv_bfloat16> and <__half> read the same bits as the storage types") {
  std::mt19937 g(707);
  const auto r = mr::presets::deepseek_v3();
  const int E = 256, K = r.top_k;
  const std::int64_t N = 513;
  const auto bf = make_logits<mr::bfloat16>(g, N, E);
  const auto hf = make_logits<mr::float16>(g, N, E);
  const auto bias = make_bias(g, E);
  device_buffer<mr::bfloat16> dbf(bf);
  device_buffer<mr::float16> dhf(hf);
  device_buffer<float> dbias(bias);
  device_buffer<std::int32_t> i1(N * K), i2(N * K);
  device_buffer<float> w1(N * K), w2(N * K);
  mr::cuda::route(r, mr::route_inputs<mr::bfloat16>{dbf.get(), N, E, dbias.get()}, mr::route_outputs{i1.get(), w1.get()});
  mr::cuda::route(r, mr::route_inputs<__nv_bfloat16>{reinterpret_cast<const __nv_bfloat16*>(dbf.get()), N, E, dbias.get()},
                  mr::route_outputs{i2.get(), w2.get()});
  CUDA_REQUIRE(cudaDeviceSynchronize());
  CHECK(same_bits(i1.to_host(), i2.to_host()));
  CHECK(same_bits(w1.to_host(), w2.to_host()));
  mr::cuda::route(r, mr::route_inputs<mr::float16>{dhf.get(), N, E, dbias.get()}, mr::route_outputs{i1.get(), w1.get()});
  mr::cuda::route(r, mr::route_inputs<__half>{reinterpret_cast<const __half*>(dhf.get()), N, E, dbias.get()},
                  mr::route_outputs{i2.get(), w2.get()});
  CUDA_REQUIRE(cudaDeviceSynchronize());
  CHECK(same_bits(i1.to_host(), i2.to_host()));
  CHECK(same_bits(w1.to_host(), w2.to_host()));
}

namespace {

template <class Load>
void check_bias_update(const std::vector<Load>& loads, std::mt19937& g, cudaStream_t stream) {
  const int E = static_cast<int>(loads.size());
  CAPTURE(E);
  sel::expert_bias policy;
  policy.update_rate = 1e-3f;
  std::vector<float> bias = make_bias(g, E);
  bias[0] = -0.0f;  // a load equal to the mean adds +0.0f: -0.0f becomes +0.0f on both sides
  std::vector<float> host = bias;
  policy.update(host.data(), loads.data(), E);
  device_buffer<float> dbias(bias);
  device_buffer<Load> dloads(loads);
  mr::cuda::update_expert_bias(policy, dbias.get(), dloads.get(), E, stream);
  CUDA_REQUIRE(cudaStreamSynchronize(stream));
  const auto dev = dbias.to_host();
  CHECK_MESSAGE(same_bits(dev, host), "bias differs first at " << first_difference(dev, host));
}

}  // namespace

GPU_TEST_CASE("update_expert_bias equals selection::expert_bias::update") {
  std::mt19937 g(808);
  stream_guard s;
  for (int E : {1, 8, 64, 256, 257, 300, 1000, 4096}) {
    std::uniform_int_distribution<int> counts(0, 5000);
    std::vector<std::int32_t> c32(E);
    for (auto& c : c32) c = counts(g);
    c32[0] = 0;
    if (E > 2) c32[1] = c32[2];
    std::vector<std::int64_t> c64(c32.begin(), c32.end());
    std::vector<float> f(E);
    std::vector<double> d(E);
    std::uniform_real_distribution<float> frac(0.0f, 3.0f);
    for (int e = 0; e < E; ++e) {
      f[e] = frac(g) * (e % 3 == 0 ? 1e-6f : 1e3f);  // mixed magnitudes: the summation order matters
      d[e] = static_cast<double>(frac(g)) * 1e10 + 1e-7 * e;
    }
    std::vector<std::int32_t> equal(E, 7);  // every load equals the mean: no change
    check_bias_update(c32, g, s.get());
    check_bias_update(c64, g, s.get());
    check_bias_update(f, g, s.get());
    check_bias_update(d, g, s.get());
    check_bias_update(equal, g, s.get());
  }
}

namespace {

// Deterministic device-side logits for the large-batch test: a hash of the
// element index on a 1/8 grid in [-8, 8), and a NaN at expert 3 of every row
// t with t % nan_period == 7.
constexpr std::int64_t nan_period = 65537;

__host__ __device__ inline float hashed_logit(std::int64_t i) {
  std::uint64_t x = static_cast<std::uint64_t>(i) * 0x9e3779b97f4a7c15ull;
  x ^= x >> 29;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 32;
  return static_cast<float>(static_cast<int>(x & 127u) - 64) / 8.0f;
}

template <class T>
__device__ inline T store_as(float x);
template <>
__device__ inline float store_as<float>(float x) {
  return x;
}
template <>
__device__ inline mr::bfloat16 store_as<mr::bfloat16>(float x) {
  return mr::bfloat16{__bfloat16_as_ushort(__float2bfloat16_rn(x))};
}

template <class T>
static __global__ void fill_logits(T* z, std::int64_t N, int E) {
  const std::int64_t total = N * E;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t t = i / E;
    const int e = static_cast<int>(i - t * E);
    float x = hashed_logit(i);
    if (t % nan_period == 7 && e == 3) x = __int_as_float(0x7fc00000);
    z[i] = store_as<T>(x);
  }
}

static __global__ void fill_grad(float* d, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    d[i] = hashed_logit(i ^ 0x5555) * 0.25f;
}

// Rows checked in the large test: the first, some spread over the batch, and
// the last (whose element offsets exceed 2^31 / 2^32).
std::vector<std::int64_t> sample_rows(std::int64_t N, std::mt19937& g) {
  std::vector<std::int64_t> rows{0, 1, 2, 7, nan_period + 7, N / 2, N - 3, N - 2, N - 1};
  std::uniform_int_distribution<std::int64_t> pick(0, N - 1);
  for (int i = 0; i < 1000; ++i) rows.push_back(pick(g));
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  return rows;
}

template <class T>
std::vector<T> gather_rows(const T* dev, const std::vector<std::int64_t>& rows, int width) {
  std::vector<T> h(rows.size() * width);
  for (std::size_t i = 0; i < rows.size(); ++i)
    CUDA_REQUIRE(cudaMemcpy(h.data() + i * width, dev + rows[i] * width, width * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

bool allocate(void** p, std::size_t bytes) {
  if (cudaMalloc(p, bytes) == cudaSuccess) return true;
  cudaGetLastError();
  return false;
}

// Routes N = 2^24 + 3 tokens on the device and checks sampled rows against
// the CPU backend (the router must not depend on the token position).
template <class Router, class T>
void check_large(const Router& r, int E, bool with_backward, std::mt19937& g) {
  const std::int64_t N = (std::int64_t{1} << 24) + 3;
  const int K = r.top_k;
  CAPTURE(E);
  CAPTURE(sizeof(T));
  void *z = nullptr, *idx = nullptr, *gates = nullptr, *count = nullptr, *bias = nullptr;
  const std::size_t zbytes = static_cast<std::size_t>(N) * E * sizeof(T);
  if (!allocate(&z, zbytes)) {
    MESSAGE("not enough device memory for the large-batch check with E = " << E << ": skipped");
    return;
  }
  REQUIRE(allocate(&idx, static_cast<std::size_t>(N) * K * sizeof(std::int32_t)));
  REQUIRE(allocate(&gates, static_cast<std::size_t>(N) * K * sizeof(float)));
  REQUIRE(allocate(&count, sizeof(std::int64_t)));
  REQUIRE(allocate(&bias, E * sizeof(float)));
  const auto host_bias = make_bias(g, E);
  CUDA_REQUIRE(cudaMemcpy(bias, host_bias.data(), E * sizeof(float), cudaMemcpyHostToDevice));
  fill_logits<T><<<4096, 256>>>(static_cast<T*>(z), N, E);
  CUDA_REQUIRE(cudaGetLastError());
  CUDA_REQUIRE(cudaMemset(count, 0, sizeof(std::int64_t)));
  const bool needs_bias = Router::selection_type::needs_expert_bias;
  const mr::route_inputs<T> in{static_cast<const T*>(z), N, E, needs_bias ? static_cast<const float*>(bias) : nullptr};
  mr::cuda::route(r, in, mr::route_outputs{static_cast<std::int32_t*>(idx), static_cast<float*>(gates),
                                           static_cast<std::int64_t*>(count)});
  CUDA_REQUIRE(cudaDeviceSynchronize());

  std::int64_t gpu_count = 0;
  CUDA_REQUIRE(cudaMemcpy(&gpu_count, count, sizeof gpu_count, cudaMemcpyDeviceToHost));
  CHECK(gpu_count == (N - 7 + nan_period - 1) / nan_period);

  const auto rows = sample_rows(N, g);
  const std::int64_t M = static_cast<std::int64_t>(rows.size());
  const auto hz = gather_rows(static_cast<const T*>(z), rows, E);
  const auto gpu_idx = gather_rows(static_cast<const std::int32_t*>(idx), rows, K);
  const auto gpu_gates = gather_rows(static_cast<const float*>(gates), rows, K);
  std::vector<std::int32_t> cpu_idx(M * K);
  std::vector<float> cpu_gates(M * K);
  const mr::route_inputs<T> host_in{hz.data(), M, E, needs_bias ? host_bias.data() : nullptr};
  mr::cpu::route(r, host_in, mr::route_outputs{cpu_idx.data(), cpu_gates.data()});
  CHECK_MESSAGE(same_bits(gpu_idx, cpu_idx), "indices differ first at sample " << first_difference(gpu_idx, cpu_idx));
  CHECK_MESSAGE(same_bits(gpu_gates, cpu_gates), "gates differ first at sample " << first_difference(gpu_gates, cpu_gates));

  if (with_backward) {
    void *grad = nullptr, *dz = nullptr;
    REQUIRE(allocate(&grad, static_cast<std::size_t>(N) * K * sizeof(float)));
    if (!allocate(&dz, static_cast<std::size_t>(N) * E * sizeof(float))) {
      MESSAGE("not enough device memory for the large-batch backward: skipped");
    } else {
      fill_grad<<<4096, 256>>>(static_cast<float*>(grad), N * K);
      CUDA_REQUIRE(cudaGetLastError());
      mr::cuda::backward(r, in, mr::backward_args{static_cast<const std::int32_t*>(idx), static_cast<const float*>(grad),
                                                  static_cast<float*>(dz)});
      CUDA_REQUIRE(cudaDeviceSynchronize());
      const auto hgrad = gather_rows(static_cast<const float*>(grad), rows, K);
      const auto gpu_dz = gather_rows(static_cast<const float*>(dz), rows, E);
      std::vector<float> cpu_dz(M * E);
      mr::cpu::backward(r, host_in, mr::backward_args{gpu_idx.data(), hgrad.data(), cpu_dz.data()});
      CHECK_MESSAGE(same_bits(gpu_dz, cpu_dz), "grad_logits differ first at " << first_difference(gpu_dz, cpu_dz));
      cudaFree(dz);
    }
    cudaFree(grad);
  }
  cudaFree(bias);
  cudaFree(count);
  cudaFree(gates);
  cudaFree(idx);
  cudaFree(z);
}

}  // namespace

GPU_TEST_CASE("large batch: N = 2^24 + 3 tokens (64-bit offsets), sampled rows equal the cpu") {
  std::mt19937 g(909);
  check_large<mr::presets::qwen3_router, float>(mr::presets::qwen3(), 64, true, g);
  // N * E > 2^32 elements.
  check_large<mr::presets::deepseek_v3_router, mr::bfloat16>(mr::presets::deepseek_v3(), 256, false, g);
}

GPU_TEST_CASE("backward: the last duplicate wins, indices outside [0, E) are ignored") {
  std::mt19937 g(1010);
  stream_guard s;
  const int E = 128;
  const std::int64_t N = 300;
  // Duplicates are valid input for the CPU too: compare directly (normalised softmax).
  {
    const auto r = mr::presets::qwen3();
    const int K = r.top_k;
    const auto z = make_logits<float>(g, N, E);
    const auto grad = make_grad(g, N * K);
    std::vector<std::int32_t> idx(N * K);
    for (std::int64_t t = 0; t < N; ++t)
      for (int j = 0; j < K; ++j) idx[t * K + j] = (static_cast<int>(t) * 5 + j * 3) % E;
    for (std::int64_t t = 0; t < N; ++t) idx[t * K + K - 1] = idx[t * K];
    std::vector<float> cpu_dz(N * E);
    mr::cpu::backward(r, mr::route_inputs<float>{z.data(), N, E},
                      mr::backward_args{idx.data(), grad.data(), cpu_dz.data()});
    device_buffer<float> dz_in(z), dgrad(grad), ddz(N * E);
    device_buffer<std::int32_t> didx(idx);
    ddz.poison();
    mr::cuda::backward(r, mr::route_inputs<float>{dz_in.get(), N, E},
                       mr::backward_args{didx.get(), dgrad.get(), ddz.get()}, s.get());
    CUDA_REQUIRE(cudaStreamSynchronize(s.get()));
    const auto gpu_dz = ddz.to_host();
    CHECK_MESSAGE(same_bits(gpu_dz, cpu_dz), "grad_logits differ first at " << first_difference(gpu_dz, cpu_dz));
  }
  // An ignored entry reads no logit, has score 0, is left out of the dot
  // product and writes nothing. Without normalisation its slot then equals, on
  // the CPU, a duplicate of a later slot's expert with dL/dgate = 0 (it adds an
  // exact 0 to the dot product and the later slot's write wins).
  {
    const auto r = mr::presets::deepseek_v2_lite();  // softmax, normalize = false
    const int K = r.top_k;
    const auto z = make_logits<float>(g, N, E);
    auto grad = make_grad(g, N * K);
    std::vector<std::int32_t> idx(N * K), bad(N * K);
    for (std::int64_t t = 0; t < N; ++t)
      for (int j = 0; j < K; ++j) idx[t * K + j] = (static_cast<int>(t) * 7 + j * 11) % E;
    bad = idx;
    for (std::int64_t t = 0; t < N; ++t) {
      bad[t * K + 1] = t % 3 == 0 ? -1 : t % 3 == 1 ? E : E + 1000 * static_cast<int>(t);
      idx[t * K + 1] = idx[t * K + K - 1];
    }
    auto cpu_grad = grad;
    for (std::int64_t t = 0; t < N; ++t) cpu_grad[t * K + 1] = 0.0f;
    std::vector<float> cpu_dz(N * E);
    mr::cpu::backward(r, mr::route_inputs<float>{z.data(), N, E},
                      mr::backward_args{idx.data(), cpu_grad.data(), cpu_dz.data()});
    device_buffer<float> dz_in(z), dgrad(grad), ddz(N * E);
    device_buffer<std::int32_t> dbad(bad);
    ddz.poison();
    mr::cuda::backward(r, mr::route_inputs<float>{dz_in.get(), N, E},
                       mr::backward_args{dbad.get(), dgrad.get(), ddz.get()}, s.get());
    CUDA_REQUIRE(cudaStreamSynchronize(s.get()));
    CUDA_REQUIRE(cudaGetLastError());
    const auto gpu_dz = ddz.to_host();
    CHECK_MESSAGE(same_bits(gpu_dz, cpu_dz), "grad_logits differ first at " << first_difference(gpu_dz, cpu_dz));
  }
}

GPU_TEST_CASE("every call runs on the given stream: no synchronisation, no allocation (graph capture)") {
  std::mt19937 g(1111);
  stream_guard s;
  const auto r = mr::presets::deepseek_v3();
  const int E = 256, K = r.top_k;
  const std::int64_t N = 1000;
  const auto z = make_logits<mr::bfloat16>(g, N, E);
  const auto bias = make_bias(g, E);
  const auto grad = make_grad(g, N * K);
  std::vector<std::int32_t> loads(E);
  for (int e = 0; e < E; ++e) loads[e] = (e * 37) % 101;
  device_buffer<mr::bfloat16> dz_in(z);
  device_buffer<float> dbias(bias), dgrad(grad), dgates(N * K), ddz(N * E), gates2(N * K), dz2(N * E), bias2(bias);
  device_buffer<std::int32_t> didx(N * K), idx2(N * K), dloads(loads);
  device_buffer<std::int64_t> count(1), count2(1);
  CUDA_REQUIRE(cudaMemset(count.get(), 0, sizeof(std::int64_t)));
  CUDA_REQUIRE(cudaMemset(count2.get(), 0, sizeof(std::int64_t)));
  CUDA_REQUIRE(cudaDeviceSynchronize());

  auto work = [&](float* b, std::int32_t* idx, float* gates, float* dz, std::int64_t* cnt) {
    const mr::route_inputs<mr::bfloat16> in{dz_in.get(), N, E, b};
    mr::cuda::route(r, in, mr::route_outputs{idx, gates, cnt}, s.get());
    mr::cuda::backward(r, in, mr::backward_args{idx, dgrad.get(), dz}, s.get());
    mr::cuda::update_expert_bias(r.selection.inner, b, dloads.get(), E, s.get());
  };
  work(dbias.get(), didx.get(), dgates.get(), ddz.get(), count.get());
  CUDA_REQUIRE(cudaStreamSynchronize(s.get()));

  cudaGraph_t graph{};
  CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
  work(bias2.get(), idx2.get(), gates2.get(), dz2.get(), count2.get());
  CUDA_REQUIRE(cudaStreamEndCapture(s.get(), &graph));
  cudaGraphExec_t exec{};
  CUDA_REQUIRE(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_REQUIRE(cudaGraphLaunch(exec, s.get()));
  CUDA_REQUIRE(cudaStreamSynchronize(s.get()));
  CHECK(same_bits(idx2.to_host(), didx.to_host()));
  CHECK(same_bits(gates2.to_host(), dgates.to_host()));
  CHECK(same_bits(dz2.to_host(), ddz.to_host()));
  CHECK(same_bits(bias2.to_host(), dbias.to_host()));
  CHECK(count2.to_host() == count.to_host());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// ---------------------------------------------------------------- host-only cases

TEST_CASE("invalid arguments throw moe_route::error before anything is launched (no device needed)") {
  // Fake device pointers: validation must reject the call before touching them.
  const auto* z = reinterpret_cast<const float*>(std::uintptr_t{256});
  auto* idx = reinterpret_cast<std::int32_t*>(std::uintptr_t{512});
  auto* w = reinterpret_cast<float*>(std::uintptr_t{1024});
  const auto* grad = reinterpret_cast<const float*>(std::uintptr_t{2048});
  auto* dz = reinterpret_cast<float*>(std::uintptr_t{4096});
  auto r = mr::presets::qwen3();
  const mr::route_outputs out{idx, w};

  CHECK_THROWS_AS(mr::cuda::route(r, mr::route_inputs<float>{z, 16, 4}, out), mr::error);  // K > E
  CHECK_THROWS_AS(mr::cuda::route(r, mr::route_inputs<float>{nullptr, 16, 128}, out), mr::error);
  CHECK_THROWS_AS(mr::cuda::route(r, mr::route_inputs<float>{z, -1, 128}, out), mr::error);
  CHECK_THROWS_AS(mr::cuda::route(r, mr::route_inputs<float>{z, 16, 5000}, out), mr::error);
  CHECK_THROWS_AS(mr::cuda::route(r, mr::route_inputs<float>{z, 16, 128}, mr::route_outputs{nullptr, w}), mr::error);
  CHECK_THROWS_AS(mr::cuda::route(r, mr::route_inputs<float>{z, 16, 128}, mr::route_outputs{idx, nullptr}), mr::error);
  r.top_k = 9;  // above MaxK = 8
  CHECK_THROWS_AS(mr::cuda::route(r, mr::route_inputs<float>{z, 16, 128}, out), mr::error);

  auto v3 = mr::presets::deepseek_v3();
  const auto* bias = reinterpret_cast<const float*>(std::uintptr_t{8192});
  CHECK_THROWS_AS(mr::cuda::route(v3, mr::route_inputs<float>{z, 16, 256}, out), mr::error);  // bias missing
  v3.selection.groups = 7;                                                                  // does not divide E
  CHECK_THROWS_AS(mr::cuda::route(v3, mr::route_inputs<float>{z, 16, 256, bias}, out), mr::error);
  v3.selection.groups = 64;  // more than 32 groups
  CHECK_THROWS_AS(mr::cuda::route(v3, mr::route_inputs<float>{z, 16, 256, bias}, out), mr::error);
  v3.selection.groups = 8;
  v3.selection.top_groups = 9;
  CHECK_THROWS_AS(mr::cuda::route(v3, mr::route_inputs<float>{z, 16, 256, bias}, out), mr::error);

  const auto q = mr::presets::qwen3();
  CHECK_THROWS_AS(mr::cuda::backward(q, mr::route_inputs<float>{z, 16, 128}, mr::backward_args{nullptr, grad, dz}),
                  mr::error);
  CHECK_THROWS_AS(mr::cuda::backward(q, mr::route_inputs<float>{z, 16, 128}, mr::backward_args{idx, nullptr, dz}),
                  mr::error);
  CHECK_THROWS_AS(mr::cuda::backward(q, mr::route_inputs<float>{z, 16, 128}, mr::backward_args{idx, grad, nullptr}),
                  mr::error);
  CHECK_THROWS_AS(mr::cuda::backward(q, mr::route_inputs<float>{z, 16, 4}, mr::backward_args{idx, grad, dz}),
                  mr::error);

  const mr::selection::expert_bias policy;
  float* b = w;
  const std::int32_t* loads = idx;
  CHECK_THROWS_AS(mr::cuda::update_expert_bias(policy, b, loads, 0), mr::error);
  CHECK_THROWS_AS(mr::cuda::update_expert_bias(policy, nullptr, loads, 8), mr::error);
  CHECK_THROWS_AS(mr::cuda::update_expert_bias(policy, b, static_cast<const std::int32_t*>(nullptr), 8), mr::error);

  // N = 0 is valid with null pointers and launches nothing.
  CHECK_NOTHROW(mr::cuda::route(q, mr::route_inputs<float>{nullptr, 0, 128}, mr::route_outputs{}));
  CHECK_NOTHROW(mr::cuda::backward(q, mr::route_inputs<float>{nullptr, 0, 128}, mr::backward_args{}));
}

TEST_CASE("cuda_error names the failing call (no device needed)") {
  const mr::cuda::cuda_error e("moe_route::cuda::route: launch", cudaErrorInvalidConfiguration);
  CHECK(std::string(e.what()).find("moe_route::cuda::route: launch") != std::string::npos);
  CHECK(e.code() == cudaErrorInvalidConfiguration);
  const std::runtime_error& base = e;
  CHECK(std::string(base.what()).find("failed") != std::string::npos);
}

int main(int argc, char** argv) {
  if (!has_device())
    std::printf("moe_route GPU tests: no CUDA device, %d test cases skipped\n", gpu_case_count());
  doctest::Context context(argc, argv);
  return context.run();
}

// ---------------------------------------------------------------- training policies

namespace {

struct training_data {
  std::vector<float> bias, probs, fractions;
  std::vector<std::int32_t> rows, sequences, ranks;
  std::int64_t S = 6;
  std::int32_t num_sequences = 4;
};

training_data make_training_data(std::mt19937& g, std::int64_t N, int E) {
  training_data d;
  std::uniform_int_distribution<int> u(1, 1000);
  std::vector<float> pi(d.S * E);
  for (auto& p : pi) p = u(g) / 1000.0f;
  d.bias.resize(d.S * E);
  d.probs.resize(d.S * E);
  mr::prior::prepare(pi.data(), d.S, E, d.bias.data(), d.probs.data());
  d.rows.resize(N);
  for (auto& r : d.rows) r = static_cast<std::int32_t>(u(g) % (d.S + 1)) - 1;
  d.sequences.resize(N);
  for (std::int64_t t = 0; t < N; ++t) d.sequences[t] = static_cast<std::int32_t>(t * d.num_sequences / N);
  d.fractions.assign(E, 1.0f / E);
  d.ranks.resize(E);
  for (int e = 0; e < E; ++e) d.ranks[e] = e % 4;
  return d;
}

template <class T>
mr::route_inputs<T> training_inputs(const T* z, std::int64_t N, int E, const float* expert_bias, const float* bias,
                                    const float* probs, const std::int32_t* rows, const std::int32_t* sequences,
                                    const float* fractions, const std::int32_t* ranks, const training_data& d) {
  mr::route_inputs<T> in{z, N, E, expert_bias};
  in.prior_bias = bias;
  in.prior_probs = probs;
  in.prior_rows = d.S;
  in.token_prior_row = rows;
  in.sequence_ids = sequences;
  in.num_sequences = d.num_sequences;
  in.load_fractions = fractions;
  in.expert_rank = ranks;
  in.rank = 1;
  return in;
}

// cpu:: and cuda:: forward and backward of a router with training policies:
// identical indices, gates, penalty values and dL/dz.
template <class Router>
void check_training_parity(const Router& r, int E, std::int64_t N, std::mt19937& g, cudaStream_t stream) {
  CAPTURE(E);
  CAPTURE(N);
  const int K = r.top_k;
  const int P = Router::num_penalties > 0 ? Router::num_penalties : 1;
  const std::size_t nk = static_cast<std::size_t>(N) * K, ne = static_cast<std::size_t>(N) * E;
  const auto z = make_logits<float>(g, N, E);
  const auto expert_bias = make_bias(g, E);
  const training_data d = make_training_data(g, N, E);
  const std::size_t bytes = mr::penalty::training_workspace_bytes(r, N, E, d.num_sequences);
  const std::vector<float> upstream = {1.5f, 0.5f, 2.0f, 1.0f, 0.75f};
  const auto grad = make_grad(g, nk);

  const auto host_in = training_inputs(z.data(), N, E, expert_bias.data(), d.bias.data(), d.probs.data(),
                                       d.rows.data(), d.sequences.data(), d.fractions.data(), d.ranks.data(), d);
  std::vector<std::int32_t> cpu_idx(nk);
  std::vector<float> cpu_gates(nk), cpu_dz(ne);
  std::vector<double> cpu_values(P);
  std::vector<unsigned char> cpu_ws(bytes);
  mr::route_outputs ho{cpu_idx.data(), cpu_gates.data()};
  ho.penalty_values = cpu_values.data();
  ho.workspace = cpu_ws.data();
  ho.workspace_bytes = bytes;
  mr::cpu::route(r, host_in, ho, mr::cpu::execution{0});
  mr::backward_args hb{cpu_idx.data(), grad.data(), cpu_dz.data()};
  hb.workspace = cpu_ws.data();
  hb.workspace_bytes = bytes;
  hb.penalty_grads = upstream.data();
  mr::cpu::backward(r, host_in, hb, mr::cpu::execution{0});

  device_buffer<float> dz_in(z), debias(expert_bias), dbias(d.bias), dprobs(d.probs), dfrac(d.fractions);
  device_buffer<std::int32_t> drows(d.rows), dseq(d.sequences), dranks(d.ranks);
  device_buffer<std::int32_t> didx(nk);
  device_buffer<float> dgates(nk), ddz(ne);
  device_buffer<double> dvalues(P);
  device_buffer<unsigned char> dws(bytes);
  didx.poison();
  dgates.poison();
  ddz.poison();
  const auto dev_in = training_inputs(dz_in.get(), N, E, debias.get(), dbias.get(), dprobs.get(), drows.get(),
                                      dseq.get(), dfrac.get(), dranks.get(), d);
  mr::route_outputs o{didx.get(), dgates.get()};
  o.penalty_values = dvalues.get();
  o.workspace = dws.get();
  o.workspace_bytes = bytes;
  mr::cuda::route(r, dev_in, o, stream);
  mr::backward_args b{didx.get(), nullptr, ddz.get()};
  device_buffer<float> dgrad(grad);
  b.grad_gates = dgrad.get();
  b.workspace = dws.get();
  b.workspace_bytes = bytes;
  const device_buffer<float> dupstream(upstream);  // device memory, as cuda::backward reads it
  b.penalty_grads = dupstream.get();
  mr::cuda::backward(r, dev_in, b, stream);
  CUDA_REQUIRE(cudaStreamSynchronize(stream));
  CHECK_MESSAGE(same_bits(didx.to_host(), cpu_idx), "indices differ");
  CHECK_MESSAGE(same_bits(dgates.to_host(), cpu_gates), "gates differ");
  if (Router::has_penalties) CHECK_MESSAGE(same_bits(dvalues.to_host(), cpu_values), "penalty values differ");
  const auto gpu_dz = ddz.to_host();
  CHECK_MESSAGE(same_bits(gpu_dz, cpu_dz), "grad_logits differ first at " << first_difference(gpu_dz, cpu_dz));
}

}  // namespace

GPU_TEST_CASE("training policies: prior and penalties, cuda equals cpu bit for bit") {
  std::mt19937 g(4242);
  stream_guard stream;
  namespace pen = mr::penalty;
  namespace pri = mr::prior;
  for (int E : {16, 64, 256, 1000}) {
    for (std::int64_t N : {1, 333, 5000}) {
      auto all = mr::with_policies(mr::router<gat::softmax, sel::top_k, 8>{}, pri::log_prior_bias{0.8f},
                                   pen::load_balance{0.3f}, pen::z_loss{0.01f}, pen::kl_to_base{0.2f},
                                   pen::logit_l2{0.1f}, pen::locality{0.4f});
      all.top_k = 6;
      check_training_parity(all, E, N, g, stream.get());
      auto seq = mr::with_policies(mr::router<gat::sigmoid, sel::expert_bias, 8>{}, pri::log_prior_bias{1.5f, false},
                                   pen::load_balance{0.3f, pen::load_balance::scope::sequence}, pen::kl_to_base{0.2f});
      seq.top_k = 4;
      check_training_parity(seq, E, N, g, stream.get());
      auto hard = mr::with_policies(mr::router<gat::sqrt_softplus, sel::top_k, 8>{}, pri::prior_override{},
                                    pen::logit_l2{0.05f}, pen::z_loss{0.02f});
      hard.top_k = 2;
      check_training_parity(hard, E, N, g, stream.get());
      auto global = mr::with_policies(mr::router<gat::softmax_after_topk, sel::top_k, 4>{},
                                      pen::load_balance{0.5f, pen::load_balance::scope::global_batch});
      global.top_k = 2;
      check_training_parity(global, E, N, g, stream.get());
    }
  }
  check_training_parity(mr::with_policies(mr::presets::deepseek_v3(), pri::log_prior_bias{1.0f}, pen::load_balance{0.2f}),
                        256, 4096, g, stream.get());
}

GPU_TEST_CASE("prior builder: cuda::prior::build equals prior::build bit for bit") {
  std::mt19937 g(99);
  stream_guard stream;
  for (int E : {8, 64, 300}) {
    const std::int64_t N = 3000, S = 17;
    const auto z = make_logits<float>(g, N, E);
    std::vector<std::int32_t> rows(N);
    for (auto& r : rows) r = static_cast<std::int32_t>(g() % (S + 1)) - 1;
    rows[0] = static_cast<std::int32_t>(S - 1);
    std::vector<float> cpu(S * E);
    const auto report = mr::prior::build<gat::sigmoid>(mr::route_inputs<float>{z.data(), N, E}, rows.data(), S, cpu.data());
    device_buffer<float> dz(z), dprior(S * E);
    device_buffer<std::int32_t> drows(rows);
    device_buffer<std::int64_t> dtokens(S);
    device_buffer<unsigned char> dws(mr::cuda::prior::build_workspace_bytes(S, E));
    mr::cuda::prior::build<gat::sigmoid>(mr::route_inputs<float>{dz.get(), N, E}, drows.get(), S, dprior.get(),
                                         dtokens.get(), dws.get(), mr::cuda::prior::build_workspace_bytes(S, E),
                                         stream.get());
    CUDA_REQUIRE(cudaStreamSynchronize(stream.get()));
    CHECK(same_bits(dprior.to_host(), cpu));
    const auto tokens = dtokens.to_host();
    std::int64_t used = 0, empty = 0;
    for (auto c : tokens) used += c, empty += c == 0;
    CHECK(used == report.tokens_used);
    CHECK(empty == static_cast<std::int64_t>(report.empty_rows.size()));
  }
}

GPU_TEST_CASE("router_l2: cuda::router_l2_apply equals penalty::router_l2::apply bit for bit") {
  std::mt19937 g(7);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  const std::vector<std::int64_t> sizes = {64 * 2048, 5, 0, 4096 * 3 + 17};
  std::vector<std::vector<float>> w(sizes.size()), w0(sizes.size()), grad(sizes.size());
  std::vector<mr::penalty::router_weights> host(sizes.size());
  for (std::size_t l = 0; l < sizes.size(); ++l) {
    for (std::int64_t i = 0; i < sizes[l]; ++i) {
      w0[l].push_back(nd(g));
      w[l].push_back(w0[l].back() + 0.1f * nd(g));
      grad[l].push_back(nd(g));
    }
  }
  std::vector<std::unique_ptr<device_buffer<float>>> dw, dw0, dgrad;
  std::vector<mr::penalty::router_weights> dev(sizes.size());
  for (std::size_t l = 0; l < sizes.size(); ++l) {
    dw.emplace_back(new device_buffer<float>(w[l]));
    dw0.emplace_back(new device_buffer<float>(w0[l]));
    dgrad.emplace_back(new device_buffer<float>(grad[l]));
    dev[l] = {dw[l]->get(), dw0[l]->get(), sizes[l], dgrad[l]->get()};
    host[l] = {w[l].data(), w0[l].data(), sizes[l], grad[l].data()};
  }
  const mr::penalty::router_l2 policy{1e4f};
  const double value = policy.apply(host.data(), static_cast<int>(host.size()));
  device_buffer<double> dvalue(1);
  const std::size_t bytes = mr::cuda::router_l2_workspace_bytes(dev.data(), static_cast<int>(dev.size()));
  device_buffer<unsigned char> ws(bytes);
  mr::cuda::router_l2_apply(policy, dev.data(), static_cast<int>(dev.size()), dvalue.get(), ws.get(), bytes);
  CUDA_REQUIRE(cudaDeviceSynchronize());
  CHECK(same_bits(dvalue.to_host(), std::vector<double>{value}));
  for (std::size_t l = 0; l < sizes.size(); ++l) CHECK(same_bits(dgrad[l]->to_host(), grad[l]));
}

// ---------------------------------------------------------------- runtime routers

// runtime::cuda's neutral inputs: too little scratch is refused on the host,
// before any launch, naming both sizes (runs without a device).
TEST_CASE("runtime::cuda: too little neutral scratch is an error naming neutral_bytes") {
  namespace rt = moe_route::runtime;
  rt::router_config c;
  c.load_balance.coefficient = 0.1f;
  const float dummy = 0.0f;
  const mr::route_inputs<float> in{&dummy, 10, 8};
  const std::size_t needed = rt::cuda::neutral_bytes(c, in);
  CHECK(needed >= 2 * 256);  // at least the [N] rows and sequence ids
  CHECK_THROWS_WITH_AS(rt::cuda::detail::complete(c, in, nullptr, 0, cudaStream_t{}),
                       doctest::Contains("neutral_bytes"), mr::error);
  // A policy that is on still needs its real input.
  c.kl_to_base.coefficient = 0.1f;
  CHECK_THROWS_WITH_AS(rt::cuda::neutral_bytes(c, in), doctest::Contains("token_prior_row"), mr::error);
}

// The runtime calls on the device (src/cuda_runtime*.cu) take minutes of nvcc,
// so this part is compiled only with MOE_ROUTE_BUILD_CUDA_RUNTIME (the gpu preset).
#ifdef MOE_ROUTE_TEST_CUDA_RUNTIME
namespace {

namespace rt = moe_route::runtime;

// One configuration through runtime::route/backward and runtime::cuda::route/
// backward: identical indices, gates, penalty values and dL/dz. With `full`
// every training input is given; otherwise none is, and the configuration's
// policies must not need one, so the neutral scratch supplies them all.
void check_runtime_parity(const rt::router_config& c, int E, std::int64_t N, bool full, std::mt19937& g,
                          cudaStream_t stream) {
  CAPTURE(rt::name(c.gating));
  CAPTURE(static_cast<int>(c.selection));
  CAPTURE(static_cast<int>(c.prior));
  CAPTURE(E);
  CAPTURE(full);
  const int K = c.top_k;
  const std::size_t nk = static_cast<std::size_t>(N) * K, ne = static_cast<std::size_t>(N) * E;
  const auto z = make_logits<float>(g, N, E);
  const auto expert_bias = make_bias(g, E);
  const training_data d = make_training_data(g, N, E);
  const auto grad = make_grad(g, nk);
  const std::vector<float> upstream = {1.5f, 0.5f, 2.0f, 1.0f, 0.75f};
  const bool biased = rt::selection_uses_bias(c.selection);
  const std::size_t bytes = rt::workspace_bytes(c, N, E, full ? d.num_sequences : 1);

  mr::route_inputs<float> host_in{z.data(), N, E, biased ? expert_bias.data() : nullptr};
  if (full)
    host_in = training_inputs(z.data(), N, E, host_in.expert_bias, d.bias.data(), d.probs.data(), d.rows.data(),
                              d.sequences.data(), d.fractions.data(), d.ranks.data(), d);
  std::vector<std::int32_t> cpu_idx(nk);
  std::vector<float> cpu_gates(nk), cpu_dz(ne);
  std::vector<double> cpu_values(rt::num_penalties);
  std::vector<unsigned char> cpu_ws(bytes);
  mr::route_outputs ho{cpu_idx.data(), cpu_gates.data()};
  ho.penalty_values = cpu_values.data();
  ho.workspace = cpu_ws.data();
  ho.workspace_bytes = bytes;
  rt::route(c, host_in, ho);
  mr::backward_args hb{cpu_idx.data(), grad.data(), cpu_dz.data()};
  hb.workspace = cpu_ws.data();
  hb.workspace_bytes = bytes;
  hb.penalty_grads = upstream.data();
  rt::backward(c, host_in, hb);

  device_buffer<float> dz_in(z), debias(expert_bias), dbias(d.bias), dprobs(d.probs), dfrac(d.fractions), dgrad(grad);
  device_buffer<std::int32_t> drows(d.rows), dseq(d.sequences), dranks(d.ranks), didx(nk);
  device_buffer<float> dgates(nk), ddz(ne);
  device_buffer<double> dvalues(rt::num_penalties);
  device_buffer<unsigned char> dws(bytes);
  didx.poison();
  dgates.poison();
  ddz.poison();
  mr::route_inputs<float> dev_in{dz_in.get(), N, E, biased ? debias.get() : nullptr};
  if (full)
    dev_in = training_inputs(dz_in.get(), N, E, dev_in.expert_bias, dbias.get(), dprobs.get(), drows.get(), dseq.get(),
                             dfrac.get(), dranks.get(), d);
  const std::size_t scratch_bytes = rt::cuda::neutral_bytes(c, dev_in);
  CHECK((scratch_bytes == 0) == full);
  device_buffer<unsigned char> scratch(scratch_bytes);
  scratch.poison();
  mr::route_outputs o{didx.get(), dgates.get()};
  o.penalty_values = dvalues.get();
  o.workspace = dws.get();
  o.workspace_bytes = bytes;
  rt::cuda::route(c, dev_in, o, scratch.get(), scratch_bytes, stream);
  mr::backward_args b{didx.get(), dgrad.get(), ddz.get()};
  b.workspace = dws.get();
  b.workspace_bytes = bytes;
  const device_buffer<float> dupstream(upstream);  // device memory, as cuda::backward reads it
  b.penalty_grads = dupstream.get();
  scratch.poison();  // backward writes the neutral inputs again
  rt::cuda::backward(c, dev_in, b, scratch.get(), scratch_bytes, stream);
  CUDA_REQUIRE(cudaStreamSynchronize(stream));
  CHECK_MESSAGE(same_bits(didx.to_host(), cpu_idx), "indices differ");
  CHECK_MESSAGE(same_bits(dgates.to_host(), cpu_gates), "gates differ");
  CHECK_MESSAGE(same_bits(dvalues.to_host(), cpu_values), "penalty values differ");
  const auto gpu_dz = ddz.to_host();
  CHECK_MESSAGE(same_bits(gpu_dz, cpu_dz), "grad_logits differ first at " << first_difference(gpu_dz, cpu_dz));
}

// One admission configuration after a CPU routing: runtime::admit and
// runtime::cuda::admit give identical indices, gates and reports.
void check_runtime_admission(const rt::router_config& c, const rt::admission_config& a, int E, std::int64_t N,
                             std::mt19937& g, cudaStream_t stream) {
  CAPTURE(static_cast<int>(a.affinity));
  CAPTURE(static_cast<int>(a.overflow));
  CAPTURE(a.dropless);
  const int K = c.top_k, groups = 3;
  const std::size_t nk = static_cast<std::size_t>(N) * K;
  const auto z = make_logits<float>(g, N, E);
  std::vector<std::int32_t> idx(nk), group_ids(static_cast<std::size_t>(N));
  std::vector<float> gates(nk), hidden(static_cast<std::size_t>(N)), weights(static_cast<std::size_t>(E));
  mr::route_inputs<float> in{z.data(), N, E};
  in.mode = mr::mode::eval;
  std::vector<double> values(rt::num_penalties);
  mr::route_outputs routed{idx.data(), gates.data()};
  routed.penalty_values = values.data();
  rt::route(c, in, routed);
  std::uniform_real_distribution<float> norm(0.5f, 2.0f);
  for (auto& x : hidden) x = norm(g);
  for (auto& x : weights) x = norm(g);
  for (std::int64_t t = 0; t < N; ++t) group_ids[static_cast<std::size_t>(t)] = static_cast<std::int32_t>(t * groups / N);

  mr::admission_inputs<float> ain{z.data(), N, E, idx.data(), gates.data()};
  ain.hidden_norms = hidden.data();
  ain.weight_norms = weights.data();
  ain.group_ids = group_ids.data();
  ain.num_groups = groups;
  std::vector<std::int32_t> cpu_idx(nk);
  std::vector<float> cpu_gates(nk);
  mr::admission_report cpu_report;
  rt::admit(c, a, ain, mr::admission_outputs{cpu_idx.data(), cpu_gates.data(), nullptr, &cpu_report});

  device_buffer<float> dz(z), dgates_in(gates), dhidden(hidden), dweights(weights), dgates(nk);
  device_buffer<std::int32_t> didx_in(idx), dgroups(group_ids), didx(nk);
  device_buffer<mr::admission_report> dreport(1);
  mr::admission_inputs<float> dev{dz.get(), N, E, didx_in.get(), dgates_in.get()};
  dev.hidden_norms = dhidden.get();
  dev.weight_norms = dweights.get();
  dev.group_ids = dgroups.get();
  dev.num_groups = groups;
  const std::size_t bytes = rt::cuda::admit_workspace_bytes(c, a, N, E, groups);
  device_buffer<unsigned char> ws(bytes);
  rt::cuda::admit(c, a, dev, mr::admission_outputs{didx.get(), dgates.get(), nullptr, dreport.get()}, ws.get(), bytes,
                  stream);
  CUDA_REQUIRE(cudaStreamSynchronize(stream));
  CHECK_MESSAGE(same_bits(didx.to_host(), cpu_idx), "admitted indices differ");
  CHECK_MESSAGE(same_bits(dgates.to_host(), cpu_gates), "admitted gates differ");
  const mr::admission_report r = dreport.to_host()[0];
  CHECK(r.offered == cpu_report.offered);
  CHECK(r.kept == cpu_report.kept);
  CHECK(r.rerouted == cpu_report.rerouted);
  CHECK(r.dropped == cpu_report.dropped);
  CHECK(r.below_threshold == cpu_report.below_threshold);
  CHECK(r.over_capacity == cpu_report.over_capacity);
}

}  // namespace

GPU_TEST_CASE("runtime routers: runtime::cuda equals the CPU runtime calls bit for bit") {
  std::mt19937 g(2027);
  stream_guard stream;
  const rt::gating_kind gatings[] = {rt::gating_kind::softmax, rt::gating_kind::sigmoid, rt::gating_kind::sqrt_softplus,
                                     rt::gating_kind::softmax_after_topk};
  const rt::selection_kind selections[] = {rt::selection_kind::top_k, rt::selection_kind::expert_bias,
                                           rt::selection_kind::group_limited, rt::selection_kind::group_limited_bias,
                                           rt::selection_kind::group_limited_score, rt::selection_kind::fixed};
  for (const int E : {64, 37}) {
    for (const auto gating : gatings) {
      for (const auto selection : selections) {
        const bool grouped = rt::selection_is_grouped(selection);
        if (gating == rt::gating_kind::softmax_after_topk &&
            (rt::selection_uses_bias(selection) || selection == rt::selection_kind::group_limited_score))
          continue;
        if (grouped && E % 8 != 0) continue;
        for (const auto prior : {rt::prior_kind::none, rt::prior_kind::log_prior_bias, rt::prior_kind::prior_override}) {
          rt::router_config c;
          c.gating = gating;
          c.selection = selection;
          c.top_k = 4;
          c.normalize = gating != rt::gating_kind::softmax;
          c.groups = 8;
          c.top_groups = 4;
          c.prior = prior;
          c.prior_bias.beta = 0.7f;
          c.load_balance.coefficient = 0.3f;
          c.z_loss.coefficient = 0.01f;
          c.kl_to_base.coefficient = 0.2f;
          c.logit_l2.coefficient = 0.1f;
          c.locality.coefficient = 0.4f;
          check_runtime_parity(c, E, 333, true, g, stream.get());
        }
        rt::router_config plain;  // only policies that need no input: every training input is neutral scratch
        plain.gating = gating;
        plain.selection = selection;
        plain.top_k = 2;
        plain.groups = 8;
        plain.top_groups = 4;
        plain.load_balance.coefficient = 0.5f;
        plain.z_loss.coefficient = 0.02f;
        check_runtime_parity(plain, E, 1000, false, g, stream.get());
      }
    }
  }
}

GPU_TEST_CASE("runtime admission: runtime::cuda::admit equals runtime::admit bit for bit") {
  std::mt19937 g(2028);
  stream_guard stream;
  rt::router_config c;
  c.top_k = 4;
  std::vector<rt::admission_config> policies(1);  // dropless
  for (const auto affinity : {rt::affinity_kind::position, rt::affinity_kind::probability, rt::affinity_kind::logit,
                              rt::affinity_kind::cosine, rt::affinity_kind::gate}) {
    rt::admission_config a;
    a.dropless = false;
    a.affinity = affinity;
    a.capacity_factor = 1.1;
    if (affinity == rt::affinity_kind::cosine) a.threshold = 0.0f;
    policies.push_back(a);
    if (affinity != rt::affinity_kind::position && affinity != rt::affinity_kind::gate) {
      a.overflow = rt::overflow_kind::reroute;
      policies.push_back(a);
    }
  }
  for (const auto gating : {rt::gating_kind::softmax, rt::gating_kind::sigmoid}) {
    c.gating = gating;
    for (const auto& a : policies) check_runtime_admission(c, a, 64, 2000, g, stream.get());
  }
}
#endif  // MOE_ROUTE_TEST_CUDA_RUNTIME
