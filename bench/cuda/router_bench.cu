// moe_route GPU benchmark: forward and backward of the CUDA backend, timed with
// CUDA events (warm-up, then the median of repeated timings), reported in
// microseconds per call and as a fraction of the device-to-device copy
// bandwidth measured in the same process.
//
//   effective bandwidth = bytes read + bytes written per call / time per call
//   forward bytes  = logits (N*E*sizeof(T)) + indices and gates (N*K*8)
//   backward bytes = logits read (row_softmax: N*E*sizeof(T); else N*K*sizeof(T))
//                    + indices and dL/dgates (N*K*8) + dL/dz written (N*E*4)
//   copy bandwidth = 2 * bytes / time of cudaMemcpyAsync (device to device)
//
// Usage: moe_route_gpu_bench [repeats]   (default 21 timings of 10 calls each)
#include <moe_route/moe_route.cuh>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace mr = moe_route;

namespace {

#define BENCH_CHECK(call)                                                                        \
  do {                                                                                           \
    const cudaError_t status_ = (call);                                                          \
    if (status_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(status_));               \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

int g_repeats = 21;
constexpr int calls_per_timing = 10;
constexpr int warmup_calls = 5;

// Median over g_repeats timings of calls_per_timing calls, in microseconds per call.
template <class F>
double median_us(cudaStream_t stream, F&& call) {
  cudaEvent_t start, stop;
  BENCH_CHECK(cudaEventCreate(&start));
  BENCH_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < warmup_calls; ++i) call();
  BENCH_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> times;
  for (int rep = 0; rep < g_repeats; ++rep) {
    BENCH_CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < calls_per_timing; ++i) call();
    BENCH_CHECK(cudaEventRecord(stop, stream));
    BENCH_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    BENCH_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(1000.0 * ms / calls_per_timing);
  }
  BENCH_CHECK(cudaEventDestroy(start));
  BENCH_CHECK(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Device-to-device copy bandwidth in bytes per second (read + write).
double copy_bandwidth(cudaStream_t stream) {
  const std::size_t bytes = std::size_t{512} << 20;
  void *src = nullptr, *dst = nullptr;
  BENCH_CHECK(cudaMalloc(&src, bytes));
  BENCH_CHECK(cudaMalloc(&dst, bytes));
  BENCH_CHECK(cudaMemsetAsync(src, 1, bytes, stream));
  const double us = median_us(stream, [&] { BENCH_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream)); });
  BENCH_CHECK(cudaFree(src));
  BENCH_CHECK(cudaFree(dst));
  return 2.0 * static_cast<double>(bytes) / (us * 1e-6);
}

__host__ __device__ inline float hashed(std::int64_t i) {
  std::uint64_t x = static_cast<std::uint64_t>(i) * 0x9e3779b97f4a7c15ull;
  x ^= x >> 29;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 32;
  return static_cast<float>(static_cast<int>(x & 0xffffu) - 32768) / 8192.0f;  // [-4, 4)
}

__device__ inline void store(float* p, float x) { *p = x; }
__device__ inline void store(mr::bfloat16* p, float x) { *p = mr::bfloat16{__bfloat16_as_ushort(__float2bfloat16_rn(x))}; }

template <class T>
static __global__ void fill(T* p, std::int64_t n, float scale) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    store(p + i, scale * hashed(i));
}

template <class T>
const char* dtype_name() {
  return sizeof(T) == 4 ? "fp32" : "bf16";
}

