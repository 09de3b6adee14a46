// moe_route: the CPU backend. Deterministic: the same inputs give the same bits
// for any thread count, and the same bits as the CUDA backend, because every
// row reduction runs in the canonical 32-lane order and every score comes from
// the shared bit-reproducible math in detail/numerics.hpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "../../admission/gates.hpp"
#include "../../admission/scores.hpp"
#include "../../config.hpp"
#include "../../detail/numerics.hpp"
#include "../../router.hpp"
#include "../../types.hpp"
#include "../../validate.hpp"
#include "training.hpp"

// GCC 12 warns (-W[maybe-]uninitialized) inside its own AVX-512 intrinsics
// when they are inlined (GCC bug 105593: the intrinsics' placeholder
// operands), so these warnings are off for this backend in AVX-512 builds.
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace moe_route::cpu {

// How a CPU call runs. threads == 1 is the sequential reference path; more
// threads split the tokens into contiguous blocks and give identical results.
// threads <= 0 uses std::thread::hardware_concurrency().
struct execution {
  int threads = 1;
};

namespace detail {

using moe_route::detail::float_max;

// Per-worker row buffers, sized for the general path (E <= 4096).
struct row_scratch {
  float v[max_experts];               // sanitised logits
  float t[max_experts];               // softmax terms exp(v - max), or scores
  std::uint64_t keys[max_experts];    // packed selection keys
  std::uint32_t order[max_experts];   // order-preserving images of the keys
  std::uint64_t candidates[max_experts];           // packed keys that can be among the top K
  std::int32_t candidate_experts[max_experts + 16];  // their experts (+16: vector stores)
  float biased[max_experts];          // z + beta b of a token under log_prior_bias
  penalty_scratch penalties;          // the penalties' row buffers
};

// Sum of x[0..n) in the canonical order a CUDA warp uses (see numerics.hpp).
inline float lane_sum(const float* x, int n) {
#if defined(__AVX512F__)
  // The same additions in the same pairs: lanes 0-15 and 16-31 are two
  // vectors, a partial last block adds into its first lanes only, and the
  // butterfly halves the vector five times. Plain adds: nothing to contract.
  __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
  int base = 0;
  for (; base + 32 <= n; base += 32) {
    lo = _mm512_add_ps(lo, _mm512_loadu_ps(x + base));
    hi = _mm512_add_ps(hi, _mm512_loadu_ps(x + base + 16));
  }
  const int rest = n - base;
  if (rest > 0) {
    const __mmask16 first = static_cast<__mmask16>(rest >= 16 ? 0xffffu : (1u << rest) - 1u);
    const __mmask16 second = static_cast<__mmask16>(rest <= 16 ? 0u : (1u << (rest - 16)) - 1u);
    lo = _mm512_mask_add_ps(lo, first, lo, _mm512_maskz_loadu_ps(first, x + base));
    hi = _mm512_mask_add_ps(hi, second, hi, _mm512_maskz_loadu_ps(second, x + base + 16));
  }
  const __m512 s16 = _mm512_add_ps(lo, hi);
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(s16),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s16), 1)));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  const __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
#elif defined(__AVX2__)
  // Lanes 0-7, 8-15, 16-23, 24-31 in four vectors. A partial last block adds
  // zeros to the lanes it does not reach: a lane starts at +0 and can never
  // become -0, so adding +0 leaves it bit-identical.
  __m256 l0 = _mm256_setzero_ps(), l1 = l0, l2 = l0, l3 = l0;
  int base = 0;
  for (; base + 32 <= n; base += 32) {
    l0 = _mm256_add_ps(l0, _mm256_loadu_ps(x + base));
    l1 = _mm256_add_ps(l1, _mm256_loadu_ps(x + base + 8));
    l2 = _mm256_add_ps(l2, _mm256_loadu_ps(x + base + 16));
    l3 = _mm256_add_ps(l3, _mm256_loadu_ps(x + base + 24));
  }
  if (base < n) {
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int rest = n - base;
    const auto part = [&](int offset) {  // lanes offset.. offset+7 that the block reaches
      const __m256i in = _mm256_cmpgt_epi32(_mm256_set1_epi32(rest - offset), iota);
      return _mm256_maskload_ps(x + base + offset, in);
    };
    l0 = _mm256_add_ps(l0, part(0));
    if (rest > 8) l1 = _mm256_add_ps(l1, part(8));
    if (rest > 16) l2 = _mm256_add_ps(l2, part(16));
    if (rest > 24) l3 = _mm256_add_ps(l3, part(24));
  }
  const __m256 s8 = _mm256_add_ps(_mm256_add_ps(l0, l2), _mm256_add_ps(l1, l3));  // offsets 16, then 8
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  const __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
#else
  float lanes[moe_route::detail::reduction_lanes] = {};
  int base = 0;
  for (; base + 32 <= n; base += 32)
    for (int l = 0; l < 32; ++l) lanes[l] += x[base + l];
  for (int l = 0; base + l < n; ++l) lanes[l] += x[base + l];
  for (int offset = 16; offset > 0; offset >>= 1)
    for (int l = 0; l < offset; ++l) lanes[l] = lanes[l] + lanes[l + offset];
  return lanes[0];
#endif
}

