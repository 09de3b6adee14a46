// moe_lm: pretrain a small MoE language model on the Q/A mixture, save it,
// and post-train it on one domain under one router condition (RPB Table 1,
// z-loss) and one admission policy, printing progress on stderr and the
// result as JSON on stdout. The RPB and CIPHER studies are loops over
// `moe_lm posttrain` with different --condition / --admission / --seed.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <regex>
#include <stdexcept>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#include <moe_route/adapters/detail/config_text.hpp>

#include "analysis.hpp"
#include "conditions.hpp"
#include "data.hpp"
#include "model.hpp"
#include "output_file.hpp"
#include "train.hpp"

namespace {

using namespace moe_lm;
using nlohmann::json;

struct data_options {
  std::uint64_t seed = 0;
  int train = 3000, post = 2000, eval = 200, probe = 200;  // per domain
  std::string train_jsonl, post_jsonl, eval_jsonl, probe_jsonl;
};

void add_optimiser_options(CLI::App* c, train_options& o) {
  c->add_option("--adam-beta2", o.beta2, "AdamW beta2");
  c->add_option("--weight-decay", o.weight_decay, "AdamW weight decay on the weight matrices");
}

// Every domain's name, in domain order.
std::vector<std::string> domain_names() {
  std::vector<std::string> names;
  for (int d = 0; d < num_domains; ++d) names.push_back(domain_name(static_cast<domain>(d)));
  return names;
}

void add_data_options(CLI::App* c, data_options& d) {
  c->add_option("--data-seed", d.seed, "seed of the embedded data set");
  c->add_option("--train-per-domain", d.train, "pretraining examples per domain");
  c->add_option("--post-per-domain", d.post, "post-training examples per domain");
  c->add_option("--eval-per-domain", d.eval, "evaluation examples per domain");
  c->add_option("--probe-per-domain", d.probe, "probe examples per domain");
  c->add_option("--train-jsonl", d.train_jsonl, "pretraining examples (JSONL) instead of the embedded ones");
  c->add_option("--post-jsonl", d.post_jsonl, "post-training examples (JSONL)");
  c->add_option("--eval-jsonl", d.eval_jsonl, "evaluation examples (JSONL)");
  c->add_option("--probe-jsonl", d.probe_jsonl, "probe examples (JSONL)");
}

split load_data(const data_options& d, std::int64_t max_len) {
  split s = default_data(d.seed, d.train, d.post, d.eval, d.probe);
  if (!d.train_jsonl.empty()) s.train = load_jsonl(d.train_jsonl, max_len + 1);
  if (!d.post_jsonl.empty()) s.post = load_jsonl(d.post_jsonl, max_len + 1);
  if (!d.eval_jsonl.empty()) s.eval = load_jsonl(d.eval_jsonl, max_len + 1);
  if (!d.probe_jsonl.empty()) s.probe = load_jsonl(d.probe_jsonl, max_len + 1);
  return s;
}

json metrics_json(const std::vector<domain_metrics>& ms) {
  json j = json::object();
  for (const auto& m : ms) j[m.domain] = {{"examples", m.examples}, {"accuracy", m.accuracy}, {"answer_loss", m.answer_loss}};
  return j;
}

// In-domain and the unweighted mean of the other domains.
json id_ood(const std::vector<domain_metrics>& ms, const std::string& in_domain) {
  json id = nullptr, ood = {{"accuracy", 0.0}, {"answer_loss", 0.0}};
  int others = 0;
  for (const auto& m : ms) {
    if (m.domain == in_domain) {
      id = {{"accuracy", m.accuracy}, {"answer_loss", m.answer_loss}};
    } else {
      ood["accuracy"] = ood["accuracy"].get<double>() + m.accuracy;
      ood["answer_loss"] = ood["answer_loss"].get<double>() + m.answer_loss;
      ++others;
    }
  }
  if (others > 0) {
    ood["accuracy"] = ood["accuracy"].get<double>() / others;
    ood["answer_loss"] = ood["answer_loss"].get<double>() / others;
  }
  return {{"id", id}, {"ood", others > 0 ? ood : json(nullptr)}};
}

// Linear-interpolation quantiles (numpy's default) of v at kQuantiles, keyed by the level.
constexpr double kQuantiles[] = {0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99};
json quantiles(std::vector<float> v) {
  if (v.empty()) return nullptr;
  std::sort(v.begin(), v.end());
  json q = json::object();
  for (double level : kQuantiles) {
    const double pos = level * static_cast<double>(v.size() - 1);
    const auto lo = static_cast<std::size_t>(pos);
    const std::size_t hi = std::min(lo + 1, v.size() - 1);
    char key[16];
    std::snprintf(key, sizeof key, "%g", level);
    q[key] = v[lo] + (pos - static_cast<double>(lo)) * (static_cast<double>(v[hi]) - v[lo]);
  }
  return q;
}

json signal_json(const moe_route::analysis::signal_retention_stats& s) {
  return {{"pools", s.pools},
          {"available", s.available},
          {"retained", s.retained},
          {"natural_retained", s.natural_retained},
          {"natural_predicted", s.natural_predicted},
          {"natural_capacity", s.natural_capacity},
          {"at_budget", s.at_budget},
          {"retained_at_budget", s.retained_at_budget},
          {"discriminative", s.discriminative},
          {"discriminative_kept", s.discriminative_kept}};
}

json train_json(const train_result& r, int every) {
  double ms = 0.0, expert_ms = 0.0, expert_rows = 0.0, window = 0.0;
  int window_steps = 0;
  json log = json::array();
  for (const auto& s : r.log) {
    ms += s.ms;
    expert_ms += s.expert_ms;
    expert_rows += static_cast<double>(s.expert_rows);
    window += s.task_loss;
    ++window_steps;
    // Every `every` steps (and the first and last): that step's values and the mean task loss since the last entry.
    if (every > 0 && (s.step % every == 0 || s.step == static_cast<int>(r.log.size()) || s.step == 1)) {
      log.push_back({{"step", s.step}, {"task_loss", s.task_loss}, {"window_loss", window / window_steps},
                     {"aux_loss", s.aux_loss}, {"router_l2", s.router_l2}, {"lr", s.lr}});
      window = 0.0;
      window_steps = 0;
    }
  }
  json loads = json::array();
  for (std::size_t l = 0; l < r.routed_loads.size(); ++l) {
    std::int64_t executed = 0, peak = 0;
    for (auto v : r.executed_loads[l]) executed += v, peak = std::max(peak, v);
    const double e = static_cast<double>(r.executed_loads[l].size());
    json layer = {{"routed_loads", r.routed_loads[l]},
                  {"executed_loads", r.executed_loads[l]},
                  {"top1_share", executed > 0 ? static_cast<double>(peak) / executed : 0.0},
                  {"peak_to_mean", executed > 0 ? static_cast<double>(peak) * e / executed : 0.0},
                  {"dropped_rate", r.slots > 0 ? 1.0 - static_cast<double>(executed) / r.slots : 0.0}};
    if (!r.routed_affinities[l].empty()) layer["affinity_quantiles"] = quantiles(r.routed_affinities[l]);
    if (r.signal_retention[l].pools > 0) layer["signal_retention"] = signal_json(r.signal_retention[l]);
    loads.push_back(layer);
  }
  std::vector<float> pooled;
  for (const auto& a : r.routed_affinities) pooled.insert(pooled.end(), a.begin(), a.end());
  return {{"steps", r.log.size()},
          {"first_loss", r.log.empty() ? 0.0 : r.log.front().task_loss},
          {"last_loss", r.log.empty() ? 0.0 : r.log.back().task_loss},
          {"mean_step_ms", r.log.empty() ? 0.0 : ms / static_cast<double>(r.log.size())},
          {"mean_expert_ms", r.log.empty() ? 0.0 : expert_ms / static_cast<double>(r.log.size())},
          {"mean_expert_rows", r.log.empty() ? 0.0 : expert_rows / static_cast<double>(r.log.size())},
          {"log", log},
          {"layers", loads},
          {"affinity_quantiles", quantiles(std::move(pooled))}};
}

void progress(const char* what, const step_log& s, int steps) {
  std::fprintf(stderr, "[%s] step %d/%d  loss %.4f (window mean %.4f)  aux %.5f%s  lr %.2e  %.1f ms/step\n", what,
               s.step, steps, s.task_loss, s.window_loss, s.aux_loss,
               s.router_l2 != 0.0 ? (" router_l2 " + std::to_string(s.router_l2)).c_str() : "", s.lr, s.ms);
}

void emit(const json& j, const std::string& path) {
  std::cout << j.dump(2) << std::endl;
  if (!path.empty())
    write_replacing(path, [&](const std::string& tmp) {
      std::ofstream out(tmp);
      out << j.dump(2) << "\n";
      out.close();  // flushes: a full disk shows here, not as a short file
      if (!out) throw std::runtime_error("write to " + tmp + " failed");
    });
}

rt::admission_config admission_of(const std::string& name, float tau, bool tau_given, double capacity_factor,
                                  double fill_factor) {
  return moe_route::adapters::detail::admission_preset_of(name, capacity_factor, fill_factor,
                                                          tau_given ? std::optional<float>(tau) : std::nullopt);
}

json admission_json(const std::string& name, const rt::admission_config& a) {
  if (a.dropless) return {{"policy", name}};
  return {{"policy", name}, {"threshold", a.threshold}, {"capacity_factor", a.capacity_factor},
          {"fill_factor", a.fill_factor}};
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moe_lm: a small MoE language model whose routers are moe_route's"};
  app.require_subcommand(1);
  int threads = 1;
  std::string json_path;
  int log_every = 50;
  app.add_option("--threads", threads, "torch threads");
  app.add_option("--json", json_path, "also write the result JSON here");
  app.add_option("--log-every", log_every, "progress line every N steps (0: none)");
  std::string device_arg = "cpu";
  app.add_option("--device", device_arg,
                 "where the model runs: cpu, or cuda[:N] (the routers then run on the library's CUDA backend; "
                 "needs a build against a CUDA LibTorch)");

  // pretrain
  auto* pre = app.add_subcommand("pretrain", "pretrain a base model on the mixture of every domain");
  model_config mc;
  std::string preset = "softmax", out_path;
  train_options pre_opt;
  pre_opt.steps = 1500;
  pre_opt.prompt_loss = true;
  float pre_lbl = 1e-2f;
  data_options pre_data;
  pre->add_option("--out", out_path, "checkpoint to write")->required();
  pre->add_option("--gating", preset,
                  "router preset: softmax (DeepSeek-V2-Lite), sigmoid_bias (Moonlight), group_limited (DeepSeek-V3), "
                  "sqrt_softplus (DeepSeek-V4) or softmax_after_topk (Mixtral)");
  pre->add_option("--d-model", mc.d_model, "width");
  pre->add_option("--layers", mc.layers, "depth");
  pre->add_option("--heads", mc.heads, "attention heads");
  pre->add_option("--experts", mc.experts, "routed experts E");
  pre->add_option("--top-k", mc.top_k, "experts per token K");
  pre->add_option("--expert-hidden", mc.expert_hidden, "hidden width of a routed expert");
  pre->add_option("--shared-hidden", mc.shared_hidden, "hidden width of the shared expert");
  pre->add_option("--max-len", mc.max_len, "positions");
  pre->add_option("--bias-update-rate", mc.bias_update_rate, "presets with an expert bias: its step");
  pre->add_flag("--untied", [&](std::int64_t) { mc.tie_embeddings = false; }, "untie the output head");
  pre->add_flag("--layer-norm", [&](std::int64_t) { mc.rms_norm = false; }, "LayerNorm instead of RMSNorm");
  pre->add_option("--steps", pre_opt.steps, "training steps");
  pre->add_option("--batch", pre_opt.batch_size, "examples per step");
  pre->add_option("--lr", pre_opt.lr, "peak learning rate");
  pre->add_option("--seed", pre_opt.seed, "initialisation and batch-order seed");
  pre->add_option("--lbl", pre_lbl, "load-balancing coefficient alpha during pretraining");
  pre->add_flag("--answer-only", [&](std::int64_t) { pre_opt.prompt_loss = false; },
                "train on the answer span only (default: predict the prompt bytes too, as a language model)");
  add_optimiser_options(pre, pre_opt);
  add_data_options(pre, pre_data);

  // posttrain
  auto* post = app.add_subcommand("posttrain", "post-train a base model on one domain under one router condition");
  std::string base_path, domain_arg, condition_arg = "sft", admission_arg = "dropless", post_out;
  train_options post_opt;
  post_opt.steps = 300;
  post_opt.lr = 1e-3;
  condition_params cp;
  float tau = 0.0f;
  double capacity_factor = 1.25, fill_factor = 4.0;
  bool admit_at_eval = false, eval_base = false;
  int post_examples = 0;
  retention_settings rs;
  data_options post_data;
  post->add_option("--base", base_path, "base checkpoint (moe_lm pretrain)")->required();
  post->add_option("--domain", domain_arg, "post-training domain: arithmetic, code or words")->required();
  post->add_option("--condition", condition_arg,
                   "sft, lbl, rpb, router_l2, kl_to_base, logit_l2, z_loss, rpb_hard, within_soft, within_hard, "
                   "global_hard");
  post->add_option("--admission", admission_arg,
                   "dropless, cipher_strict, cipher_reroute, locmoe, capacity_position, capacity_probs, "
                   "capacity_gate");
  auto* tau_opt = post->add_option("--tau", tau, "admission threshold (cipher_*: 0, locmoe: 0.01 by default)");
  post->add_option("--capacity-factor", capacity_factor, "admission (and --expert-choice) capacity factor");
  post->add_option("--fill-factor", fill_factor, "cipher_reroute fill factor");
  post->add_option("--groups", post_opt.admission_groups, "admission groups per batch (expert-parallel ranks)");
  float locality = 0.0f;
  post->add_option("--locality", locality,
                   "locality penalty lambda_loc (LocMoE; CIPHER uses 0.01) on top of the condition: each of the "
                   "--groups ranks hosts E / groups experts and routes its micro-batch");
  post->add_flag("--admit-at-eval", admit_at_eval, "admission also when evaluating");
  float witness_margin = std::numeric_limits<float>::quiet_NaN();
  post->add_option("--witness-margin", witness_margin,
                   "check every step's admission against CIPHER's Theorem 1 (analysis::signal_retention): a routed "
                   "slot with cosine >= this margin is a signal; capacities by --capacity-factor");
  bool pad_experts = false, fixed_router = false, expert_choice = false;
  post->add_flag("--fixed-router", fixed_router,
                 "train with the fixed assignment (t K + j) mod E (CIPHER eq. 3); evaluate with the learned router");
  post->add_flag("--expert-choice", expert_choice,
                 "train with expert-choice routing (each expert takes --capacity-factor x N K / E tokens by "
                 "softmax score); evaluate with the learned router");
  post->add_flag("--pad-experts", pad_experts,
                 "run every expert on as many rows as the most loaded one (capacity-padded expert time)");
  post->add_option("--out", post_out, "write the post-trained checkpoint here");
  post->add_option("--steps", post_opt.steps, "training steps");
  post->add_option("--batch", post_opt.batch_size, "examples per step");
  post->add_option("--lr", post_opt.lr, "peak learning rate");
  post->add_option("--seed", post_opt.seed, "batch-order seed (and shuffle seed)");
  post->add_option("--lbl-alpha", cp.lbl_alpha, "lbl: alpha");
  post->add_option("--beta", cp.beta, "rpb, within_soft: beta (with --calibrate-beta: in units of the calibrated beta)");
  std::string prior_form_arg = "softmax";
  post->add_option("--prior-form", prior_form_arg,
                   "how the prior reads the base router: softmax (RPB, every preset) or gate_scores (the preset's "
                   "scores normalised to sum 1)");
  bool calibrate_beta = false;
  double prior_logit_ratio = 1.0;
  post->add_flag("--calibrate-beta", calibrate_beta,
                 "scale beta so that sd(beta b) / sd(z), the prior bias's spread over the router logits', is "
                 "--prior-logit-ratio (docs/results.md)");
  post->add_option("--prior-logit-ratio", prior_logit_ratio, "--calibrate-beta: the target ratio (RPB: about 1)");
  bool freeze_expert_bias = false;
  post->add_flag("--freeze-expert-bias", freeze_expert_bias,
                 "do not update the expert bias (it is never updated under a prior condition)");
  post->add_option("--router-l2", cp.router_l2, "router_l2: lambda");
  post->add_option("--kl", cp.kl_to_base, "kl_to_base: coefficient");
  post->add_option("--logit-l2", cp.logit_l2, "logit_l2: coefficient");
  post->add_option("--z-loss", cp.z_loss, "z_loss: coefficient");
  post->add_option("--post-examples", post_examples, "use the first N post-training examples (0: all)");
  post->add_option("--rho", rs.rho, "retention: kept edge fraction");
  post->add_option("--nulls", rs.nulls, "retention: null-model resamples");
  post->add_option("--detector-seed", rs.seed, "retention: community-detector and null-model seed");
  std::string detector_arg = "louvain";
  post->add_option("--detector", detector_arg, "retention: louvain or leiden");
  post->add_flag("--eval-base", eval_base, "also evaluate the base model");
  add_optimiser_options(post, post_opt);
  add_data_options(post, post_data);

  // eval
  auto* ev = app.add_subcommand("eval", "evaluate a checkpoint per domain");
  std::string eval_path, prompt;
  data_options eval_data;
  ev->add_option("--model", eval_path, "checkpoint")->required();
  ev->add_option("--prompt", prompt, "print the greedy answer to this prompt instead");
  add_data_options(ev, eval_data);

  CLI11_PARSE(app, argc, argv);
  try {
    torch::set_num_threads(threads);
    if (!std::regex_match(device_arg, std::regex("cpu|cuda(:[0-9]+)?")))
      throw std::invalid_argument("--device must be cpu, cuda or cuda:N, got \"" + device_arg + "\"");
    const torch::Device device(device_arg);
    if (device.is_cuda() && !cuda_backend_built())
      throw std::invalid_argument("--device " + device_arg +
                                  ": this moe_lm was built without the CUDA backend (build it against a CUDA LibTorch "
                                  "with -DMOE_ROUTE_BUILD_CUDA_RUNTIME=ON)");
    if (device.is_cuda() && !torch::cuda::is_available())
      throw std::invalid_argument("--device " + device_arg + ": no CUDA device is visible");
    const auto start = std::chrono::steady_clock::now();
    if (*pre) {
      mc.gating = parse_preset(preset);
      pre_opt.threads = threads;
      pre_opt.log_every = log_every;
      pre_opt.on_log = [&](const step_log& s) { progress("pretrain", s, pre_opt.steps); };
      const split data = load_data(pre_data, mc.max_len);
      torch::manual_seed(pre_opt.seed);
      auto m = std::make_shared<model>(mc);
      m->to(device);
      rt::router_config r = preset_router(mc);
      r.load_balance.coefficient = pre_lbl;
      m->set_router(r);
      const train_result tr = train(*m, data.train, pre_opt);
      save_model(m, out_path);
      const routing_trace trace = probe(*m, data.probe);
      json layers = json::array();
      for (std::int64_t l = 0; l < trace.layers; ++l)
        layers.push_back(workload({trace.indices.begin() + l * trace.tokens * trace.k,
                                   trace.indices.begin() + (l + 1) * trace.tokens * trace.k},
                                  trace.tokens, trace.k, trace.experts));
      emit({{"command", "pretrain"},
            {"model", json::parse(to_json(mc))},
            {"seed", pre_opt.seed},
            {"steps", pre_opt.steps},
            {"lr", pre_opt.lr},
            {"beta2", pre_opt.beta2},
            {"weight_decay", pre_opt.weight_decay},
            {"lbl", pre_lbl},
            {"prompt_loss", pre_opt.prompt_loss},
            {"device", device.str()},
            {"checkpoint", out_path},
            {"train", train_json(tr, log_every)},
            {"eval", metrics_json(evaluate(*m, data.eval))},
            {"probe_workload", layers},
            {"seconds", seconds_since(start)}},
           json_path);
    } else if (*post) {
      auto m = load_model(base_path);
      m->to(device);
      const model_config& c = m->config();
      const split data = load_data(post_data, c.max_len);
      const domain dom = parse_domain(domain_arg);
      std::vector<example> post_set = of_domain(data.post, dom);
      if (post_examples > 0 && static_cast<std::size_t>(post_examples) < post_set.size())
        post_set.resize(static_cast<std::size_t>(post_examples));
      const std::vector<example> probe_set = of_domain(data.probe, dom);
      const condition cond = parse_condition(condition_arg);
      condition_setup cs = setup(cond, m->router(), cp);
      const rt::router_config learned = cs.router;
      if (fixed_router) {
        if (cs.prior != prior_source::none)
          throw std::invalid_argument("--fixed-router ignores the logits' ranking, so it cannot take a prior condition");
        cs.router.selection = rt::selection_kind::fixed;
      }
      if (locality != 0.0f) {
        if (post_opt.admission_groups < 2)
          throw std::invalid_argument("--locality needs --groups >= 2 (the expert-parallel ranks)");
        cs.router.locality.coefficient = locality;
      }
      if (expert_choice) {
        if (cond != condition::sft || fixed_router || admission_arg != "dropless")
          throw std::invalid_argument(
              "--expert-choice replaces the router and admission while training, so it takes --condition sft, "
              "--admission dropless and no --fixed-router");
      }
      const rt::admission_config adm =
          admission_of(admission_arg, tau, tau_opt->count() > 0, capacity_factor, fill_factor);
      rs.detector = parse_detector(detector_arg);
      const prior_form form = parse_prior_form(prior_form_arg);
      if (calibrate_beta && !(prior_logit_ratio > 0.0))
        throw std::invalid_argument("--prior-logit-ratio must be positive");

      json result = {{"command", "posttrain"}, {"base", base_path}, {"domain", domain_name(dom)},
                     {"condition", condition_name(cond)}, {"seed", post_opt.seed},
                     {"admission", admission_json(admission_arg, adm)}, {"pad_experts", pad_experts},
                     {"fixed_router", fixed_router}, {"expert_choice", expert_choice},
                     {"groups", post_opt.admission_groups}, {"locality", locality}, {"device", device.str()},
                     {"model", json::parse(to_json(c))}};
      if (eval_base) {
        const auto base_metrics = evaluate(*m, data.eval);
        result["base_eval"] = metrics_json(base_metrics);
        result["base_summary"] = id_ood(base_metrics, domain_name(dom));
      }
      const routing_trace base_trace = probe(*m, probe_set);
      if (cs.prior != prior_source::none) {
        const int e = static_cast<int>(c.experts);
        base_prior bp = build_prior(*m, post_set, form);
        const std::vector<prior_table> unshuffled = prepare_prior(bp.pi, e);
        // The spreads behind --calibrate-beta, layer means: the prior bias b and the router logits z.
        double logit_sd = 0.0, bias_sd = 0.0, bias_range = 0.0;
        for (std::size_t l = 0; l < bp.pi.size(); ++l) {
          const row_spread b = spread(unshuffled[l].bias, e);
          logit_sd += bp.logits[l].sd / static_cast<double>(bp.pi.size());
          bias_sd += b.sd / static_cast<double>(bp.pi.size());
          bias_range += b.range / static_cast<double>(bp.pi.size());
        }
        const double unit = calibrate_beta ? prior_logit_ratio * logit_sd / bias_sd : 1.0;
        cs.router.prior_bias.beta = static_cast<float>(cp.beta * unit);
        // beta and the ratio it gives only where the bias is added (the soft prior conditions).
        const bool soft = cs.router.prior == rt::prior_kind::log_prior_bias;
        result["prior"] = {{"form", prior_form_name(form)}, {"logit_sd", logit_sd}, {"bias_sd", bias_sd},
                           {"bias_range", bias_range}, {"calibrated", calibrate_beta},
                           {"target_ratio", calibrate_beta ? json(prior_logit_ratio) : json(nullptr)},
                           {"beta_unit", unit}, {"beta", soft ? json(cs.router.prior_bias.beta) : json(nullptr)},
                           {"ratio", soft ? json(cs.router.prior_bias.beta * bias_sd / logit_sd) : json(nullptr)}};
        if (cs.prior == prior_source::within_shuffle || cs.prior == prior_source::global_shuffle) {
          const std::vector<std::vector<float>> original = bp.pi;
          if (cs.prior == prior_source::within_shuffle) {
            const auto comm = communities(base_trace, rs);
            shuffle_prior(bp.pi, e, &comm, post_opt.seed);
          } else {
            shuffle_prior(bp.pi, e, nullptr, post_opt.seed);
          }
          result["shuffle_validation"] = shuffle_validation(original, bp.pi, e, c.top_k, cs.router.prior_bias.beta);
          m->set_prior(prepare_prior(bp.pi, e));
        } else {
          m->set_prior(unshuffled);
        }
      }
      post_opt.prior_rows = cs.prior != prior_source::none;
      post_opt.router_l2 = cs.router_l2;
      post_opt.update_expert_bias = cs.update_expert_bias && !expert_choice && !freeze_expert_bias;
      result["expert_bias_updates"] = post_opt.update_expert_bias && rt::selection_uses_bias(cs.router.selection);
      result["optimiser"] = {{"lr", post_opt.lr}, {"beta2", post_opt.beta2}, {"weight_decay", post_opt.weight_decay},
                             {"batch", post_opt.batch_size}, {"steps", post_opt.steps}};
      if (cs.router_l2 != 0.0f)
        for (const auto& w : m->router_weights()) post_opt.base_router.push_back(w.detach().clone());
      post_opt.threads = threads;
      post_opt.routed_affinities = true;
      if (!std::isnan(witness_margin)) {
        if (expert_choice)
          throw std::invalid_argument("--witness-margin checks token-choice admission, not --expert-choice");
        moe_route::analysis::signal_retention_options so;
        so.margin = witness_margin;
        so.capacity_factor = capacity_factor;
        post_opt.signal_retention = so;
        result["signal_retention"] = {{"margin", so.margin}, {"capacity_factor", so.capacity_factor},
                                      {"eps", so.eps}, {"eta", so.eta}};
      }
      post_opt.log_every = log_every;
      post_opt.on_log = [&](const step_log& s) { progress(condition_name(cond), s, post_opt.steps); };
      m->set_router(cs.router);
      m->set_admission(adm, admit_at_eval);
      m->set_expert_padding(pad_experts);
      if (expert_choice)
        m->set_expert_choice(moe_route::selection::expert_choice{static_cast<int>(c.top_k), capacity_factor, 0});
      const train_result tr = train(*m, post_set, post_opt);
      if (fixed_router) m->set_router(learned);
      m->set_expert_choice(std::nullopt);
      const auto metrics = evaluate(*m, data.eval);
      const routing_trace post_trace = probe(*m, probe_set);
      result["train"] = train_json(tr, log_every);
      result["eval"] = metrics_json(metrics);
      result["summary"] = id_ood(metrics, domain_name(dom));
      result["retention"] = retention(base_trace, post_trace, rs);
      result["seconds"] = seconds_since(start);
      if (!post_out.empty()) {
        m->set_prior({});
        m->set_admission(rt::admission_config{});
        save_model(m, post_out);
      }
      emit(result, json_path);
    } else if (*ev) {
      auto m = load_model(eval_path);
      m->to(device);
      if (!prompt.empty()) {
        std::cout << generate(*m, prompt, static_cast<int>(m->config().max_len)) << std::endl;
        return 0;
      }
      const split data = load_data(eval_data, m->config().max_len);
      emit({{"command", "eval"}, {"model", eval_path}, {"eval", metrics_json(evaluate(*m, data.eval))},
            {"routing", routing_structure(probe(*m, data.probe), domain_names())},
            {"seconds", seconds_since(start)}},
           json_path);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_lm: %s\n", e.what());
    return 1;
  }
  return 0;
}
