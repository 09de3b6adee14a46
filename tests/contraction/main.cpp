// The library's math must not depend on whether the compiler contracts a*b+c
// into an fma: the CUDA compiler does so by default, host compilers do so
// with -mfma -ffp-contract=fast. fused.cpp and unfused.cpp compile the same
// code both ways; every result must agree bit for bit.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

void fused(const float* x, std::int64_t n, float* out);
void unfused(const float* x, std::int64_t n, float* out);
void fused_routers(const float*, std::int64_t, int, const float*, float*, std::int32_t*, float*);
void unfused_routers(const float*, std::int64_t, int, const float*, float*, std::int32_t*, float*);
void fused_zero_routers(const float*, std::int64_t, int, const float*, const float*, float*);
void unfused_zero_routers(const float*, std::int64_t, int, const float*, const float*, float*);
void fused_statistics(const std::int32_t*, std::int64_t, int, int, const float*, const float*, std::int64_t, double*);
void unfused_statistics(const std::int32_t*, std::int64_t, int, int, const float*, const float*, std::int64_t, double*);

int main() {
  std::mt19937 gen(7);
  const std::int64_t n = 1 << 20;
  std::vector<float> x(n);
  std::uniform_real_distribution<float> wide(-100.0f, 100.0f);
  std::normal_distribution<float> narrow(0.0f, 3.0f);
  for (std::int64_t i = 0; i < n; ++i) x[i] = (i % 2) ? wide(gen) : narrow(gen);
  std::vector<float> a(6 * n), b(6 * n);
  fused(x.data(), n, a.data());
  unfused(x.data(), n, b.data());
  int failures = 0;
  if (std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) != 0) {
    std::printf("elementwise math differs between fused and unfused builds\n");
    ++failures;
  }

  const std::int64_t tokens = 512;
  const int experts = 256;
  std::vector<float> z(tokens * experts), bias(experts);
  for (auto& v : z) v = narrow(gen);
  for (auto& v : bias) v = 0.1f * narrow(gen);
  std::vector<float> ga(4 * tokens * 8), gb(ga.size()), da(4 * tokens * experts), db(da.size());
  std::vector<std::int32_t> ia(ga.size()), ib(ga.size());
  fused_routers(z.data(), tokens, experts, bias.data(), ga.data(), ia.data(), da.data());
  unfused_routers(z.data(), tokens, experts, bias.data(), gb.data(), ib.data(), db.data());
  if (ia != ib) { std::printf("indices differ\n"); ++failures; }
  if (std::memcmp(ga.data(), gb.data(), ga.size() * sizeof(float)) != 0) { std::printf("gates differ\n"); ++failures; }
  if (std::memcmp(da.data(), db.data(), da.size() * sizeof(float)) != 0) { std::printf("gradients differ\n"); ++failures; }

  // Signed zeros in the gradients: a third of the rows all NaN, a third with
  // some NaN, upstream gradients with many zeros of both signs.
  const std::int64_t zn = 96;
  const int ze = 64;
  std::vector<float> zz(zn * ze), zdw(zn * 8);
  for (std::int64_t t = 0; t < zn; ++t)
    for (int i = 0; i < ze; ++i) {
      float& v = zz[t * ze + i];
      v = narrow(gen);
      if (t % 3 == 0 || (t % 3 == 1 && i % 5 == 2)) v = (i % 2) ? -std::numeric_limits<float>::quiet_NaN()
                                                                 : std::numeric_limits<float>::quiet_NaN();
    }
  for (std::size_t i = 0; i < zdw.size(); ++i) {
    const int c = static_cast<int>((i * 7 + i / 8) % 6);
    zdw[i] = c == 0 ? 0.0f : c == 1 ? -0.0f : c == 2 ? -0.0f : 0.25f * narrow(gen);
  }
  std::vector<float> za(5 * 3 * zn * ze), zb(za.size());
  fused_zero_routers(zz.data(), zn, ze, bias.data(), zdw.data(), za.data());
  unfused_zero_routers(zz.data(), zn, ze, bias.data(), zdw.data(), zb.data());
  if (std::memcmp(za.data(), zb.data(), za.size() * sizeof(float)) != 0) {
    std::int64_t count = 0, first = -1;
    for (std::size_t i = 0; i < za.size(); ++i)
      if (std::memcmp(&za[i], &zb[i], sizeof(float)) != 0 && count++ == 0) first = static_cast<std::int64_t>(i);
    std::printf("gradients with signed zeros differ (%lld entries; first: router %lld, pass %lld, token %lld, expert %lld)\n",
                static_cast<long long>(count), static_cast<long long>(first / (3 * zn * ze)),
                static_cast<long long>(first / (zn * ze) % 3), static_cast<long long>(first / ze % zn),
                static_cast<long long>(first % ze));
    ++failures;
  }
  // Host statistics over an assignment with dropped slots and a column-shuffled prior.
  const std::int64_t sn = 999;
  const int se = 37, slots = 3, rows = 40;
  std::vector<std::int32_t> assigned(sn * slots);
  for (std::size_t i = 0; i < assigned.size(); ++i) assigned[i] = i % 7 == 3 ? -1 : static_cast<std::int32_t>((i * i + i / 5) % se);
  std::vector<float> pi(rows * se), shuffled(pi.size());
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (auto& v : pi) v = unit(gen);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < se; ++c) shuffled[r * se + c] = pi[r * se + (c * 5 + 3) % se];
  double sa[10], sb[10];
  fused_statistics(assigned.data(), sn, slots, se, pi.data(), shuffled.data(), rows, sa);
  unfused_statistics(assigned.data(), sn, slots, se, pi.data(), shuffled.data(), rows, sb);
  bool same_statistics = true;
  for (int i = 0; i < 10; ++i)
    if (std::memcmp(&sa[i], &sb[i], sizeof(double)) != 0) {
      std::printf("statistic %d differs: %.17g and %.17g\n", i, sa[i], sb[i]);
      same_statistics = false;
    }
  failures += same_statistics ? 0 : 1;
  std::printf("%d passed, %d failed\n", 6 - failures, failures);
  return failures == 0 ? 0 : 1;
}