// The row maximum, starting from -FLT_MAX so that a row of NaNs (all -inf)
// keeps a finite maximum. The values are never NaN, so the maximum is the
// same in any order (up to the sign of a zero maximum, which cannot change
// exp(v - max)), and it is taken 16 lanes at a time.
inline float row_max(const float* v, int n) {
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(-float_max);
  int e = 0;
  for (; e + 16 <= n; e += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(v + e));
  if (e < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - e)) - 1u);
    mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, v + e));
  }
  __m256 h = _mm256_max_ps(_mm512_castps512_ps256(mv),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(mv), 1)));
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  q = _mm_max_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
#elif defined(__AVX2__)
  __m256 a = _mm256_set1_ps(-float_max), b = a;
  int e = 0;
  for (; e + 16 <= n; e += 16) {
    a = _mm256_max_ps(a, _mm256_loadu_ps(v + e));
    b = _mm256_max_ps(b, _mm256_loadu_ps(v + e + 8));
  }
  for (; e + 8 <= n; e += 8) a = _mm256_max_ps(a, _mm256_loadu_ps(v + e));
  a = _mm256_max_ps(a, b);
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  q = _mm_max_ss(q, _mm_movehdup_ps(q));
  float r = _mm_cvtss_f32(q);
  for (; e < n; ++e) r = moe_route::detail::max(r, v[e]);
  return r;
#else
  constexpr int lanes = 16;
  float m[lanes];
  for (int l = 0; l < lanes; ++l) m[l] = -float_max;
  int base = 0;
  for (; base + lanes <= n; base += lanes)
    for (int l = 0; l < lanes; ++l) m[l] = moe_route::detail::max(m[l], v[base + l]);
  for (int l = 0; base + l < n; ++l) m[l] = moe_route::detail::max(m[l], v[base + l]);
  float r = m[0];
  for (int l = 1; l < lanes; ++l) r = moe_route::detail::max(r, m[l]);
  return r;
#endif
}

// Whether any of x[0..n) is NaN or +-inf, in a form the compiler vectorises.
inline bool any_nonfinite(const float* x, int n) {
  int bad = 0;
  for (int e = 0; e < n; ++e) bad |= !moe_route::detail::is_finite(x[e]);
  return bad != 0;
}

// Insert a packed key into best[0..k), kept in descending order.
inline void insert_top(std::uint64_t* best, int k, std::uint64_t key) {
  if (key <= best[k - 1]) return;
  int j = k - 1;
  for (; j > 0 && best[j - 1] < key; --j) best[j] = best[j - 1];
  best[j] = key;
}

// The largest k packed keys of keys[0..n), descending.
inline void top_keys(const std::uint64_t* keys, int n, int k, std::uint64_t* best) {
  for (int j = 0; j < k; ++j) best[j] = 0;
  for (int e = 0; e < n; ++e) insert_top(best, k, keys[e]);
}

// The order-preserving 32-bit image of a selection key: the upper half of its
// packed key (pack_key orders by this, then by the lower expert index).
inline std::uint32_t ordered_key(float key) {
  return static_cast<std::uint32_t>(moe_route::detail::pack_key(key, 0) >> 32);
}

inline std::uint64_t packed_key(const std::uint32_t* order, int e) {
  return (static_cast<std::uint64_t>(order[e]) << 32) | (0xffffffffu - static_cast<std::uint32_t>(e));
}

inline int popcount16(unsigned m) {
#if defined(__GNUC__) || defined(__clang__)
  return __builtin_popcount(m);
#else
  int c = 0;
  for (; m != 0; m &= m - 1) ++c;
  return c;
#endif
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// For each 8-bit mask, the positions of its set bits packed into bytes.
struct compress_table {
  std::uint64_t positions[256];
};
constexpr compress_table make_compress_table() {
  compress_table t{};
  for (int m = 0; m < 256; ++m) {
    int c = 0;
    for (int b = 0; b < 8; ++b)
      if ((m >> b) & 1) t.positions[m] |= static_cast<std::uint64_t>(b) << (8 * c++);
  }
  return t;
}
inline constexpr compress_table compress_positions = make_compress_table();
#endif

// The experts e with order[e] >= threshold, ascending, into out (room for
// n + 16 entries); returns their number.
inline int compact_at_least(const std::uint32_t* order, int n, std::uint32_t threshold, std::int32_t* out) {
  int count = 0, e = 0;
#if defined(__AVX512F__)
  const __m512i bound = _mm512_set1_epi32(static_cast<int>(threshold));
  const __m512i step = _mm512_set1_epi32(16);
  __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; e + 16 <= n; e += 16) {
    const __mmask16 m = _mm512_cmpge_epu32_mask(_mm512_loadu_si512(order + e), bound);
    _mm512_storeu_si512(out + count, _mm512_maskz_compress_epi32(m, index));
    count += popcount16(m);
    index = _mm512_add_epi32(index, step);
  }
#elif defined(__AVX2__)
  const __m256i bound = _mm256_set1_epi32(static_cast<int>(threshold));
  for (; e + 8 <= n; e += 8) {
    const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(order + e));
    const __m256i at_least = _mm256_cmpeq_epi32(_mm256_max_epu32(o, bound), o);  // unsigned o >= bound
    const unsigned m = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(at_least)));
    const __m256i picked = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(compress_positions.positions[m])));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + count), _mm256_add_epi32(picked, _mm256_set1_epi32(e)));
    count += popcount16(m);
  }
