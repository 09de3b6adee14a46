// Fuzz target: the files the moe_lm driver reads besides LibTorch's own
// archive. The first byte chooses what the rest is:
//   even: a JSONL data file (--train-jsonl, ...), read with a token limit
//         taken from the second byte (0: none), as load_jsonl;
//   odd:  a checkpoint's configuration text (moe_lm_config), read as
//         model_config_from_json.
// A data file must give std::runtime_error "<path>:<line>: ..." (or
// "<path>: no examples") with a line that exists, or exactly the examples an
// independent reading of its lines gives; a configuration must give
// std::invalid_argument "checkpoint config: ..." or a configuration in the
// checked ranges whose text form reads back the same. Nothing else may be
// thrown, and no sanitizer may report.
#include "fuzz_input.hpp"

#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config.hpp"
#include "data.hpp"

namespace {

using namespace moe_lm;

// The examples of a JSONL text as the format defines them, or an empty
// optional where some line is not an example (the loader must then fail on
// that line).
struct expected_examples {
  std::vector<example> examples;
  std::int64_t bad_line = 0;  // 1-based, 0: none
};

expected_examples read_lines(const std::string& text, std::int64_t max_tokens) {
  expected_examples r;
  std::int64_t number = 0;
  std::size_t start = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception&) {  // also a number past double's range
    }
    const auto text_field = [&](const char* name) { return j.is_object() && j.contains(name) && j[name].is_string(); };
    example e;
    bool ok = text_field("prompt") && text_field("answer") && text_field("domain");
    if (ok) {
      e.prompt = j["prompt"].get<std::string>();
      e.answer = j["answer"].get<std::string>();
      const std::string d = j["domain"].get<std::string>();
      ok = d == "arithmetic" || d == "code" || d == "words";
      e.dom = d == "arithmetic" ? domain::arithmetic : d == "code" ? domain::code : domain::words;
      ok = ok && !e.answer.empty();
      const std::int64_t tokens = 3 + static_cast<std::int64_t>(e.prompt.size() + e.answer.size());
      ok = ok && (max_tokens == 0 || tokens <= max_tokens);
    }
    if (!ok) {
      r.bad_line = number;
      return r;
    }
    r.examples.push_back(e);
  }
  return r;
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

void check_jsonl(const std::string& text, std::int64_t max_tokens) {
  const std::string path = (fuzz::private_directory("moe_lm_data") / "data.jsonl").string();
  std::ofstream(path, std::ios::binary) << text;
  const expected_examples want = read_lines(text, max_tokens);
  try {
    const std::vector<example> got = load_jsonl(path, max_tokens);
    FUZZ_CHECK(want.bad_line == 0, "line " + std::to_string(want.bad_line) + " is no example, yet the file loaded");
    FUZZ_CHECK(got.size() == want.examples.size() && !got.empty(), "the number of examples");
    for (std::size_t i = 0; i < got.size(); ++i)
      FUZZ_CHECK(got[i].prompt == want.examples[i].prompt && got[i].answer == want.examples[i].answer &&
                     got[i].dom == want.examples[i].dom,
                 "example " + std::to_string(i));
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    if (want.bad_line > 0)
      FUZZ_CHECK(starts_with(what, path + ":" + std::to_string(want.bad_line) + ": "), what);
    else
      FUZZ_CHECK(want.examples.empty() && what == path + ": no examples", what);
  }
}

void check_config(const std::string& text) {
  model_config c;
  try {
    c = model_config_from_json(text);
  } catch (const std::invalid_argument& e) {
    FUZZ_CHECK(starts_with(e.what(), "checkpoint config: "), e.what());
    return;
  }
  FUZZ_CHECK(c.d_model >= 1 && c.layers >= 1 && c.heads >= 1 && c.d_model % c.heads == 0, "dimensions");
  FUZZ_CHECK(c.experts >= 1 && c.experts <= 4096 && c.top_k >= 1 && c.top_k <= 16 && c.top_k <= c.experts, "E, K");
  FUZZ_CHECK(c.expert_hidden >= 1 && c.shared_hidden >= 1 && c.max_len >= 4, "widths");
  FUZZ_CHECK(std::isfinite(c.bias_update_rate) && c.bias_update_rate >= 0.0f, "bias_update_rate");
  FUZZ_CHECK(parameter_count(c) <= static_cast<double>(max_model_parameters), "parameters");
  FUZZ_CHECK(to_json(model_config_from_json(to_json(c))) == to_json(c), "the text form changed the configuration");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    if (rest.empty()) return 0;
    check_jsonl(rest.substr(1), static_cast<std::uint8_t>(rest[0]) % 64);
  } else {
    check_config(rest);
  }
  return 0;
}