struct device_memory {
  void* p = nullptr;
  explicit device_memory(std::size_t bytes) { BENCH_CHECK(cudaMalloc(&p, bytes)); }
  ~device_memory() { cudaFree(p); }
  device_memory(const device_memory&) = delete;
  device_memory& operator=(const device_memory&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

template <class Router, class T>
void run(const char* name, const Router& r, std::int64_t N, int E, double copy_bw, cudaStream_t stream) {
  const int K = r.top_k;
  const std::size_t ne = static_cast<std::size_t>(N) * E, nk = static_cast<std::size_t>(N) * K;
  device_memory z(ne * sizeof(T)), bias(E * sizeof(float)), idx(nk * sizeof(std::int32_t)), gates(nk * sizeof(float)),
      dgates(nk * sizeof(float)), dz(ne * sizeof(float));
  fill<T><<<1024, 256, 0, stream>>>(z.as<T>(), static_cast<std::int64_t>(ne), 1.0f);
  fill<float><<<64, 256, 0, stream>>>(bias.as<float>(), E, 0.01f);
  fill<float><<<1024, 256, 0, stream>>>(dgates.as<float>(), static_cast<std::int64_t>(nk), 0.25f);
  BENCH_CHECK(cudaGetLastError());
  const mr::route_inputs<T> in{z.as<T>(), N, E, bias.as<float>()};
  const mr::route_outputs out{idx.as<std::int32_t>(), gates.as<float>()};
  const mr::backward_args args{idx.as<std::int32_t>(), dgates.as<float>(), dz.as<float>()};

  const double fwd = median_us(stream, [&] { mr::cuda::route(r, in, out, stream); });
  const double bwd = median_us(stream, [&] { mr::cuda::backward(r, in, args, stream); });

  const bool row_read = Router::gating_type::shape == mr::gating::kind::row_softmax;
  const double fwd_bytes = static_cast<double>(ne * sizeof(T) + nk * 8);
  const double bwd_bytes =
      static_cast<double>((row_read ? ne * sizeof(T) : nk * sizeof(T)) + nk * 8 + ne * sizeof(float));
  const double fwd_bw = fwd_bytes / (fwd * 1e-6), bwd_bw = bwd_bytes / (bwd * 1e-6);
  std::printf("%-22s %-5s %8lld %5d %3d | %9.2f %8.1f %6.2f | %9.2f %8.1f %6.2f\n", name, dtype_name<T>(),
              static_cast<long long>(N), E, K, fwd, fwd_bw * 1e-9, fwd_bw / copy_bw, bwd, bwd_bw * 1e-9,
              bwd_bw / copy_bw);
}

template <class T>
void run_all(double copy_bw, cudaStream_t stream) {
  for (std::int64_t N : {std::int64_t{16384}, std::int64_t{262144}}) {
    for (const auto& ek : {std::pair<int, int>{256, 8}, std::pair<int, int>{64, 6}}) {
      auto v3 = mr::presets::deepseek_v3();  // sigmoid, group-limited expert bias (8 groups, top 4)
      v3.top_k = ek.second;
      run<mr::presets::deepseek_v3_router, T>("deepseek_v3", v3, N, ek.first, copy_bw, stream);
      mr::router<mr::gating::softmax, mr::selection::top_k, 8> softmax_topk;
      softmax_topk.top_k = ek.second;
      run<decltype(softmax_topk), T>("softmax top_k", softmax_topk, N, ek.first, copy_bw, stream);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: GPU benchmark skipped\n");
    return 0;
  }
  if (argc > 1) g_repeats = std::max(1, std::atoi(argv[1]));
  cudaDeviceProp prop{};
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreate(&stream));
  const double copy_bw = copy_bandwidth(stream);
  std::printf("moe_route GPU benchmark: %s (sm_%d%d), device copy bandwidth %.1f GB/s (read + write)\n", prop.name,
              prop.major, prop.minor, copy_bw * 1e-9);
  std::printf("median of %d timings x %d calls; GB/s = bytes read + written per call / time; frac = GB/s / copy\n",
              g_repeats, calls_per_timing);
  std::printf("%-22s %-5s %8s %5s %3s | %9s %8s %6s | %9s %8s %6s\n", "router", "dtype", "N", "E", "K", "fwd us",
              "GB/s", "frac", "bwd us", "GB/s", "frac");
  run_all<float>(copy_bw, stream);
  run_all<mr::bfloat16>(copy_bw, stream);
  BENCH_CHECK(cudaStreamDestroy(stream));
  return 0;
}
