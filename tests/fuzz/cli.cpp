// Fuzz target: the moe-route command line (tools/moe-route), in process. The
// input is a command line, one argument per line, run in a private directory
// that holds small valid inputs (logits.npy, prior.npy, ...). Every command
// line must end with exit code 0, 1 (data error) or 2 (usage error), never with
// an exception the tool does not name or a sanitizer report, and a run that
// fails must leave no file behind (outputs are staged and renamed only on
// success). Arguments that would leave the directory ('/', '..'), start
// gnuplot (--plot) or ask for unbounded work (numbers of 5 digits and more,
// --nulls above 20, --threads above 4) make the input uninteresting: the
// sandbox's limits, not the tool's.
#include "common.hpp"  // tools/moe-route
#include "fuzz_input.hpp"

#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
namespace cli = moe_route_cli;

constexpr std::int64_t tokens = 16, experts = 8, k = 2, prior_rows = 4;

// The private directory with the fixtures, made once and removed at exit; the
// process works inside it.
const std::set<std::string>& fixtures() {
  static const std::set<std::string> names = [] {
    const fs::path& dir = fuzz::private_directory("cli");
    fs::current_path(dir);
    std::vector<float> logits(tokens * experts), prior(prior_rows * experts, 1.0f / experts), bias(experts, 0.0f),
        hidden(tokens, 1.0f), weight(experts, 1.5f);
    for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>((i * 37) % 17) / 4.0f - 2.0f;
    std::vector<std::int32_t> rows(tokens), trace(tokens * k), communities(experts), domains(tokens);
    for (std::int64_t t = 0; t < tokens; ++t) {
      rows[t] = t % 5 == 4 ? -1 : static_cast<std::int32_t>(t % prior_rows);
      domains[t] = static_cast<std::int32_t>(t % 2);
      for (std::int64_t j = 0; j < k; ++j) trace[t * k + j] = static_cast<std::int32_t>((t + 3 * j) % experts);
    }
    for (std::int64_t e = 0; e < experts; ++e) communities[e] = static_cast<std::int32_t>(e / 4);
    const std::size_t N = tokens, E = experts, R = prior_rows, K = k;
    cli::staged_outputs out;
    out.save_f32("logits.npy", logits.data(), {N, E});
    out.save_f32("prior.npy", prior.data(), {R, E});
    out.save_i32("prior_rows.npy", rows.data(), {N});
    out.save_f32("expert_bias.npy", bias.data(), {E});
    out.save_f32("hidden_norms.npy", hidden.data(), {N});
    out.save_f32("weight_norms.npy", weight.data(), {E});
    out.save_i32("trace.npy", trace.data(), {N, K});
    out.save_i32("communities.npy", communities.data(), {E});
    out.save_i32("domains.npy", domains.data(), {N});
    out.commit();
    std::set<std::string> all;
    for (const auto& entry : fs::directory_iterator(dir)) all.insert(entry.path().filename().string());
    return all;
  }();
  return names;
}

bool inside_the_sandbox(const std::vector<std::string>& args) {
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.find('/') != std::string::npos || a.find("..") != std::string::npos || a == "--plot") return false;
    if (a.size() >= 5 && a.find_first_not_of("0123456789+-.eE") == std::string::npos) return false;
    const std::string& flag = i > 0 ? args[i - 1] : a;
    const double value = std::atof(a.c_str());
    if ((flag == "--nulls" && value > 20) || (flag == "--threads" && value > 4)) return false;
  }
  return true;
}

// The regular files a run created, anywhere below the directory.
std::vector<std::string> new_files() {
  std::vector<std::string> files;
  for (const auto& entry : fs::recursive_directory_iterator(fs::current_path()))
    if (entry.is_regular_file() && !fixtures().count(fs::relative(entry.path()).string()))
      files.push_back(fs::relative(entry.path()).string());
  return files;
}

void clean() {
  for (const auto& entry : fs::directory_iterator(fs::current_path()))
    if (!fixtures().count(entry.path().filename().string())) fs::remove_all(entry.path());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fixtures();
  std::vector<std::string> args{"moe-route"};
  std::string arg;
  for (std::size_t i = 0; i <= size; ++i) {
    if (i == size || data[i] == '\n' || data[i] == 0) {
      if (!arg.empty() || (i < size && data[i] == 0)) args.push_back(arg);
      arg.clear();
    } else {
      arg += static_cast<char>(data[i]);
    }
  }
  if (!inside_the_sandbox(args)) return -1;  // not added to the corpus
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const int rc = cli::run(static_cast<int>(args.size()), argv.data());
  FUZZ_CHECK(rc == 0 || rc == 1 || rc == 2, "exit code " + std::to_string(rc));
  if (rc != 0) {
    const std::vector<std::string> left = new_files();
    FUZZ_CHECK(left.empty(), "a failed run left " + left.front() + " behind");
  }
  clean();
  return 0;
}
