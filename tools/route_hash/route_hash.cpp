// route_hash: a fingerprint of moe_route's CPU results over a broad grid of
// routers, shapes, logit dtypes, thread counts and inputs, so that a
// restructuring or an optimisation of the library can be shown to be
// bit-identical. ctest route_hash compares its output with
// tests/route_hash.expected (docs/development.md); to compare two trees, build
// it against each with the same compiler and flags:
//
//   cmake --build build/default --target moe_route_hash
//   build/default/tools/moe_route_hash [--verbose]
//
// Output: one line per section, "<section> <FNV-1a-64 of the section's bytes>
// <cases>", then "total <FNV-1a-64 over the sections' names, hashes and case
// counts>". With --verbose, one line per case comes first ("<section>/<case>
// <FNV-1a-64 of the case's bytes>"): diff two verbose outputs to find the
// first case that differs.
//
// What is hashed: every output of every call, as raw bytes (so the signs of
// zeros and NaN payloads count), each array preceded by its length, each case
// preceded by its name and followed by whether it threw. A call that throws
// moe_route::error contributes the message text (errors are behaviour too);
// output buffers start filled with fixed sentinels, so untouched outputs are
// deterministic as well. Nothing depends on time, addresses, unordered
// containers or the number of cores (the thread counts are fixed, 1 and 2).
//
// Only public headers are included, and the runtime calls come compiled
// (moe_route::runtime).
#include <moe_route/moe_route.hpp>
#include <moe_route/runtime/instantiate.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace mr = moe_route;
namespace rt = moe_route::runtime;
namespace ad = moe_route::admission;
namespace pen = moe_route::penalty;
namespace cb = moe_route::analysis::capacity_bounds;

namespace {

// ---------------------------------------------------------------------------
// Hashing.

constexpr std::uint64_t fnv_offset = 0xcbf29ce484222325ull;
constexpr std::uint64_t fnv_prime = 0x100000001b3ull;

std::uint64_t fnv(std::uint64_t h, const void* p, std::size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * fnv_prime;
  return h;
}

class hasher {
 public:
  explicit hasher(bool verbose) : verbose_(verbose) {}

  void section(const char* name) { sections_.push_back(section_state{name, fnv_offset, 0}); }

  // Feeds bytes to the current case and the current section.
  void put(const void* p, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    std::uint64_t c = case_, s = sections_.back().hash;
    for (std::size_t i = 0; i < n; ++i) {
      c = (c ^ b[i]) * fnv_prime;
      s = (s ^ b[i]) * fnv_prime;
    }
    case_ = c;
    sections_.back().hash = s;
  }
  template <class T>
  void val(const T& v) {
    static_assert((std::is_trivially_copyable_v<T> && std::has_unique_object_representations_v<T>) ||
                      std::is_floating_point_v<T>,
                  "hash scalars without padding");
    put(&v, sizeof v);
  }
  void flag(bool b) { val(static_cast<std::uint8_t>(b ? 1 : 0)); }
  template <class T>
  void arr(const T* p, std::size_t n) {
    val(static_cast<std::uint64_t>(n));
    if (n > 0) put(p, n * sizeof(T));
  }
  template <class T>
  void vec(const std::vector<T>& v) {
    arr(v.data(), v.size());
  }
  void str(const std::string& s) { arr(s.data(), s.size()); }

  // One case: its name, what body() hashes, and how it ended. A moe_route::error
  // is part of the result (its message is hashed); expect_error says which
  // ending is planned, and cases that end otherwise are counted (stderr).
  template <class F>
  void run(const std::string& name, F&& body, bool expect_error = false) {
    case_ = fnv_offset;
    ++sections_.back().cases;
    str(name);
    bool threw = false;
    try {
      body();
      val(std::uint8_t{0});
    } catch (const mr::error& e) {
      threw = true;
      val(std::uint8_t{1});
      str(e.what());
    } catch (const std::exception& e) {
      threw = true;
      val(std::uint8_t{2});
      str(e.what());
    }
    if (threw != expect_error) {
      ++unexpected_;
      if (verbose_) std::fprintf(stderr, "route_hash: %s/%s %s\n", sections_.back().name, name.c_str(),
                                 threw ? "threw unexpectedly" : "did not throw");
    }
    if (verbose_)
      std::printf("%s/%s %016llx%s\n", sections_.back().name, name.c_str(), static_cast<unsigned long long>(case_),
                  threw ? " (error)" : "");
  }

  int finish() const {
    std::uint64_t total = fnv_offset;
    for (const auto& s : sections_) {
      std::printf("%s %016llx %lld\n", s.name, static_cast<unsigned long long>(s.hash), static_cast<long long>(s.cases));
      total = fnv(total, s.name, std::strlen(s.name));
      total = fnv(total, &s.hash, sizeof s.hash);
      total = fnv(total, &s.cases, sizeof s.cases);
    }
    std::printf("total %016llx\n", static_cast<unsigned long long>(total));
    if (unexpected_ > 0)
      std::fprintf(stderr, "route_hash: %lld case(s) did not end as planned (run with --verbose to list them)\n",
                   static_cast<long long>(unexpected_));
    return 0;
  }

 private:
  struct section_state {
    const char* name;
    std::uint64_t hash;
    std::int64_t cases;
  };
  bool verbose_;
  std::vector<section_state> sections_;
  std::uint64_t case_ = fnv_offset;
  std::int64_t unexpected_ = 0;
};

hasher* H = nullptr;

std::string S(long long v) { return std::to_string(v); }

// ---------------------------------------------------------------------------
// Inputs: a fixed generator (SplitMix64) and exact float values.

struct rng {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  int below(int n) { return static_cast<int>(next() % static_cast<std::uint64_t>(n)); }
  // Exact: an integer in [-2^23, 2^23) times scale * 2^-23 (scale a power of two).
  float sym(float scale) {
    const auto i = static_cast<std::int32_t>(next() >> 40) - (1 << 23);
    return static_cast<float>(i) * (scale * 0x1p-23f);
  }
  // Exact: an integer in [0, 2^24) times 2^-24, in [0, 1).
  float unit() { return static_cast<float>(next() >> 40) * 0x1p-24f; }
};

float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
double bits_double(std::uint64_t u) {
  double d;
  std::memcpy(&d, &u, sizeof d);
  return d;
}

const float inf_f = std::numeric_limits<float>::infinity();
const float nan_f = std::numeric_limits<float>::quiet_NaN();
const float neg_nan_f = bits_float(0xffc00001u);
const float max_f = std::numeric_limits<float>::max();
const float sentinel_f = bits_float(0x7fc0a5a5u);  // a quiet NaN no computation produces
const double sentinel_d = bits_double(0x7ff8a5a5a5a5a5a5ull);
constexpr std::int32_t sentinel_i = -7;

std::uint64_t mix_seed(std::uint64_t a, std::uint64_t b) {
  rng g{a * 0x9e3779b97f4a7c15ull ^ (b + 0x632be59bd9b4e019ull)};
  return g.next();
}

// Logits [n x e]: most rows random (three scales), and rows with exact ties,
// all-equal values, NaN (both signs), +-inf, signed zeros and subnormals,
// all-NaN / all-inf rows, huge magnitudes and a repeated maximum.
std::vector<float> make_logits(std::uint64_t seed, std::int64_t n, int e, bool specials = true) {
  rng g{mix_seed(seed, 1)};
  std::vector<float> z(static_cast<std::size_t>(n) * e);
  static const float levels[] = {-1.0f, 0.0f, 0.5f, 1.0f, 2.0f};
  for (std::int64_t t = 0; t < n; ++t) {
    float* row = z.data() + t * e;
    const int kind = static_cast<int>((static_cast<std::uint64_t>(t) + seed) % (specials ? 16 : 8));
    for (int i = 0; i < e; ++i) row[i] = g.sym(4.0f);
    switch (kind) {
      case 1:
        for (int i = 0; i < e; ++i) row[i] = g.sym(32.0f);
        break;
      case 2:
        for (int i = 0; i < e; ++i) row[i] = g.sym(0.125f);
        break;
      case 8:  // exact ties
        for (int i = 0; i < e; ++i) row[i] = levels[g.below(5)];
        break;
      case 9: {  // all equal
        const float c = t % 3 == 0 ? 0.0f : (t % 3 == 1 ? 1.5f : -2.0f);
        for (int i = 0; i < e; ++i) row[i] = c;
        break;
      }
      case 10: {  // NaN entries
        const int count = 1 + g.below(3);
        for (int j = 0; j < count; ++j) row[g.below(e)] = (j % 2) ? neg_nan_f : nan_f;
        break;
      }
      case 11:  // infinities (two +inf: a tie at the top)
        row[g.below(e)] = inf_f;
        row[g.below(e)] = -inf_f;
        if (e > 2) row[g.below(e)] = inf_f;
        break;
      case 12:  // signed zeros and subnormals
        for (int i = 0; i < e; ++i) {
          const int c = g.below(8);
          row[i] = c < 3 ? 0.0f : (c < 6 ? -0.0f : (c == 6 ? 1e-40f : -1e-40f));
        }
        break;
      case 13: {  // a whole row of NaN, -inf, +inf, or NaN mixed with -inf
        const int c = g.below(4);
        for (int i = 0; i < e; ++i)
          row[i] = c == 0 ? nan_f : (c == 1 ? -inf_f : (c == 2 ? inf_f : ((i % 2) ? nan_f : -inf_f)));
        break;
      }
      case 14: {  // huge magnitudes (fp16: infinities)
        static const float huge[] = {1e30f, -1e30f, 3e38f, -3e38f, 1e5f, -7e4f};
        for (int i = 0; i < e; ++i)
          if (g.below(3) == 0) row[i] = huge[g.below(6)];
        if (g.below(2) == 0) row[g.below(e)] = max_f;
        break;
      }
      case 15: {  // the maximum repeated at other positions
        int at = 0;
        for (int i = 1; i < e; ++i)
          if (row[i] > row[at]) at = i;
        for (int j = 0; j < 3; ++j) row[g.below(e)] = row[at];
        break;
      }
      default:
        break;
    }
  }
  return z;
}

// Upstream gradients: exact values in [-2, 2), with zeros of both signs.
std::vector<float> make_grads(std::uint64_t seed, std::size_t n) {
  rng g{mix_seed(seed, 2)};
  std::vector<float> d(n);
  for (std::size_t i = 0; i < n; ++i) {
    d[i] = g.sym(2.0f);
    if (i % 9 == 4) d[i] = 0.0f;
    if (i % 13 == 6) d[i] = -0.0f;
  }
  return d;
}

// Expert bias: multiples of 1/64 in [-1/8, 1/8] (ties included).
std::vector<float> make_bias(std::uint64_t seed, int e) {
  rng g{mix_seed(seed, 3)};
  std::vector<float> b(e);
  for (int i = 0; i < e; ++i) b[i] = static_cast<float>(g.below(17) - 8) / 64.0f;
  return b;
}

// Positive finite norms in [0.5, 2).
std::vector<float> make_norms(std::uint64_t seed, std::size_t n) {
  rng g{mix_seed(seed, 4)};
  std::vector<float> v(n);
  for (auto& x : v) x = 0.5f + 1.5f * g.unit();
  return v;
}

struct logit_set {
  std::vector<float> f32;
  std::vector<mr::bfloat16> bf16;
  std::vector<mr::float16> f16;
  explicit logit_set(std::vector<float> z) : f32(std::move(z)) {
    bf16.reserve(f32.size());
    f16.reserve(f32.size());
    for (float x : f32) {
      bf16.push_back(mr::bfloat16::from_float(x));
      f16.push_back(mr::float16::from_float(x));
    }
  }
  template <class T>
  const T* get() const {
    if constexpr (std::is_same_v<T, float>) return f32.data();
    else if constexpr (std::is_same_v<T, mr::bfloat16>) return bf16.data();
    else return f16.data();
  }
};

template <class F>
void for_dtypes(F&& f) {
  f(float{}, "f32");
  f(mr::bfloat16{}, "bf16");
  f(mr::float16{}, "f16");
}

template <class F>
void for_presets(F&& f) {
  f(mr::presets::deepseek_v2_lite(), "deepseek_v2_lite", mr::presets::deepseek_v2_lite_experts);
  f(mr::presets::moonlight(), "moonlight", mr::presets::moonlight_experts);
  f(mr::presets::deepseek_v3(), "deepseek_v3", mr::presets::deepseek_v3_experts);
  f(mr::presets::qwen3(), "qwen3", mr::presets::qwen3_experts);
  f(mr::presets::mixtral(), "mixtral", mr::presets::mixtral_experts);
  f(mr::presets::deepseek_v4(), "deepseek_v4", mr::presets::deepseek_v4_experts);
}

template <class F>
void for_gatings(F&& f) {
  f(mr::gating::softmax{}, "softmax");
  f(mr::gating::sigmoid{}, "sigmoid");
  f(mr::gating::sqrt_softplus{}, "sqrt_softplus");
  f(mr::gating::softmax_after_topk{}, "softmax_after_topk");
}

// Group-limited parameters valid for E and K: 32 groups of 128 for E = 4096,
// 8 groups when 8 divides E, one expert per group for E = 7.
int pick_groups(int e) {
  if (e % 32 == 0 && e >= 1024) return 32;
  if (e % 8 == 0) return 8;
  if (e == 7) return 7;
  return 1;
}
struct group_params {
  int groups, top_groups, per_group_k;
};
group_params groups_for(int e, int k) {
  const int g = pick_groups(e), size = e / g;
  const int top = std::min(g, std::max(std::min(4, g), (k + size - 1) / size));
  return {g, top, std::min(2, size)};
}

template <class R>
void set_k(R& r, int e, int k) {
  r.top_k = k;
  if constexpr (R::selection_type::shape == mr::selection::kind::grouped) {
    const group_params p = groups_for(e, k);
    r.selection.groups = p.groups;
    r.selection.top_groups = p.top_groups;
    r.selection.per_group_k = p.per_group_k;
  }
}

// The training inputs of one (N, E): a prepared prior table (built with
// prior::build from other logits), its within-community and global shuffles,
// each token's prior row (-1 for some), sequences (the last one empty), load
// fractions, the experts' ranks.
struct policy_data {
  std::int64_t rows = 4;
  std::vector<float> pi, bias, probs, bias_within, probs_within, bias_global, probs_global;
  std::vector<std::int32_t> token_row, seq, expert_rank;
  std::int32_t num_sequences = 6;
  std::vector<float> load_fractions;
  std::int32_t rank = 1;

