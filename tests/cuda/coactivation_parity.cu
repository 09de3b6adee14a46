// GPU parity of cuda::coactivation_counts against the host analysis::coactivation
// (exact integer counts). One CUDA translation unit; without a CUDA device the
// test case is skipped (doctest skip) and the executable exits 0.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <moe_route/analysis/coactivation.hpp>
#include <moe_route/backend/cuda/coactivation.cuh>

#include <cstdint>
#include <random>
#include <vector>

namespace {

bool has_device() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  cudaGetLastError();
  return ok;
}

}  // namespace

TEST_CASE("cuda::coactivation_counts equals analysis::coactivation" * doctest::skip(!has_device())) {
  struct shape {
    std::int64_t n;
    int k, e;
  };
  for (const shape s : {shape{0, 2, 4}, shape{1, 1, 3}, shape{5000, 6, 64}, shape{100000, 8, 256}}) {
    const std::int64_t n = s.n;
    const int k = s.k, e = s.e;
    CAPTURE(n);
    CAPTURE(k);
    CAPTURE(e);
    std::mt19937 gen(static_cast<unsigned>(n + k + e));
    std::vector<std::int32_t> idx(static_cast<std::size_t>(n) * k);
    for (std::int64_t t = 0; t < n; ++t) {
      std::vector<int> pool(e);
      for (int x = 0; x < e; ++x) pool[x] = x;
      for (int j = 0; j < k; ++j) {
        std::swap(pool[j], pool[j + gen() % (e - j)]);
        idx[t * k + j] = (gen() % 17 == 0) ? -1 : pool[j];  // some dropped slots
      }
    }
    const auto host = moe_route::analysis::coactivation(idx.data(), n, k, e);
    std::int32_t* d_idx = nullptr;
    unsigned long long* d_counts = nullptr;
    REQUIRE(cudaMalloc(&d_idx, idx.size() * sizeof(std::int32_t) + 4) == cudaSuccess);
    REQUIRE(cudaMalloc(&d_counts, static_cast<std::size_t>(e) * e * sizeof(unsigned long long)) == cudaSuccess);
    if (!idx.empty()) REQUIRE(cudaMemcpy(d_idx, idx.data(), idx.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice) == cudaSuccess);
    for (int run = 0; run < 2; ++run) {  // run-to-run identical
      moe_route::cuda::coactivation_counts(d_idx, n, k, e, d_counts, nullptr);
      std::vector<unsigned long long> dev(static_cast<std::size_t>(e) * e);
      REQUIRE(cudaMemcpy(dev.data(), d_counts, dev.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost) == cudaSuccess);
      bool equal = true;
      for (std::size_t i = 0; i < dev.size(); ++i) equal = equal && dev[i] == static_cast<unsigned long long>(host.counts[i]);
      CHECK(equal);
    }
    cudaFree(d_idx);
    cudaFree(d_counts);
  }
  CHECK_THROWS_AS(moe_route::cuda::coactivation_counts(nullptr, 1, 2, 4, nullptr), moe_route::error);
}
