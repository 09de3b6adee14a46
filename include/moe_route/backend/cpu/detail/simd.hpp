// moe_route CPU backend: the vector kernels of a row (AVX-512, AVX2 and
// scalar forms with the same results): canonical sums, the row maximum,
// non-finite detection, and the packed-key primitives of top-k selection.
#pragma once

#include <algorithm>
#include <cstdint>

#include <moe_route/backend/cpu/detail/isa.hpp>
#include <moe_route/config.hpp>
#include <moe_route/detail/numerics.hpp>

// The AVX2 kernels (the *_avx2 functions) exist where the flags enable AVX2
// without AVX-512, and are called always; and in a baseline build with the
// run-time x86-64-v3 path (detail/isa.hpp), compiled as target("avx2,fma")
// functions and called when the row runs on that path (`avx2` below), where
// they are inlined into the path's copy of the loops.
#if defined(__AVX2__) && !defined(__AVX512F__)
#define MOE_ROUTE_CPU_AVX2_KERNELS 1
#define MOE_ROUTE_CPU_AVX2_TARGET
#elif MOE_ROUTE_CPU_RUNTIME_X86_64_V3
#define MOE_ROUTE_CPU_AVX2_KERNELS 1
#define MOE_ROUTE_CPU_AVX2_TARGET MOE_ROUTE_CPU_X86_64_V3_TARGET
#else
#define MOE_ROUTE_CPU_AVX2_KERNELS 0
#endif

#if defined(__AVX512F__) || MOE_ROUTE_CPU_AVX2_KERNELS
#include <immintrin.h>
#endif

// GCC 12 warns (-W[maybe-]uninitialized) inside its own AVX-512 intrinsics
// when they are inlined (GCC bug 105593: the intrinsics' operands), so the
// CPU backend's headers turn these warnings off around their code in AVX-512
// builds.
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#define MOE_ROUTE_CPU_SIMD_WARNINGS_OFF                              \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"") \
      _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")
#define MOE_ROUTE_CPU_SIMD_WARNINGS_ON _Pragma("GCC diagnostic pop")
#else
#define MOE_ROUTE_CPU_SIMD_WARNINGS_OFF
#define MOE_ROUTE_CPU_SIMD_WARNINGS_ON
#endif

MOE_ROUTE_CPU_SIMD_WARNINGS_OFF

namespace moe_route::cpu::detail {

using moe_route::detail::float_max;

// Whether the AVX2 kernels run: always where the flags enable AVX2, else when
// the caller's row runs on the run-time x86-64-v3 path.
inline bool use_avx2([[maybe_unused]] bool x86_64_v3) {
#if defined(__AVX2__)
  return true;
#else
  return x86_64_v3;
#endif
}

#if MOE_ROUTE_CPU_AVX2_KERNELS
// The floats p[0..min(count, 8)) in lanes 0..7, zeros beyond (never read).
MOE_ROUTE_CPU_AVX2_TARGET inline __m256 first_lanes_avx2(const float* p, int count) {
  const __m256i in = _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_maskload_ps(p, in);
}

MOE_ROUTE_CPU_AVX2_TARGET inline float lane_sum_avx2(const float* x, int n) {
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
    const int rest = n - base;
    l0 = _mm256_add_ps(l0, first_lanes_avx2(x + base, rest));
    if (rest > 8) l1 = _mm256_add_ps(l1, first_lanes_avx2(x + base + 8, rest - 8));
    if (rest > 16) l2 = _mm256_add_ps(l2, first_lanes_avx2(x + base + 16, rest - 16));
    if (rest > 24) l3 = _mm256_add_ps(l3, first_lanes_avx2(x + base + 24, rest - 24));
  }
  const __m256 s8 = _mm256_add_ps(_mm256_add_ps(l0, l2), _mm256_add_ps(l1, l3));  // offsets 16, then 8
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  const __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}
#endif

