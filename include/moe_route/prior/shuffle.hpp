// moe_route: shuffled-prior controls (RPB section 5.2.2, App. E). docs/policies.md section 3.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <moe_route/detail/validate.hpp>
#include <moe_route/types.hpp>

namespace moe_route::prior {

namespace detail {

// SplitMix64: a fixed, documented generator, so a seed gives the same
// permutation with every compiler and standard library (std:: distributions
// are implementation-defined).
struct splitmix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, bound) without modulo bias (rejection of the short tail).
  std::uint64_t below(std::uint64_t bound) {
    const std::uint64_t limit = ~0ull - (~0ull % bound);
    std::uint64_t x;
    do x = next(); while (x >= limit);
    return x % bound;
  }
};

// Fisher-Yates over the listed positions: values at those positions are permuted among themselves.
inline void shuffle_positions(std::vector<int>& sigma, const std::vector<int>& positions, splitmix64& rng) {
  for (std::size_t i = positions.size(); i > 1; --i) {
    const std::size_t j = static_cast<std::size_t>(rng.below(i));
    std::swap(sigma[positions[i - 1]], sigma[positions[j]]);
  }
}

}  // namespace detail

// A permutation sigma of the E experts that moves experts only inside their
// community: communities[e] is expert e's label (any int; RPB uses the base
// router's Louvain communities of the layer). Seeded and reproducible.
inline std::vector<int> within_community_permutation(const int* communities, int num_experts, std::uint64_t seed) {
  if (num_experts < 1) moe_route::detail::fail("num_experts (= " + std::to_string(num_experts) + ") must be >= 1");
  if (communities == nullptr) moe_route::detail::fail("communities is null");
  std::vector<int> sigma(num_experts);
  for (int e = 0; e < num_experts; ++e) sigma[e] = e;
  detail::splitmix64 rng{seed};
  std::vector<bool> done(num_experts, false);
  for (int e = 0; e < num_experts; ++e) {  // communities in order of first appearance
    if (done[e]) continue;
    std::vector<int> members;
    for (int f = e; f < num_experts; ++f)
      if (communities[f] == communities[e]) {
        members.push_back(f);
        done[f] = true;
      }
    detail::shuffle_positions(sigma, members, rng);
  }
  return sigma;
}

// A uniformly random permutation of all E experts (the global-shuffle control).
inline std::vector<int> global_permutation(int num_experts, std::uint64_t seed) {
  if (num_experts < 1) moe_route::detail::fail("num_experts (= " + std::to_string(num_experts) + ") must be >= 1");
  std::vector<int> sigma(num_experts), all(num_experts);
  for (int e = 0; e < num_experts; ++e) sigma[e] = all[e] = e;
  detail::splitmix64 rng{seed};
  detail::shuffle_positions(sigma, all, rng);
  return sigma;
}

// shuffled[r, sigma(e)] = pi[r, e] for every row: expert e's prior mass moves to sigma(e).
inline void apply_permutation(const float* pi, std::int64_t rows, int num_experts, const std::vector<int>& sigma,
                              float* shuffled) {
  if (static_cast<int>(sigma.size()) != num_experts)
    moe_route::detail::fail("permutation size (= " + std::to_string(sigma.size()) + ") must equal num_experts (= " +
                            std::to_string(num_experts) + ")");
  std::vector<bool> seen(num_experts, false);
  for (int e = 0; e < num_experts; ++e) {
    if (sigma[e] < 0 || sigma[e] >= num_experts || seen[sigma[e]])
      moe_route::detail::fail("sigma is not a permutation of [0, num_experts)");
    seen[sigma[e]] = true;
  }
  if (rows > 0 && (pi == nullptr || shuffled == nullptr)) moe_route::detail::fail("prior or shuffled (output) is null");
  for (std::int64_t r = 0; r < rows; ++r)
    for (int e = 0; e < num_experts; ++e) shuffled[r * num_experts + sigma[e]] = pi[r * num_experts + e];
}

}  // namespace moe_route::prior
