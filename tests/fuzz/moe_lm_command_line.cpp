// Fuzz target: the moe_lm driver's command line (examples/moe_lm/options.cpp),
// read as the driver reads it, one argument per line, in a private directory
// holding the files that must exist (base.pt, data.jsonl). Every command line
// must give either a command whose every setting is in the ranges written
// here (independently of options.cpp), or no command with exit code 0 (help)
// or a CLI11 error code and a message; never an exception or a sanitizer
// report. A model configuration that passes also survives the checkpoint's
// text form unchanged.
#include "fuzz_input.hpp"

#include <cmath>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "conditions.hpp"
#include "config.hpp"
#include "options.hpp"

namespace {

using namespace moe_lm;

void enter_the_sandbox() {
  static const bool ready = [] {
    namespace fs = std::filesystem;
    fs::current_path(fuzz::private_directory("moe_lm_command_line"));
    std::ofstream("base.pt") << "not read by the parser";
    std::ofstream("data.jsonl") << "";
    return true;
  }();
  (void)ready;
}

bool finite_at_least(double v, double lo) { return std::isfinite(v) && v >= lo; }

// The parameter count of a model, term by term from the architecture
// (model.cpp): token and position embeddings; per layer two norms, qkv and the
// output projection, the router, E experts of two [d x h] matrices, the shared
// expert's two [d x s]; the final norm; the untied head.
double parameters(const model_config& c) {
  const double d = static_cast<double>(c.d_model), norm = c.rms_norm ? d : 2 * d;
  double layer = 2 * norm + 3 * d * d + d * d + static_cast<double>(c.experts) * d;
  layer += static_cast<double>(c.experts) * 2 * d * static_cast<double>(c.expert_hidden);
  layer += 2 * d * static_cast<double>(c.shared_hidden);
  return 260 * d + static_cast<double>(c.max_len) * d + static_cast<double>(c.layers) * layer + norm +
         (c.tie_embeddings ? 0 : 260 * d);
}

void check_model(const model_config& c) {
  FUZZ_CHECK(c.d_model >= 1 && c.layers >= 1 && c.heads >= 1 && c.d_model % c.heads == 0, "dimensions");
  FUZZ_CHECK(c.experts >= 1 && c.experts <= 4096, "experts " + std::to_string(c.experts));
  FUZZ_CHECK(c.top_k >= 1 && c.top_k <= 16 && c.top_k <= c.experts, "top_k " + std::to_string(c.top_k));
  FUZZ_CHECK(c.expert_hidden >= 1 && c.shared_hidden >= 1 && c.max_len >= 4, "widths");
  FUZZ_CHECK(finite_at_least(c.bias_update_rate, 0.0), "bias_update_rate");
  FUZZ_CHECK(parameters(c) <= 2147483648.0, "parameters " + std::to_string(parameters(c)));
  const model_config back = model_config_from_json(to_json(c));
  FUZZ_CHECK(to_json(back) == to_json(c), "the checkpoint's form changed the configuration");
}

void check_training(const train_settings& t) {
  FUZZ_CHECK(t.steps >= 1 && t.batch_size >= 1, "steps and batch");
  FUZZ_CHECK(std::isfinite(t.lr) && t.lr > 0.0, "lr");
  FUZZ_CHECK(std::isfinite(t.beta2) && t.beta2 >= 0.0 && t.beta2 < 1.0, "beta2");
  FUZZ_CHECK(finite_at_least(t.weight_decay, 0.0), "weight decay");
  FUZZ_CHECK(t.admission_groups >= 1 && t.admission_groups <= 4096, "groups");
}

void check_data(const data_options& d) {
  FUZZ_CHECK(d.train >= 1 && d.post >= 1 && d.eval >= 1 && d.probe >= 1, "examples per domain");
}

bool cosine(float v) { return std::isfinite(v) && v >= -1.0f && v <= 1.0f; }

void check_posttrain(const posttrain_command& q) {
  check_training(q.train);
  check_data(q.data);
  FUZZ_CHECK(!q.base.empty(), "base");
  FUZZ_CHECK(std::isfinite(q.capacity_factor) && q.capacity_factor > 0.0, "capacity factor");
  if (!q.admission.dropless) {
    FUZZ_CHECK(q.admission.capacity_factor == q.capacity_factor, "the admission's capacity factor");
    FUZZ_CHECK(std::isfinite(q.admission.fill_factor) && q.admission.fill_factor > 0.0, "fill factor");
    FUZZ_CHECK(q.admission.affinity != rt::affinity_kind::cosine || cosine(q.admission.threshold), "tau");
  }
  FUZZ_CHECK(finite_at_least(q.locality, 0.0) && (q.locality == 0.0f || q.train.admission_groups >= 2), "locality");
  FUZZ_CHECK(!q.witness_margin || cosine(*q.witness_margin), "witness margin");
  FUZZ_CHECK(!q.expert_choice || (q.cond == condition::sft && !q.fixed_router && q.admission.dropless &&
                                  !q.witness_margin),
             "expert choice with another router change");
  const condition_setup cs = setup(q.cond, rt::router_config{}, q.params);
  FUZZ_CHECK(!q.fixed_router || cs.prior == prior_source::none, "fixed router with a prior");
  FUZZ_CHECK(q.admission.dropless || q.admission.overflow != rt::overflow_kind::reroute ||
                 cs.router.prior != rt::prior_kind::log_prior_bias || q.params.beta == 0.0f,
             "reroute admission under a soft prior");
  const condition_params& p = q.params;
  for (float v : {p.lbl_alpha, p.beta, p.router_l2, p.kl_to_base, p.logit_l2, p.z_loss})
    FUZZ_CHECK(finite_at_least(v, 0.0), "a condition coefficient");
  FUZZ_CHECK(std::isfinite(q.prior_logit_ratio) && q.prior_logit_ratio > 0.0, "prior logit ratio");
  FUZZ_CHECK(q.post_examples >= 0, "post examples");
  FUZZ_CHECK(std::isfinite(q.retention.rho) && q.retention.rho > 0.0 && q.retention.rho <= 1.0, "rho");
  FUZZ_CHECK(q.retention.nulls >= 0, "nulls");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  enter_the_sandbox();
  const std::vector<std::string> args =
      fuzz::argument_lines(std::string(reinterpret_cast<const char*>(data), size), "moe_lm");
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  parsed_command parsed;
  try {
    parsed = parse_command_line(static_cast<int>(argv.size()), argv.data(), out, err);
  } catch (const std::exception& e) {
    fuzz::finding(std::string("the parser threw: ") + e.what());
  }
  if (!parsed.cmd) {
    FUZZ_CHECK(parsed.exit_code == 0 || !err.str().empty(), "a refusal without a message");
    FUZZ_CHECK(parsed.exit_code != 0 || !out.str().empty(), "exit code 0 without a command or help");
    return 0;
  }
  const command& c = *parsed.cmd;
  FUZZ_CHECK(c.common.threads >= 1 && c.common.threads <= 1024 && c.common.log_every >= 0, "common options");
  FUZZ_CHECK(std::regex_match(c.common.device, std::regex("cpu|cuda(:[0-9]+)?")), "device " + c.common.device);
  if (const auto* p = std::get_if<pretrain_command>(&c.run)) {
    check_model(p->model);
    check_training(p->train);
    check_data(p->data);
    FUZZ_CHECK(finite_at_least(p->lbl, 0.0), "lbl");
    FUZZ_CHECK(!p->out.empty(), "out");
  } else if (const auto* q = std::get_if<posttrain_command>(&c.run)) {
    check_posttrain(*q);
  } else {
    const auto& e = std::get<eval_command>(c.run);
    FUZZ_CHECK(!e.model.empty(), "model");
    check_data(e.data);
  }
  return 0;
}
