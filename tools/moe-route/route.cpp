// moe-route route: runs a router (gating, selection, optional prior and
// admission) on logits [N x E] from a .npy file on the CPU backend (or, in a
// CUDA build, with --backend cuda on the GPU: route_cuda.cu) and writes
// indices, gates, dispatch metadata and workload statistics.
#include "common.hpp"
#ifdef MOE_ROUTE_CLI_CUDA
#include "route_cuda.hpp"
#endif

#include <moe_route/moe_route.hpp>
#include <moe_route/runtime/instantiate.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>

namespace moe_route_cli {

namespace mr = moe_route;
namespace rt = moe_route::runtime;
namespace fs = std::filesystem;

namespace {

struct route_options {
  std::string logits, expert_bias, prior, prior_rows, hidden_norms, weight_norms, out;
  int k = 0;
  std::string gating = "softmax";
  bool normalize_set = false, normalize = false;
  float scaling = 1.0f;
  int groups = 0, top_groups = 0, per_group_k = 2;
  float beta = 1.0f;
  std::string prior_mode = "soft";
  float prior_eps = 0.05f, prior_cap = 5.0f;
  std::string admission = "dropless";
  std::optional<float> tau;
  std::optional<double> capacity_factor;
  std::int64_t min_capacity = 0;
  double fill_factor = 4.0;
  std::string backend = "cpu";
  int threads = 0;
};

// Everything one routing call produced, in the shapes written to disk.
struct routed {
  std::vector<std::int32_t> indices;
  std::vector<float> gates;
  int slots = 0;  // S: K, or E for expert_choice
  std::int64_t nonfinite_rows = 0;
  nlohmann::json admission = nullptr;
  std::int64_t hard_prior_tokens = 0;
};

// The prior: b = prepare(pi), rows r(t).
struct prior_data {
  std::vector<float> bias;
  std::vector<std::int32_t> rows;
  std::int64_t num_rows = 0;
  mr::prior::prepare_report report;
};

nlohmann::json admission_json(const mr::admission_report& a) {
  return {{"offered", a.offered},       {"kept", a.kept},
          {"rerouted", a.rerouted},     {"dropped", a.dropped},
          {"below_threshold", a.below_threshold}, {"over_capacity", a.over_capacity},
          {"tokens_without_experts", a.tokens_without_experts}};
}

struct inputs {
  array<float> logits;
  std::int64_t n = 0;
  int e = 0;
  // The logits admission ranks by: the logits themselves, or in soft prior mode
  // with an admission policy z' = fma(beta, b[r(t)], z), the logits the gates
  // came from (bias_gates = true).
  std::vector<float> admission_logits;
  const float* z() const { return admission_logits.empty() ? logits.data.data() : admission_logits.data(); }
  array<float> expert_bias, hidden_norms, weight_norms;
  std::optional<prior_data> prior;
};

rt::gating_kind gating_named(const std::string& name) {
  if (name == "sigmoid") return rt::gating_kind::sigmoid;
  if (name == "sqrt_softplus") return rt::gating_kind::sqrt_softplus;
  if (name == "softmax_after_topk") return rt::gating_kind::softmax_after_topk;
  return rt::gating_kind::softmax;
}

// The router of the options, as a runtime router (moe_route::runtime: the
// routers every front end shares, compiled once). With a prior, the prior is
// its router-level policy: log_prior_bias{beta, bias_gates = true} (soft) or
// prior_override (hard).
rt::router_config router_of(const route_options& o, const inputs& in) {
  rt::router_config c;
  c.gating = gating_named(o.gating);
  const bool biased = !in.expert_bias.data.empty();
  if (o.groups > 0) {
    c.selection = biased ? rt::selection_kind::group_limited_bias : rt::selection_kind::group_limited;
    c.groups = o.groups;
    c.top_groups = o.top_groups;
    c.per_group_k = o.per_group_k;
  } else {
    c.selection = biased ? rt::selection_kind::expert_bias : rt::selection_kind::top_k;
  }
  c.top_k = o.k;
  c.normalize = o.normalize_set ? o.normalize : rt::normalizes_by_default(c.gating);
  c.scaling_factor = o.scaling;
  if (in.prior) {
    c.prior = o.prior_mode == "soft" ? rt::prior_kind::log_prior_bias : rt::prior_kind::prior_override;
    c.prior_bias = mr::prior::log_prior_bias{o.beta, true};
  }
  return c;
}

// The admission policy of the options (docs/admission.md: the presets
// cipher_strict, cipher_reroute, locmoe, capacity_position, capacity_probs).
rt::admission_config admission_of(const route_options& o) {
  rt::admission_config a;
  if (o.admission == "dropless") return a;
  a.dropless = false;
  a.capacity_factor = o.capacity_factor.value_or(1.0);
  a.min_capacity = o.min_capacity;
  if (o.admission == "cipher_strict" || o.admission == "cipher_reroute") {
    a.affinity = rt::affinity_kind::cosine;
    a.threshold = *o.tau;
    a.capacity_factor = o.capacity_factor.value_or(8.0);
    if (o.admission == "cipher_reroute") {
      a.overflow = rt::overflow_kind::reroute;
      a.fill_factor = o.fill_factor;
    }
  } else if (o.admission == "locmoe") {
    a.affinity = rt::affinity_kind::cosine;
    a.threshold = o.tau.value_or(0.01f);
  } else {
    a.affinity = o.admission == "capacity_position" ? rt::affinity_kind::position : rt::affinity_kind::probability;
  }
  return a;
}

routed run_cpu(const route_options& o, const inputs& in) {
  routed res;
  const mr::cpu::execution ex{o.threads > 0 ? o.threads : 1};
  if (o.admission == "expert_choice") {
    mr::selection::expert_choice p;
    p.top_k = o.k;
    p.capacity_factor = o.capacity_factor.value_or(1.0);
    p.min_capacity = o.min_capacity;
    res.slots = in.e;
    res.indices.assign(static_cast<std::size_t>(in.n) * in.e, -1);
    res.gates.assign(res.indices.size(), 0.0f);
    mr::expert_choice_report rep;
    mr::cpu::expert_choice(p, mr::expert_choice_inputs<float>{in.z(), in.n, in.e},
                           mr::expert_choice_outputs{res.indices.data(), res.gates.data(), nullptr, &rep});
    res.admission = {{"assignments", rep.assignments},
                     {"tokens_without_experts", rep.tokens_without_experts},
                     {"max_experts_per_token", rep.max_experts_per_token}};
    return res;
  }
  const rt::router_config c = router_of(o, in);
  res.slots = o.k;
  const std::size_t slots = static_cast<std::size_t>(in.n) * o.k;
  std::vector<std::int32_t> idx(slots);
  std::vector<float> gates(slots);
  mr::route_inputs<float> ri{in.logits.data.data(), in.n, in.e,
                             in.expert_bias.data.empty() ? nullptr : in.expert_bias.data.data()};
  // Inference routing, or with a prior the training mode the prior policies act
  // in. Every runtime router carries the penalties (all off here): they need
  // their value slots and, in training, the workspace.
  mr::route_outputs out{idx.data(), gates.data()};
  double penalty_values[rt::num_penalties];
  out.penalty_values = penalty_values;
  std::vector<unsigned char> workspace;
  ri.mode = mr::mode::eval;
  if (in.prior) {
    ri.mode = mr::mode::train;
    ri.prior_bias = in.prior->bias.data();
    ri.prior_rows = in.prior->num_rows;
    ri.token_prior_row = in.prior->rows.data();
    workspace.resize(rt::workspace_bytes(c, in.n, in.e));
    out.workspace = workspace.data();
    out.workspace_bytes = workspace.size();
  }
  res.nonfinite_rows = rt::route(c, ri, out, ex).nonfinite_rows;
  if (in.prior && o.prior_mode == "hard")
    res.hard_prior_tokens = std::count_if(in.prior->rows.begin(), in.prior->rows.end(), [](std::int32_t x) { return x >= 0; });

  mr::admission_inputs<float> ain{in.z(), in.n, in.e, idx.data(), gates.data()};
  ain.hidden_norms = in.hidden_norms.data.empty() ? nullptr : in.hidden_norms.data.data();
  ain.weight_norms = in.weight_norms.data.empty() ? nullptr : in.weight_norms.data.data();
  res.indices.resize(slots);
  res.gates.resize(slots);
  mr::admission_report arep;
  rt::admit(c, admission_of(o), ain, mr::admission_outputs{res.indices.data(), res.gates.data(), nullptr, &arep}, ex);
  res.admission = admission_json(arep);
  return res;
}

#ifdef MOE_ROUTE_CLI_CUDA
// --backend cuda: the same routing on the GPU (route_cuda.cu).
routed run_cuda(const route_options& o, const inputs& in) {
  cuda_route_args a;
  a.k = o.k;
  a.gating = o.gating;
  a.normalize_set = o.normalize_set;
  a.normalize = o.normalize;
  a.scaling = o.scaling;
  a.groups = o.groups;
  a.top_groups = o.top_groups;
  a.per_group_k = o.per_group_k;
  a.admission = o.admission;
  a.tau = o.tau;
  a.capacity_factor = o.capacity_factor;
  a.min_capacity = o.min_capacity;
  a.fill_factor = o.fill_factor;
  if (in.prior) {
    a.prior_mode = o.prior_mode == "soft" ? cuda_route_args::prior::soft : cuda_route_args::prior::hard;
    a.beta = o.beta;
    a.prior_bias = in.prior->bias.data();
    a.prior_rows = in.prior->num_rows;
    a.token_prior_row = in.prior->rows.data();
  }
  a.logits = in.logits.data.data();
  a.admission_logits = in.z();
  a.n = in.n;
  a.e = in.e;
  a.expert_bias = in.expert_bias.data.empty() ? nullptr : in.expert_bias.data.data();
  a.hidden_norms = in.hidden_norms.data.empty() ? nullptr : in.hidden_norms.data.data();
  a.weight_norms = in.weight_norms.data.empty() ? nullptr : in.weight_norms.data.data();
  cuda_route_result c = route_cuda(a);
  routed res;
  res.indices = std::move(c.indices);
  res.gates = std::move(c.gates);
  res.slots = c.slots;
  res.nonfinite_rows = c.nonfinite_rows;
  if (c.expert_choice)
    res.admission = {{"assignments", c.expert_choice_report.assignments},
                     {"tokens_without_experts", c.expert_choice_report.tokens_without_experts},
                     {"max_experts_per_token", c.expert_choice_report.max_experts_per_token}};
  else
    res.admission = admission_json(c.admission);
  if (in.prior && o.prior_mode == "hard")
    res.hard_prior_tokens = std::count_if(in.prior->rows.begin(), in.prior->rows.end(), [](std::int32_t x) { return x >= 0; });
  return res;
}
#endif

void check_options(const route_options& o) {
  if (o.k < 1 || o.k > rt::router_max_k) throw usage_error("--k must be in [1, " + std::to_string(rt::router_max_k) + "]");
  if (o.gating == "softmax_after_topk" && !o.expert_bias.empty())
    throw usage_error("--gating softmax_after_topk cannot be combined with --expert-bias");
  if (o.groups < 0) throw usage_error("--groups must be >= 0");
  if (o.groups > 0 && o.top_groups < 1) throw usage_error("--groups needs --top-groups T >= 1");
  if (o.groups == 0 && o.top_groups != 0) throw usage_error("--top-groups needs --groups");
  const bool has_prior = !o.prior.empty();
  if (has_prior != !o.prior_rows.empty()) throw usage_error("--prior and --prior-rows go together");
  if (!(o.scaling > 0.0f) || !std::isfinite(o.scaling)) throw usage_error("--scaling must be positive and finite");
  const std::string& a = o.admission;
  const bool cosine = a == "cipher_strict" || a == "cipher_reroute" || a == "locmoe";
  if (cosine && (o.hidden_norms.empty() || o.weight_norms.empty()))
    throw usage_error("--admission " + a + " ranks by cosine affinity: it needs --hidden-norms and --weight-norms");
  if ((a == "cipher_strict" || a == "cipher_reroute") && !o.tau) throw usage_error("--admission " + a + " needs --tau");
  if ((a == "capacity_position" || a == "capacity_probs" || a == "locmoe") && !o.capacity_factor)
    throw usage_error("--admission " + a + " needs --capacity-factor");
  if (a == "capacity_position" && o.tau) throw usage_error("--admission capacity_position has no threshold (--tau)");
  if (a == "dropless" && (o.tau || o.capacity_factor)) throw usage_error("--tau/--capacity-factor need an --admission policy");
  if (a == "expert_choice" && (has_prior || !o.expert_bias.empty() || o.groups > 0))
    throw usage_error("--admission expert_choice replaces token-choice selection: no --prior, --expert-bias or --groups");
  if (o.capacity_factor && !(*o.capacity_factor > 0.0)) throw usage_error("--capacity-factor must be > 0");
  if (o.min_capacity < 0) throw usage_error("--min-capacity must be >= 0");
}

void run_route(const route_options& o) {
  check_options(o);
#ifdef MOE_ROUTE_CLI_CUDA
  if (o.backend == "cuda")
    if (const std::string problem = cuda_device_problem(); !problem.empty()) throw data_error(problem);
#else
  if (o.backend == "cuda")
    throw data_error("--backend cuda: this moe-route is built without the CUDA backend (the CLI routes on the CPU; "
                     "use the library's moe_route::cuda from C++ for GPU routing)");
#endif
  inputs in;
  in.logits = load_f32(o.logits, "--logits");
  if (in.logits.shape.size() != 2)
    throw data_error("--logits: " + o.logits + " has shape " + shape_string(in.logits.shape) + "; expected [N, E]");
  in.n = static_cast<std::int64_t>(in.logits.dim(0));
  in.e = static_cast<int>(in.logits.dim(1));
  if (in.e < 1 || in.e > mr::max_experts)
    throw data_error("--logits: E (= " + std::to_string(in.e) + ") must be in [1, " + std::to_string(mr::max_experts) + "]");
  if (o.k > in.e) throw data_error("--k (= " + std::to_string(o.k) + ") exceeds the number of experts E = " + std::to_string(in.e));
  auto vector_of = [&](const std::string& path, const char* flag, std::size_t size, const char* name) {
    array<float> a = load_f32(path, flag);
    if (a.shape.size() != 1 || a.dim(0) != size)
      throw data_error(std::string(flag) + ": " + path + " has shape " + shape_string(a.shape) + "; expected [" + name +
                       "] = (" + std::to_string(size) + ",)");
    return a;
  };
  if (!o.expert_bias.empty()) in.expert_bias = vector_of(o.expert_bias, "--expert-bias", in.e, "E");
  if (!o.hidden_norms.empty()) in.hidden_norms = vector_of(o.hidden_norms, "--hidden-norms", in.n, "N");
  if (!o.weight_norms.empty()) in.weight_norms = vector_of(o.weight_norms, "--weight-norms", in.e, "E");
  if (!o.prior.empty()) {
    const array<float> pi = load_f32(o.prior, "--prior");
    if (pi.shape.size() != 2 || pi.dim(1) != static_cast<std::size_t>(in.e))
      throw data_error("--prior: " + o.prior + " has shape " + shape_string(pi.shape) + "; expected [S, E] with E = " +
                       std::to_string(in.e));
    const array<std::int32_t> rows = load_i32(o.prior_rows, "--prior-rows");
    if (rows.shape.size() != 1 || rows.dim(0) != static_cast<std::size_t>(in.n))
      throw data_error("--prior-rows: " + o.prior_rows + " has shape " + shape_string(rows.shape) + "; expected [N] = (" +
                       std::to_string(in.n) + ",)");
    prior_data p;
    p.num_rows = static_cast<std::int64_t>(pi.dim(0));
    for (std::size_t t = 0; t < rows.data.size(); ++t)
      if (rows.data[t] < -1 || rows.data[t] >= p.num_rows)
        throw data_error("--prior-rows: entry " + std::to_string(t) + " (= " + std::to_string(rows.data[t]) +
                         ") must be -1 or a row of the prior in [0, " + std::to_string(p.num_rows) + ")");
    p.rows = rows.data;
    p.bias.resize(pi.data.size());
    p.report = mr::prior::prepare(pi.data.data(), p.num_rows, in.e, p.bias.data(), nullptr, {o.prior_eps, o.prior_cap});
    // Routing applies the prior itself (run_cpu); admission ranks by the
    // logits the gates came from, z' in soft mode (as the policy computes it).
    if (o.prior_mode == "soft" && o.admission != "dropless" && o.beta != 0.0f) {
      in.admission_logits = in.logits.data;
      for (std::int64_t t = 0; t < in.n; ++t)
        if (p.rows[t] >= 0)
          for (int e = 0; e < in.e; ++e) {
            float& x = in.admission_logits[t * in.e + e];
            x = mr::detail::fma(o.beta, p.bias[static_cast<std::size_t>(p.rows[t]) * in.e + e], x);
          }
    }
    in.prior = std::move(p);
  }

  routed res;
#ifdef MOE_ROUTE_CLI_CUDA
  if (o.backend == "cuda") res = run_cuda(o, in);
  else
#endif
  res = run_cpu(o, in);

  // Dispatch metadata of the final indices.
  const int e = in.e;
  std::vector<std::int64_t> counts(e), offsets(e + 1),
      perm(static_cast<std::size_t>(mr::dispatch_rows_bound(in.n, res.slots, e, 1)));
  const std::int64_t rows = mr::cpu::dispatch(mr::dispatch_inputs{res.indices.data(), in.n, res.slots, e},
                                              mr::dispatch_outputs{counts.data(), offsets.data(), perm.data()});
  const mr::analysis::workload_stats w = mr::analysis::workload(res.indices.data(), in.n, res.slots, e);

  nlohmann::json stats = {
      {"tokens", in.n}, {"experts", e}, {"slots_per_token", res.slots}, {"k", o.k}, {"gating", o.gating},
      {"admission", o.admission}, {"nonfinite_rows", res.nonfinite_rows},
      {"workload",
       {{"slots", w.slots}, {"executed", w.executed}, {"dropped", w.dropped}, {"dropped_rate", w.dropped_rate},
        {"loads", w.loads}, {"max_load", w.max_load}, {"top1_share", w.top1_share}, {"peak_to_mean", w.peak_to_mean},
        {"load_entropy", w.load_entropy}, {"normalized_load_entropy", w.normalized_load_entropy},
        {"experts_per_token", w.experts_per_token}, {"experts_per_token_histogram", w.experts_per_token_histogram},
        {"tokens_without_experts", w.tokens_without_experts}}},
      {"admission_report", res.admission}};
  if (in.prior)
    stats["prior"] = {{"mode", o.prior_mode}, {"beta", o.beta}, {"rows", in.prior->num_rows},
                      {"upper_clamped", in.prior->report.upper_clamped},
                      {"lower_clamped", in.prior->report.lower_clamped},
                      {"hard_assigned_tokens", res.hard_prior_tokens}};

  ensure_directory(o.out);
  staged_outputs out;
  const std::size_t n = static_cast<std::size_t>(in.n), s = static_cast<std::size_t>(res.slots);
  out.save_i32((fs::path(o.out) / "indices.npy").string(), res.indices.data(), {n, s});
  out.save_f32((fs::path(o.out) / "gates.npy").string(), res.gates.data(), {n, s});
  out.save_i64((fs::path(o.out) / "counts.npy").string(), counts.data(), {static_cast<std::size_t>(e)});
  out.save_i64((fs::path(o.out) / "offsets.npy").string(), offsets.data(), {static_cast<std::size_t>(e) + 1});
  out.save_i64((fs::path(o.out) / "permutation.npy").string(), perm.data(), {static_cast<std::size_t>(rows)});
  out.save_text((fs::path(o.out) / "stats.json").string(), stats.dump(2) + "\n");
  out.commit();
  std::printf("routed %lld tokens over %d experts (%s, K = %d, admission %s): executed %lld of %lld slots, "
              "top-1 share %.4f, peak-to-mean %.3f -> %s\n",
              static_cast<long long>(in.n), e, o.gating.c_str(), o.k, o.admission.c_str(),
              static_cast<long long>(w.executed), static_cast<long long>(w.slots), w.top1_share, w.peak_to_mean,
              o.out.c_str());
}

}  // namespace

void add_route(CLI::App& app) {
  auto o = std::make_shared<route_options>();
  CLI::App* c = app.add_subcommand("route", "Route logits [N x E] (.npy float32) and write indices, gates, "
                                            "dispatch metadata and stats.json");
  c->add_option("--logits", o->logits, "logits Z.npy, float32 [N, E]")->required();
  c->add_option("--k", o->k, "experts per token K")->required();
  c->add_option("--gating", o->gating, "gating function")
      ->check(CLI::IsMember({"softmax", "sigmoid", "sqrt_softplus", "softmax_after_topk"}));
  c->add_flag_callback("--normalize", [o] { o->normalize_set = true; o->normalize = true; }, "normalise the K gates");
  c->add_flag_callback("--no-normalize", [o] { o->normalize_set = true; o->normalize = false; }, "do not normalise the gates");
  c->add_option("--scaling", o->scaling, "routed scaling factor");
  c->add_option("--expert-bias", o->expert_bias, "expert bias B.npy, float32 [E] (aux-loss-free selection)");
  c->add_option("--groups", o->groups, "expert groups G (group-limited selection)");
  c->add_option("--top-groups", o->top_groups, "groups kept");
  c->add_option("--per-group-k", o->per_group_k, "keys summed per group score");
  c->add_option("--prior", o->prior, "prior table PI.npy, float32 [S, E]");
  c->add_option("--prior-rows", o->prior_rows, "prior row per token R.npy, int32 [N] (-1 = none)");
  c->add_option("--beta", o->beta, "prior strength beta (soft mode)");
  c->add_option("--prior-mode", o->prior_mode, "soft: z + beta b[r(t)]; hard: top-K of b[r(t)]")
      ->check(CLI::IsMember({"soft", "hard"}));
  c->add_option("--prior-eps", o->prior_eps, "prior clamp lower bound eps/E");
  c->add_option("--prior-cap", o->prior_cap, "prior clamp upper bound C/E");
  c->add_option("--admission", o->admission, "admission policy")
      ->check(CLI::IsMember({"dropless", "cipher_strict", "cipher_reroute", "locmoe", "capacity_position",
                             "capacity_probs", "expert_choice"}));
  c->add_option("--tau", o->tau, "affinity threshold tau");
  c->add_option("--capacity-factor", o->capacity_factor, "capacity factor");
  c->add_option("--min-capacity", o->min_capacity, "minimum capacity per expert");
  c->add_option("--fill-factor", o->fill_factor, "reroute fill factor (cipher_reroute)");
  c->add_option("--hidden-norms", o->hidden_norms, "hidden-state norms XN.npy, float32 [N] (cosine affinity)");
  c->add_option("--weight-norms", o->weight_norms, "router weight norms WN.npy, float32 [E] (cosine affinity)");
  c->add_option("--backend", o->backend, "backend (cuda: a CUDA build with a GPU)")->check(CLI::IsMember({"cpu", "cuda"}));
  c->add_option("--threads", o->threads, "CPU threads (default 1)");
  c->add_option("--out", o->out, "output directory")->required();
  c->callback([o] { run_route(*o); });
}

}  // namespace moe_route_cli