#endif
  for (; e < n; ++e) {  // branch-free
    out[count] = e;
    count += order[e] >= threshold ? 1 : 0;
  }
  return count;
}

// A lower bound of the k-th largest of order[0..n) (n >= 2 Lanes, k <= Lanes):
// the k-th largest maximum of Lanes interleaved lanes, since k distinct keys
// reach it. 0 when fewer than k lanes hold a nonzero key.
template <int Lanes>
std::uint32_t lane_bound(const std::uint32_t* order, int n, int k) {
#if defined(__AVX512F__)
  if constexpr (Lanes == 16) {
    __m512i m = _mm512_setzero_si512();
    int e = 0;
    for (; e + 16 <= n; e += 16) m = _mm512_max_epu32(m, _mm512_loadu_si512(order + e));
    if (e < n) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (n - e)) - 1u);
      m = _mm512_max_epu32(m, _mm512_maskz_loadu_epi32(tail, order + e));
    }
    // rank of lane i = the lanes j with m[j] > m[i], over the 15 rotations.
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i fifteen = _mm512_set1_epi32(15), one = _mm512_set1_epi32(1);
    __m512i rank = _mm512_setzero_si512();
    for (int j = 1; j < 16; ++j) {
      const __m512i rotated = _mm512_permutexvar_epi32(_mm512_and_si512(_mm512_add_epi32(iota, _mm512_set1_epi32(j)), fifteen), m);
      rank = _mm512_mask_add_epi32(rank, _mm512_cmpgt_epu32_mask(rotated, m), rank, one);
    }
    const __mmask16 top = _mm512_cmplt_epi32_mask(rank, _mm512_set1_epi32(k));
    const __m512i kept = _mm512_mask_blend_epi32(top, _mm512_set1_epi32(-1), m);
    __m256i h = _mm256_min_epu32(_mm512_castsi512_si256(kept), _mm512_extracti64x4_epi64(kept, 1));
    __m128i q = _mm_min_epu32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    q = _mm_min_epu32(q, _mm_shuffle_epi32(q, 0x4e));
    q = _mm_min_epu32(q, _mm_shuffle_epi32(q, 0xb1));
    return static_cast<std::uint32_t>(_mm_cvtsi128_si32(q));
  }
#elif defined(__AVX2__)
  if constexpr (Lanes == 16) {
    __m256i a = _mm256_setzero_si256(), b = a;  // lanes 0-7 and 8-15
    int e = 0;
    for (; e + 16 <= n; e += 16) {
      a = _mm256_max_epu32(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(order + e)));
      b = _mm256_max_epu32(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(order + e + 8)));
    }
    if (e < n) {  // zeros (the identity of the maximum) beyond the row
      const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const int rest = n - e;
      const __m256i in0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(rest), iota);
      const __m256i in1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(rest - 8), iota);
      a = _mm256_max_epu32(a, _mm256_maskload_epi32(reinterpret_cast<const int*>(order + e), in0));
      b = _mm256_max_epu32(b, _mm256_maskload_epi32(reinterpret_cast<const int*>(order + e + 8), in1));
    }
    alignas(32) std::uint32_t m[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(m), a);
    _mm256_store_si256(reinterpret_cast<__m256i*>(m + 8), b);
    const __m256i flip = _mm256_set1_epi32(static_cast<int>(0x80000000u));  // unsigned order as signed
    const __m256i as = _mm256_xor_si256(a, flip), bs = _mm256_xor_si256(b, flip);
    std::uint32_t bound = ~std::uint32_t{0};  // the smallest lane maximum of rank < k
    for (int i = 0; i < 16; ++i) {
      const __m256i mi = _mm256_set1_epi32(static_cast<int>(m[i] ^ 0x80000000u));
      const int rank =
          popcount16(static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(as, mi))))) +
          popcount16(static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(bs, mi)))));
      bound = rank < k ? std::min(bound, m[i]) : bound;
    }
    return bound;
  }
#endif
  std::uint32_t m[Lanes] = {};
  int base = 0;
  for (; base + Lanes <= n; base += Lanes)
    for (int l = 0; l < Lanes; ++l) m[l] = std::max(m[l], order[base + l]);
  for (int l = 0; base + l < n; ++l) m[l] = std::max(m[l], order[base + l]);
  std::uint32_t bound = ~std::uint32_t{0};  // the smallest lane maximum of rank < k
  for (int i = 0; i < Lanes; ++i) {
    int rank = 0;
    for (int j = 0; j < Lanes; ++j) rank += m[j] > m[i] ? 1 : 0;
    bound = rank < k ? std::min(bound, m[i]) : bound;
  }
  return bound;
}

