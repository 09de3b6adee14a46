// moe_lm: the command line (CLI11), read and checked without LibTorch. Every
// option's value is checked where it is read, so a bad value is refused
// naming its flag before a model, a data set or a file is touched; what only
// the checkpoint can tell (its E and K against --groups, say) is checked when
// the command runs (main.cpp).
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <moe_route/runtime/config.hpp>

#include "conditions.hpp"
#include "config.hpp"
#include "data.hpp"

namespace moe_lm {

// Where the examples come from: the embedded data set (sizes per domain, its
// seed) unless a JSONL file replaces a part.
struct data_options {
  std::uint64_t seed = 0;
  int train = 3000, post = 2000, eval = 200, probe = 200;  // per domain
  std::string train_jsonl, post_jsonl, eval_jsonl, probe_jsonl;
};

struct common_options {
  int threads = 1;         // torch threads
  std::string json_path;   // also write the result JSON here
  int log_every = 50;      // progress line every N steps (0: none)
  std::string device = "cpu";  // cpu, cuda or cuda:N
};

struct pretrain_command {
  model_config model;
  train_settings train;
  float lbl = 1e-2f;  // the load-balancing coefficient alpha
  std::string out;    // the checkpoint
  data_options data;
};

struct posttrain_command {
  std::string base, out;  // checkpoints: read, and (when not empty) written
  domain post_domain = domain::arithmetic;
  condition cond = condition::sft;
  condition_params params;
  std::string admission_name = "dropless";
  rt::admission_config admission;  // the preset at --tau, --capacity-factor, --fill-factor
  double capacity_factor = 1.25;
  train_settings train;
  float locality = 0.0f;
  std::optional<float> witness_margin;
  bool admit_at_eval = false, eval_base = false, pad_experts = false, fixed_router = false, expert_choice = false;
  prior_form form = prior_form::softmax;
  bool calibrate_beta = false;
  double prior_logit_ratio = 1.0;
  bool freeze_expert_bias = false;
  int post_examples = 0;  // the first N post-training examples (0: all)
  retention_settings retention;
  data_options data;
};

struct eval_command {
  std::string model, prompt;
  data_options data;
};

struct command {
  common_options common;
  std::variant<pretrain_command, posttrain_command, eval_command> run;
};

// What parse_command_line found: a command to run, or none and the process's
// exit code (0 after --help; CLI11's code for a refused command line, after
// its message, which names the option, was written to `err`).
struct parsed_command {
  std::optional<command> cmd;
  int exit_code = 0;
};

// Reads argv[1..argc) as `moe_lm` does. Throws nothing but std::bad_alloc.
parsed_command parse_command_line(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

}  // namespace moe_lm
