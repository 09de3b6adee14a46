// Fuzz target: what the expert-parallel driver moe_route_ep reads
// (examples/expert_parallel), in a private directory holding ref.json. The
// first byte chooses what the rest is:
//   even: a command line, one argument per line, read as the driver reads it:
//         a command whose every setting is in the ranges written here, or no
//         command with exit code 0 (help) or a CLI11 error code and a message;
//   odd:  two files for --compare, split at the first NUL byte: the
//         comparison's verdict, or std::runtime_error naming one of the two
//         files; a file that reads as a record agrees with itself.
// Nothing else may be thrown, and no sanitizer may report.
#include "fuzz_input.hpp"

#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "compare.hpp"
#include "options.hpp"

namespace {

const std::filesystem::path& sandbox() {
  static const std::filesystem::path dir = [] {
    const std::filesystem::path d = fuzz::private_directory("ep_driver");
    std::filesystem::current_path(d);
    std::ofstream("ref.json") << "{}";
    return d;
  }();
  return dir;
}

void check_command_line(const std::string& text) {
  const std::vector<std::string> args = fuzz::argument_lines(text, "moe_route_ep");
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  ep::parsed_command parsed;
  try {
    parsed = ep::parse_command_line(static_cast<int>(argv.size()), argv.data(), out, err);
  } catch (const std::exception& e) {
    fuzz::finding(std::string("the parser threw: ") + e.what());
  }
  if (!parsed.cmd) {
    FUZZ_CHECK(parsed.exit_code == 0 || !err.str().empty(), "a refusal without a message");
    return;
  }
  const ep::command& c = *parsed.cmd;
  const ep::options& o = c.run;
  FUZZ_CHECK(o.router == "balanced" || o.router == "aux_free", "router " + o.router);
  FUZZ_CHECK(o.admission == "capacity_probs" || o.admission == "cipher_strict" || o.admission == "cipher_reroute" ||
                 o.admission == "dropless",
             "admission " + o.admission);
  FUZZ_CHECK(std::isfinite(o.capacity_factor) && o.capacity_factor > 0.0, "capacity factor");
  FUZZ_CHECK(std::isfinite(o.tau) && o.tau >= -1.0f && o.tau <= 1.0f, "tau");
  FUZZ_CHECK(o.tokens_per_rank >= 1 && o.tokens_per_rank <= (1 << 20), "tokens per rank");
  FUZZ_CHECK(o.steps >= 1 && o.steps <= (1 << 16), "steps");
  FUZZ_CHECK(std::isfinite(o.learning_rate) && o.learning_rate > 0.0f, "learning rate");
  FUZZ_CHECK(o.simulated_ranks == 0 || (o.simulated_ranks >= 1 && ep::experts % o.simulated_ranks == 0),
             "simulated ranks " + std::to_string(o.simulated_ranks));
  FUZZ_CHECK(c.reference.empty() == c.candidate.empty(), "--compare takes two files");
  if (!c.reference.empty())
    FUZZ_CHECK(std::filesystem::is_regular_file(c.reference) && std::filesystem::is_regular_file(c.candidate),
               "--compare of a file that does not exist");
}

void check_compare(const std::string& text) {
  const std::size_t cut = std::min(text.find('\0'), text.size());
  const std::string a = (sandbox() / "a.json").string(), b = (sandbox() / "b.json").string();
  std::ofstream(a, std::ios::binary) << text.substr(0, cut);
  std::ofstream(b, std::ios::binary) << (cut < text.size() ? text.substr(cut + 1) : std::string());
  std::ostringstream report;
  try {
    ep::compare_files(a, b, report);
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    FUZZ_CHECK(what.rfind(a + ": ", 0) == 0 || what.rfind(b + ": ", 0) == 0, what);
  }
  try {
    FUZZ_CHECK(ep::compare_files(a, a, report), "a record disagrees with itself");
  } catch (const std::runtime_error& e) {
    FUZZ_CHECK(std::string(e.what()).rfind(a + ": ", 0) == 0, e.what());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  sandbox();
  if (size == 0) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0)
    check_command_line(rest);
  else
    check_compare(rest);
  return 0;
}