// The k largest packed keys (order[e], then the lower e), descending: the
// result of top_keys over every packed key, found by ranking only the few
// keys at or above a lane bound. `keys` holds the packed keys when some are
// masked to 0 (group-limited selection; their order is 0 too), else nullptr.
inline void select_top(const std::uint32_t* order, const std::uint64_t* keys, int n, int k, std::uint64_t* best,
                       row_scratch& s) {
  constexpr int small = 16, large = 32, max_ranked = 64;
  std::uint32_t bound = 0;
  if (k <= small && n >= 2 * small)
    bound = lane_bound<small>(order, n, k);
  else if (n >= 2 * large)
    bound = lane_bound<large>(order, n, k);
  if (bound == 0) {  // short rows, or fewer than k lanes with a key
    if (keys == nullptr) {
      for (int e = 0; e < n; ++e) s.keys[e] = packed_key(order, e);
      keys = s.keys;
    }
    top_keys(keys, n, k, best);
    return;
  }
  // Candidates have order >= bound > 0: never masked, packed key = packed_key().
  const int count = compact_at_least(order, n, bound, s.candidate_experts);
  std::uint64_t* candidates = s.candidates;
  for (int i = 0; i < count; ++i) candidates[i] = packed_key(order, s.candidate_experts[i]);
  if (count > max_ranked) {
    top_keys(candidates, count, k, best);
    return;
  }
  // Rank the (unique) candidates against each other, branch-free.
  std::uint64_t slots[max_top_k + 1];
#if defined(__AVX512F__)
  if (count <= 16) {
    const __mmask8 lo = static_cast<__mmask8>(count >= 8 ? 0xffu : (1u << count) - 1u);
    const __mmask8 hi = static_cast<__mmask8>(count >= 16 ? 0xffu : count <= 8 ? 0u : (1u << (count - 8)) - 1u);
    const __m512i c0 = _mm512_maskz_loadu_epi64(lo, candidates);  // absent lanes are 0, below every key
    const __m512i c1 = _mm512_maskz_loadu_epi64(hi, candidates + 8);
    for (int i = 0; i < count; ++i) {
      const __m512i ci = _mm512_set1_epi64(static_cast<long long>(candidates[i]));
      const int rank = popcount16(_mm512_cmpgt_epu64_mask(c0, ci)) + popcount16(_mm512_cmpgt_epu64_mask(c1, ci));
      slots[rank < k ? rank : k] = candidates[i];
    }
    for (int j = 0; j < k; ++j) best[j] = slots[j];
    return;
  }
#elif defined(__AVX2__)
  if (count <= 16) {
    const __m256i flip = _mm256_set1_epi64x(static_cast<long long>(0x8000000000000000ull));  // unsigned as signed
    const __m256i iota = _mm256_setr_epi64x(0, 1, 2, 3);
    __m256i c[4];  // absent lanes load 0, which flips to the smallest value
    for (int q = 0; q < 4; ++q) {
      const __m256i in = _mm256_cmpgt_epi64(_mm256_set1_epi64x(count - 4 * q), iota);
      c[q] = _mm256_xor_si256(_mm256_maskload_epi64(reinterpret_cast<const long long*>(candidates + 4 * q), in), flip);
    }
    for (int i = 0; i < count; ++i) {
      const __m256i ci = _mm256_set1_epi64x(static_cast<long long>(candidates[i] ^ 0x8000000000000000ull));
      int rank = 0;
      for (int q = 0; q < 4; ++q)
        rank += popcount16(static_cast<unsigned>(_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(c[q], ci)))));
      slots[rank < k ? rank : k] = candidates[i];
    }
    for (int j = 0; j < k; ++j) best[j] = slots[j];
    return;
  }
#endif
  for (int i = 0; i < count; ++i) {
    int rank = 0;
    for (int j = 0; j < count; ++j) rank += candidates[j] > candidates[i] ? 1 : 0;
    slots[rank < k ? rank : k] = candidates[i];
  }
  for (int j = 0; j < k; ++j) best[j] = slots[j];
}

// Group-limited selection: zero the keys of every expert outside the
// top_groups best groups (group score = sum of its per_group_k best keys,
// added in descending order).
template <class Grouped>
void mask_groups(const Grouped& g, std::uint64_t* keys, int num_experts) {
  const int size = num_experts / g.groups;
  std::uint64_t group_keys[moe_route::detail::reduction_lanes];
  std::uint64_t best[max_experts];
  for (int grp = 0; grp < g.groups; ++grp) {
    top_keys(keys + grp * size, size, g.per_group_k, best);
    float score = 0.0f;
    for (int j = 0; j < g.per_group_k; ++j) score += moe_route::detail::packed_value(best[j]);
    group_keys[grp] = moe_route::detail::pack_key(score, grp);
  }
  std::uint64_t kept[moe_route::detail::reduction_lanes];
  top_keys(group_keys, g.groups, g.top_groups, kept);
  bool keep[moe_route::detail::reduction_lanes] = {};
  for (int j = 0; j < g.top_groups; ++j) keep[moe_route::detail::packed_expert(kept[j])] = true;
  for (int e = 0; e < num_experts; ++e)
    if (!keep[e / size]) keys[e] = 0;
}

// The sanitised logits of one row and whether the row held NaN or +-inf.
// Sanitising changes only non-finite values, so a finite fp32 row is used in
// place; other rows are converted (and sanitised if needed) into buf.
template <class T>
const float* load_row(const T* z, int num_experts, float* buf, bool& nonfinite) {
  const float* v;
  if constexpr (std::is_same_v<T, float>) {
    v = z;
  } else {
    for (int e = 0; e < num_experts; ++e) buf[e] = moe_route::detail::to_float(z[e]);
    v = buf;
  }
  nonfinite = any_nonfinite(v, num_experts);
  if (nonfinite) {
    for (int e = 0; e < num_experts; ++e) buf[e] = moe_route::detail::sanitize(v[e]);
    v = buf;
  }
  return v;
}

