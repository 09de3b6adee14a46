#include "data.hpp"

#include <algorithm>
#include <fstream>
#include <stdexcept>
#include <unordered_set>

#include <nlohmann/json.hpp>

namespace moe_lm {

const char* domain_name(domain d) {
  switch (d) {
    case domain::arithmetic: return "arithmetic";
    case domain::code: return "code";
    case domain::words: return "words";
  }
  return "?";
}

domain parse_domain(const std::string& name) {
  for (int i = 0; i < num_domains; ++i)
    if (name == domain_name(static_cast<domain>(i))) return static_cast<domain>(i);
  throw std::invalid_argument("unknown domain \"" + name + "\" (known: arithmetic, code, words)");
}

std::int64_t encoded_length(const example& e) {
  return 3 + static_cast<std::int64_t>(e.prompt.size() + e.answer.size());
}

std::uint64_t rng::next() {
  std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::uint64_t rng::below(std::uint64_t n) {
  // Rejection keeps every value equally likely (no modulo bias).
  const std::uint64_t limit = ~std::uint64_t{0} - (~std::uint64_t{0} % n);
  std::uint64_t x;
  do x = next();
  while (x >= limit);
  return x % n;
}

namespace {

// Common words whose plural follows the regular rules below.
const char* const word_list[] = {
    "cat",   "dog",   "box",   "fox",   "bus",   "key",   "day",   "toy",   "boy",   "cup",   "pen",   "map",
    "hat",   "bag",   "car",   "sun",   "egg",   "ant",   "bee",   "cow",   "pig",   "owl",   "jar",   "bed",
    "city",  "baby",  "lady",  "story", "party", "berry", "cherry","penny", "pony",  "fly",   "spy",   "sky",
    "church","bench", "brush", "dish",  "watch", "match", "glass", "class", "kiss",  "wish",  "flash", "lunch",
    "apple", "house", "green", "river", "stone", "table", "chair", "plant", "water", "light", "bread", "cloud",
    "horse", "flower","train", "music", "paper", "clock", "money", "night", "heart", "world", "smile", "dream",
    "tiger", "zebra", "lemon", "melon", "grape", "onion", "salad", "candle","window","garden","forest","planet",
    "rocket","castle","bottle","button","pencil","basket","ticket","pocket","dragon","spider","rabbit","monkey",
    "donkey","turkey","valley","jersey","letter","number","farmer","doctor","singer","writer","mirror","carpet",
    "orange","banana","hammer","ladder","circle","square","yellow","purple","silver","golden","summer","winter",
    "quiz",  "buzz",  "wax",   "tax",   "mix",   "fix",   "gas",   "bush",  "crash", "beach", "coach", "peach"};
constexpr int num_words = sizeof(word_list) / sizeof(word_list[0]);

bool is_vowel(char c) { return c == 'a' || c == 'e' || c == 'i' || c == 'o' || c == 'u'; }

std::string plural(const std::string& w) {
  const auto ends = [&](const std::string& s) {
    return w.size() >= s.size() && w.compare(w.size() - s.size(), s.size(), s) == 0;
  };
  if (ends("s") || ends("x") || ends("z") || ends("ch") || ends("sh")) {
    if (ends("z") && w.size() >= 2 && is_vowel(w[w.size() - 2])) return w + "zes";  // quiz -> quizzes
    return w + "es";
  }
  if (ends("y") && w.size() >= 2 && !is_vowel(w[w.size() - 2])) return w.substr(0, w.size() - 1) + "ies";
  return w + "s";
}

const char* word(rng& r) { return word_list[r.below(num_words)]; }

example arithmetic(rng& r) {
  const int op = static_cast<int>(r.below(3));
  int a, b, v;
  char sym;
  if (op == 0) {
    a = r.range(0, 99), b = r.range(0, 99), v = a + b, sym = '+';
  } else if (op == 1) {
    a = r.range(0, 99), b = r.range(0, a), v = a - b, sym = '-';
  } else {
    a = r.range(0, 12), b = r.range(0, 12), v = a * b, sym = '*';
  }
  return {std::to_string(a) + sym + std::to_string(b) + "=", std::to_string(v), domain::arithmetic};
}

// A straight-line program over a, b, c, d: the first statement assigns a
// digit, each later one combines an earlier variable with a digit or another
// earlier variable; the answer is the printed value. Values stay within
// [-99, 99] so answers are short.
example code(rng& r) {
  const int statements = r.range(2, 4);
  std::string prompt;
  int value[4] = {0, 0, 0, 0};
  value[0] = r.range(0, 9);
  prompt = "a=" + std::to_string(value[0]) + ";";
  for (int s = 1; s < statements; ++s) {
    for (;;) {
      const int x = static_cast<int>(r.below(static_cast<std::uint64_t>(s)));
      const bool with_var = s >= 2 && r.below(2) == 0;
      const int y = with_var ? static_cast<int>(r.below(static_cast<std::uint64_t>(s))) : r.range(0, 9);
      const int operand = with_var ? value[y] : y;
      const int op = static_cast<int>(r.below(3));
      const int v = op == 0 ? value[x] + operand : (op == 1 ? value[x] - operand : value[x] * operand);
      if (v < -99 || v > 99) continue;
      value[s] = v;
      prompt += std::string(1, static_cast<char>('a' + s)) + "=" + static_cast<char>('a' + x) + "+-*"[op] +
                (with_var ? std::string(1, static_cast<char>('a' + y)) : std::to_string(y)) + ";";
      break;
    }
  }
  const int shown = r.below(4) == 0 ? static_cast<int>(r.below(static_cast<std::uint64_t>(statements)))
                                    : statements - 1;
  prompt += std::string("print(") + static_cast<char>('a' + shown) + ")";
  return {prompt, std::to_string(value[shown]), domain::code};
}

example words(rng& r) {
  const std::string w = word(r);
  switch (r.below(7)) {
    case 0: return {"reverse: " + w, std::string(w.rbegin(), w.rend()), domain::words};
    case 1: return {"plural: " + w, plural(w), domain::words};
    case 2: {
      std::string up = w;
      for (char& c : up) c = static_cast<char>(c - 'a' + 'A');
      return {"upper: " + w, up, domain::words};
    }
    case 3: return {"length: " + w, std::to_string(w.size()), domain::words};
    case 4: {
      const std::string v = word(r);
      return {"swap: " + w + " " + v, v + " " + w, domain::words};
    }
    case 5: {
      const std::string v = word(r), u = word(r);
      return {"initials: " + w + " " + v + " " + u, std::string{w[0], v[0], u[0]}, domain::words};
    }
    default: {
      const std::string v = word(r);
      return {"last: " + w + " " + v, std::string(1, v.back()) + std::string(1, w.back()), domain::words};
    }
  }
}

}  // namespace

example generate(domain d, rng& r) {
  switch (d) {
    case domain::arithmetic: return arithmetic(r);
    case domain::code: return code(r);
    case domain::words: return words(r);
  }
  throw std::invalid_argument("generate: bad domain");
}

split default_data(std::uint64_t seed, int train_per_domain, int post_per_domain, int eval_per_domain,
                   int probe_per_domain) {
  split out;
  for (int di = 0; di < num_domains; ++di) {
    const domain d = static_cast<domain>(di);
    // Distinct prompts first, then a shuffle, so that the four parts share one
    // distribution and no prompt is in two of them.
    const std::size_t need =
        static_cast<std::size_t>(train_per_domain + post_per_domain + eval_per_domain + probe_per_domain);
    rng r(seed * 0x100000001b3ull + static_cast<std::uint64_t>(di) + 1);
    std::unordered_set<std::string> seen;
    std::vector<example> pool;
    for (std::size_t attempts = 0; pool.size() < need; ++attempts) {
      if (attempts > 100 * need + 1000)
        throw std::runtime_error(std::string("default_data: too few distinct ") + domain_name(d) + " prompts for " +
                                 std::to_string(need) + " examples");
      example e = generate(d, r);
      if (seen.insert(e.prompt).second) pool.push_back(std::move(e));
    }
    for (std::size_t i = pool.size(); i > 1; --i) std::swap(pool[i - 1], pool[r.below(i)]);
    auto take = [&, at = std::size_t{0}](std::vector<example>& to, int n) mutable {
      to.insert(to.end(), pool.begin() + static_cast<std::ptrdiff_t>(at),
                pool.begin() + static_cast<std::ptrdiff_t>(at + static_cast<std::size_t>(n)));
      at += static_cast<std::size_t>(n);
    };
    take(out.train, train_per_domain);
    take(out.post, post_per_domain);
    take(out.eval, eval_per_domain);
    take(out.probe, probe_per_domain);
  }
  return out;
}

std::vector<example> load_jsonl(const std::string& path, std::int64_t max_tokens) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot open");
  std::vector<example> out;
  std::string line;
  for (std::int64_t number = 1; std::getline(in, line); ++number) {
    const auto fail = [&](const std::string& what) {
      throw std::runtime_error(path + ":" + std::to_string(number) + ": " + what);
    };
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {  // parse errors, and numbers past double's range
      fail(std::string("bad JSON: ") + e.what());
    }
    if (!j.is_object()) fail("expected a JSON object with \"prompt\", \"answer\" and \"domain\"");
    example e;
    for (const char* field : {"prompt", "answer", "domain"}) {
      const auto it = j.find(field);
      if (it == j.end()) fail(std::string("missing field \"") + field + "\"");
      if (!it->is_string()) fail(std::string("field \"") + field + "\" must be a string, got " + it->type_name());
    }
    e.prompt = j["prompt"].get<std::string>();
    e.answer = j["answer"].get<std::string>();
    try {
      e.dom = parse_domain(j["domain"].get<std::string>());
    } catch (const std::invalid_argument& err) {
      fail(err.what());
    }
    if (e.answer.empty()) fail("empty answer (exact match needs one)");
    if (max_tokens > 0 && encoded_length(e) > max_tokens)
      fail("example has " + std::to_string(encoded_length(e)) + " tokens, more than the model's " +
           std::to_string(max_tokens));
    out.push_back(std::move(e));
  }
  if (in.bad()) throw std::runtime_error(path + ": read error");
  if (out.empty()) throw std::runtime_error(path + ": no examples");
  return out;
}

std::vector<example> of_domain(const std::vector<example>& xs, domain d) {
  std::vector<example> out;
  std::copy_if(xs.begin(), xs.end(), std::back_inserter(out), [d](const example& e) { return e.dom == d; });
  return out;
}

}  // namespace moe_lm
