// moe_lm: the Q/A data of the reference training driver. An example is a
// prompt, its exact answer and its domain. The embedded default data set has
// three domains whose characters differ (digits and operators; variable
// names, '=', ';' and "print"; lower-case English words), generated from a
// seed; a JSONL loader reads users' own corpora in the same shape.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe_lm {

// The domains every example belongs to. JSONL files name them by these strings.
enum class domain : int { arithmetic = 0, code = 1, words = 2 };
inline constexpr int num_domains = 3;
const char* domain_name(domain d);
// The domain a name denotes; throws std::invalid_argument for an unknown name.
domain parse_domain(const std::string& name);

struct example {
  std::string prompt;
  std::string answer;
  domain dom = domain::arithmetic;
};

// Byte-level vocabulary: four special tokens, then the 256 byte values.
// A sequence is BOS prompt SEP answer EOS, right-padded with PAD.
namespace vocab {
inline constexpr std::int64_t pad = 0, bos = 1, sep = 2, eos = 3;
inline constexpr std::int64_t first_byte = 4;
inline constexpr std::int64_t size = first_byte + 256;
inline std::int64_t of(char c) { return first_byte + static_cast<unsigned char>(c); }
}  // namespace vocab

// Tokens of BOS prompt SEP answer EOS.
std::int64_t encoded_length(const example& e);

// A small deterministic generator (splitmix64), so a seed gives the same data
// on every platform and standard library.
class rng {
 public:
  explicit rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next();
  // Uniform in [0, n) by rejection; n >= 1.
  std::uint64_t below(std::uint64_t n);
  int range(int lo, int hi) { return lo + static_cast<int>(below(static_cast<std::uint64_t>(hi - lo + 1))); }

 private:
  std::uint64_t state_;
};

// One example of domain d drawn from r.
example generate(domain d, rng& r);

struct split {
  std::vector<example> train;  // pretraining (the mixture)
  std::vector<example> post;   // post-training pool (one domain is taken from it)
  std::vector<example> eval;   // accuracy and answer-span loss
  std::vector<example> probe;  // held-out routing traces
};

// The embedded default: per domain, distinct prompts for each part (no prompt
// is in two parts), drawn from `seed`.
split default_data(std::uint64_t seed, int train_per_domain = 3000, int post_per_domain = 2000,
                   int eval_per_domain = 200, int probe_per_domain = 200);

// Reads one {"prompt": str, "answer": str, "domain": str} object per line
// (blank lines are skipped). Throws std::runtime_error "<path>:<line>: <what>"
// for unreadable files, bad JSON, a missing field, a field of the wrong type,
// an unknown domain, an empty answer, or (max_tokens > 0) an example whose
// encoding is longer than max_tokens; "<path>: no examples" for a file without
// one (empty, or blank lines only).
std::vector<example> load_jsonl(const std::string& path, std::int64_t max_tokens = 0);

// The examples of one domain.
std::vector<example> of_domain(const std::vector<example>& xs, domain d);

}  // namespace moe_lm
