#include "options.hpp"

#include <cmath>
#include <limits>
#include <ostream>
#include <regex>
#include <stdexcept>

#include <CLI/CLI.hpp>

#include <moe_route/adapters/detail/config_text.hpp>

#include "common/cli_checks.hpp"

namespace moe_lm {

namespace {

using moe_route_examples::cosine;
using moe_route_examples::file_name;
using moe_route_examples::finite;
using moe_route_examples::non_negative;
using moe_route_examples::positive;

// Integers in [lo, hi].
template <class T>
CLI::Range between(T lo, T hi) {
  return CLI::Range(lo, hi);
}

constexpr int max_count = 1 << 30;  // steps, batches, examples: far past any run, far from int's end

// Calls f; an std::invalid_argument it throws (a name it does not know, a
// check it fails) becomes a usage error naming `flag` (when the message does
// not already name it).
template <class F>
auto named(const std::string& flag, F f) {
  try {
    return f();
  } catch (const std::invalid_argument& e) {
    if (flag.empty()) throw CLI::ValidationError(e.what());
    throw CLI::ValidationError(flag, e.what());
  }
}

void add_optimiser_options(CLI::App* c, train_settings& o) {
  c->add_option("--adam-beta2", o.beta2, "AdamW beta2")
      ->check(finite<double>("in [0, 1)", [](double v) { return v >= 0.0 && v < 1.0; }));
  c->add_option("--weight-decay", o.weight_decay, "AdamW weight decay on the weight matrices")
      ->check(non_negative<double>());
}

void add_training_options(CLI::App* c, train_settings& o, const char* seed_help) {
  c->add_option("--steps", o.steps, "training steps")->check(between(1, max_count));
  c->add_option("--batch", o.batch_size, "examples per step")->check(between(1, max_count));
  c->add_option("--lr", o.lr, "peak learning rate")->check(positive<double>());
  c->add_option("--seed", o.seed, seed_help);
  add_optimiser_options(c, o);
}

void add_data_options(CLI::App* c, data_options& d) {
  c->add_option("--data-seed", d.seed, "seed of the embedded data set");
  c->add_option("--train-per-domain", d.train, "pretraining examples per domain")->check(between(1, max_count));
  c->add_option("--post-per-domain", d.post, "post-training examples per domain")->check(between(1, max_count));
  c->add_option("--eval-per-domain", d.eval, "evaluation examples per domain")->check(between(1, max_count));
  c->add_option("--probe-per-domain", d.probe, "probe examples per domain")->check(between(1, max_count));
  c->add_option("--train-jsonl", d.train_jsonl, "pretraining examples (JSONL) instead of the embedded ones")
      ->check(CLI::ExistingFile);
  c->add_option("--post-jsonl", d.post_jsonl, "post-training examples (JSONL)")->check(CLI::ExistingFile);
  c->add_option("--eval-jsonl", d.eval_jsonl, "evaluation examples (JSONL)")->check(CLI::ExistingFile);
  c->add_option("--probe-jsonl", d.probe_jsonl, "probe examples (JSONL)")->check(CLI::ExistingFile);
}

}  // namespace

parsed_command parse_command_line(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  CLI::App app{"moe_lm: a small MoE language model whose routers are moe_route's"};
  app.require_subcommand(1);
  common_options common;
  app.add_option("--threads", common.threads, "torch threads")->check(between(1, 1024));
  app.add_option("--json", common.json_path, "also write the result JSON here")->check(file_name());
  app.add_option("--log-every", common.log_every, "progress line every N steps (0: none)")
      ->check(between(0, max_count));
  app.add_option("--device", common.device,
                 "where the model runs: cpu, or cuda[:N] (the routers then run on the library's CUDA backend; "
                 "needs a build against a CUDA LibTorch)");

  // pretrain
  auto* pre = app.add_subcommand("pretrain", "pretrain a base model on the mixture of every domain");
  pretrain_command p;
  p.train.steps = 1500;
  p.train.prompt_loss = true;
  std::string preset = "softmax";
  model_config& mc = p.model;
  pre->add_option("--out", p.out, "checkpoint to write")->required()->check(file_name());
  pre->add_option("--gating", preset,
                  "router preset: softmax (DeepSeek-V2-Lite), sigmoid_bias (Moonlight), group_limited (DeepSeek-V3), "
                  "sqrt_softplus (DeepSeek-V4) or softmax_after_topk (Mixtral)");
  // The dimensions' ranges are check(model_config)'s, after parsing (it also bounds their product).
  pre->add_option("--d-model", mc.d_model, "width");
  pre->add_option("--layers", mc.layers, "depth");
  pre->add_option("--heads", mc.heads, "attention heads");
  pre->add_option("--experts", mc.experts, "routed experts E");
  pre->add_option("--top-k", mc.top_k, "experts per token K");
  pre->add_option("--expert-hidden", mc.expert_hidden, "hidden width of a routed expert");
  pre->add_option("--shared-hidden", mc.shared_hidden, "hidden width of the shared expert");
  pre->add_option("--max-len", mc.max_len, "positions");
  pre->add_option("--bias-update-rate", mc.bias_update_rate, "presets with an expert bias: its step");
  // Flags into bools: CLI11 2.1's flag callbacks let std::stoll's exception out for --flag=text.
  bool untied = false, layer_norm = false, answer_only = false;
  pre->add_flag("--untied", untied, "untie the output head");
  pre->add_flag("--layer-norm", layer_norm, "LayerNorm instead of RMSNorm");
  add_training_options(pre, p.train, "initialisation and batch-order seed");
  pre->add_option("--lbl", p.lbl, "load-balancing coefficient alpha during pretraining")
      ->check(non_negative<float>());
  pre->add_flag("--answer-only", answer_only,
                "train on the answer span only (default: predict the prompt bytes too, as a language model)");
  add_data_options(pre, p.data);

  // posttrain
  auto* post = app.add_subcommand("posttrain", "post-train a base model on one domain under one router condition");
  posttrain_command q;
  q.train.steps = 300;
  q.train.lr = 1e-3;
  std::string domain_arg, condition_arg = "sft", detector_arg = "louvain", prior_form_arg = "softmax";
  float tau = 0.0f, witness_margin = 0.0f;
  double fill_factor = 4.0;
  post->add_option("--base", q.base, "base checkpoint (moe_lm pretrain)")->required()->check(CLI::ExistingFile);
  post->add_option("--domain", domain_arg, "post-training domain: arithmetic, code or words")->required();
  post->add_option("--condition", condition_arg,
                   "sft, lbl, rpb, router_l2, kl_to_base, logit_l2, z_loss, rpb_hard, within_soft, within_hard, "
                   "global_hard");
  post->add_option("--admission", q.admission_name,
                   "dropless, cipher_strict, cipher_reroute, locmoe, capacity_position, capacity_probs, "
                   "capacity_gate");
  auto* tau_opt = post->add_option("--tau", tau, "admission threshold (cipher_*: 0, locmoe: 0.01 by default)")
                      ->check(cosine<float>());
  post->add_option("--capacity-factor", q.capacity_factor, "admission (and --expert-choice) capacity factor")
      ->check(positive<double>());
  post->add_option("--fill-factor", fill_factor, "cipher_reroute fill factor")->check(positive<double>());
  post->add_option("--groups", q.train.admission_groups, "admission groups per batch (expert-parallel ranks)")
      ->check(between(1, moe_route::max_experts));
  post->add_option("--locality", q.locality,
                   "locality penalty lambda_loc (LocMoE; CIPHER uses 0.01) on top of the condition: each of the "
                   "--groups ranks hosts E / groups experts and routes its micro-batch")
      ->check(non_negative<float>());
  post->add_flag("--admit-at-eval", q.admit_at_eval, "admission also when evaluating");
  auto* margin_opt =
      post->add_option("--witness-margin", witness_margin,
                       "check every step's admission against CIPHER's Theorem 1 (analysis::signal_retention): a "
                       "routed slot with cosine >= this margin is a signal; capacities by --capacity-factor")
          ->check(cosine<float>());
  post->add_flag("--fixed-router", q.fixed_router,
                 "train with the fixed assignment (t K + j) mod E (CIPHER eq. 3); evaluate with the learned router");
  post->add_flag("--expert-choice", q.expert_choice,
                 "train with expert-choice routing (each expert takes --capacity-factor x N K / E tokens by "
                 "softmax score); evaluate with the learned router");
  post->add_flag("--pad-experts", q.pad_experts,
                 "run every expert on as many rows as the most loaded one (capacity-padded expert time)");
  post->add_option("--out", q.out, "write the post-trained checkpoint here")->check(file_name());
  add_training_options(post, q.train, "batch-order seed (and shuffle seed)");
  post->add_option("--lbl-alpha", q.params.lbl_alpha, "lbl: alpha")->check(non_negative<float>());
  post->add_option("--beta", q.params.beta,
                   "rpb, within_soft: beta (with --calibrate-beta: in units of the calibrated beta)")
      ->check(non_negative<float>());
  post->add_option("--prior-form", prior_form_arg,
                   "how the prior reads the base router: softmax (RPB, every preset) or gate_scores (the preset's "
                   "scores normalised to sum 1)");
  post->add_flag("--calibrate-beta", q.calibrate_beta,
                 "scale beta so that sd(beta b) / sd(z), the prior bias's spread over the router logits', is "
                 "--prior-logit-ratio (docs/results.md)");
  post->add_option("--prior-logit-ratio", q.prior_logit_ratio, "--calibrate-beta: the target ratio (RPB: about 1)")
      ->check(positive<double>());
  post->add_flag("--freeze-expert-bias", q.freeze_expert_bias,
                 "do not update the expert bias (it is never updated under a prior condition)");
  post->add_option("--router-l2", q.params.router_l2, "router_l2: lambda")->check(non_negative<float>());
  post->add_option("--kl", q.params.kl_to_base, "kl_to_base: coefficient")->check(non_negative<float>());
  post->add_option("--logit-l2", q.params.logit_l2, "logit_l2: coefficient")->check(non_negative<float>());
  post->add_option("--z-loss", q.params.z_loss, "z_loss: coefficient")->check(non_negative<float>());
  post->add_option("--post-examples", q.post_examples, "use the first N post-training examples (0: all)")
      ->check(between(0, max_count));
  post->add_option("--rho", q.retention.rho, "retention: kept edge fraction")
      ->check(finite<double>("in (0, 1]", [](double v) { return v > 0.0 && v <= 1.0; }));
  post->add_option("--nulls", q.retention.nulls, "retention: null-model resamples")->check(between(0, 1 << 20));
  post->add_option("--detector-seed", q.retention.seed, "retention: community-detector and null-model seed");
  post->add_option("--detector", detector_arg, "retention: louvain or leiden");
  post->add_flag("--eval-base", q.eval_base, "also evaluate the base model");
  add_data_options(post, q.data);

  // eval
  auto* ev = app.add_subcommand("eval", "evaluate a checkpoint per domain");
  eval_command e;
  ev->add_option("--model", e.model, "checkpoint")->required()->check(CLI::ExistingFile);
  ev->add_option("--prompt", e.prompt, "print the greedy answer to this prompt instead");
  add_data_options(ev, e.data);

  parsed_command result;
  try {
    app.parse(argc, argv);
    if (!std::regex_match(common.device, std::regex("cpu|cuda(:[0-9]{1,4})?")))
      throw CLI::ValidationError("--device", "must be cpu, cuda or cuda:N, got \"" + common.device + "\"");
    command c{common, {}};
    if (*pre) {
      mc.gating = named("--gating", [&] { return parse_preset(preset); });
      mc.tie_embeddings = !untied;
      mc.rms_norm = !layer_norm;
      p.train.prompt_loss = !answer_only;
      named("", [&] { check(mc, naming::flags); });
      c.run = p;
    } else if (*post) {
      q.post_domain = named("--domain", [&] { return parse_domain(domain_arg); });
      q.cond = named("--condition", [&] { return parse_condition(condition_arg); });
      q.form = named("--prior-form", [&] { return parse_prior_form(prior_form_arg); });
      q.retention.detector = named("--detector", [&] { return parse_detector(detector_arg); });
      q.admission = named("--admission", [&] {
        const rt::admission_config a = moe_route::adapters::detail::admission_preset_of(
            q.admission_name, q.capacity_factor, fill_factor,
            tau_opt->count() > 0 ? std::optional<float>(tau) : std::nullopt);
        rt::validate(a);
        return a;
      });
      if (margin_opt->count() > 0) q.witness_margin = witness_margin;
      if (q.locality != 0.0f && q.train.admission_groups < 2)
        throw CLI::ValidationError("--locality", "needs --groups >= 2 (the expert-parallel ranks)");
      if (q.expert_choice && (q.cond != condition::sft || q.fixed_router || q.admission_name != "dropless"))
        throw CLI::ValidationError("--expert-choice",
                                   "replaces the router and admission while training, so it takes --condition "
                                   "sft, --admission dropless and no --fixed-router");
      if (q.expert_choice && q.witness_margin)
        throw CLI::ValidationError("--witness-margin", "checks token-choice admission, not --expert-choice");
      const condition_setup cs = setup(q.cond, rt::router_config{}, q.params);
      if (!q.admission.dropless && q.admission.overflow == rt::overflow_kind::reroute &&
          cs.router.prior == rt::prior_kind::log_prior_bias && cs.router.prior_bias.beta != 0.0f &&
          cs.router.prior_bias.bias_gates)
        throw CLI::ValidationError("--admission",
                                   q.admission_name + " cannot run under --condition " + condition_arg +
                                       " (a soft prior with --beta != 0): its rerouted gates would come from the "
                                       "unbiased logits, the routed ones from the biased logits");
      if (q.fixed_router && cs.prior != prior_source::none)
        throw CLI::ValidationError("--fixed-router",
                                   "ignores the logits' ranking, so it cannot take a condition with a prior");
      c.run = q;
    } else {
      c.run = e;
    }
    result.cmd = std::move(c);
  } catch (const CLI::RequiredError& error) {
    // CLI11 says only "A subcommand is required" when the command is misspelt.
    const std::vector<std::string> extra = app.remaining();
    if (!app.get_subcommands().empty() || extra.empty()) {
      result.exit_code = app.exit(error, out, err);
    } else {
      result.exit_code = app.exit(
          CLI::ExtrasError("unknown command \"" + extra.front() + "\" (pretrain, posttrain or eval)",
                           CLI::ExitCodes::ExtrasError),
          out, err);
    }
  } catch (const CLI::ParseError& error) {
    result.exit_code = app.exit(error, out, err);
  }
  return result;
}

}  // namespace moe_lm