// Row state shared by forward and backward: sanitised logits, and for
// row_softmax the terms and their canonical sum.
template <class Router, class T>
struct row_state {
  using G = typename Router::gating_type;
  row_scratch& s;
  const float* v;  // sanitised logits
  int num_experts;
  float sum = 0.0f;
  bool nonfinite = false;

  row_state(row_scratch& scratch, const T* z, int e_count) : s(scratch), num_experts(e_count) {
    v = load_row(z, num_experts, s.v, nonfinite);
    if constexpr (G::shape == gating::kind::row_softmax) {
      const float m = row_max(v, num_experts);
      for (int e = 0; e < num_experts; ++e) s.t[e] = G::term(v[e], m);
      sum = lane_sum(s.t, num_experts);
    }
  }

  // The gating score of expert e (the logit itself for selected_softmax).
  float score(int e) const {
    if constexpr (G::shape == gating::kind::row_softmax)
      return sum > 0.0f ? moe_route::detail::div(s.t[e], sum) : 0.0f;
    else if constexpr (G::shape == gating::kind::elementwise)
      return G::score(v[e]);
    else
      return v[e];
  }
};

template <class Router, class T>
bool route_row(const Router& r, const T* z, int num_experts, std::int64_t token, const float* bias,
               row_scratch& scratch, std::int32_t* indices, float* gates) {
  using G = typename Router::gating_type;
  using S = typename Router::selection_type;
  const int k = r.top_k;
  row_state<Router, T> row(scratch, z, num_experts);
  const float* v = row.v;

  int chosen[Router::max_k];
  float selected[Router::max_k] = {};  // zeroed: silences a GCC -Wmaybe-uninitialized false positive
  if constexpr (S::shape == selection::kind::fixed) {
    for (int j = 0; j < k; ++j) chosen[j] = S::expert(token, j, k, num_experts);
    for (int j = 0; j < k; ++j) selected[j] = row.score(chosen[j]);
  } else {
    const float neg_inf = -moe_route::detail::infinity();
    std::uint32_t* order = scratch.order;
    if constexpr (!S::needs_scores && !S::needs_expert_bias) {
      // Keys from the logits alone (top_k: the logit, -inf for a NaN logit).
      for (int e = 0; e < num_experts; ++e)
        order[e] = ordered_key(v[e] != neg_inf ? S::key(v[e], 0.0f, 0.0f) : neg_inf);
    } else {
      // Scores of every expert first (kept for the gates), then the keys; a
      // NaN logit (v = -inf) ranks below every number whatever its key.
      float* scores = scratch.t;
      if constexpr (G::shape == gating::kind::row_softmax) {
        if (row.sum > 0.0f)
          for (int e = 0; e < num_experts; ++e) scores[e] = moe_route::detail::div(scratch.t[e], row.sum);
        else
          for (int e = 0; e < num_experts; ++e) scores[e] = 0.0f;
      } else if constexpr (G::shape == gating::kind::elementwise) {
        for (int e = 0; e < num_experts; ++e) scores[e] = G::score(v[e]);
      } else {
        for (int e = 0; e < num_experts; ++e) scores[e] = 0.0f;
      }
      for (int e = 0; e < num_experts; ++e) {
        const float sc = S::needs_scores ? scores[e] : 0.0f;
        const float b = S::needs_expert_bias ? bias[e] : 0.0f;
        const float key = S::key(v[e], sc, b);
        order[e] = ordered_key(v[e] != neg_inf ? key : neg_inf);
      }
    }
    std::uint64_t best[Router::max_k];
    if constexpr (S::shape == selection::kind::grouped) {
      std::uint64_t* keys = scratch.keys;
      for (int e = 0; e < num_experts; ++e) keys[e] = packed_key(order, e);
      mask_groups(r.selection, keys, num_experts);
      for (int e = 0; e < num_experts; ++e) order[e] = static_cast<std::uint32_t>(keys[e] >> 32);
      select_top(order, keys, num_experts, k, best, scratch);
    } else {
      select_top(order, nullptr, num_experts, k, best, scratch);
    }
    for (int j = 0; j < k; ++j) chosen[j] = moe_route::detail::packed_expert(best[j]);
    if constexpr (S::needs_scores || S::needs_expert_bias) {
      if constexpr (G::shape != gating::kind::selected_softmax) {
        for (int j = 0; j < k; ++j) selected[j] = scratch.t[chosen[j]];
      } else {
        for (int j = 0; j < k; ++j) selected[j] = row.score(chosen[j]);
      }
    } else {
      for (int j = 0; j < k; ++j) selected[j] = row.score(chosen[j]);
    }
  }

  for (int j = 0; j < k; ++j) indices[j] = chosen[j];
  moe_route::detail::gate_weights(r, selected, gates, k);
  return row.nonfinite;
}