  policy_data(std::int64_t n, int e) {
    const std::size_t se = static_cast<std::size_t>(rows) * e;
    const std::int64_t nb = std::max<std::int64_t>(n, 8 * rows);
    const std::vector<float> base = make_logits(static_cast<std::uint64_t>(e) * 31 + 5, nb, e, false);
    std::vector<std::int32_t> base_rows(nb);
    for (std::int64_t t = 0; t < nb; ++t) base_rows[t] = static_cast<std::int32_t>(t % rows);
    mr::route_inputs<float> bin;
    bin.logits = base.data();
    bin.num_tokens = nb;
    bin.num_experts = e;
    pi.assign(se, 0.0f);
    mr::prior::build<mr::gating::softmax>(bin, base_rows.data(), rows, pi.data());
    bias.assign(se, 0.0f);
    probs.assign(se, 0.0f);
    mr::prior::prepare(pi.data(), rows, e, bias.data(), probs.data());
    std::vector<int> communities(e);
    for (int i = 0; i < e; ++i) communities[i] = (i * 5) % 3;
    std::vector<float> shuffled(se);
    mr::prior::apply_permutation(pi.data(), rows, e, mr::prior::within_community_permutation(communities.data(), e, 1234 + e),
                                 shuffled.data());
    bias_within.assign(se, 0.0f);
    probs_within.assign(se, 0.0f);
    mr::prior::prepare(shuffled.data(), rows, e, bias_within.data(), probs_within.data());
    mr::prior::apply_permutation(pi.data(), rows, e, mr::prior::global_permutation(e, 99), shuffled.data());
    bias_global.assign(se, 0.0f);
    probs_global.assign(se, 0.0f);
    mr::prior::prepare(shuffled.data(), rows, e, bias_global.data(), probs_global.data());

    // At least one entry: with no tokens the pointers stay non-null (the
    // run-time router rejects a null token_prior_row even then; see errors).
    token_row.assign(std::max<std::int64_t>(n, 1), -1);
    seq.assign(token_row.size(), 0);
    for (std::int64_t t = 0; t < n; ++t) {
      token_row[t] = t % 5 == 4 ? -1 : static_cast<std::int32_t>((t * 3 + t / 7) % rows);
      seq[t] = static_cast<std::int32_t>(t * 5 / std::max<std::int64_t>(n, 1));  // sequence 5 stays empty
    }
    rng g{mix_seed(static_cast<std::uint64_t>(e), static_cast<std::uint64_t>(n) + 7)};
    std::vector<std::int64_t> counts(e);
    for (int i = 0; i < e; ++i) counts[i] = g.below(4) == 0 ? 0 : g.below(50);
    counts[0] += 1;
    load_fractions.assign(e, 0.0f);
    pen::load_fractions(counts.data(), e, load_fractions.data());
    expert_rank.resize(e);
    for (int i = 0; i < e; ++i) expert_rank[i] = i % 4;
  }
};

enum class prior_table { prepared, within, global };

struct training_setup {
  const policy_data* pd = nullptr;
  prior_table table = prior_table::prepared;
  bool prior = false, probs = false, sequences = false, fractions = false, ranks = false;
  mr::mode mode = mr::mode::train;
};

template <class T>
mr::route_inputs<T> make_inputs(const T* z, std::int64_t n, int e, const float* bias, const training_setup& ts) {
  mr::route_inputs<T> in;
  in.logits = z;
  in.num_tokens = n;
  in.num_experts = e;
  in.expert_bias = bias;
  in.mode = ts.mode;
  if (ts.pd != nullptr) {
    const policy_data& pd = *ts.pd;
    const float* b = ts.table == prior_table::within ? pd.bias_within.data()
                     : ts.table == prior_table::global ? pd.bias_global.data() : pd.bias.data();
    const float* p = ts.table == prior_table::within ? pd.probs_within.data()
                     : ts.table == prior_table::global ? pd.probs_global.data() : pd.probs.data();
    if (ts.prior || ts.probs) {
      in.prior_rows = pd.rows;
      in.token_prior_row = pd.token_row.data();
    }
    if (ts.prior) in.prior_bias = b;
    if (ts.probs) in.prior_probs = p;
    if (ts.sequences) {
      in.sequence_ids = pd.seq.data();
      in.num_sequences = pd.num_sequences;
    }
    if (ts.fractions) in.load_fractions = pd.load_fractions.data();
    if (ts.ranks) {
      in.expert_rank = pd.expert_rank.data();
      in.rank = pd.rank;
    }
  }
  return in;
}

training_setup all_inputs(const policy_data& pd, prior_table table = prior_table::prepared) {
  training_setup ts;
  ts.pd = &pd;
  ts.table = table;
  ts.prior = ts.probs = ts.sequences = ts.fractions = ts.ranks = true;
  return ts;
}

// ---------------------------------------------------------------------------
// One typed forward and backward: indices, gates, the non-finite row counts,
// penalty values and workspace size, then dL/dz.

template <class Router, class T>
void typed_step(const Router& r, const mr::route_inputs<T>& in, const float* dw, int threads,
                const float* penalty_grads = nullptr) {
  const std::int64_t n = in.num_tokens;
  const int e = in.num_experts, k = r.top_k;
  std::vector<std::int32_t> idx(static_cast<std::size_t>(n) * k, sentinel_i);
  std::vector<float> gates(idx.size(), sentinel_f);
  std::vector<double> values(static_cast<std::size_t>(std::max(1, Router::num_penalties)), sentinel_d);
  const std::size_t bytes = pen::training_workspace_bytes(r, n, e, in.num_sequences);
  std::vector<unsigned char> ws(std::max<std::size_t>(bytes, 1), 0);
  std::int64_t counter = 5;
  mr::route_outputs out;
  out.indices = idx.data();
  out.gates = gates.data();
  out.nonfinite_rows = &counter;
  out.penalty_values = values.data();
  out.workspace = ws.data();
  out.workspace_bytes = bytes;
  const mr::route_report rep = mr::cpu::route(r, in, out, mr::cpu::execution{threads});
  H->vec(idx);
  H->vec(gates);
  H->val(rep.nonfinite_rows);
  H->val(counter);
  H->vec(values);
  H->val(static_cast<std::uint64_t>(bytes));
  std::vector<float> dz(static_cast<std::size_t>(n) * e, sentinel_f);
  mr::backward_args b;
  b.indices = idx.data();
  b.grad_gates = dw;
  b.grad_logits = dz.data();
  b.workspace = ws.data();
  b.workspace_bytes = bytes;
  b.penalty_grads = penalty_grads;
  mr::cpu::backward(r, in, b, mr::cpu::execution{threads});
  H->vec(dz);
}

struct shape {
  int e;
  std::int64_t n;
};

// Thread counts worth running: a CPU call splits its tokens over threads only
// from 257 tokens on (256 per thread at least), so below that the 2-thread
// run is the 1-thread run.
std::vector<int> token_threads(std::int64_t n) { return n > 256 ? std::vector<int>{1, 2} : std::vector<int>{1}; }

std::string shape_name(const shape& s, int k) { return "E" + S(s.e) + "_N" + S(s.n) + "_K" + S(k); }

const shape grid_shapes[] = {{7, 37}, {7, 300}, {64, 0}, {64, 37}, {64, 300}, {256, 37}, {256, 300}, {4096, 37}, {4096, 260}};

std::uint64_t shape_seed(int e, std::int64_t n) { return static_cast<std::uint64_t>(e) * 1000003ull + static_cast<std::uint64_t>(n); }

// ---------------------------------------------------------------------------
// Section: the 16-bit types' conversions.

void section_types() {
  H->section("types");
  H->run("bf16_fp16_from_float", [] {
    std::vector<float> xs = {0.0f, -0.0f, 1.0f, -1.0f, 0.1f, 1.0f / 3.0f, 65504.0f, 65519.0f, 65520.0f, 1e5f,
                             -1e5f, 6.1e-5f, 6.0e-8f, 2.9e-8f, 3.0e-8f, 1e-40f, -1e-40f, max_f, -max_f, inf_f,
                             -inf_f, nan_f, neg_nan_f, bits_float(0x7f800001u), bits_float(0x3f808000u),
                             bits_float(0x3f818000u), bits_float(0x3f80ffffu)};
    rng g{42};
    for (int i = 0; i < 2000; ++i) xs.push_back(bits_float(static_cast<std::uint32_t>(g.next())));
    for (float x : xs) {
      const mr::bfloat16 b = mr::bfloat16::from_float(x);
      const mr::float16 h = mr::float16::from_float(x);
      H->val(b.bits);
      H->val(h.bits);
    }
  });
}

// ---------------------------------------------------------------------------
// Section: every preset as a typed router, every dtype, the grid of shapes,
// K from the preset (clamped to E and MaxK), K = E = 7 where MaxK allows, K = 1.

void section_presets() {
  H->section("presets");
  std::vector<shape> shapes(std::begin(grid_shapes), std::end(grid_shapes));
  shapes.push_back({128, 300});
  shapes.push_back({8, 300});
  for (const shape& s : shapes) {
    const logit_set z(make_logits(shape_seed(s.e, s.n), s.n, s.e));
    const std::vector<float> bias = make_bias(shape_seed(s.e, s.n), s.e);
    const std::vector<float> dw = make_grads(shape_seed(s.e, s.n), static_cast<std::size_t>(s.n) * 32);
    for_presets([&](auto base, const char* pname, int own_e) {
      using R = decltype(base);
      if ((s.e == 128 || s.e == 8) && s.e != own_e) return;  // the extra shapes are the presets' own E
      std::vector<int> ks = {std::min({base.top_k, s.e, R::max_k})};
      if (s.e == 7 && R::max_k >= 7 && ks[0] != 7) ks.push_back(7);
      if (s.e == 64 && s.n == 37) ks.push_back(1);
      for (int k : ks) {
        R r = base;
        set_k(r, s.e, k);
        for_dtypes([&](auto tag, const char* dname) {
          using T = decltype(tag);
          for (int threads : {1, 2}) {
            const std::string name = std::string(pname) + "/" + dname + "/" + shape_name(s, k) + "/t" + S(threads);
            H->run(name, [&] {
              typed_step(r, make_inputs(z.get<T>(), s.n, s.e, bias.data(), training_setup{}), dw.data(), threads);
            });
          }
        });
      }
    });
  }
}

// ---------------------------------------------------------------------------
// Section: RPB's conditions on every preset, plus two routers with a prior and
// several penalties (and one in eval mode), on every dtype.

void section_conditions() {
  H->section("conditions");
  const float penalty_grads[] = {0.5f, 2.0f, -1.0f, 0.25f, 3.0f};
  const shape shapes[] = {{7, 37}, {64, 0}, {64, 300}, {256, 300}, {4096, 37}, {128, 300}, {8, 300}};
  for (const shape& s : shapes) {
    const logit_set z(make_logits(shape_seed(s.e, s.n) + 11, s.n, s.e));
    const std::vector<float> bias = make_bias(shape_seed(s.e, s.n) + 11, s.e);
    const std::vector<float> dw = make_grads(shape_seed(s.e, s.n) + 11, static_cast<std::size_t>(s.n) * 32);
    const policy_data pd(s.n, s.e);
    for_presets([&](auto base0, const char* pname, int own_e) {
      using R = decltype(base0);
      if ((s.e == 128 || s.e == 8) && s.e != own_e) return;
      R base = base0;
      set_k(base, s.e, std::min({base0.top_k, s.e, R::max_k}));
      namespace cd = mr::conditions;
      for_dtypes([&](auto tag, const char* dname) {
        using T = decltype(tag);
        for (int threads : token_threads(s.n)) {
          const std::string at = std::string(pname) + "/" + dname + "/" + shape_name(s, base.top_k) + "/t" + S(threads);
          auto step = [&](const char* cname, const auto& r, const training_setup& ts, const float* pg = nullptr) {
            H->run(at + "/" + cname, [&] {
              typed_step(r, make_inputs(z.get<T>(), s.n, s.e, bias.data(), ts), dw.data(), threads, pg);
            });
          };
          const training_setup all = all_inputs(pd);
          step("sft", cd::sft(base), all);
          step("lbl", cd::lbl(base, 1e-2f), all);
          step("rpb", cd::rpb(base, 1.0f), all);
          step("rpb_hard", cd::rpb_hard(base), all);
          step("router_l2", cd::router_l2(base), all);
          step("kl_to_base", cd::kl_to_base(base, 1e-2f), all);
          step("logit_l2", cd::logit_l2(base), all);
          step("z_loss", cd::z_loss(base), all);
          step("within_soft", cd::within_soft(base, 0.8f), all_inputs(pd, prior_table::within));
          step("within_hard", cd::within_hard(base), all_inputs(pd, prior_table::within));
          step("global_hard", cd::global_hard(base), all_inputs(pd, prior_table::global));
          const auto multi1 = mr::with_policies(
              base, mr::prior::log_prior_bias{0.5f, false},
              pen::load_balance{1e-2f, pen::load_balance::scope::sequence}, pen::z_loss{1e-3f}, pen::kl_to_base{1e-2f},
              pen::logit_l2{1e-2f}, pen::locality{1e-2f, 1e-3f});
          step("multi_soft_seq", multi1, all, penalty_grads);
          training_setup eval = all;
          eval.mode = mr::mode::eval;
          step("multi_soft_seq_eval", multi1, eval, penalty_grads);
          const auto multi2 =
              mr::with_policies(base, mr::prior::prior_override{},
                                pen::load_balance{5e-3f, pen::load_balance::scope::global_batch}, pen::locality{2e-2f, 0.05f});
          step("multi_hard_global", multi2, all);
          auto off = multi1;
          mr::get<pen::z_loss>(off).coefficient = 0.0f;
          mr::get<pen::kl_to_base>(off).coefficient = 0.0f;
          mr::get<mr::prior::log_prior_bias>(off).beta = 0.0f;
          step("multi_partly_off", off, all);
        }
      });
    });
  }
}

// ---------------------------------------------------------------------------
// Section: run-time routers: every gating x selection x prior kind, penalty
// sets (off with neutral inputs; all five; sequence scope with upstream
// penalty gradients; global batch; all five in eval mode).

struct penalty_set {
  const char* name;
  rt::router_config (*apply)(rt::router_config);
  bool probs, sequences, fractions, ranks;
  mr::mode mode;
  const float* penalty_grads;
};

const float runtime_penalty_grads[rt::num_penalties] = {0.5f, 2.0f, -1.0f, 0.25f, 3.0f};

rt::router_config pen_off(rt::router_config c) { return c; }
rt::router_config pen_all(rt::router_config c) {
  c.load_balance = pen::load_balance{1e-2f, pen::load_balance::scope::batch};
  c.z_loss = pen::z_loss{1e-3f};
  c.kl_to_base = pen::kl_to_base{1e-2f};
  c.logit_l2 = pen::logit_l2{1e-2f};
  c.locality = pen::locality{1e-2f, 1e-3f};
  return c;
}
rt::router_config pen_seq(rt::router_config c) {
  c.load_balance = pen::load_balance{2e-2f, pen::load_balance::scope::sequence};
  c.locality = pen::locality{5e-2f, 0.1f};
  return c;
}
rt::router_config pen_global(rt::router_config c) {
  c.load_balance = pen::load_balance{1e-2f, pen::load_balance::scope::global_batch};
  c.z_loss = pen::z_loss{1e-2f};
  c.logit_l2 = pen::logit_l2{1e-3f};
  return c;
}

const penalty_set penalty_sets[] = {
    {"off", pen_off, false, false, false, false, mr::mode::train, nullptr},
    {"all", pen_all, true, true, true, true, mr::mode::train, nullptr},
    {"seq", pen_seq, false, true, false, true, mr::mode::train, runtime_penalty_grads},
    {"global", pen_global, true, true, true, true, mr::mode::train, nullptr},
    {"all_eval", pen_all, true, true, true, true, mr::mode::eval, nullptr},
};

struct prior_variant {
  const char* name;
  rt::prior_kind kind;
  float beta;
  bool bias_gates;
};
const prior_variant prior_variants[] = {
    {"none", rt::prior_kind::none, 1.0f, true},
    {"lpb", rt::prior_kind::log_prior_bias, 0.7f, true},
    {"lpb_sel", rt::prior_kind::log_prior_bias, 1.3f, false},
    {"override", rt::prior_kind::prior_override, 1.0f, true},
};

const std::pair<rt::gating_kind, const char*> runtime_gatings[] = {
    {rt::gating_kind::softmax, "softmax"},
    {rt::gating_kind::sigmoid, "sigmoid"},
    {rt::gating_kind::sqrt_softplus, "sqrt_softplus"},
    {rt::gating_kind::softmax_after_topk, "softmax_after_topk"},
};
const std::pair<rt::selection_kind, const char*> runtime_selections[] = {
    {rt::selection_kind::top_k, "top_k"},
    {rt::selection_kind::expert_bias, "expert_bias"},
    {rt::selection_kind::group_limited, "group_limited"},
    {rt::selection_kind::group_limited_bias, "group_limited_bias"},
    {rt::selection_kind::fixed, "fixed"},
};

rt::router_config runtime_config(rt::gating_kind g, rt::selection_kind sel, int e, int k) {
  rt::router_config c;
  c.gating = g;
  c.selection = sel;
  c.top_k = k;
  c.normalize = (static_cast<int>(g) + static_cast<int>(sel) + k) % 2 == 0;
  c.scaling_factor = k % 2 ? 1.0f : 1.75f;
  const group_params gp = groups_for(e, k);
  c.groups = gp.groups;
  c.top_groups = gp.top_groups;
  c.per_group_k = gp.per_group_k;
  return c;
}

// rt::route + rt::backward; the workspace size comes from rt::workspace_bytes.
void runtime_step(const rt::router_config& c, const mr::route_inputs<float>& in, const float* dw, int threads,
                  const float* penalty_grads) {
  const std::int64_t n = in.num_tokens;
  const int e = in.num_experts, k = c.top_k;
  const std::size_t bytes = rt::workspace_bytes(c, n, e, in.num_sequences);
  H->val(static_cast<std::uint64_t>(bytes));
  std::vector<unsigned char> ws(std::max<std::size_t>(bytes, 1), 0);
  std::vector<std::int32_t> idx(static_cast<std::size_t>(n) * k, sentinel_i);
  std::vector<float> gates(idx.size(), sentinel_f);
  std::vector<double> values(rt::num_penalties, sentinel_d);
  std::int64_t counter = 0;
  mr::route_outputs out;
  out.indices = idx.data();
  out.gates = gates.data();
  out.nonfinite_rows = &counter;
  out.penalty_values = values.data();
  out.workspace = ws.data();
  out.workspace_bytes = bytes;
  const mr::route_report rep = rt::route(c, in, out, mr::cpu::execution{threads});
  H->vec(idx);
  H->vec(gates);
  H->val(rep.nonfinite_rows);
  H->val(counter);
  H->vec(values);
  std::vector<float> dz(static_cast<std::size_t>(n) * e, sentinel_f);
  mr::backward_args b;
  b.indices = idx.data();
  b.grad_gates = dw;
  b.grad_logits = dz.data();
  b.workspace = ws.data();
  b.workspace_bytes = bytes;
  b.penalty_grads = penalty_grads;
  rt::backward(c, in, b, mr::cpu::execution{threads});
  H->vec(dz);
}

std::vector<int> runtime_ks(const shape& s) {
  switch (s.e) {
    case 7: return {2, 7};
    case 64: return s.n == 37 ? std::vector<int>{1, 6} : std::vector<int>{6};
    case 256: return {8};
    default: return {16};
  }
}

void section_runtime() {
  H->section("runtime");
  const shape shapes[] = {{7, 37}, {7, 300}, {64, 0}, {64, 37}, {64, 300}, {256, 37}, {256, 300}, {4096, 37}, {4096, 260}};
  for (const shape& s : shapes) {
    const std::vector<float> z = make_logits(shape_seed(s.e, s.n) + 21, s.n, s.e);
    const std::vector<float> bias = make_bias(shape_seed(s.e, s.n) + 21, s.e);
    const std::vector<float> dw = make_grads(shape_seed(s.e, s.n) + 21, static_cast<std::size_t>(s.n) * 16);
    const policy_data pd(s.n, s.e);
    const bool big_e = s.e == 4096, big = big_e && s.n > 256;
    for (int k : runtime_ks(s)) {
      for (const auto& [g, gname] : runtime_gatings)
        for (const auto& [sel, sname] : runtime_selections)
          for (const prior_variant& pv : prior_variants)
            for (const penalty_set& ps : penalty_sets) {
              const bool main_set = std::strcmp(ps.name, "off") == 0 || std::strcmp(ps.name, "all") == 0;
              // E = 4096 is the slow case: the main penalty sets only, and with
              // 260 tokens (two threads) no prior and the 2-thread run only.
              if (big_e && !main_set) continue;
              if (big && pv.kind != rt::prior_kind::none) continue;
              std::vector<int> thread_counts = main_set ? token_threads(s.n) : std::vector<int>{1};
              if (big) thread_counts = {2};
              rt::router_config c = ps.apply(runtime_config(g, sel, s.e, k));
              c.prior = pv.kind;
              c.prior_bias = mr::prior::log_prior_bias{pv.beta, pv.bias_gates};
              training_setup ts;
              ts.pd = &pd;
              ts.prior = pv.kind != rt::prior_kind::none || ps.probs;
              ts.probs = ps.probs;
              ts.sequences = ps.sequences;
              ts.fractions = ps.fractions;
              ts.ranks = ps.ranks;
              ts.mode = ps.mode;
              const mr::route_inputs<float> in =
                  make_inputs(z.data(), s.n, s.e, rt::selection_uses_bias(sel) ? bias.data() : nullptr, ts);
              const bool invalid = g == rt::gating_kind::softmax_after_topk && rt::selection_uses_bias(sel);
              for (int threads : thread_counts) {
                const std::string name = std::string(gname) + "/" + sname + "/" + pv.name + "/" + ps.name + "/" +
                                         shape_name(s, k) + "/t" + S(threads);
                H->run(name, [&] { runtime_step(c, in, dw.data(), threads, ps.penalty_grads); }, invalid);
              }
            }
    }
  }
}

// ---------------------------------------------------------------------------
// Section: typed admission (cpu::admit and its backward) for every preset's
// router, every admission preset and further policies, 1, 3 and 4 groups
// (one of them empty), per-expert capacities, every dtype.

struct group_setup {
  const char* name;
  int groups;
  int kind;  // 0: null ids; 1: t % 3; 2: contiguous thirds of 4 groups (group 3 empty)
};
const group_setup group_setups[] = {{"g1", 1, 0}, {"g3", 3, 1}, {"g4_empty", 4, 2}};

std::vector<std::int32_t> make_group_ids(const group_setup& gs, std::int64_t n) {
  std::vector<std::int32_t> ids(n, 0);
  for (std::int64_t t = 0; t < n; ++t)
    ids[t] = gs.kind == 1 ? static_cast<std::int32_t>(t % 3) : static_cast<std::int32_t>(t * 3 / std::max<std::int64_t>(n, 1));
  return ids;
}

std::vector<std::int64_t> make_capacity(int e, std::int64_t n, int k) {
  std::vector<std::int64_t> cap(e);
  const std::int64_t mean = std::max<std::int64_t>(1, n * k / e);
  for (int i = 0; i < e; ++i) cap[i] = i % 5 == 0 ? 0 : (i % 3 == 0 ? mean * 2 : (mean + 1) / 2);
  return cap;
}

// f(policy, name, use_capacity_array)
template <class F>
void for_admission_policies(F&& f) {
  f(ad::dropless(), "dropless", false);
  f(ad::cipher_strict(0.5f, 1.0), "cipher_strict(0.5,1)", false);
  f(ad::cipher_strict(0.01f), "cipher_strict(0.01)", false);
  f(ad::cipher_reroute(0.5f, 1.0, 1.0), "cipher_reroute(0.5,1,1)", false);
  f(ad::cipher_reroute(0.0f, 0.5, 4.0), "cipher_reroute(0,0.5,4)", false);
  f(ad::cipher_reroute(-1.0f), "cipher_reroute(-1)", true);
  f(ad::locmoe(1.0), "locmoe(1)", false);
  f(ad::locmoe(0.5, 0.2f), "locmoe(0.5,0.2)", false);
  f(ad::capacity_position(1.0), "capacity_position(1)", false);
  f(ad::capacity_position(0.5, 2), "capacity_position(0.5,2)", false);
  f(ad::capacity_probs(1.25), "capacity_probs(1.25)", false);
  f(ad::capacity_probs(0.3, 1), "capacity_probs(0.3,1)", false);
  {
    ad::policy<ad::logit, ad::drop> p;
    p.threshold = 0.25f;
    p.capacity_factor = 0.75;
    p.overflow.renormalize = true;
    f(p, "logit_drop_renorm", false);
  }
  {
    ad::policy<ad::probability, ad::reroute> p;
    p.capacity_factor = 0.5;
    p.overflow.fill_factor = 2.0;
    p.overflow.max_rounds = 1;
    f(p, "probability_reroute_1round", false);
  }
  {
    ad::policy<ad::logit, ad::reroute> p;
    p.threshold = -0.5f;
    p.overflow.max_rounds = 0;
    f(p, "logit_reroute_0rounds_capacity", true);
  }
  {
    ad::policy<ad::cosine, ad::drop> p;
    p.threshold = 0.3f;
    p.capacity_factor = 0.8;
    p.overflow.renormalize = true;
    f(p, "cosine_drop_renorm", false);
  }
  {
    ad::policy<ad::position, ad::drop> p;
    p.overflow.renormalize = true;
    f(p, "position_drop_renorm_capacity", true);
  }
}

template <class Router, class Policy, class T>
void admit_step(const Router& r, const Policy& p, const T* z, std::int64_t n, int e, const float* bias,
                const group_setup& gs, const std::vector<float>& hn, const std::vector<float>& wn, bool use_cap,
                const float* dw, int threads) {
  const int k = r.top_k;
  const std::size_t slots = static_cast<std::size_t>(n) * k;
  std::vector<std::int32_t> routed(slots, sentinel_i);
  std::vector<float> routed_gates(slots, sentinel_f);
  mr::route_inputs<T> rin;
  rin.logits = z;
  rin.num_tokens = n;
  rin.num_experts = e;
  rin.expert_bias = bias;
  mr::cpu::route(r, rin, mr::route_outputs{routed.data(), routed_gates.data()}, mr::cpu::execution{threads});
  const std::vector<std::int32_t> ids = make_group_ids(gs, n);
  const std::vector<std::int64_t> cap = make_capacity(e, n, k);
  mr::admission_inputs<T> in;
  in.logits = z;
  in.num_tokens = n;
  in.num_experts = e;
  in.routed_indices = routed.data();
  in.routed_gates = routed_gates.data();
  in.hidden_norms = hn.data();
  in.weight_norms = wn.data();
  in.group_ids = gs.kind == 0 ? nullptr : ids.data();
  in.num_groups = gs.groups;
  in.capacity = use_cap ? cap.data() : nullptr;
  std::vector<std::int32_t> idx(slots, sentinel_i);
  std::vector<float> gates(slots, sentinel_f);
  std::vector<std::int8_t> status(slots, std::int8_t{-5});
  mr::admission_report written;
  written.offered = -3;
  const mr::admission_report rep =
      mr::cpu::admit(r, p, in, mr::admission_outputs{idx.data(), gates.data(), status.data(), &written},
                     mr::cpu::execution{threads});
  H->vec(idx);
  H->vec(gates);
  H->vec(status);
  const mr::admission_report* reports[] = {&rep, &written};
  for (const mr::admission_report* x : reports) {
    H->val(x->offered);
    H->val(x->kept);
    H->val(x->rerouted);
    H->val(x->dropped);
    H->val(x->below_threshold);
    H->val(x->over_capacity);
    H->val(x->tokens_without_experts);
    H->val(x->invalid);
  }
  std::vector<float> dz(static_cast<std::size_t>(n) * e, sentinel_f);
  mr::admission_backward_args b;
  b.routed_indices = routed.data();
  b.admitted_indices = idx.data();
  b.grad_gates = dw;
  b.grad_logits = dz.data();
  mr::cpu::admission_backward(r, p, rin, b, mr::cpu::execution{threads});
  H->vec(dz);
  H->flag(ad::renormalizes(p));
}

void section_admission() {
  H->section("admission");
  for_presets([&](auto base, const char* pname, int own_e) {
    using R = decltype(base);
    const shape shapes[] = {{64, 0}, {7, 37}, {own_e, 300}, {64, 1100}};
    for (const shape& s : shapes) {
      const logit_set z(make_logits(shape_seed(s.e, s.n) + 31, s.n, s.e));
      const std::vector<float> bias = make_bias(shape_seed(s.e, s.n) + 31, s.e);
      const std::vector<float> dw = make_grads(shape_seed(s.e, s.n) + 31, static_cast<std::size_t>(s.n) * 8);
      const std::vector<float> hn = make_norms(shape_seed(s.e, s.n) + 31, static_cast<std::size_t>(s.n));
      const std::vector<float> wn = make_norms(shape_seed(s.e, s.n) + 32, static_cast<std::size_t>(s.e));
      R r = base;
      set_k(r, s.e, std::min({base.top_k, s.e, R::max_k}));
      for_dtypes([&](auto tag, const char* dname) {
        using T = decltype(tag);
        if (s.n > 1000 && !std::is_same_v<T, float>) return;
        for_admission_policies([&](const auto& p, const char* aname, bool use_cap) {
          for (const group_setup& gs : group_setups) {
            // Reroute rounds split their pending tokens from 64 on and the
            // affinity pass from 512 tokens: 37 tokens stay sequential, and
            // 1100 tokens (there to split the affinity pass) run on 2 threads.
            if (s.n > 1000 && gs.kind == 2) continue;
            const std::vector<int> thread_counts = s.n < 64 ? std::vector<int>{1} : s.n > 1000 ? std::vector<int>{2} : std::vector<int>{1, 2};
            for (int threads : thread_counts) {
              const std::string name = std::string(pname) + "/" + dname + "/" + shape_name(s, r.top_k) + "/" + aname +
                                       "/" + gs.name + "/t" + S(threads);
              H->run(name, [&] {
                admit_step(r, p, z.get<T>(), s.n, s.e, bias.data(), gs, hn, wn, use_cap, dw.data(), threads);
              });
            }
          }
        });
      });
    }
  });
}

// ---------------------------------------------------------------------------
// Section: run-time admission (rt::admit, every affinity x overflow,
// renormalisation, dropless, groups), and rt::backward with the admitted
// indices, with and without penalties.

struct admission_variant {
  const char* name;
  rt::admission_config a;
};

std::vector<admission_variant> admission_variants() {
  std::vector<admission_variant> v;
  auto add = [&](const char* name, bool dropless, rt::affinity_kind aff, rt::overflow_kind of, float tau, double cf,
                 std::int64_t minc, bool renorm, double fill, int rounds) {
    rt::admission_config a;
    a.dropless = dropless;
    a.affinity = aff;
    a.overflow = of;
    a.threshold = tau;
    a.capacity_factor = cf;
    a.min_capacity = minc;
    a.renormalize = renorm;
    a.fill_factor = fill;
    a.max_rounds = rounds;
    v.push_back({name, a});
  };
  const float none = -inf_f;
  using A = rt::affinity_kind;
  using O = rt::overflow_kind;
  add("dropless", true, A::probability, O::drop, none, 1.0, 0, false, 4.0, -1);
  add("prob_drop", false, A::probability, O::drop, none, 1.0, 0, false, 4.0, -1);
  add("prob_drop_renorm", false, A::probability, O::drop, none, 0.5, 2, true, 4.0, -1);
  add("prob_reroute", false, A::probability, O::reroute, none, 0.75, 0, false, 2.0, -1);
  add("logit_drop", false, A::logit, O::drop, 0.5f, 1.0, 0, false, 4.0, -1);
  add("logit_reroute", false, A::logit, O::reroute, 0.0f, 0.5, 0, false, 1.0, 1);
  add("cosine_drop_renorm", false, A::cosine, O::drop, 0.3f, 1.25, 0, true, 4.0, -1);
  add("cosine_reroute", false, A::cosine, O::reroute, 0.2f, 1.0, 0, false, 4.0, -1);
  add("position_drop", false, A::position, O::drop, none, 1.0, 0, false, 4.0, -1);
  add("position_drop_renorm", false, A::position, O::drop, none, 0.5, 1, true, 4.0, -1);
  add("position_reroute_invalid", false, A::position, O::reroute, none, 1.0, 0, false, 4.0, -1);
  return v;
}

void section_runtime_admission() {
  H->section("runtime_admission");
  const shape shapes[] = {{7, 37}, {64, 300}, {256, 300}, {64, 1100}};
  const std::vector<admission_variant> variants = admission_variants();
  for (const shape& s : shapes) {
    const std::vector<float> z = make_logits(shape_seed(s.e, s.n) + 41, s.n, s.e);
    const std::vector<float> bias = make_bias(shape_seed(s.e, s.n) + 41, s.e);
    const std::vector<float> dw = make_grads(shape_seed(s.e, s.n) + 41, static_cast<std::size_t>(s.n) * 16);
    const std::vector<float> hn = make_norms(shape_seed(s.e, s.n) + 41, static_cast<std::size_t>(s.n));
    const std::vector<float> wn = make_norms(shape_seed(s.e, s.n) + 42, static_cast<std::size_t>(s.e));
    const policy_data pd(s.n, s.e);
    const int k = s.e == 7 ? 3 : (s.e == 64 ? 6 : 8);
    for (const auto& [g, gname] : runtime_gatings)
      for (std::size_t vi = 0; vi < variants.size(); ++vi) {
        const admission_variant& av = variants[vi];
        for (const group_setup& gs : group_setups) {
          if (gs.kind == 2) continue;
          for (int penalties = 0; penalties < 2; ++penalties) {
            if (penalties && vi % 2 == 0) continue;  // penalties with every other variant
            const std::vector<int> thread_counts = s.e == 64 ? (s.n > 1000 ? std::vector<int>{2} : std::vector<int>{1, 2})
                                                             : std::vector<int>{1};
            for (int threads : thread_counts) {
              const std::string name = std::string(gname) + "/" + av.name + "/" + gs.name + (penalties ? "/penalties" : "") +
                                       "/" + shape_name(s, k) + "/t" + S(threads);
              rt::router_config c = runtime_config(g, g == rt::gating_kind::sigmoid && penalties ? rt::selection_kind::expert_bias
                                                                                            : rt::selection_kind::top_k,
                                                   s.e, k);
              if (penalties) c = pen_all(c);
              const bool invalid = std::strstr(av.name, "invalid") != nullptr;
              H->run(name, [&] {
                const training_setup ts = penalties ? all_inputs(pd) : training_setup{};
                const mr::route_inputs<float> rin = make_inputs(z.data(), s.n, s.e, bias.data(), ts);
                const std::size_t bytes = rt::workspace_bytes(c, s.n, s.e, rin.num_sequences);
                std::vector<unsigned char> ws(std::max<std::size_t>(bytes, 1), 0);
                const std::size_t slots = static_cast<std::size_t>(s.n) * k;
                std::vector<std::int32_t> routed(slots, sentinel_i);
                std::vector<float> routed_gates(slots, sentinel_f);
                std::vector<double> values(rt::num_penalties, sentinel_d);
                mr::route_outputs out{routed.data(), routed_gates.data()};
                out.penalty_values = values.data();
                out.workspace = ws.data();
                out.workspace_bytes = bytes;
                rt::route(c, rin, out, mr::cpu::execution{threads});
                H->vec(values);
                const std::vector<std::int32_t> ids = make_group_ids(gs, s.n);
                mr::admission_inputs<float> in;
                in.logits = z.data();
                in.num_tokens = s.n;
                in.num_experts = s.e;
                in.routed_indices = routed.data();
                in.routed_gates = routed_gates.data();
                in.hidden_norms = hn.data();
                in.weight_norms = wn.data();
                in.group_ids = gs.kind == 0 ? nullptr : ids.data();
                in.num_groups = gs.groups;
                std::vector<std::int32_t> idx(slots, sentinel_i);
                std::vector<float> gates(slots, sentinel_f);
                std::vector<std::int8_t> status(slots, std::int8_t{-5});
                const mr::admission_report rep = rt::admit(c, av.a, in, mr::admission_outputs{idx.data(), gates.data(), status.data()},
                                                           mr::cpu::execution{threads});
                H->vec(idx);
                H->vec(gates);
                H->vec(status);
                H->val(rep.offered);
                H->val(rep.kept);
                H->val(rep.rerouted);
                H->val(rep.dropped);
                H->val(rep.below_threshold);
                H->val(rep.over_capacity);
                H->val(rep.tokens_without_experts);
                H->val(rep.invalid);
                std::vector<float> dz(static_cast<std::size_t>(s.n) * s.e, sentinel_f);
                mr::backward_args b;
                b.indices = routed.data();
                b.admitted_indices = idx.data();
                b.renormalize = rt::renormalizes(av.a);
                b.grad_gates = dw.data();
                b.grad_logits = dz.data();
                b.workspace = ws.data();
                b.workspace_bytes = bytes;
                rt::backward(c, rin, b, mr::cpu::execution{threads});
                H->vec(dz);
                H->flag(b.renormalize);
              }, invalid);
            }
          }
        }
      }
  }
}

// ---------------------------------------------------------------------------
// Section: expert choice (forward, backward, and the dispatch of its result).

void dispatch_and_hash(const std::int32_t* indices, std::int64_t n, int slots, int e, int align, int ranks,
                       const std::int32_t* expert_rank, bool optional) {
  mr::dispatch_inputs in;
  in.indices = indices;
  in.num_tokens = n;
  in.slots_per_token = slots;
  in.num_experts = e;
  in.align = align;
  in.num_ranks = ranks;
  in.expert_rank = expert_rank;
  std::vector<std::int64_t> counts(e, -9), offsets(static_cast<std::size_t>(e) + 1, -9);
  std::vector<std::int64_t> perm(static_cast<std::size_t>(mr::dispatch_rows_bound(n, slots, e, align)), -9);
  std::vector<std::int64_t> inverse(static_cast<std::size_t>(n) * slots, -9), rank_counts(ranks, -9);
  mr::dispatch_outputs out;
  out.counts = counts.data();
  out.offsets = offsets.data();
  if (optional) {
    out.permutation = perm.data();
    out.inverse = inverse.data();
    out.rank_counts = rank_counts.data();
  }
  const std::int64_t rows = mr::cpu::dispatch(in, out);
  H->val(rows);
  H->val(mr::dispatch_rows_bound(n, slots, e, align));
  H->vec(counts);
  H->vec(offsets);
  if (optional) {
    H->vec(perm);
    H->vec(inverse);
    H->vec(rank_counts);
  }
}

void section_expert_choice() {
  H->section("expert_choice");
  struct ec_params {
    const char* name;
    int top_k;
    double cf;
    std::int64_t min_cap;
    bool cap_array;
  };
  const ec_params params[] = {{"k1_cf1", 1, 1.0, 0, false},
                              {"k2_cf1.25", 2, 1.25, 0, false},
                              {"k2_cf0.5_min3", 2, 0.5, 3, false},
                              {"k4_cf2", 4, 2.0, 0, false},
                              {"capacity", 2, 1.0, 0, true}};
  const shape shapes[] = {{64, 0}, {7, 37}, {7, 300}, {64, 300}, {256, 300}, {64, 1100}, {4096, 37}};
  for (const shape& s : shapes) {
    const logit_set z(make_logits(shape_seed(s.e, s.n) + 51, s.n, s.e));
    const std::vector<float> dw = make_grads(shape_seed(s.e, s.n) + 51, static_cast<std::size_t>(s.n) * s.e);
    for_dtypes([&](auto tag, const char* dname) {
      using T = decltype(tag);
      if (s.n > 1000 && !std::is_same_v<T, float>) return;
      for (const ec_params& p : params)
        for (const group_setup& gs : group_setups) {
          if (gs.kind == 2 && s.e > 64) continue;
          for (int threads : {1, 2}) {
            const std::string name =
                std::string(dname) + "/" + shape_name(s, p.top_k) + "/" + p.name + "/" + gs.name + "/t" + S(threads);
            H->run(name, [&] {
              const std::vector<std::int32_t> ids = make_group_ids(gs, s.n);
              const std::vector<std::int64_t> cap = make_capacity(s.e, s.n, p.top_k);
              mr::selection::expert_choice pol;
              pol.top_k = p.top_k;
              pol.capacity_factor = p.cf;
              pol.min_capacity = p.min_cap;
              mr::expert_choice_inputs<T> in;
              in.logits = z.get<T>();
              in.num_tokens = s.n;
              in.num_experts = s.e;
              in.group_ids = gs.kind == 0 ? nullptr : ids.data();
              in.num_groups = gs.groups;
              in.capacity = p.cap_array ? cap.data() : nullptr;
              const std::size_t pairs = static_cast<std::size_t>(s.n) * s.e;
              std::vector<std::int32_t> idx(pairs, sentinel_i), ept(s.n, sentinel_i);
              std::vector<float> gates(pairs, sentinel_f);
              mr::expert_choice_report written;
              written.assignments = -3;
              mr::expert_choice_outputs out;
              out.indices = idx.data();
              out.gates = gates.data();
              out.experts_per_token = ept.data();
              out.report = &written;
              const mr::expert_choice_report rep = mr::cpu::expert_choice(pol, in, out, mr::cpu::execution{threads});
              H->vec(idx);
              H->vec(gates);
              H->vec(ept);
              const mr::expert_choice_report* reports[] = {&rep, &written};
              for (const mr::expert_choice_report* x : reports) {
                H->val(x->assignments);
                H->val(x->tokens_without_experts);
                H->val(x->max_experts_per_token);
                H->val(x->invalid);
              }
              std::vector<float> dz(pairs, sentinel_f);
              mr::cpu::expert_choice_backward(in, idx.data(), dw.data(), dz.data(), mr::cpu::execution{threads});
              H->vec(dz);
              dispatch_and_hash(idx.data(), s.n, s.e, s.e, 4, s.e % 4 == 0 ? 4 : 1, nullptr, true);
            });
          }
        }
    });
  }
}

// ---------------------------------------------------------------------------
// Section: dispatch metadata of index arrays with -1 entries: alignments,
// rank counts with the contiguous and a custom expert map, optional outputs.

void section_dispatch() {
  H->section("dispatch");
  struct dshape {
    std::int64_t n;
    int slots, e;
  };
  const dshape shapes[] = {{37, 2, 7}, {300, 6, 64}, {300, 8, 256}, {37, 16, 4096}, {0, 4, 64}, {1000, 1, 8}, {37, 7, 7}};
  for (const dshape& d : shapes) {
    rng g{mix_seed(static_cast<std::uint64_t>(d.e), static_cast<std::uint64_t>(d.n * 16 + d.slots))};
    std::vector<std::int32_t> idx(static_cast<std::size_t>(d.n) * d.slots);
    for (auto& x : idx) x = g.below(5) == 0 ? -1 : g.below(d.e);
    if (d.e == 256)  // a hot expert
      for (std::size_t i = 0; i < idx.size(); i += 3) idx[i] = 17;
    std::vector<int> rank_options = {1, 2, 4, 8, 7};
    for (int align : {1, 4, 128})
      for (int ranks : rank_options) {
        if (d.e % ranks != 0) continue;
        for (int custom = 0; custom < 2; ++custom)
          for (int optional = 0; optional < 2; ++optional) {
            if (!optional && custom) continue;
            std::vector<std::int32_t> er(d.e);
            for (int e = 0; e < d.e; ++e) er[e] = (e * 3 + 1) % ranks;
            const std::string name = "N" + S(d.n) + "_S" + S(d.slots) + "_E" + S(d.e) + "/align" + S(align) + "/R" +
                                     S(ranks) + (custom ? "/custom_ranks" : "") + (optional ? "" : "/required_only");
            H->run(name, [&] {
              dispatch_and_hash(idx.data(), d.n, d.slots, d.e, align, ranks, custom ? er.data() : nullptr, optional != 0);
            });
          }
      }
  }
  // Dispatch of an admitted result (drops from cipher_strict) and of a routed one.
  H->run("qwen3_cipher_strict_admitted", [] {
    const int e = 128;
    const std::int64_t n = 300;
    auto r = mr::presets::qwen3();
    const std::vector<float> z = make_logits(777, n, e);
    const std::vector<float> hn = make_norms(777, n), wn = make_norms(778, e);
    std::vector<std::int32_t> routed(n * r.top_k), idx(n * r.top_k);
    std::vector<float> gates(n * r.top_k), agates(n * r.top_k);
    mr::cpu::route(r, mr::route_inputs<float>{z.data(), n, e}, mr::route_outputs{routed.data(), gates.data()});
    mr::admission_inputs<float> in;
    in.logits = z.data();
    in.num_tokens = n;
    in.num_experts = e;
    in.routed_indices = routed.data();
    in.routed_gates = gates.data();
    in.hidden_norms = hn.data();
    in.weight_norms = wn.data();
    mr::cpu::admit(r, ad::cipher_strict(0.3f, 0.8), in, mr::admission_outputs{idx.data(), agates.data()});
    dispatch_and_hash(routed.data(), n, r.top_k, e, 128, 8, nullptr, true);
    dispatch_and_hash(idx.data(), n, r.top_k, e, 128, 8, nullptr, true);
  });
}

// ---------------------------------------------------------------------------
// Section: Router-L2 on router weights (value and accumulated gradients).

void section_router_l2() {
  H->section("router_l2");
  const std::int64_t sizes[] = {0, 1, 4095, 4096, 4097, 10000};
  rng g{31337};
  for (float coef : {1e4f, 0.5f})
    for (int layers : {1, 2, 3})
      for (int with_grad = 0; with_grad < 2; ++with_grad)
        for (std::size_t first = 0; first < std::size(sizes); ++first) {
          const std::string name = "coef" + std::string(coef > 1.0f ? "1e4" : "0.5") + "/L" + S(layers) + "/size" +
                                   S(sizes[first]) + (with_grad ? "/grad" : "/value_only");
          std::vector<std::vector<float>> w(layers), w0(layers), dw(layers);
          std::vector<pen::router_weights> rw(layers);
          for (int l = 0; l < layers; ++l) {
            const std::int64_t size = sizes[(first + l * 2) % std::size(sizes)];
            w[l].resize(size);
            w0[l].resize(size);
            dw[l].resize(size);
            for (std::int64_t i = 0; i < size; ++i) {
              w[l][i] = g.sym(0.5f);
              w0[l][i] = i % 7 == 0 ? w[l][i] : w[l][i] + g.sym(0.0078125f);
              dw[l][i] = g.sym(1.0f);
            }
            rw[l] = pen::router_weights{w[l].data(), w0[l].data(), size, with_grad ? dw[l].data() : nullptr};
          }
          H->run(name, [&] {
            const double v = pen::router_l2{coef}.apply(rw.data(), layers);
            H->val(v);
            for (int l = 0; l < layers; ++l) H->vec(dw[l]);
          });
        }
}

// ---------------------------------------------------------------------------
// Section: the prior builder and preparation, shuffles and their validation.

void section_prior() {
  H->section("prior");
  const shape shapes[] = {{7, 37}, {64, 300}, {256, 300}, {4096, 37}};
  for (const shape& s : shapes) {
    const logit_set z(make_logits(shape_seed(s.e, s.n) + 61, s.n, s.e));
    const std::int64_t rows = 5;
    std::vector<std::int32_t> token_rows(s.n);
    for (std::int64_t t = 0; t < s.n; ++t) token_rows[t] = t % 7 == 6 ? -1 : static_cast<std::int32_t>(t % rows);
    for_gatings([&](auto gtag, const char* gname) {
      using G = decltype(gtag);
      for_dtypes([&](auto tag, const char* dname) {
        using T = decltype(tag);
        const std::string at = std::string(gname) + "/" + dname + "/E" + S(s.e) + "_N" + S(s.n);
        H->run(at + "/build_prepare", [&] {
          mr::route_inputs<T> in;
          in.logits = z.get<T>();
          in.num_tokens = s.n;
          in.num_experts = s.e;
          std::vector<float> pi(static_cast<std::size_t>(rows + 1) * s.e, sentinel_f);
          // rows + 1 rows: the last one receives no token
          const mr::prior::build_report rep = mr::prior::build<G>(in, token_rows.data(), rows + 1, pi.data());
          H->vec(pi);
          H->val(rep.tokens_used);
          H->vec(rep.empty_rows);
          for (const mr::prior::clamp_bounds& bounds : {mr::prior::clamp_bounds{}, mr::prior::clamp_bounds{0.2f, 2.0f}}) {
            std::vector<float> b(static_cast<std::size_t>(rows) * s.e, sentinel_f), p(b.size(), sentinel_f);
            const mr::prior::prepare_report pr = mr::prior::prepare(pi.data(), rows, s.e, b.data(), p.data(), bounds);
            H->vec(b);
            H->vec(p);
            H->val(pr.upper_clamped);
            H->val(pr.lower_clamped);
          }
        });
      });
    });
    H->run("E" + S(s.e) + "/shuffles", [&] {
      std::vector<float> pi(static_cast<std::size_t>(rows) * s.e);
      rng g{mix_seed(static_cast<std::uint64_t>(s.e), 61)};
      for (auto& x : pi) x = g.below(6) == 0 ? 0.0f : g.unit();
      for (std::int64_t r = 0; r < rows; ++r) pi[r * s.e + static_cast<std::size_t>(r) % s.e] = 0.75f;
      std::vector<int> comm_a(s.e), comm_b(s.e);
      for (int e = 0; e < s.e; ++e) {
        comm_a[e] = e % 3;
        comm_b[e] = e / 5 - 2;
      }
      std::vector<std::vector<int>> perms = {mr::prior::within_community_permutation(comm_a.data(), s.e, 1),
                                             mr::prior::within_community_permutation(comm_b.data(), s.e, 2),
                                             mr::prior::within_community_permutation(comm_a.data(), s.e, 0xffffffffffffull),
                                             mr::prior::global_permutation(s.e, 3),
                                             mr::prior::global_permutation(s.e, 0)};
      for (const std::vector<int>& sigma : perms) {
        H->vec(sigma);
        std::vector<float> shuffled(pi.size(), sentinel_f);
        mr::prior::apply_permutation(pi.data(), rows, s.e, sigma, shuffled.data());
        H->vec(shuffled);
        for (int k : {1, std::min(6, s.e), s.e}) {
          for (float beta : {1.0f, 0.5f}) {
            const mr::prior::shuffle_validation v =
                mr::prior::validate_shuffle(pi.data(), shuffled.data(), rows, s.e, k, beta, mr::prior::clamp_bounds{0.05f, 5.0f});
            H->val(v.topk_overlap);
            H->val(v.change_rate);
            H->val(v.p90_abs_bias_change);
            H->val(v.upper_clamp_fraction);
          }
        }
      }
    });
  }
}

// ---------------------------------------------------------------------------
// Section: smaller public pieces: expert-bias update, load fractions, workload
// statistics, CIPHER capacity bounds, capacity rule, constants and names.

void hash_workload(const mr::analysis::workload_stats& w) {
  H->val(w.tokens);
  H->val(w.slots);
  H->val(w.executed);
  H->val(w.dropped);
  H->val(w.dropped_rate);
  H->vec(w.loads);
  H->val(w.max_load);
  H->val(w.top1_share);
  H->val(w.peak_to_mean);
  H->val(w.load_entropy);
  H->val(w.normalized_load_entropy);
  H->val(w.experts_per_token);
  H->vec(w.experts_per_token_histogram);
  H->val(w.tokens_without_experts);
}

void section_misc() {
  H->section("misc");
  H->run("expert_bias_update", [] {
    for (int e : {1, 7, 64, 256}) {
      std::vector<float> bias = make_bias(static_cast<std::uint64_t>(e), e);
      rng g{static_cast<std::uint64_t>(e) + 5};
      std::vector<std::int64_t> li(e);
      std::vector<float> lf(e);
      for (int i = 0; i < e; ++i) {
        li[i] = g.below(4);  // many loads equal the mean or each other
        lf[i] = static_cast<float>(g.below(8)) * 0.25f;
      }
      mr::selection::expert_bias sel;
      sel.update(bias.data(), li.data(), e);
      H->vec(bias);
      sel.update_rate = 0.0625f;
      sel.update(bias.data(), lf.data(), e);
      H->vec(bias);
      auto moon = mr::presets::moonlight();
      moon.selection.update(bias.data(), li.data(), e);
      H->vec(bias);
      auto v3 = mr::presets::deepseek_v3();
      v3.selection.inner.update_rate = 3e-3f;
      v3.selection.inner.update(bias.data(), lf.data(), e);
      H->vec(bias);
    }
  });
  H->run("load_fractions", [] {
    for (int e : {1, 7, 64}) {
      rng g{static_cast<std::uint64_t>(e) * 3};
      for (int k : {1, 3}) {
        const std::int64_t n = 41;
        std::vector<std::int32_t> idx(n * k);
        for (auto& x : idx) x = g.below(4) == 0 ? -1 : g.below(e);
        std::vector<float> f(e, sentinel_f);
        pen::load_fractions(idx.data(), n, k, e, f.data());
        H->vec(f);
        std::vector<std::int32_t> dropped(n * k, -1);
        pen::load_fractions(dropped.data(), n, k, e, f.data());
        H->vec(f);
      }
      std::vector<std::int64_t> counts(e);
      for (auto& c : counts) c = g.below(1000);
      std::vector<float> f(e, sentinel_f);
      pen::load_fractions(counts.data(), e, f.data());
      H->vec(f);
    }
  });
  H->run("workload", [] {
    for (int e : {1, 7, 64, 256}) {
      for (int slots : {1, 4}) {
        rng g{static_cast<std::uint64_t>(e * 10 + slots)};
        for (std::int64_t n : {0, 5, 300}) {
          std::vector<std::int32_t> idx(static_cast<std::size_t>(n) * slots);
          for (auto& x : idx) x = g.below(3) == 0 ? -1 : g.below(std::max(1, e / 3));
          hash_workload(mr::analysis::workload(idx.data(), n, slots, e));
        }
      }
    }
  });
  H->run("capacity_bounds", [] {
    H->val(cb::ell(0.1, 0.01));
    H->val(cb::geometric_exponent(4096.0, 0.05));
    for (double mu : {0.0, 1.0, 7.5})
      for (std::int64_t ne : {1, 6, 100, 100000}) H->val(cb::cipher_budget(ne, mu, 0.1, 0.01));
    H->val(cb::natural_order_lower_bound(0.1, 0.9, 1.0, 256.0, 4096.0, 0.05));
    for (double pi : {0.001, 0.05, 0.5}) H->val(cb::natural_order_capacity(pi, 1000, 0.1));
    for (double delta : {0.05, 0.06, 0.07})
      for (double kappa : {2.0, 10.0}) {
        H->val(cb::dimension_condition(kappa, 1.0, 256.0, 6.0, 0.1, 0.9, delta));
        H->val(cb::min_dimension(kappa, 1.0, 256.0, 6.0, 0.1, 0.9, delta));
      }
    H->val(cb::availability_bound(0.9, 0.01));
    H->val(cb::min_available_pool(0.9, 0.01));
    for (double q : {0.0, 0.01, 0.3, 1.0}) {
      H->val(cb::binomial_quantile_budget(500, q, 0.01));
      H->val(cb::simple_budget(500, q, 0.01));
    }
    H->val(cb::drift_tolerance(0.5, 2.0, 1.0, 256.0, 6.0, 0.1, 0.9, 8192.0));
    H->val(cb::output_fidelity_bound(3.0, 0.25));
    H->val(cb::output_fidelity_bound(3.0, 0.0));
  });
  H->run("capacity_rule_and_keys", [] {
    for (double f : {0.0, 0.3, 0.5, 1.0, 1.25, 8.0, 1e300})
      for (std::int64_t minc : {0, 3})
        for (std::int64_t tokens : {0, 7, 300, 4096})
          for (int k : {1, 2, 8})
            for (int e : {7, 64, 256}) H->val(ad::capacity_from_factor(f, minc, tokens, k, e));
    for (float a : {0.0f, -0.0f, 1.0f, -1.0f, inf_f, -inf_f, nan_f, max_f, 1e-40f})
      for (std::int64_t t : {0, 1, 1000000}) H->val(ad::rank_key(a, t));
    for (std::int32_t routed : {0, 3})
      for (std::int32_t admitted : {-1, 0, 3, 5}) H->val(static_cast<std::int8_t>(ad::status_of(routed, admitted)));
    H->flag(ad::renormalizes(ad::dropless()));
    H->flag(ad::renormalizes(ad::cipher_strict(0.1f)));
    H->flag(ad::renormalizes(ad::cipher_reroute(0.1f)));
    for (int e : {8, 64})
      for (int r : {1, 2, 8})
        for (int x = 0; x < e; x += 3) H->val(mr::contiguous_rank(x, e, r));
    H->val(mr::dispatch_rows_bound(300, 8, 256, 128));
  });
  H->run("constants_and_names", [] {
    H->val(mr::max_top_k);
    H->val(mr::max_experts);
    H->val(mr::max_fast_path_experts);
    H->val(rt::router_max_k);
    H->val(rt::num_penalties);
    for (const char* p : rt::penalty_names) H->str(p);
    for (const auto& g : runtime_gatings) H->str(rt::name(g.first));
    H->str(mr::gating::softmax::name);
    H->str(mr::gating::sigmoid::name);
    H->str(mr::gating::sqrt_softplus::name);
    H->str(mr::gating::softmax_after_topk::name);
    H->str(pen::load_balance::name);
    H->str(pen::z_loss::name);
    H->str(pen::kl_to_base::name);
    H->str(pen::logit_l2::name);
    H->str(pen::locality::name);
    H->str(ad::position::name);
    H->str(ad::probability::name);
    H->str(ad::logit::name);
    H->str(ad::cosine::name);
    H->str(mr::selection::expert_choice::name);
    for (int v : {MOE_ROUTE_VERSION_MAJOR, MOE_ROUTE_VERSION_MINOR, MOE_ROUTE_VERSION_PATCH}) H->val(v);
    for_presets([](auto r, const char* name, int e) {
      H->str(name);
      H->val(e);
      H->val(r.top_k);
      H->flag(r.normalize);
      H->val(r.scaling_factor);
      H->val(decltype(r)::max_k);
    });
    // Workspace sizes of the typed and run-time routers.
    const auto lbl = mr::conditions::lbl(mr::presets::qwen3());
    auto seq = mr::with_policies(mr::presets::qwen3(), pen::load_balance{1e-3f, pen::load_balance::scope::sequence},
                                 pen::z_loss{}, pen::kl_to_base{});
    for (std::int64_t n : {0, 1, 1023, 1024, 1025, 5000})
      for (int e : {7, 4096})
        for (std::int32_t seqs : {0, 1, 9}) {
          H->val(static_cast<std::uint64_t>(pen::training_workspace_bytes(lbl, n, e, seqs)));
          H->val(static_cast<std::uint64_t>(pen::training_workspace_bytes(seq, n, e, seqs)));
          H->val(static_cast<std::uint64_t>(pen::training_workspace_bytes(mr::presets::qwen3(), n, e, seqs)));
          H->val(static_cast<std::uint64_t>(rt::workspace_bytes(pen_all(rt::router_config{}), n, e, seqs)));
          H->val(static_cast<std::uint64_t>(rt::workspace_bytes(rt::router_config{}, n, e, seqs)));
        }
    H->val(mr::penalty_slot<pen::z_loss, decltype(seq)>);
    H->val(mr::penalty_slot<pen::kl_to_base, decltype(seq)>);
    H->val(mr::penalty_slot<pen::locality, decltype(seq)>);
  });
}

// ---------------------------------------------------------------------------
// Section: the messages of invalid calls.

void section_errors() {
  H->section("errors");
  auto expect = [](const std::string& name, auto&& body) { H->run(name, body, true); };
  const int e8 = 8;
  const std::int64_t n4 = 4;
  const std::vector<float> z = make_logits(5, 64, 4097, false);  // large enough for every call below
  const std::vector<float> bias(4097, 0.0f);
  std::vector<std::int32_t> idx(64 * 32, 0);
  std::vector<float> gates(64 * 32, 0.0f), dz(64 * 4097, 0.0f);
  const std::vector<float> dw(64 * 32, 0.5f);
  auto route = [&](const auto& r, const mr::route_inputs<float>& in) {
    std::vector<double> values(8);
    std::vector<unsigned char> ws(1 << 20);
    mr::route_outputs out{idx.data(), gates.data()};
    out.penalty_values = values.data();
    out.workspace = ws.data();
    out.workspace_bytes = ws.size();
    mr::cpu::route(r, in, out);
  };
  auto in_of = [&](std::int64_t n, int e) {
    mr::route_inputs<float> in;
    in.logits = z.data();
    in.num_tokens = n;
    in.num_experts = e;
    in.expert_bias = bias.data();
    return in;
  };

  // Router and shape checks.
  expect("top_k_above_max_k", [&] {
    auto r = mr::presets::qwen3();
    r.top_k = 9;
    route(r, in_of(n4, 128));
  });
  expect("top_k_above_e", [&] { route(mr::presets::qwen3(), in_of(n4, 7)); });
  expect("top_k_zero", [&] {
    auto r = mr::presets::qwen3();
    r.top_k = 0;
    route(r, in_of(n4, 64));
  });
  expect("groups_not_dividing", [&] {
    auto r = mr::presets::deepseek_v3();
    r.selection.groups = 3;
    route(r, in_of(n4, 256));
  });
  expect("groups_above_32", [&] {
    auto r = mr::presets::deepseek_v3();
    r.selection.groups = 64;
    route(r, in_of(n4, 4096));
  });
  expect("top_groups_above_groups", [&] {
    auto r = mr::presets::deepseek_v3();
    r.selection.top_groups = 9;
    route(r, in_of(n4, 256));
  });
  expect("per_group_k_above_group_size", [&] {
    auto r = mr::presets::deepseek_v3();
    r.selection.per_group_k = 33;
    route(r, in_of(n4, 256));
  });
  expect("kept_groups_too_small", [&] {
    auto r = mr::presets::deepseek_v3();
    r.selection.groups = 32;
    r.selection.top_groups = 1;
    r.selection.per_group_k = 1;
    route(r, in_of(n4, 64));
  });
  expect("scaling_nan", [&] {
    auto r = mr::presets::qwen3();
    r.scaling_factor = nan_f;
    route(r, in_of(n4, 128));
  });
  expect("scaling_inf", [&] {
    auto r = mr::presets::mixtral();
    r.scaling_factor = inf_f;
    route(r, in_of(n4, 8));
  });
  expect("null_logits", [&] {
    auto in = in_of(n4, 64);
    in.logits = nullptr;
    route(mr::presets::deepseek_v2_lite(), in);
  });
  expect("null_expert_bias", [&] {
    auto in = in_of(n4, 64);
    in.expert_bias = nullptr;
    route(mr::presets::moonlight(), in);
  });
  expect("negative_tokens", [&] { route(mr::presets::qwen3(), in_of(-1, 128)); });
  expect("zero_experts", [&] { route(mr::presets::mixtral(), in_of(n4, 0)); });
  expect("too_many_experts", [&] { route(mr::presets::mixtral(), in_of(n4, 4097)); });
  expect("null_indices_output", [&] {
    mr::cpu::route(mr::presets::qwen3(), in_of(n4, 128), mr::route_outputs{nullptr, gates.data()});
  });
  expect("null_gates_output", [&] {
    mr::cpu::route(mr::presets::qwen3(), in_of(n4, 128), mr::route_outputs{idx.data(), nullptr});
  });
  expect("backward_index_out_of_range", [&] {
    std::vector<std::int32_t> bad(n4 * 8, 1);
    for (int j = 0; j < 8; ++j) bad[j] = j;
    bad[13] = 128;
    mr::cpu::backward(mr::presets::qwen3(), in_of(n4, 128), mr::backward_args{bad.data(), dw.data(), dz.data()});
  });
  expect("backward_null_grad_gates", [&] {
    mr::cpu::backward(mr::presets::qwen3(), in_of(n4, 128), mr::backward_args{idx.data(), nullptr, dz.data()});
  });
  expect("backward_null_grad_logits", [&] {
    mr::cpu::backward(mr::presets::qwen3(), in_of(n4, 128), mr::backward_args{idx.data(), dw.data(), nullptr});
  });
  expect("admitted_index_out_of_range", [&] {
    std::vector<std::int32_t> routed = {0, 1, 2, 3}, admitted = {0, 9, 2, 3};
    mr::backward_args b{routed.data(), dw.data(), dz.data()};
    b.admitted_indices = admitted.data();
    auto r = mr::presets::mixtral();
    mr::cpu::backward(r, in_of(2, 8), b);
  });
  expect("admitted_expert_twice", [&] {
    std::vector<std::int32_t> routed = {0, 1, 2, 3}, admitted = {1, -1, 2, 3};
    mr::backward_args b{routed.data(), dw.data(), dz.data()};
    b.admitted_indices = admitted.data();
    mr::cpu::backward(mr::presets::mixtral(), in_of(2, 8), b);
  });

  // Training inputs.
  const policy_data pd(n4, e8);
  auto train_in = [&](const training_setup& ts) { return make_inputs(z.data(), n4, e8, bias.data(), ts); };
  auto base8 = mr::presets::deepseek_v2_lite();
  expect("penalty_values_null", [&] {
    mr::cpu::route(mr::conditions::lbl(base8), train_in(all_inputs(pd)), mr::route_outputs{idx.data(), gates.data()});
  });
  expect("workspace_too_small", [&] {
    std::vector<double> values(1);
    std::vector<unsigned char> ws(8);
    mr::route_outputs out{idx.data(), gates.data()};
    out.penalty_values = values.data();
    out.workspace = ws.data();
    out.workspace_bytes = ws.size();
    mr::cpu::route(mr::conditions::lbl(base8), train_in(all_inputs(pd)), out);
  });
  expect("workspace_null", [&] {
    std::vector<double> values(1);
    mr::route_outputs out{idx.data(), gates.data()};
    out.penalty_values = values.data();
    mr::cpu::route(mr::conditions::z_loss(base8), train_in(all_inputs(pd)), out);
  });
  expect("sequence_id_out_of_range", [&] {
    auto in = train_in(all_inputs(pd));
    std::vector<std::int32_t> seq = {0, 1, 6, 2};
    in.sequence_ids = seq.data();
    route(mr::with_policies(base8, pen::load_balance{1e-2f, pen::load_balance::scope::sequence}), in);
  });
  expect("num_sequences_zero", [&] {
    auto in = train_in(all_inputs(pd));
    in.num_sequences = 0;
    route(mr::with_policies(base8, pen::load_balance{1e-2f, pen::load_balance::scope::sequence}), in);
  });
  expect("load_fractions_negative", [&] {
    auto in = train_in(all_inputs(pd));
    std::vector<float> f(e8, 0.125f);
    f[3] = -0.125f;
    in.load_fractions = f.data();
    route(mr::with_policies(base8, pen::load_balance{1e-2f, pen::load_balance::scope::global_batch}), in);
  });
  expect("load_fractions_null", [&] {
    auto in = train_in(all_inputs(pd));
    in.load_fractions = nullptr;
    route(mr::with_policies(base8, pen::load_balance{1e-2f, pen::load_balance::scope::global_batch}), in);
  });
  expect("locality_rank_without_experts", [&] {
    auto in = train_in(all_inputs(pd));
    in.rank = 9;
    route(mr::with_policies(base8, pen::locality{}), in);
  });
  expect("locality_epsilon_zero", [&] {
    route(mr::with_policies(base8, pen::locality{1e-2f, 0.0f}), train_in(all_inputs(pd)));
  });
  expect("expert_rank_null", [&] {
    auto in = train_in(all_inputs(pd));
    in.expert_rank = nullptr;
    route(mr::with_policies(base8, pen::locality{}), in);
  });
  expect("token_prior_row_out_of_range", [&] {
    auto in = train_in(all_inputs(pd));
    std::vector<std::int32_t> rows = {0, 4, -1, 1};
    in.token_prior_row = rows.data();
    route(mr::conditions::rpb(base8), in);
  });
  expect("prior_bias_nonfinite", [&] {
    auto in = train_in(all_inputs(pd));
    std::vector<float> b = pd.bias;
    b[11] = inf_f;
    in.prior_bias = b.data();
    route(mr::conditions::logit_l2(base8), in);
  });
  expect("prior_probs_zero", [&] {
    auto in = train_in(all_inputs(pd));
    std::vector<float> p = pd.probs;
    p[5] = 0.0f;
    in.prior_probs = p.data();
    route(mr::conditions::kl_to_base(base8), in);
  });
  expect("prior_rows_zero", [&] {
    auto in = train_in(all_inputs(pd));
    in.prior_rows = 0;
    route(mr::conditions::rpb_hard(base8), in);
  });
  expect("prior_bias_null", [&] {
    auto in = train_in(all_inputs(pd));
    in.prior_bias = nullptr;
    route(mr::conditions::rpb(base8), in);
  });
  expect("beta_nan", [&] { route(mr::conditions::rpb(base8, nan_f), train_in(all_inputs(pd))); });
  expect("z_loss_coefficient_inf", [&] { route(mr::conditions::z_loss(base8, inf_f), train_in(all_inputs(pd))); });

  // Run-time routers.
  auto rt_route = [&](const rt::router_config& c, const mr::route_inputs<float>& in) {
    std::vector<double> values(rt::num_penalties);
    std::vector<unsigned char> ws(1 << 20);
    mr::route_outputs out{idx.data(), gates.data()};
    out.penalty_values = values.data();
    out.workspace = ws.data();
    out.workspace_bytes = ws.size();
    rt::route(c, in, out);
  };
  auto cfg = [] {
    rt::router_config c;
    c.top_k = 2;
    return c;
  };
  expect("rt_top_k_17", [&] {
    auto c = cfg();
    c.top_k = 17;
    rt_route(c, in_of(n4, 64));
  });
  expect("rt_softmax_after_topk_bias", [&] {
    auto c = cfg();
    c.gating = rt::gating_kind::softmax_after_topk;
    c.selection = rt::selection_kind::group_limited_bias;
    rt_route(c, in_of(n4, 64));
  });
  expect("rt_groups_zero", [&] {
    auto c = cfg();
    c.selection = rt::selection_kind::group_limited;
    c.groups = 0;
    rt_route(c, in_of(n4, 64));
  });
  expect("rt_top_groups", [&] {
    auto c = cfg();
    c.selection = rt::selection_kind::group_limited;
    c.groups = 4;
    c.top_groups = 5;
    rt_route(c, in_of(n4, 64));
  });
  expect("rt_per_group_k", [&] {
    auto c = cfg();
    c.selection = rt::selection_kind::group_limited;
    c.per_group_k = 0;
    rt_route(c, in_of(n4, 64));
  });
  expect("rt_groups_not_dividing", [&] {
    auto c = cfg();
    c.selection = rt::selection_kind::group_limited;
    c.groups = 5;
    c.top_groups = 2;
    rt_route(c, in_of(n4, 64));
  });
  expect("rt_z_loss_nan", [&] {
    auto c = cfg();
    c.z_loss.coefficient = nan_f;
    rt_route(c, in_of(n4, 64));
  });
  expect("rt_scaling_inf", [&] {
    auto c = cfg();
    c.scaling_factor = -inf_f;
    rt_route(c, in_of(n4, 64));
  });
  expect("rt_locality_epsilon_one", [&] {
    auto c = cfg();
    c.locality.epsilon = 1.0f;
    rt_route(c, in_of(n4, 64));
  });
  expect("rt_kl_without_rows", [&] {
    auto c = cfg();
    c.kl_to_base.coefficient = 1e-2f;
    rt_route(c, in_of(n4, 64));
  });
  expect("rt_logit_l2_without_bias", [&] {
    auto c = cfg();
    c.logit_l2.coefficient = 1e-2f;
    auto in = in_of(n4, e8);
    in.token_prior_row = pd.token_row.data();
    in.prior_rows = pd.rows;
    rt_route(c, in);
  });
  expect("rt_kl_without_probs", [&] {
    auto c = cfg();
    c.kl_to_base.coefficient = 1e-2f;
    auto in = in_of(n4, e8);
    in.token_prior_row = pd.token_row.data();
    in.prior_rows = pd.rows;
    in.prior_bias = pd.bias.data();
    rt_route(c, in);
  });
  // Not an error: with no tokens a runtime router, like a typed one, reads no prior input.
  H->run("rt_zero_tokens_without_token_prior_row", [&] {
    auto c = cfg();
    c.prior = rt::prior_kind::log_prior_bias;
    auto in = in_of(0, e8);
    in.prior_bias = pd.bias.data();
    in.prior_rows = pd.rows;
    rt_route(c, in);
  });
  expect("rt_prior_without_rows", [&] {
    auto c = cfg();
    c.prior = rt::prior_kind::prior_override;
    rt_route(c, in_of(n4, e8));
  });
  expect("rt_sequence_scope_without_ids", [&] {
    auto c = cfg();
    c.load_balance = pen::load_balance{1e-2f, pen::load_balance::scope::sequence};
    rt_route(c, in_of(n4, e8));
  });
  expect("rt_global_scope_without_fractions", [&] {
    auto c = cfg();
    c.load_balance = pen::load_balance{1e-2f, pen::load_balance::scope::global_batch};
    rt_route(c, in_of(n4, e8));
  });
  auto rt_admit = [&](const rt::admission_config& a) {
    std::vector<std::int32_t> routed = {0, 1, 2, 3, 4, 5, 6, 7};
    std::vector<float> rg(8, 0.5f);
    mr::admission_inputs<float> in;
    in.logits = z.data();
    in.num_tokens = n4;
    in.num_experts = e8;
    in.routed_indices = routed.data();
    in.routed_gates = rg.data();
    rt::admit(cfg(), a, in, mr::admission_outputs{idx.data(), gates.data()});
  };
  expect("rt_admission_position_reroute", [&] {
    rt::admission_config a;
    a.dropless = false;
    a.affinity = rt::affinity_kind::position;
    a.overflow = rt::overflow_kind::reroute;
    rt_admit(a);
  });
  expect("rt_admission_capacity_factor_zero", [&] {
    rt::admission_config a;
    a.dropless = false;
    a.capacity_factor = 0.0;
    rt_admit(a);
  });
  expect("rt_admission_min_capacity_negative", [&] {
    rt::admission_config a;
    a.dropless = false;
    a.min_capacity = -1;
    rt_admit(a);
  });
  expect("rt_admission_threshold_nan", [&] {
    rt::admission_config a;
    a.dropless = false;
    a.threshold = nan_f;
    rt_admit(a);
  });
  expect("rt_admission_position_threshold", [&] {
    rt::admission_config a;
    a.dropless = false;
    a.affinity = rt::affinity_kind::position;
    a.threshold = 0.5f;
    rt_admit(a);
  });
  expect("rt_admission_fill_factor_zero", [&] {
    rt::admission_config a;
    a.dropless = false;
    a.overflow = rt::overflow_kind::reroute;
    a.fill_factor = 0.0;
    rt_admit(a);
  });
  expect("rt_admission_cosine_without_norms", [&] {
    rt::admission_config a;
    a.dropless = false;
    a.affinity = rt::affinity_kind::cosine;
    rt_admit(a);
  });

  // Typed admission.
  auto admit = [&](const auto& p, auto&& edit) {
    auto r = mr::presets::mixtral();
    std::vector<std::int32_t> routed = {0, 1, 2, 3, 4, 5, 6, 7};
    std::vector<float> rg(8, 0.5f), hn(n4, 1.0f), wn(e8, 1.0f);
    std::vector<std::int32_t> ids = {0, 1, 0, 1};
    std::vector<std::int64_t> cap(e8, 1);
    mr::admission_inputs<float> in;
    in.logits = z.data();
    in.num_tokens = n4;
    in.num_experts = e8;
    in.routed_indices = routed.data();
    in.routed_gates = rg.data();
    in.hidden_norms = hn.data();
    in.weight_norms = wn.data();
    in.group_ids = ids.data();
    in.num_groups = 2;
    in.capacity = cap.data();
    edit(in, routed, hn, wn, ids, cap);
    mr::cpu::admit(r, p, in, mr::admission_outputs{idx.data(), gates.data()});
  };
  auto no_edit = [](auto&...) {};
  expect("admit_hidden_norms_null", [&] {
    admit(ad::cipher_strict(0.1f), [](auto& in, auto&...) { in.hidden_norms = nullptr; });
  });
  expect("admit_hidden_norm_zero", [&] {
    admit(ad::cipher_strict(0.1f), [](auto&, auto&, auto& hn, auto&...) { hn[2] = 0.0f; });
  });
  expect("admit_weight_norm_nan", [&] {
    admit(ad::locmoe(1.0), [](auto&, auto&, auto&, auto& wn, auto&...) { wn[5] = nan_f; });
  });
  expect("admit_group_id_out_of_range", [&] {
    admit(ad::capacity_probs(1.0), [](auto&, auto&, auto&, auto&, auto& ids, auto&) { ids[3] = 2; });
  });
  expect("admit_num_groups_zero", [&] {
    admit(ad::capacity_probs(1.0), [](auto& in, auto&...) { in.num_groups = 0; });
  });
  expect("admit_routed_out_of_range", [&] {
    admit(ad::capacity_position(1.0), [](auto&, auto& routed, auto&...) { routed[6] = 8; });
  });
  expect("admit_routed_twice", [&] {
    admit(ad::capacity_position(1.0), [](auto&, auto& routed, auto&...) { routed[5] = 4; });
  });
  expect("admit_capacity_negative", [&] {
    admit(ad::capacity_position(1.0), [](auto&, auto&, auto&, auto&, auto&, auto& cap) { cap[7] = -1; });
  });
  expect("admit_threshold_nan", [&] { admit(ad::cipher_reroute(nan_f), no_edit); });
  expect("admit_position_threshold", [&] {
    auto p = ad::capacity_position(1.0);
    p.threshold = 0.0f;
    admit(p, no_edit);
  });
  expect("admit_capacity_factor_negative", [&] { admit(ad::capacity_probs(-0.5), no_edit); });
  expect("admit_min_capacity_negative", [&] { admit(ad::capacity_probs(1.0, -2), no_edit); });
  expect("admit_fill_factor_negative", [&] { admit(ad::cipher_reroute(0.1f, 1.0, -1.0), no_edit); });
  expect("admit_max_rounds", [&] {
    auto p = ad::cipher_reroute(0.1f);
    p.overflow.max_rounds = -2;
    admit(p, no_edit);
  });
  expect("admit_logits_null", [&] {
    admit(ad::capacity_probs(1.0), [](auto& in, auto&...) { in.logits = nullptr; });
  });
  expect("admit_too_many_slots", [&] {
    admit(ad::capacity_probs(1.0), [](auto& in, auto&...) {
      in.num_tokens = std::int64_t{1} << 31;
      in.logits = nullptr;
    });
  });
  expect("admit_groups_times_experts", [&] {
    admit(ad::capacity_probs(1.0), [](auto& in, auto&...) {
      in.num_groups = 1 << 29;
      in.group_ids = nullptr;
    });
  });
  expect("admission_backward_null_admitted", [&] {
    mr::admission_backward_args b;
    b.routed_indices = idx.data();
    b.grad_gates = dw.data();
    b.grad_logits = dz.data();
    mr::cpu::admission_backward(mr::presets::mixtral(), ad::cipher_strict(0.1f), in_of(n4, e8), b);
  });

  // Expert choice.
  auto ec = [&](auto&& edit) {
    mr::selection::expert_choice p;
    std::vector<std::int32_t> ids = {0, 1, 0, 1};
    std::vector<std::int64_t> cap(e8, 1);
    mr::expert_choice_inputs<float> in;
    in.logits = z.data();
    in.num_tokens = n4;
    in.num_experts = e8;
    in.group_ids = ids.data();
    in.num_groups = 2;
    in.capacity = cap.data();
    mr::expert_choice_outputs out;
    out.indices = idx.data();
    out.gates = gates.data();
    edit(p, in, out, ids, cap);
    mr::cpu::expert_choice(p, in, out);
  };
  expect("ec_top_k_zero", [&] { ec([](auto& p, auto&...) { p.top_k = 0; }); });
  expect("ec_capacity_factor_nan", [&] { ec([](auto& p, auto&...) { p.capacity_factor = std::nan(""); }); });
  expect("ec_min_capacity_negative", [&] { ec([](auto& p, auto&...) { p.min_capacity = -1; }); });
  expect("ec_group_id_out_of_range", [&] { ec([](auto&, auto&, auto&, auto& ids, auto&) { ids[0] = -1; }); });
  expect("ec_capacity_negative", [&] { ec([](auto&, auto&, auto&, auto&, auto& cap) { cap[1] = -4; }); });
  expect("ec_too_many_pairs", [&] {
    ec([](auto&, auto& in, auto&...) {
      in.num_tokens = std::int64_t{1} << 20;
      in.num_experts = 4096;
      in.logits = nullptr;
    });
  });
  expect("ec_gates_null", [&] { ec([](auto&, auto&, auto& out, auto&...) { out.gates = nullptr; }); });
  expect("ec_experts_4097", [&] { ec([](auto&, auto& in, auto&...) { in.num_experts = 4097; }); });
  expect("ec_backward_index_out_of_range", [&] {
    mr::expert_choice_inputs<float> in;
    in.logits = z.data();
    in.num_tokens = 2;
    in.num_experts = e8;
    std::vector<std::int32_t> bad(16, -1);
    bad[9] = 8;
    mr::cpu::expert_choice_backward(in, bad.data(), dw.data(), dz.data());
  });

  // Dispatch.
  auto disp = [&](auto&& edit) {
    std::vector<std::int32_t> ind = {0, 1, -1, 3, 4, 5, 6, 7};
    std::vector<std::int32_t> er(e8, 0);
    std::vector<std::int64_t> counts(e8), offsets(e8 + 1);
    mr::dispatch_inputs in;
    in.indices = ind.data();
    in.num_tokens = n4;
    in.slots_per_token = 2;
    in.num_experts = e8;
    mr::dispatch_outputs out;
    out.counts = counts.data();
    out.offsets = offsets.data();
    edit(in, out, ind, er);
    mr::cpu::dispatch(in, out);
  };
  expect("dispatch_align_zero", [&] { disp([](auto& in, auto&...) { in.align = 0; }); });
  expect("dispatch_ranks_zero", [&] { disp([](auto& in, auto&...) { in.num_ranks = 0; }); });
  expect("dispatch_ranks_not_dividing", [&] { disp([](auto& in, auto&...) { in.num_ranks = 3; }); });
  expect("dispatch_slots_zero", [&] { disp([](auto& in, auto&...) { in.slots_per_token = 0; }); });
  expect("dispatch_counts_null", [&] { disp([](auto&, auto& out, auto&...) { out.counts = nullptr; }); });
  expect("dispatch_offsets_null", [&] { disp([](auto&, auto& out, auto&...) { out.offsets = nullptr; }); });
  expect("dispatch_index_out_of_range", [&] { disp([](auto&, auto&, auto& ind, auto&) { ind[4] = 8; }); });
  expect("dispatch_index_below_minus_one", [&] { disp([](auto&, auto&, auto& ind, auto&) { ind[2] = -2; }); });
  expect("dispatch_expert_rank_out_of_range", [&] {
    disp([](auto& in, auto&, auto&, auto& er) {
      in.num_ranks = 2;
      er[3] = 2;
      in.expert_rank = er.data();
    });
  });
  expect("dispatch_experts_zero", [&] { disp([](auto& in, auto&...) { in.num_experts = 0; }); });

  // Prior tools.
  expect("prepare_zero_row", [&] {
    std::vector<float> pi(16, 0.125f), b(16);
    for (int e = 8; e < 16; ++e) pi[e] = 0.0f;
    mr::prior::prepare(pi.data(), 2, 8, b.data());
  });
  expect("prepare_negative_entry", [&] {
    std::vector<float> pi(8, 0.125f), b(8);
    pi[3] = -0.1f;
    mr::prior::prepare(pi.data(), 1, 8, b.data());
  });
  expect("prepare_epsilon_zero", [&] {
    std::vector<float> pi(8, 0.125f), b(8);
    mr::prior::prepare(pi.data(), 1, 8, b.data(), nullptr, mr::prior::clamp_bounds{0.0f, 5.0f});
  });
  expect("prepare_cap_below_epsilon", [&] {
    std::vector<float> pi(8, 0.125f), b(8);
    mr::prior::prepare(pi.data(), 1, 8, b.data(), nullptr, mr::prior::clamp_bounds{0.5f, 0.25f});
  });
  expect("prepare_experts_zero", [&] {
    std::vector<float> pi(8, 0.125f), b(8);
    mr::prior::prepare(pi.data(), 1, 0, b.data());
  });
  expect("build_row_out_of_range", [&] {
    std::vector<std::int32_t> rows = {0, 1, 2, -2};
    std::vector<float> pi(3 * e8);
    mr::prior::build<mr::gating::sigmoid>(in_of(n4, e8), rows.data(), 3, pi.data());
  });
  expect("build_no_rows", [&] {
    std::vector<std::int32_t> rows = {0, 0, 0, 0};
    std::vector<float> pi(e8);
    mr::prior::build<mr::gating::softmax>(in_of(n4, e8), rows.data(), 0, pi.data());
  });
  expect("permutation_not_bijective", [&] {
    std::vector<float> pi(8, 0.125f), out(8);
    mr::prior::apply_permutation(pi.data(), 1, 8, std::vector<int>{0, 1, 2, 3, 4, 5, 6, 6}, out.data());
  });
  expect("permutation_wrong_size", [&] {
    std::vector<float> pi(8, 0.125f), out(8);
    mr::prior::apply_permutation(pi.data(), 1, 8, std::vector<int>{0, 1, 2}, out.data());
  });
  expect("within_community_null", [&] { mr::prior::within_community_permutation(nullptr, 8, 1); });
  expect("global_permutation_zero", [&] { mr::prior::global_permutation(0, 1); });
  expect("validate_shuffle_k_above_e", [&] {
    std::vector<float> pi(8, 0.125f);
    mr::prior::validate_shuffle(pi.data(), pi.data(), 1, 8, 9);
  });

  // Other pieces.
  expect("router_l2_no_layers", [&] { pen::router_l2{}.apply(nullptr, 0); });
  expect("router_l2_null_weights", [&] {
    pen::router_weights w{nullptr, bias.data(), 4, nullptr};
    pen::router_l2{}.apply(&w, 1);
  });
  expect("router_l2_negative_size", [&] {
    pen::router_weights w{bias.data(), bias.data(), -1, nullptr};
    pen::router_l2{}.apply(&w, 1);
  });
  expect("load_fractions_bad_index", [&] {
    std::vector<std::int32_t> ind = {0, 1, 8, -1};
    std::vector<float> f(e8);
    pen::load_fractions(ind.data(), 2, 2, e8, f.data());
  });
  expect("load_fractions_negative_count", [&] {
    std::vector<std::int64_t> counts(e8, 1);
    counts[2] = -1;
    std::vector<float> f(e8);
    pen::load_fractions(counts.data(), e8, f.data());
  });
  expect("expert_bias_update_no_experts", [&] {
    std::vector<float> b(4);
    std::vector<std::int64_t> loads(4);
    mr::selection::expert_bias{}.update(b.data(), loads.data(), 0);
  });
  expect("expert_bias_update_null_loads", [&] {
    std::vector<float> b(4);
    mr::selection::expert_bias{}.update(b.data(), static_cast<const float*>(nullptr), 4);
  });
  expect("workload_bad_entry", [&] {
    std::vector<std::int32_t> ind = {0, 9};
    mr::analysis::workload(ind.data(), 1, 2, 8);
  });
  expect("workload_slots_zero", [&] { mr::analysis::workload(idx.data(), 1, 0, 8); });
  expect("capacity_bounds_ell", [] { cb::ell(0.1, 0.2); });
  expect("capacity_bounds_budget_mu", [] { cb::cipher_budget(10, -1.0, 0.1, 0.01); });
  expect("capacity_bounds_dimension", [] { cb::geometric_exponent(1.0, 0.05); });
  expect("capacity_bounds_fidelity", [] { cb::output_fidelity_bound(-1.0, 0.5); });
  expect("capacity_bounds_kappa", [] { cb::min_dimension(1.0, 1.0, 256.0, 6.0, 0.1, 0.9, 0.05); });
}

}  // namespace

int main(int argc, char** argv) {
  bool verbose = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--verbose") == 0) {
      verbose = true;
    } else {
      std::fprintf(stderr, "usage: %s [--verbose]\n", argv[0]);
      return 2;
    }
  }
  hasher h(verbose);
  H = &h;
  section_types();
  section_presets();
  section_conditions();
  section_runtime();
  section_admission();
  section_runtime_admission();
  section_expert_choice();
  section_dispatch();
  section_router_l2();
  section_prior();
  section_misc();
  section_errors();
  return h.finish();
}