// Sum of x[0..n) in the canonical order a CUDA warp uses (see numerics.hpp).
inline float lane_sum(const float* x, int n, [[maybe_unused]] bool x86_64_v3) {
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
#else
#if MOE_ROUTE_CPU_AVX2_KERNELS
  if (use_avx2(x86_64_v3)) return lane_sum_avx2(x, n);
#endif
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

#if MOE_ROUTE_CPU_AVX2_KERNELS
MOE_ROUTE_CPU_AVX2_TARGET inline float row_max_avx2(const float* v, int n) {
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
}
#endif

// The row maximum, starting from -FLT_MAX so that a row of NaNs (all -inf)
// keeps a finite maximum. The values are never NaN, so the maximum is the
// same in any order (up to the sign of a zero maximum, which cannot change
// exp(v - max)), and it is taken 16 lanes at a time.
inline float row_max(const float* v, int n, [[maybe_unused]] bool x86_64_v3) {
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
#else
#if MOE_ROUTE_CPU_AVX2_KERNELS
  if (use_avx2(x86_64_v3)) return row_max_avx2(v, n);
#endif
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
// packed key (pack_key orders by this, then by the lower expert index), in
// pack_key's steps written as bit operations, so that loops over keys vectorise.
inline std::uint32_t ordered_key(float key) {
  std::uint32_t u = moe_route::detail::float_to_bits(key);
  u &= ~(static_cast<std::uint32_t>(key == 0.0f) << 31);         // -0 as +0
  u ^= (0u - (u >> 31)) | 0x80000000u;                            // negative: ~u; else u | 2^31
  return u & (0u - static_cast<std::uint32_t>(key == key));       // NaN: 0
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

#if MOE_ROUTE_CPU_AVX2_KERNELS
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

#if MOE_ROUTE_CPU_AVX2_KERNELS
// compact_at_least's whole blocks of 8 from e on: their count, e moved past them.
MOE_ROUTE_CPU_AVX2_TARGET inline int compact_blocks_avx2(const std::uint32_t* order, int n, std::uint32_t threshold,
                                                        std::int32_t* out, int& e) {
  int count = 0;
  const __m256i bound = _mm256_set1_epi32(static_cast<int>(threshold));
  for (; e + 8 <= n; e += 8) {
    const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(order + e));
    const __m256i at_least = _mm256_cmpeq_epi32(_mm256_max_epu32(o, bound), o);  // unsigned o >= bound
    const unsigned m = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(at_least)));
    const __m256i picked = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(compress_positions.positions[m])));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + count), _mm256_add_epi32(picked, _mm256_set1_epi32(e)));
    count += popcount16(m);
  }
  return count;
}
#endif

// The experts e with order[e] >= threshold, ascending, into out (room for
// n + 16 entries); returns their number.
inline int compact_at_least(const std::uint32_t* order, int n, std::uint32_t threshold, std::int32_t* out,
                            [[maybe_unused]] bool x86_64_v3) {
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
#elif MOE_ROUTE_CPU_AVX2_KERNELS
  if (use_avx2(x86_64_v3)) count = compact_blocks_avx2(order, n, threshold, out, e);
#endif
  for (; e < n; ++e) {  // branch-free
    out[count] = e;
    count += order[e] >= threshold ? 1 : 0;
  }
  return count;
}

#if MOE_ROUTE_CPU_AVX2_KERNELS
// lane_bound<16> in two vectors of eight lanes.
MOE_ROUTE_CPU_AVX2_TARGET inline std::uint32_t lane_bound16_avx2(const std::uint32_t* order, int n, int k) {
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

// A lower bound of the k-th largest of order[0..n) (n >= 2 Lanes, k <= Lanes):
// the k-th largest maximum of Lanes interleaved lanes, since k distinct keys
// reach it. 0 when fewer than k lanes hold a nonzero key.
template <int Lanes>
std::uint32_t lane_bound(const std::uint32_t* order, int n, int k, [[maybe_unused]] bool x86_64_v3) {
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
#elif MOE_ROUTE_CPU_AVX2_KERNELS
  if constexpr (Lanes == 16)
    if (use_avx2(x86_64_v3)) return lane_bound16_avx2(order, n, k);
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

#if MOE_ROUTE_CPU_AVX2_KERNELS
// The rank of each of count <= 16 distinct packed keys among them, each key
// written to slots[min(rank, k)] (slots has k + 1 entries).
MOE_ROUTE_CPU_AVX2_TARGET inline void rank_candidates_avx2(const std::uint64_t* candidates, int count, int k,
                                                          std::uint64_t* slots) {
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
}
#endif

}  // namespace moe_route::cpu::detail

MOE_ROUTE_CPU_SIMD_WARNINGS_ON