// Gate weights of the experts in indices[0..K) from the unbiased logits z (the
// prior policies' gates); returns whether the row held NaN or +-inf.
template <class Router, class T>
bool gates_at(const Router& r, const T* z, int num_experts, const std::int32_t* indices, row_scratch& scratch,
              float* gates) {
  row_state<Router, T> row(scratch, z, num_experts);
  float selected[Router::max_k] = {};
  for (int j = 0; j < r.top_k; ++j) selected[j] = row.score(indices[j]);
  moe_route::detail::gate_weights(r, selected, gates, r.top_k);
  return row.nonfinite;
}

// One token of the forward, with the router's prior policy where it acts.
template <class Router, class T>
bool route_token(const Router& r, const route_inputs<T>& in, std::int64_t t, row_scratch& scratch,
                 std::int32_t* indices, float* gates) {
  const int num_experts = in.num_experts;
  const T* z = in.logits + t * num_experts;
  if constexpr (Router::has_prior) {
    if (prior_active(r, in, t)) {
      const float* b = in.prior_bias + std::int64_t{in.token_prior_row[t]} * num_experts;
      if constexpr (Router::template has<prior::log_prior_bias>) {
        const auto& policy = get<prior::log_prior_bias>(r);
        const bool nonfinite = biased_row(z, b, policy.beta, num_experts, scratch.biased);
        route_row(r, scratch.biased, num_experts, t, in.expert_bias, scratch, indices, gates);
        if (!policy.bias_gates) gates_at(r, z, num_experts, indices, scratch, gates);
        return nonfinite;
      } else {  // prior_override: the K largest prior biases, ties to the lower expert
        for (int e = 0; e < num_experts; ++e) scratch.order[e] = ordered_key(b[e]);
        std::uint64_t best[Router::max_k];
        select_top(scratch.order, nullptr, num_experts, r.top_k, best, scratch);
        for (int j = 0; j < r.top_k; ++j) indices[j] = moe_route::detail::packed_expert(best[j]);
        return gates_at(r, z, num_experts, indices, scratch, gates);
      }
    }
  }
  return route_row(r, z, num_experts, t, in.expert_bias, scratch, indices, gates);
}

template <class Router, class T>
void backward_row(const Router& r, const T* z, int num_experts, const std::int32_t* indices, const float* dw,
                  row_scratch& scratch, float* dz) {
  using G = typename Router::gating_type;
  const int k = r.top_k;
  float selected[Router::max_k] = {};  // zeroed: silences a GCC -Wmaybe-uninitialized false positive
  float dsel[Router::max_k];

  if constexpr (G::shape == gating::kind::row_softmax) {
    row_state<Router, T> row(scratch, z, num_experts);
    for (int j = 0; j < k; ++j) selected[j] = row.score(indices[j]);
    moe_route::detail::gate_weights_vjp(r, selected, dw, dsel, k);
    float dot = 0.0f;  // <ds, s>, nonzero terms only at the selected experts
    for (int j = 0; j < k; ++j) dot = moe_route::detail::fma(dsel[j], selected[j], dot);
    const float neg_dot = -dot;
    if (row.sum > 0.0f) {
      const float sum = row.sum;
      for (int e = 0; e < num_experts; ++e) dz[e] = moe_route::detail::div(scratch.t[e], sum) * neg_dot;
    } else {
      for (int e = 0; e < num_experts; ++e) dz[e] = 0.0f * neg_dot;
    }
    for (int j = 0; j < k; ++j) dz[indices[j]] = selected[j] * (dsel[j] - dot);
  } else {
    // Elementwise and selected-softmax gradients are nonzero only at the
    // selected experts. The whole row is still loaded: that measured faster
    // than K scattered loads (the sequential loads keep the prefetcher busy).
    float v[Router::max_k];
    row_state<Router, T> row(scratch, z, num_experts);
    for (int j = 0; j < k; ++j) v[j] = row.v[indices[j]];
    for (int j = 0; j < k; ++j) {
      if constexpr (G::shape == gating::kind::elementwise)
        selected[j] = G::score(v[j]);
      else
        selected[j] = v[j];
    }
    moe_route::detail::gate_weights_vjp(r, selected, dw, dsel, k);
    for (int e = 0; e < num_experts; ++e) dz[e] = 0.0f;
    for (int j = 0; j < k; ++j) {
      if constexpr (G::shape == gating::kind::elementwise)
        dz[indices[j]] = dsel[j] * G::derivative(v[j], selected[j]);
      else
        dz[indices[j]] = dsel[j];
    }
  }
}

