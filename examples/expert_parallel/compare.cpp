// The comparison the test runs: an MPI run against the single-process
// reference, field by field.
//
// Bit-equal: every integer (indices, admission, loads, dispatch counts), and
// every float whose arithmetic is the same operations in the same order in
// both drivers: the outputs y, dL/dz, the expert weight gradients (each
// expert accumulates its rows in global token order in both: source ranks
// arrive in rank order and own ascending token slices), the expert bias (from
// the exact integer counts) and the final weights. dL/dz is bit-equal even
// where the reference takes load_balance over the whole batch in one call:
// with equal slices, alpha E f_e / N and (1/R) alpha E f_e / N_r round to the
// same double, because 1/R is a power of two.
//
// Tolerance 1e-12 of the field's largest magnitude: the double sums whose order
// differs, namely dL/dW_router (MPI_Allreduce of per-rank partial sums vs one
// sum over all tokens), the penalty values (the mean of the ranks'
// load_balance values vs the single-batch value, the all-reduced sum of the
// ranks' locality values) and the loss. Their rounding error is a few 1e-16
// of the magnitude.
//
// The final router weights are SGD steps on the all-reduced gradient, so they
// are bit-equal unless a gradient entry sits within ~1e-16 of a float rounding
// boundary; with the test's inputs they are.
#include "compare.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <ostream>
#include <stdexcept>
#include <vector>

namespace ep {
namespace {

struct verdict {
  double max_diff = 0.0;
  double scale = 0.0;
  bool ok = true;
  std::string problem;
};

// Flattens a number or an array of numbers.
std::vector<double> numbers(const json& v) {
  std::vector<double> out;
  if (v.is_array())
    for (const auto& e : v) out.push_back(e.get<double>());
  else
    out.push_back(v.get<double>());
  return out;
}

verdict check(const json& ref, const json& run, double tolerance) {
  verdict v;
  const std::vector<double> a = numbers(ref), b = numbers(run);
  if (a.size() != b.size()) {
    v.ok = false;
    v.problem = "sizes " + std::to_string(a.size()) + " and " + std::to_string(b.size());
    return v;
  }
  for (double x : a) v.scale = std::max(v.scale, std::fabs(x));
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(a[i] - b[i]);
    const bool same = tolerance == 0.0 ? a[i] == b[i] : d <= tolerance * v.scale;
    v.max_diff = std::max(v.max_diff, d);
    if (!same && v.ok) {
      v.ok = false;
      char text[96];
      std::snprintf(text, sizeof text, "first at [%zu]: %.17g vs %.17g", i, a[i], b[i]);
      v.problem = text;
    }
  }
  return v;
}

struct rule {
  const char* path;  // JSON pointer below a step (or below "final")
  double tolerance;  // 0: bit-equal; else relative to the field's largest magnitude
};

constexpr double summed = 1e-12;
constexpr rule step_rules[] = {
    {"/indices", 0.0},      {"/admitted", 0.0},     {"/loads", 0.0},
    {"/send_counts", 0.0},  {"/rank_counts", 0.0},  {"/expert_rows", 0.0},
    {"/outputs", 0.0},      {"/grad_logits", 0.0},  {"/grad_experts", 0.0},
    {"/expert_bias", 0.0},  {"/grad_router", summed}, {"/penalties/load_balance", summed},
    {"/penalties/locality", summed}, {"/loss", summed},
};
constexpr rule final_rules[] = {{"/router", 0.0}, {"/experts", 0.0}, {"/expert_bias", 0.0}};

// A number, or an array of numbers.
bool numeric(const json& v) {
  if (v.is_number()) return true;
  if (!v.is_array()) return false;
  for (const auto& e : v)
    if (!e.is_number()) return false;
  return true;
}

[[noreturn]] void not_a_record(const std::string& name, const std::string& what) {
  throw std::runtime_error(name + ": not a moe_route_ep record (" + what + ")");
}

void check_fields(const json& j, const char* where, const rule* rules, std::size_t count, const std::string& name) {
  if (!j.is_object()) not_a_record(name, std::string(where) + " is not an object");
  for (std::size_t r = 0; r < count; ++r) {
    const json::json_pointer p(rules[r].path);
    if (!j.contains(p)) not_a_record(name, std::string(where) + " has no " + rules[r].path);
    if (!numeric(j.at(p)))
      not_a_record(name, std::string(where) + rules[r].path + " is not a number or an array of numbers");
  }
}

}  // namespace

void check_record(const json& record, const std::string& name) {
  const auto fail = [&](const std::string& what) { not_a_record(name, what); };
  if (!record.is_object()) fail("not a JSON object");
  if (!record.contains("layer") || !record["layer"].is_object()) fail("no \"layer\" object");
  if (!record.contains("steps") || !record["steps"].is_array()) fail("no \"steps\" array");
  for (std::size_t s = 0; s < record["steps"].size(); ++s)
    check_fields(record["steps"][s], ("step " + std::to_string(s)).c_str(), step_rules, std::size(step_rules), name);
  if (!record.contains("final")) fail("no \"final\" object");
  check_fields(record["final"], "final", final_rules, std::size(final_rules), name);
}

bool compare(const json& reference, const json& run, std::ostream& report) {
  json ref_layer = reference.at("layer"), run_layer = run.at("layer");
  ref_layer.erase("mode");
  run_layer.erase("mode");
  if (ref_layer != run_layer) {
    report << "different configurations:\n  " << ref_layer.dump() << "\n  " << run_layer.dump() << "\n";
    return false;
  }
  const json& ref_steps = reference.at("steps");
  const json& run_steps = run.at("steps");
  if (ref_steps.size() != run_steps.size()) {
    report << ref_steps.size() << " steps against " << run_steps.size() << "\n";
    return false;
  }
  bool all = true;
  const auto line = [&](const std::string& where, const rule& r, const json& a, const json& b) {
    const verdict v = check(a.at(json::json_pointer(r.path)), b.at(json::json_pointer(r.path)), r.tolerance);
    all = all && v.ok;
    const std::string tolerance = r.tolerance == 0.0 ? "bit-equal" : "tol 1e-12";
    char text[160];
    std::snprintf(text, sizeof text, "%-7s %-24s %-10s max |diff| %-10.3g of %-10.3g %s ", where.c_str(), r.path,
                  tolerance.c_str(), v.max_diff, v.scale, v.ok ? "ok" : "MISMATCH");
    report << text << v.problem << "\n";
  };
  for (std::size_t s = 0; s < ref_steps.size(); ++s)
    for (const rule& r : step_rules) line("step " + std::to_string(s), r, ref_steps[s], run_steps[s]);
  for (const rule& r : final_rules) line("final", r, reference.at("final"), run.at("final"));
  report << (all ? "agree" : "DISAGREE") << "\n";
  return all;
}

namespace {

json read_record(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot be read");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {  // parse errors, and numbers past double's range
    throw std::runtime_error(path + ": not JSON (" + e.what() + ")");
  }
  check_record(j, path);
  return j;
}

}  // namespace

bool compare_files(const std::string& reference, const std::string& run, std::ostream& report) {
  return compare(read_record(reference), read_record(run), report);
}

}  // namespace ep
