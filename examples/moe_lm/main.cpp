// moe_lm: pretrain a small MoE language model on the Q/A mixture, save it,
// and post-train it on one domain under one router condition (RPB Table 1,
// z-loss) and one admission policy, printing progress on stderr and the
// result as JSON on stdout. The RPB and CIPHER studies are loops over
// `moe_lm posttrain` with different --condition / --admission / --seed.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <variant>

#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#include "analysis.hpp"
#include "conditions.hpp"
#include "data.hpp"
#include "model.hpp"
#include "options.hpp"
#include "common/output_file.hpp"
#include "train.hpp"

namespace {

using namespace moe_lm;
using nlohmann::json;

// Every domain's name, in domain order.
std::vector<std::string> domain_names() {
  std::vector<std::string> names;
  for (int d = 0; d < num_domains; ++d) names.push_back(domain_name(static_cast<domain>(d)));
  return names;
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
    moe_route_examples::write_replacing(path, [&](const std::string& tmp) {
      std::ofstream out(tmp);
      out << j.dump(2) << "\n";
      out.close();  // flushes: a full disk shows here, not as a short file
      if (!out) throw std::runtime_error("write to " + tmp + " failed");
    });
}

json admission_json(const std::string& name, const rt::admission_config& a) {
  if (a.dropless) return {{"policy", name}};
  return {{"policy", name}, {"threshold", a.threshold}, {"capacity_factor", a.capacity_factor},
          {"fill_factor", a.fill_factor}};
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

json pretrain(const common_options& common, const pretrain_command& cmd, const torch::Device& device) {
  const auto start = std::chrono::steady_clock::now();
  train_options opt;
  static_cast<train_settings&>(opt) = cmd.train;
  opt.threads = common.threads;
  opt.log_every = common.log_every;
  opt.on_log = [&](const step_log& s) { progress("pretrain", s, opt.steps); };
  const split data = load_data(cmd.data, cmd.model.max_len);
  torch::manual_seed(opt.seed);
  auto m = std::make_shared<model>(cmd.model);
  m->to(device);
  rt::router_config r = preset_router(cmd.model);
  r.load_balance.coefficient = cmd.lbl;
  m->set_router(r);
  const train_result tr = train(*m, data.train, opt);
  save_model(m, cmd.out);
  const routing_trace trace = probe(*m, data.probe);
  json layers = json::array();
  for (std::int64_t l = 0; l < trace.layers; ++l)
    layers.push_back(workload({trace.indices.begin() + l * trace.tokens * trace.k,
                               trace.indices.begin() + (l + 1) * trace.tokens * trace.k},
                              trace.tokens, trace.k, trace.experts));
  return {{"command", "pretrain"},
          {"model", json::parse(to_json(cmd.model))},
          {"seed", opt.seed},
          {"steps", opt.steps},
          {"lr", opt.lr},
          {"beta2", opt.beta2},
          {"weight_decay", opt.weight_decay},
          {"lbl", cmd.lbl},
          {"prompt_loss", opt.prompt_loss},
          {"device", device.str()},
          {"checkpoint", cmd.out},
          {"train", train_json(tr, common.log_every)},
          {"eval", metrics_json(evaluate(*m, data.eval))},
          {"probe_workload", layers},
          {"seconds", seconds_since(start)}};
}

json posttrain(const common_options& common, const posttrain_command& cmd, const torch::Device& device) {
  const auto start = std::chrono::steady_clock::now();
  auto m = load_model(cmd.base);
  m->to(device);
  const model_config& c = m->config();
  const split data = load_data(cmd.data, c.max_len);
  const domain dom = cmd.post_domain;
  std::vector<example> post_set = of_domain(data.post, dom);
  if (cmd.post_examples > 0 && static_cast<std::size_t>(cmd.post_examples) < post_set.size())
    post_set.resize(static_cast<std::size_t>(cmd.post_examples));
  const std::vector<example> probe_set = of_domain(data.probe, dom);
  condition_setup cs = setup(cmd.cond, m->router(), cmd.params);
  const rt::router_config learned = cs.router;
  if (cmd.fixed_router) cs.router.selection = rt::selection_kind::fixed;
  if (cmd.locality != 0.0f) cs.router.locality.coefficient = cmd.locality;
  train_options opt;
  static_cast<train_settings&>(opt) = cmd.train;
  const rt::admission_config& adm = cmd.admission;

  json result = {{"command", "posttrain"}, {"base", cmd.base}, {"domain", domain_name(dom)},
                 {"condition", condition_name(cmd.cond)}, {"seed", opt.seed},
                 {"admission", admission_json(cmd.admission_name, adm)}, {"pad_experts", cmd.pad_experts},
                 {"fixed_router", cmd.fixed_router}, {"expert_choice", cmd.expert_choice},
                 {"groups", opt.admission_groups}, {"locality", cmd.locality}, {"device", device.str()},
                 {"model", json::parse(to_json(c))}};
  if (cmd.eval_base) {
    const auto base_metrics = evaluate(*m, data.eval);
    result["base_eval"] = metrics_json(base_metrics);
    result["base_summary"] = id_ood(base_metrics, domain_name(dom));
  }
  const routing_trace base_trace = probe(*m, probe_set);
  if (cs.prior != prior_source::none) {
    const int e = static_cast<int>(c.experts);
    base_prior bp = build_prior(*m, post_set, cmd.form);
    const std::vector<prior_table> unshuffled = prepare_prior(bp.pi, e);
    // The spreads behind --calibrate-beta, layer means: the prior bias b and the router logits z.
    double logit_sd = 0.0, bias_sd = 0.0, bias_range = 0.0;
    for (std::size_t l = 0; l < bp.pi.size(); ++l) {
      const row_spread b = spread(unshuffled[l].bias, e);
      logit_sd += bp.logits[l].sd / static_cast<double>(bp.pi.size());
      bias_sd += b.sd / static_cast<double>(bp.pi.size());
      bias_range += b.range / static_cast<double>(bp.pi.size());
    }
    const double unit = cmd.calibrate_beta ? cmd.prior_logit_ratio * logit_sd / bias_sd : 1.0;
    cs.router.prior_bias.beta = static_cast<float>(cmd.params.beta * unit);
    // beta and the ratio it gives only where the bias is added (the soft prior conditions).
    const bool soft = cs.router.prior == rt::prior_kind::log_prior_bias;
    result["prior"] = {{"form", prior_form_name(cmd.form)}, {"logit_sd", logit_sd}, {"bias_sd", bias_sd},
                       {"bias_range", bias_range}, {"calibrated", cmd.calibrate_beta},
                       {"target_ratio", cmd.calibrate_beta ? json(cmd.prior_logit_ratio) : json(nullptr)},
                       {"beta_unit", unit}, {"beta", soft ? json(cs.router.prior_bias.beta) : json(nullptr)},
                       {"ratio", soft ? json(cs.router.prior_bias.beta * bias_sd / logit_sd) : json(nullptr)}};
    if (cs.prior == prior_source::within_shuffle || cs.prior == prior_source::global_shuffle) {
      const std::vector<std::vector<float>> original = bp.pi;
      if (cs.prior == prior_source::within_shuffle) {
        const auto comm = communities(base_trace, cmd.retention);
        shuffle_prior(bp.pi, e, &comm, opt.seed);
      } else {
        shuffle_prior(bp.pi, e, nullptr, opt.seed);
      }
      result["shuffle_validation"] = shuffle_validation(original, bp.pi, e, c.top_k, cs.router.prior_bias.beta);
      m->set_prior(prepare_prior(bp.pi, e));
    } else {
      m->set_prior(unshuffled);
    }
  }
  opt.prior_rows = cs.prior != prior_source::none;
  opt.router_l2 = cs.router_l2;
  opt.update_expert_bias = cs.update_expert_bias && !cmd.expert_choice && !cmd.freeze_expert_bias;
  result["expert_bias_updates"] = opt.update_expert_bias && rt::selection_uses_bias(cs.router.selection);
  result["optimiser"] = {{"lr", opt.lr}, {"beta2", opt.beta2}, {"weight_decay", opt.weight_decay},
                         {"batch", opt.batch_size}, {"steps", opt.steps}};
  if (cs.router_l2 != 0.0f)
    for (const auto& w : m->router_weights()) opt.base_router.push_back(w.detach().clone());
  opt.threads = common.threads;
  opt.routed_affinities = true;
  if (cmd.witness_margin) {
    moe_route::analysis::signal_retention_options so;
    so.margin = *cmd.witness_margin;
    so.capacity_factor = cmd.capacity_factor;
    opt.signal_retention = so;
    result["signal_retention"] = {{"margin", so.margin}, {"capacity_factor", so.capacity_factor},
                                  {"eps", so.eps}, {"eta", so.eta}};
  }
  opt.log_every = common.log_every;
  opt.on_log = [&](const step_log& s) { progress(condition_name(cmd.cond), s, opt.steps); };
  m->set_router(cs.router);
  m->set_admission(adm, cmd.admit_at_eval);
  m->set_expert_padding(cmd.pad_experts);
  if (cmd.expert_choice)
    m->set_expert_choice(moe_route::selection::expert_choice{static_cast<int>(c.top_k), cmd.capacity_factor, 0});
  const train_result tr = train(*m, post_set, opt);
  if (cmd.fixed_router) m->set_router(learned);
  m->set_expert_choice(std::nullopt);
  const auto metrics = evaluate(*m, data.eval);
  const routing_trace post_trace = probe(*m, probe_set);
  result["train"] = train_json(tr, common.log_every);
  result["eval"] = metrics_json(metrics);
  result["summary"] = id_ood(metrics, domain_name(dom));
  result["retention"] = retention(base_trace, post_trace, cmd.retention);
  result["seconds"] = seconds_since(start);
  if (!cmd.out.empty()) {
    m->set_prior({});
    m->set_admission(rt::admission_config{});
    save_model(m, cmd.out);
  }
  return result;
}

// The evaluation record; with --prompt, the greedy answer printed instead (no record).
std::optional<json> eval(const eval_command& cmd, const torch::Device& device) {
  const auto start = std::chrono::steady_clock::now();
  auto m = load_model(cmd.model);
  m->to(device);
  if (!cmd.prompt.empty()) {
    std::cout << generate(*m, cmd.prompt, static_cast<int>(m->config().max_len)) << std::endl;
    return std::nullopt;
  }
  const split data = load_data(cmd.data, m->config().max_len);
  return json{{"command", "eval"}, {"model", cmd.model}, {"eval", metrics_json(evaluate(*m, data.eval))},
              {"routing", routing_structure(probe(*m, data.probe), domain_names())},
              {"seconds", seconds_since(start)}};
}

}  // namespace

int main(int argc, char** argv) {
  const parsed_command parsed = parse_command_line(argc, argv, std::cout, std::cerr);
  if (!parsed.cmd) return parsed.exit_code;
  const command& cmd = *parsed.cmd;
  try {
    torch::set_num_threads(cmd.common.threads);
    const torch::Device device(cmd.common.device);
    if (device.is_cuda() && !cuda_backend_built())
      throw std::invalid_argument("--device " + cmd.common.device +
                                  ": this moe_lm was built without the CUDA backend (build it against a CUDA LibTorch "
                                  "with -DMOE_ROUTE_BUILD_CUDA_RUNTIME=ON)");
    if (device.is_cuda() && !torch::cuda::is_available())
      throw std::invalid_argument("--device " + cmd.common.device + ": no CUDA device is visible");
    std::optional<json> result;
    if (const auto* p = std::get_if<pretrain_command>(&cmd.run)) result = pretrain(cmd.common, *p, device);
    else if (const auto* q = std::get_if<posttrain_command>(&cmd.run)) result = posttrain(cmd.common, *q, device);
    else result = eval(std::get<eval_command>(cmd.run), device);
    if (result) emit(*result, cmd.common.json_path);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_lm: %s\n", e.what());
    return 1;
  }
  return 0;
}