// The backward of one token whose gates were admitted (admission/gates.hpp):
// the gate inputs sigma (routed experts) and phi (rerouted experts) from the
// sanitised row v, their VJP, then the gating's VJP into dz.
template <class Router>
void admitted_backward_row(const Router& r, const float* v, int num_experts, const std::int32_t* routed,
                           const std::int32_t* admitted, bool renormalize, const float* dg, row_scratch& scratch,
                           float* dz) {
  namespace num = moe_route::detail;
  using namespace moe_route::admission;
  using G = typename Router::gating_type;
  const int k = r.top_k;
  row_stats st;
  if constexpr (gate_input_needs_row<G>) st = softmax_row_stats(v, num_experts, scratch.t);
  float sigma[max_top_k] = {}, phi[max_top_k] = {};  // zeroed: silences a GCC -Wmaybe-uninitialized false positive
  float d_sigma[max_top_k], d_phi[max_top_k];
  bool rerouted[max_top_k];
  for (int j = 0; j < k; ++j) {
    rerouted[j] = status_of(routed[j], admitted[j]) == slot_status::rerouted;
    sigma[j] = gate_input<G>(v[routed[j]], st);
    phi[j] = rerouted[j] ? gate_input<G>(v[admitted[j]], st) : 0.0f;
  }
  admitted_gate_weights_vjp(r, sigma, phi, routed, admitted, renormalize, dg, d_sigma, d_phi, k);
  if constexpr (G::shape == gating::kind::row_softmax) {
    float dot = 0.0f;  // <ds, s> over the nonzero entries: routed slots, then rerouted ones
    for (int j = 0; j < k; ++j) dot = num::fma(d_sigma[j], sigma[j], dot);
    for (int j = 0; j < k; ++j)
      if (rerouted[j]) dot = num::fma(d_phi[j], phi[j], dot);
    for (int e = 0; e < num_experts; ++e) dz[e] = gate_input<G>(v[e], st) * -dot;
    for (int j = 0; j < k; ++j) dz[routed[j]] = sigma[j] * (d_sigma[j] - dot);
    for (int j = 0; j < k; ++j)
      if (rerouted[j]) dz[admitted[j]] = phi[j] * (d_phi[j] - dot);
  } else {
    for (int e = 0; e < num_experts; ++e) dz[e] = 0.0f;
    for (int j = 0; j < k; ++j) {
      if constexpr (G::shape == gating::kind::elementwise) {
        dz[routed[j]] = d_sigma[j] * G::derivative(v[routed[j]], sigma[j]);
        if (rerouted[j]) dz[admitted[j]] = d_phi[j] * G::derivative(v[admitted[j]], phi[j]);
      } else {
        dz[routed[j]] = d_sigma[j];
        if (rerouted[j]) dz[admitted[j]] = d_phi[j];
      }
    }
  }
}

// Admitted indices must be -1 or experts, and a rerouted slot must bring the
// token a new expert.
inline void validate_admitted(const backward_args& args, std::int64_t num_tokens, int k, int num_experts) {
  using moe_route::admission::slot_status;
  for (std::int64_t t = 0; t < num_tokens; ++t) {
    const std::int32_t* routed = args.indices + t * k;
    const std::int32_t* admitted = args.admitted_indices + t * k;
    for (int j = 0; j < k; ++j) {
      if (admitted[j] < -1 || admitted[j] >= num_experts)
        moe_route::detail::fail("admitted_indices[" + std::to_string(t * k + j) + "] must be -1 or in [0, E)");
      if (moe_route::admission::status_of(routed[j], admitted[j]) == slot_status::rerouted)
        for (int i = 0; i < k; ++i)
          if (routed[i] == admitted[j] || (i != j && admitted[i] == admitted[j]))
            moe_route::detail::fail("admitted_indices: token " + std::to_string(t) + " holds expert " +
                                    std::to_string(admitted[j]) + " twice (a rerouted slot must get a new expert)");
    }
  }
}

// Runs body(begin, end, worker) over contiguous token blocks on up to
// `threads` threads (the caller's thread included), with one scratch each.
template <class Body>
void for_token_blocks(std::int64_t num_tokens, const execution& ex, Body body) {
  if (num_tokens == 0) return;
  int threads = ex.threads > 0 ? ex.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  constexpr std::int64_t min_tokens_per_thread = 256;  // below this a thread costs more than it saves
  threads = static_cast<int>(std::min<std::int64_t>(threads, (num_tokens + min_tokens_per_thread - 1) / min_tokens_per_thread));
  threads = std::max(threads, 1);
  const std::int64_t block = (num_tokens + threads - 1) / threads;
  std::vector<std::unique_ptr<row_scratch>> scratch(threads);
  for (auto& s : scratch) s.reset(new row_scratch);  // default-initialised: no 128 KiB memset per call
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int w = 1; w < threads; ++w) {
    const std::int64_t begin = w * block, end = std::min(num_tokens, begin + block);
    if (begin < end) pool.emplace_back([&, w, begin, end] { body(begin, end, w, *scratch[w]); });
  }
  body(0, std::min(num_tokens, block), 0, *scratch[0]);
  for (auto& t : pool) t.join();
}

}  // namespace detail

// Forward: indices and gate weights of every token (POLICIES.md sections 1-3),
// and with penalties their values and the training workspace (section 5).
// Throws moe_route::error, writing nothing, if an argument is invalid.
template <class Router, class T>
route_report route(const Router& r, const route_inputs<T>& in, const route_outputs& out, execution ex = {}) {
  static_assert(is_router<Router>, "cpu::route: the first argument must be a moe_route::router");
  moe_route::detail::validate_route(r, in, out);
  moe_route::detail::validate_training_values(r, in);
  const int num_experts = in.num_experts;
  const int k = r.top_k;
  const std::size_t workers = ex.threads > 0 ? ex.threads : std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::int64_t> nonfinite(workers, 0);

  const penalty::switches on = penalty::active(r, in);
  const bool penalties = Router::has_penalties && on.any() && in.num_tokens > 0;
  const auto layout = penalty::training_layout<Router>(in.num_tokens, num_experts, in.num_sequences);
  std::vector<detail::penalty_partials> partials(penalties ? workers : 0);
  if constexpr (Router::has_penalties)
    for (auto& part : partials) detail::prepare_partials(r, in, part);
  std::optional<detail::workspace_view> ws;
  if (penalties) ws.emplace(out.workspace, layout);

  detail::for_token_blocks(in.num_tokens, ex, [&](std::int64_t begin, std::int64_t end, int worker,
                                                   detail::row_scratch& scratch) {
    std::int64_t bad = 0;
    for (std::int64_t t = begin; t < end; ++t) {
      bad += detail::route_token(r, in, t, scratch, out.indices + t * k, out.gates + t * k);
      if constexpr (Router::has_penalties)
        if (penalties) detail::penalty_forward_row(r, in, on, out.indices, t, scratch.penalties, partials[worker], *ws);
    }
    nonfinite[worker] = bad;
  });
  if constexpr (Router::has_penalties) {
    for (int j = 0; j < Router::num_penalties; ++j) out.penalty_values[j] = 0.0;
    if (penalties) {
      detail::reduce_partials(partials, *ws, layout, num_experts, in.num_sequences);
      detail::chunk_totals<Router>(*ws, in.num_tokens);
      penalty::values(r, ws->state(r, in), out.penalty_values);
    }
  }
  route_report report;
  for (std::int64_t n : nonfinite) report.nonfinite_rows += n;
  if (out.nonfinite_rows != nullptr) *out.nonfinite_rows += report.nonfinite_rows;
  return report;
}

// Fused backward: dL/dz [N x E] from dL/dgates [N x K] in one pass over the
// logits, plus the penalties' gradients. The indices must be those the forward
// wrote for the same inputs, and the workspace the one it filled. With
// args.admitted_indices the gates are those of admission (cpu::admit) and the
// gradient follows admission/gates.hpp: dropped slots pass nothing but their
// share of the normaliser, rerouted ones flow into their new expert's score.
template <class Router, class T>
void backward(const Router& r, const route_inputs<T>& in, const backward_args& args, execution ex = {}) {
  static_assert(is_router<Router>, "cpu::backward: the first argument must be a moe_route::router");
  moe_route::detail::validate_backward(r, in, args);
  moe_route::detail::validate_training_values(r, in);
  const int num_experts = in.num_experts;
  const int k = r.top_k;
  const std::int64_t entries = in.num_tokens * k;
  for (std::int64_t i = 0; i < entries; ++i)
    if (args.indices[i] < 0 || args.indices[i] >= num_experts)
      moe_route::detail::fail("indices[" + std::to_string(i) + "] (= " + std::to_string(args.indices[i]) +
                              ") is not an expert in [0, num_experts)");
  if (args.admitted_indices != nullptr) detail::validate_admitted(args, in.num_tokens, k, num_experts);
  const penalty::switches on = penalty::active(r, in);
  const bool penalties = Router::has_penalties && on.any() && in.num_tokens > 0;
  std::optional<detail::workspace_view> ws;
  penalty::token_weights weights;
  if constexpr (Router::has_penalties) {
    if (penalties) {
      ws.emplace(args.workspace, penalty::training_layout<Router>(in.num_tokens, num_experts, in.num_sequences));
      const penalty::upstream_grads up = detail::upstream_of<Router>(args);
      if (on.distribution) detail::distribution_grads(r, in, up, *ws);
      weights = penalty::weights(r, *ws->header, up);
    }
  }
  detail::for_token_blocks(in.num_tokens, ex, [&](std::int64_t begin, std::int64_t end, int,
                                                   detail::row_scratch& scratch) {
    for (std::int64_t t = begin; t < end; ++t) {
      const T* z = in.logits + t * num_experts;
      float* dz = args.grad_logits + t * num_experts;
      bool biased = false;
      if constexpr (Router::template has<prior::log_prior_bias>) {
        // With bias_gates the gates were computed from z', and dL/dz = dL/dz'.
        if (get<prior::log_prior_bias>(r).bias_gates && detail::prior_active(r, in, t)) {
          const float* b = in.prior_bias + std::int64_t{in.token_prior_row[t]} * num_experts;
          detail::biased_row(z, b, get<prior::log_prior_bias>(r).beta, num_experts, scratch.biased);
          biased = true;
        }
      }
      if (args.admitted_indices != nullptr) {
        float* v = scratch.v;
        for (int e = 0; e < num_experts; ++e)
          v[e] = moe_route::detail::sanitize(biased ? scratch.biased[e] : moe_route::detail::to_float(z[e]));
        detail::admitted_backward_row(r, v, num_experts, args.indices + t * k, args.admitted_indices + t * k,
                                      args.renormalize, args.grad_gates + t * k, scratch, dz);
      } else if (biased) {
        detail::backward_row(r, scratch.biased, num_experts, args.indices + t * k, args.grad_gates + t * k, scratch, dz);
      } else {
        detail::backward_row(r, z, num_experts, args.indices + t * k, args.grad_gates + t * k, scratch, dz);
      }
      if constexpr (Router::has_penalties)
        if (penalties) detail::penalty_backward_row(r, in, on, weights, *ws, t, scratch.penalties, dz);
    }
  });
}

}  // namespace moe_route::cpu

#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
