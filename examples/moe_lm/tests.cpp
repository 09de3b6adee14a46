// moe_lm tests: the routing op's gradient against LibTorch autograd of the
// same math, the JSONL loader's errors, the embedded data, and a smoke run of
// pretraining and post-training under several conditions.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <set>
#include <string>

#include <sstream>

#include "analysis.hpp"
#include "conditions.hpp"
#include "config.hpp"
#include "data.hpp"
#include "options.hpp"

#include "test_main.hpp"

using namespace moe_lm;
using moe_lm::testing::mean_loss;
using moe_lm::testing::pretrain_tiny;
using moe_lm::testing::tiny_config;

namespace {

// ---------------------------------------------------------------------------
// The routing op against the same math in torch ops. Selection is not
// differentiable, so the reference takes the library's indices and rebuilds
// the gates and penalties from the logits with autograd.

struct reference_case {
  rt::router_config router;
  bool with_prior = false;
};

double max_abs(const torch::Tensor& t) { return t.abs().max().item<double>(); }

void check_gradient(const reference_case& rc) {
  torch::manual_seed(7);
  const std::int64_t n = 37, e = 8;
  const int k = rc.router.top_k;
  auto z = (torch::randn({n, e}) * 1.5).requires_grad_(true);
  const auto upstream_gates = torch::randn({n, k});
  const auto upstream_values = torch::tensor({0.7f, 1.3f, 0.9f, 1.1f, 0.5f});
  route_call call;
  call.router = rc.router;
  auto bias = torch::randn({e}) * 0.1;
  call.expert_bias = bias;
  std::vector<float> pi_probs;
  torch::Tensor rows_t, prior_bias_t, prior_probs_t;
  if (rc.with_prior) {
    const std::int64_t s = 3;
    const auto pi = torch::softmax(torch::randn({s, e}), 1).contiguous();
    std::vector<std::vector<float>> tables{std::vector<float>(pi.data_ptr<float>(), pi.data_ptr<float>() + pi.numel())};
    auto prepared = prepare_prior(tables, static_cast<int>(e));
    call.prior = std::make_shared<const prior_table>(prepared[0]);
    for (std::int64_t t = 0; t < n; ++t) call.prior_rows.push_back(static_cast<std::int32_t>(t % 4) - 1);  // -1 .. 2
    prior_bias_t = torch::from_blob(const_cast<float*>(call.prior->bias.data()), {s, e}).clone();
    prior_probs_t = torch::from_blob(const_cast<float*>(call.prior->probs.data()), {s, e}).clone();
    rows_t = torch::from_blob(call.prior_rows.data(), {n}, torch::kInt32).to(torch::kInt64);
  }
  layer_record rec;
  const auto out = route(z, call, rec);
  (out[0] * upstream_gates).sum().add((out[1] * upstream_values).sum()).backward();
  const auto grad_lib = z.grad().clone();

  auto zr = z.detach().clone().requires_grad_(true);
  const auto idx = rec.routed.to(torch::kInt64);
  const bool softmax = rc.router.gating == rt::gating_kind::softmax;
  // Gates from the (prior-biased, in training) logits.
  torch::Tensor zg = zr;
  torch::Tensor valid = torch::ones({n}, torch::kBool);
  if (rc.with_prior) {
    valid = rows_t >= 0;
    const auto b = prior_bias_t.index_select(0, rows_t.clamp_min(0)) * valid.unsqueeze(1).to(torch::kFloat32);
    zg = zr + rc.router.prior_bias.beta * b;
  }
  const auto scores = softmax ? torch::softmax(zg, 1) : torch::sigmoid(zg);
  auto gates = scores.gather(1, idx);
  if (rc.router.normalize) gates = gates / (gates.sum(1, true) + 1e-20);
  // Penalties on the unbiased logits.
  const auto p = softmax ? torch::softmax(zr, 1) : torch::sigmoid(zr) / torch::sigmoid(zr).sum(1, true);
  std::vector<torch::Tensor> values(rt::num_penalties, torch::zeros({}));
  if (rc.router.load_balance.coefficient != 0.0f) {
    const auto f = torch::bincount(idx.reshape({-1}), {}, e).to(torch::kFloat32) / static_cast<double>(n * k);
    values[0] = rc.router.load_balance.coefficient * static_cast<double>(e) * (f * p.mean(0)).sum();
  }
  if (rc.router.z_loss.coefficient != 0.0f)
    values[1] = rc.router.z_loss.coefficient * torch::logsumexp(zr, 1).pow(2).mean();
  if (rc.router.kl_to_base.coefficient != 0.0f) {
    const auto target = prior_probs_t.index_select(0, rows_t.clamp_min(0));
    const auto kl = (target * (target.log() - p.log())).sum(1) * valid.to(torch::kFloat32);
    values[2] = rc.router.kl_to_base.coefficient * kl.sum() / valid.sum().to(torch::kFloat32);
  }
  auto loss = (gates * upstream_gates).sum();
  for (int i = 0; i < rt::num_penalties; ++i) {
    CHECK(out[1][i].item<double>() == doctest::Approx(values[static_cast<std::size_t>(i)].item<double>()).epsilon(1e-5));
    loss = loss + values[static_cast<std::size_t>(i)] * upstream_values[i];
  }
  CHECK(max_abs(out[0] - gates.detach()) < 1e-6);
  loss.backward();
  CHECK(max_abs(grad_lib - zr.grad()) < 1e-5 * std::max(1.0, max_abs(zr.grad())));
}

std::string temp_file(const std::string& name, const std::string& contents) {
  const std::string path = std::string("/tmp/moe_lm_test_") + name;
  std::ofstream(path) << contents;
  return path;
}

std::string load_error(const std::string& contents) {
  const std::string path = temp_file("bad.jsonl", contents);
  try {
    load_jsonl(path);
  } catch (const std::runtime_error& e) {
    std::remove(path.c_str());
    return e.what();
  }
  std::remove(path.c_str());
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("route op: gradient of softmax gates with load balance and z-loss equals LibTorch autograd") {
  reference_case rc;
  rc.router.gating = rt::gating_kind::softmax;
  rc.router.load_balance.coefficient = 0.01f;
  rc.router.z_loss.coefficient = 0.001f;
  check_gradient(rc);
  rc.router.normalize = true;
  check_gradient(rc);
}

TEST_CASE("route op: gradient of sigmoid normalised gates with an expert bias and penalties equals LibTorch autograd") {
  reference_case rc;
  rc.router.gating = rt::gating_kind::sigmoid;
  rc.router.selection = rt::selection_kind::expert_bias;
  rc.router.normalize = true;
  rc.router.load_balance.coefficient = 0.01f;
  rc.router.z_loss.coefficient = 0.002f;
  check_gradient(rc);
}

TEST_CASE("route op: gradient under the soft prior (RPB) with kl_to_base equals LibTorch autograd") {
  reference_case rc;
  rc.with_prior = true;
  rc.router.gating = rt::gating_kind::softmax;
  rc.router.prior = rt::prior_kind::log_prior_bias;
  rc.router.prior_bias.beta = 1.0f;
  rc.router.kl_to_base.coefficient = 0.05f;
  check_gradient(rc);
}

TEST_CASE("expert-choice op: each expert takes its C best tokens, and the gradient equals LibTorch autograd") {
  torch::manual_seed(11);
  const std::int64_t n = 29, e = 6;
  auto z0 = torch::randn({n, e}) * 1.5;
  z0[5] = z0[3].clone();  // two identical tokens: ties go to the lower index
  const auto z = z0.requires_grad_(true);
  layer_record rec;
  const auto gates = route_expert_choice(z, moe_route::selection::expert_choice{2, 1.0, 0}, 1, rec);
  const auto upstream = torch::randn({n, e});
  (gates * upstream).sum().backward();

  // Reference: capacity C = ceil(N K / E); expert j takes the C tokens of highest softmax score.
  const std::int64_t cap = (n * 2 + e - 1) / e;
  const auto s = torch::softmax(z.detach(), 1);
  std::vector<std::vector<std::int32_t>> taken(static_cast<std::size_t>(n));
  for (std::int64_t j = 0; j < e; ++j) {
    std::vector<std::int64_t> tokens(static_cast<std::size_t>(n));
    for (std::int64_t t = 0; t < n; ++t) tokens[static_cast<std::size_t>(t)] = t;
    std::stable_sort(tokens.begin(), tokens.end(),
                     [&](std::int64_t a, std::int64_t b) { return s[a][j].item<float>() > s[b][j].item<float>(); });
    for (std::int64_t c = 0; c < cap; ++c) taken[static_cast<std::size_t>(tokens[static_cast<std::size_t>(c)])].push_back(static_cast<std::int32_t>(j));
  }
  auto ref_gates = torch::zeros({n, e});
  for (std::int64_t t = 0; t < n; ++t) {
    CAPTURE(t);
    const auto& row = taken[static_cast<std::size_t>(t)];
    for (std::int64_t c = 0; c < e; ++c) {
      const std::int32_t want = c < static_cast<std::int64_t>(row.size()) ? row[static_cast<std::size_t>(c)] : -1;
      CHECK(rec.executed[t][c].item<std::int32_t>() == want);
      if (want >= 0) ref_gates[t][c] = s[t][want];
    }
  }
  CHECK(max_abs(gates.detach() - ref_gates) < 1e-6);
  auto zr = z.detach().clone().requires_grad_(true);
  const auto idx = rec.executed.to(torch::kInt64);
  const auto mask = (idx >= 0).to(torch::kFloat32);
  (torch::softmax(zr, 1).gather(1, idx.clamp_min(0)) * mask * upstream).sum().backward();
  CHECK(max_abs(z.grad() - zr.grad()) < 1e-6);
}

TEST_CASE("route op: the locality penalty, one call per expert-parallel rank, equals LibTorch autograd") {
  torch::manual_seed(13);
  const std::int64_t n = 40, e = 8, split_at = 23;  // rank 0 routes tokens [0, 23), rank 1 [23, 40)
  const float lambda = 0.05f, eps = 1e-3f;
  auto z = (torch::randn({n, e}) * 1.5).requires_grad_(true);
  route_call call;
  call.router.gating = rt::gating_kind::softmax;
  call.router.locality.coefficient = lambda;
  call.router.locality.epsilon = eps;
  for (std::int64_t t = 0; t < n; ++t) call.group_ids.push_back(t < split_at ? 0 : 1);
  call.num_groups = 2;
  layer_record rec;
  const auto out = route(z, call, rec);
  const auto upstream_gates = torch::randn({n, 2});
  const auto upstream_values = torch::tensor({0.7f, 1.3f, 0.9f, 1.1f, 0.5f});
  (out[0] * upstream_gates).sum().add((out[1] * upstream_values).sum()).backward();

  route_call plain = call;  // selection is per token, so splitting the call does not change it
  plain.router.locality.coefficient = 0.0f;
  layer_record rec_plain;
  torch::NoGradGuard no_grad_for_plain;
  route(z.detach(), plain, rec_plain);
  CHECK(torch::equal(rec.routed, rec_plain.routed));
  {
    torch::AutoGradMode grad_on(true);
    auto zr = z.detach().clone().requires_grad_(true);
    const auto p = torch::softmax(zr, 1);
    const auto gates = p.gather(1, rec.routed.to(torch::kInt64));
    // Rank r hosts experts j with j * 2 / 8 == r: 0-3 on rank 0, 4-7 on rank 1.
    torch::Tensor locality = torch::zeros({});
    for (int r = 0; r < 2; ++r) {
      const auto rows = r == 0 ? p.slice(0, 0, split_at) : p.slice(0, split_at, n);
      const auto dc = rows.mean(0);
      auto dl = torch::full({e}, eps / 4.0f);
      dl.slice(0, 4 * r, 4 * r + 4).fill_((1.0f - eps) / 4.0f);
      locality = locality + lambda * (dc * (dc / dl).log()).sum() / 2.0;  // the mean over the ranks
    }
    CHECK(out[1][4].item<double>() == doctest::Approx(locality.item<double>()).epsilon(1e-5));
    for (int i = 0; i < 4; ++i) CHECK(out[1][i].item<double>() == 0.0);
    ((gates * upstream_gates).sum() + locality * upstream_values[4]).backward();
    CHECK(max_abs(z.grad() - zr.grad()) < 1e-5 * std::max(1.0, max_abs(zr.grad())));
  }
}

TEST_CASE("JSONL loader: examples and errors with line numbers") {
  const std::string good = R"({"prompt": "1+1=", "answer": "2", "domain": "arithmetic"})";
  const std::string path = temp_file("good.jsonl", good + "\n\n" + R"({"prompt":"reverse: ab","answer":"ba","domain":"words"})" + "\n");
  const auto xs = load_jsonl(path);
  std::remove(path.c_str());
  REQUIRE(xs.size() == 2);
  CHECK(xs[1].prompt == "reverse: ab");
  CHECK(xs[1].answer == "ba");
  CHECK(xs[1].dom == domain::words);

  std::string e = load_error(good + "\n" + R"({"prompt": "1+2=", "answer": )" + "\n");
  CHECK(contains(e, ":2: bad JSON"));
  e = load_error(good + "\n" + good + "\n" + R"({"prompt": "1+2=", "domain": "arithmetic"})" + "\n");
  CHECK(contains(e, ":3: missing field \"answer\""));
  e = load_error(R"({"prompt": "1+2=", "answer": 3, "domain": "arithmetic"})");
  CHECK(contains(e, ":1: field \"answer\" must be a string"));
  e = load_error(good + "\n" + R"({"prompt": "x", "answer": "y", "domain": "poetry"})");
  CHECK(contains(e, ":2: unknown domain \"poetry\""));
  e = load_error("[1, 2]");
  CHECK(contains(e, ":1: expected a JSON object"));
  CHECK(contains(load_error("{\"prompt\": \"\", \"answer\": \"\", \"domain\": \"code\"}"), ":1: empty answer"));
  CHECK(contains(load_error(""), "bad.jsonl: no examples"));
  // nlohmann reports a number past double's range as out_of_range, not as a parse error.
  CHECK(contains(load_error(good + "\n" + R"({"prompt": "1+1=", "answer": "2", "domain": "code", "x": 1e999})"),
                 ":2: bad JSON"));
  CHECK(contains(load_error("\n  \t\n"), "bad.jsonl: no examples"));
}

namespace {

// The command line as moe_lm reads it: the parse and what it wrote to stderr.
struct parse_outcome {
  parsed_command parsed;
  std::string err;
};

parse_outcome parse(std::vector<std::string> args) {
  args.insert(args.begin(), "moe_lm");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  parse_outcome o{parse_command_line(static_cast<int>(argv.size()), argv.data(), out, err), {}};
  o.err = err.str();
  return o;
}

}  // namespace

TEST_CASE("command line: valid commands are read into their settings") {
  const auto pre = parse({"--threads", "2", "pretrain", "--out", "m.pt", "--experts", "16", "--top-k", "2",
                          "--gating", "sigmoid_bias", "--steps", "7", "--lr", "0.01", "--answer-only"});
  REQUIRE(pre.parsed.cmd);
  CHECK(pre.parsed.cmd->common.threads == 2);
  const auto& p = std::get<pretrain_command>(pre.parsed.cmd->run);
  CHECK(p.model.experts == 16);
  CHECK(p.model.top_k == 2);
  CHECK(p.model.gating == gating_preset::sigmoid_bias);
  CHECK(p.train.steps == 7);
  CHECK(p.train.lr == 0.01);
  CHECK(!p.train.prompt_loss);

  const std::string base = temp_file("base.pt", "a checkpoint's name: the parser does not read it");
  const auto post = parse({"posttrain", "--base", base, "--domain", "code", "--condition", "z_loss", "--admission",
                           "cipher_reroute", "--tau", "0.2", "--capacity-factor", "1.5", "--witness-margin", "0.3"});
  REQUIRE(post.parsed.cmd);
  const auto& q = std::get<posttrain_command>(post.parsed.cmd->run);
  CHECK(q.post_domain == domain::code);
  CHECK(q.cond == condition::z_loss);
  CHECK(!q.admission.dropless);
  CHECK(q.admission.overflow == rt::overflow_kind::reroute);
  CHECK(q.admission.threshold == 0.2f);
  CHECK(q.admission.capacity_factor == 1.5);
  REQUIRE(q.witness_margin);
  CHECK(*q.witness_margin == 0.3f);

  // A soft prior with beta = 0 adds nothing, so reroute admission may run under it.
  CHECK(parse({"posttrain", "--base", base, "--domain", "code", "--condition", "rpb", "--beta", "0", "--admission",
               "cipher_reroute"})
            .parsed.cmd);
  std::remove(base.c_str());

  const auto help = parse({"--help"});
  CHECK(!help.parsed.cmd);
  CHECK(help.parsed.exit_code == 0);
}

TEST_CASE("command line: every bad value is refused naming its option, before anything runs") {
  const std::string base = temp_file("base.pt", "a checkpoint's name: the parser does not read it");
  const std::vector<std::string> pre = {"pretrain", "--out", "m.pt"};
  const std::vector<std::string> post = {"posttrain", "--base", base, "--domain", "words"};
  const auto with = [](std::vector<std::string> base, std::initializer_list<std::string> more) {
    base.insert(base.end(), more);
    return base;
  };
  const std::pair<std::vector<std::string>, std::string> cases[] = {
      {with(pre, {"--steps", "0"}), "--steps"},
      {with(pre, {"--batch", "-3"}), "--batch"},
      {with(pre, {"--lr", "nan"}), "--lr"},
      {with(pre, {"--lr", "-1"}), "--lr"},
      {with(pre, {"--lbl", "inf"}), "--lbl"},
      {with(pre, {"--adam-beta2", "1"}), "--adam-beta2"},
      {with(pre, {"--experts", "0"}), "--experts"},
      {with(pre, {"--experts", "5000"}), "--experts"},
      {with(pre, {"--top-k", "17", "--experts", "32"}), "--top-k"},
      {with(pre, {"--top-k", "9", "--experts", "8"}), "--top-k"},
      {with(pre, {"--heads", "3"}), "--d-model"},
      {with(pre, {"--max-len", "3"}), "--max-len"},
      {with(pre, {"--d-model", "1000000"}), "parameters"},
      {with(pre, {"--bias-update-rate", "nan"}), "--bias-update-rate"},
      {with(pre, {"--gating", "topk"}), "--gating"},
      {with(pre, {"--train-per-domain", "0"}), "--train-per-domain"},
      {with(pre, {"--steps", "1.5"}), "--steps"},
      {{"--threads", "0", "pretrain", "--out", "m.pt"}, "--threads"},
      {{"--device", "gpu", "pretrain", "--out", "m.pt"}, "--device"},
      {{"--log-every", "-1", "pretrain", "--out", "m.pt"}, "--log-every"},
      {{"pretrain"}, "--out"},
      {with(pre, {"--answer-only=--x"}), "--answer-only"},  // CLI11 2.1 threw std::stoll's exception here
      {{"pretrain", "--out", ""}, "--out"},
      {{"--json", "", "pretrain", "--out", "m.pt"}, "--json"},
      {with(pre, {"--train-jsonl", "no_such_file.jsonl"}), "--train-jsonl"},
      {{"posttrain", "--base", "no_such_checkpoint.pt", "--domain", "words"}, "--base"},
      {with(post, {"--domain", "poetry"}), "--domain"},
      {with(post, {"--condition", "rbp"}), "--condition"},
      {with(post, {"--admission", "cipher"}), "--admission"},
      {with(post, {"--tau", "2"}), "--tau"},
      {with(post, {"--capacity-factor", "0"}), "--capacity-factor"},
      {with(post, {"--fill-factor", "inf"}), "--fill-factor"},
      {with(post, {"--groups", "0"}), "--groups"},
      {with(post, {"--locality", "0.01"}), "--locality"},
      {with(post, {"--expert-choice", "--condition", "rpb"}), "--expert-choice"},
      {with(post, {"--expert-choice", "--witness-margin", "0.1"}), "--witness-margin"},
      {with(post, {"--fixed-router", "--condition", "kl_to_base"}), "--fixed-router"},
      {with(post, {"--condition", "within_soft", "--admission", "cipher_reroute"}), "--admission"},
      {with(post, {"--beta", "-1"}), "--beta"},
      {with(post, {"--rho", "0"}), "--rho"},
      {with(post, {"--nulls", "-1"}), "--nulls"},
      {with(post, {"--detector", "infomap"}), "--detector"},
      {with(post, {"--prior-form", "logits"}), "--prior-form"},
      {with(post, {"--prior-logit-ratio", "0"}), "--prior-logit-ratio"},
      {with(post, {"--post-examples", "-1"}), "--post-examples"},
      {{"eval"}, "--model"},
      {{"train"}, "train"},
  };
  for (const auto& [args, flag] : cases) {
    const auto o = parse(args);
    std::string line;
    for (const auto& a : args) line += a + " ";
    INFO(line, "-> ", o.err);
    CHECK(!o.parsed.cmd);
    CHECK(o.parsed.exit_code != 0);
    CHECK(contains(o.err, flag));
  }
  std::remove(base.c_str());
}

TEST_CASE("checkpoint config: round trip, and every bad field refused by name") {
  model_config c;
  c.experts = 24;
  c.top_k = 3;
  c.gating = gating_preset::sqrt_softplus;
  c.rms_norm = false;
  const model_config back = model_config_from_json(to_json(c));
  CHECK(to_json(back) == to_json(c));

  const auto error_of = [](const std::string& text) {
    try {
      model_config_from_json(text);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::string j = to_json(c);
  const auto replaced = [&](const std::string& from, const std::string& to) {
    std::string t = j;
    t.replace(t.find(from), from.size(), to);
    return t;
  };
  CHECK(contains(error_of("not json"), "checkpoint config: not JSON"));
  CHECK(contains(error_of(replaced("\"bias_update_rate\":0.0010000000474974513", "\"bias_update_rate\":1e999")),
                 "checkpoint config: not JSON"));
  CHECK(contains(error_of("[1]"), "not a JSON object"));
  CHECK(contains(error_of(replaced("\"experts\":24", "\"experts\":0")), "experts (= 0) must be >= 1"));
  CHECK(contains(error_of(replaced("\"experts\":24", "\"experts\":1e3")), "field \"experts\" must be an integer"));
  CHECK(contains(error_of(replaced("\"top_k\":3", "\"top_k\":4294967299")), "field \"top_k\" must be an integer"));
  CHECK(contains(error_of(replaced("\"top_k\":3", "\"top_k\":30")), "top_k (= 30) must be in [1, 16]"));
  CHECK(contains(error_of(replaced("\"gating\":\"sqrt_softplus\"", "\"gating\":7")), "field \"gating\" must be a string"));
  CHECK(contains(error_of(replaced("\"gating\":\"sqrt_softplus\"", "\"gating\":\"relu\"")), "unknown gating preset"));
  CHECK(contains(error_of(replaced("\"rms_norm\":false,", "")), "no field \"rms_norm\""));
  CHECK(contains(error_of(replaced("\"heads\":4", "\"heads\":5")), "d_model (= 64) must be a multiple of heads (= 5)"));
}

TEST_CASE("embedded data: deterministic, disjoint parts, exact answers") {
  const split a = default_data(3, 50, 30, 20, 20), b = default_data(3, 50, 30, 20, 20);
  REQUIRE(a.train.size() == 150);
  CHECK(a.post.size() == 90);
  for (std::size_t i = 0; i < a.train.size(); ++i) CHECK(a.train[i].prompt == b.train[i].prompt);
  std::set<std::string> train_prompts;
  for (const auto& x : a.train) train_prompts.insert(x.prompt);
  for (const auto& x : a.eval) CHECK(train_prompts.count(x.prompt) == 0);
  for (const auto& x : a.train) {
    CHECK(encoded_length(x) <= 48);
    if (x.dom != domain::arithmetic) continue;
    const auto op = x.prompt.find_first_of("+-*");
    const int l = std::stoi(x.prompt.substr(0, op)), r = std::stoi(x.prompt.substr(op + 1));
    const int v = x.prompt[op] == '+' ? l + r : (x.prompt[op] == '-' ? l - r : l * r);
    CHECK(x.answer == std::to_string(v));
  }
}

namespace {

struct smoke_run {
  condition c;
  std::string admission;
  int groups = 1;
  float locality = 0.0f;       // the locality penalty over the groups
  bool expert_choice = false;  // expert-choice routing while training
};

// Pretrains a tiny model of `preset`, then post-trains a copy under each run.
void smoke(gating_preset preset, const std::vector<smoke_run>& runs) {
  const split data = default_data(1, 100, 80, 12, 12);
  auto base = pretrain_tiny(preset, data.train);
  const std::string ckpt = std::string("/tmp/moe_lm_test_base_") + preset_name(preset) + ".pt";
  save_model(base, ckpt);
  {  // the checkpoint gives the same model
    auto again = load_model(ckpt);
    const auto tokens = make_batch(data.eval, {0, 1, 2}, 48).tokens;
    routing_context ctx;
    ctx.mode = moe_route::mode::eval;
    torch::NoGradGuard g;
    base->eval();
    again->eval();
    CHECK(max_abs(base->forward(tokens, ctx) - again->forward(tokens, ctx)) == 0.0);
  }

  const auto post_set = of_domain(data.post, domain::arithmetic);
  const auto probe_set = of_domain(data.probe, domain::arithmetic);
  for (const smoke_run& r : runs) {
    CAPTURE(condition_name(r.c));
    CAPTURE(r.admission);
    auto m = load_model(ckpt);
    condition_params cp;
    cp.router_l2 = 10.0f;
    const condition_setup cs = setup(r.c, m->router(), cp);
    const routing_trace base_trace = probe(*m, probe_set);
    train_options o;
    o.steps = 20;
    o.batch_size = 16;
    o.lr = 3e-3;
    o.threads = 1;
    o.seed = 5;
    o.prior_rows = cs.prior != prior_source::none;
    o.router_l2 = cs.router_l2;
    o.update_expert_bias = cs.update_expert_bias;
    o.admission_groups = r.groups;
    if (cs.router_l2 != 0.0f)
      for (const auto& w : m->router_weights()) o.base_router.push_back(w.detach().clone());
    std::vector<prior_table> tables;
    if (cs.prior != prior_source::none) {
      auto pi = build_prior(*m, post_set).pi;
      if (cs.prior == prior_source::within_shuffle) {
        const auto comm = communities(base_trace, {});
        shuffle_prior(pi, 4, &comm, 1);
      } else if (cs.prior == prior_source::global_shuffle) {
        shuffle_prior(pi, 4, nullptr, 1);
      }
      tables = prepare_prior(pi, 4);
      m->set_prior(tables);
    }
    rt::router_config router = cs.router;
    router.locality.coefficient = r.locality;
    m->set_router(router);
    if (r.expert_choice) m->set_expert_choice(moe_route::selection::expert_choice{2, 1.0, 0});
    rt::admission_config adm;
    if (r.admission != "dropless") {
      adm.dropless = false;
      adm.affinity = rt::affinity_kind::cosine;
      adm.threshold = 0.0f;
      adm.capacity_factor = 1.0;
      if (r.admission == "cipher_reroute") adm.overflow = rt::overflow_kind::reroute;
    }
    m->set_admission(adm);
    const train_result tr = train(*m, post_set, o);
    CHECK(mean_loss(tr, 15, 20) < mean_loss(tr, 0, 5));
    if (r.c == condition::lbl || r.c == condition::kl_to_base || r.c == condition::z_loss || r.c == condition::logit_l2)
      CHECK(tr.log.back().aux_loss > 0.0);
    if (r.c == condition::router_l2) CHECK(tr.log.back().router_l2 > 0.0);
    if (r.locality != 0.0f) CHECK(tr.log.back().aux_loss > 0.0);
    if (r.expert_choice) {  // every expert took its capacity of every group in every step
      m->set_expert_choice(std::nullopt);
      const auto& loads = tr.executed_loads[0];
      CHECK(std::all_of(loads.begin(), loads.end(), [&](std::int64_t v) { return v == loads[0] && v > 0; }));
    }
    if (r.admission != "dropless") {
      std::int64_t executed = 0;
      for (auto v : tr.executed_loads[0]) executed += v;
      CHECK(executed <= tr.slots);
    }
    if (r.admission == "cipher_strict") {
      // Capacity-padded experts (one batched matmul over E x (peak load) rows per layer) compute the
      // outputs and expert-weight gradients of the per-expert loop.
      const auto tokens = make_batch(data.eval, {0, 1, 2, 3}, 48).tokens;
      routing_context ctx;
      ctx.mode = moe_route::mode::eval;
      m->eval();
      const auto run = [&](bool pad) {
        m->set_expert_padding(pad);
        m->zero_grad();
        const auto out = m->forward(tokens, ctx);
        (out * out).sum().backward();
        return std::make_pair(out.detach(), m->named_parameters()["block0.moe.w1"].grad().clone());
      };
      const auto [plain, plain_grad] = run(false);
      const auto& last = m->moe_layers()[0]->last;
      const std::int64_t peak = *std::max_element(last.counts.begin(), last.counts.end());
      CHECK(last.expert_rows == last.executed.numel());
      const auto [padded, padded_grad] = run(true);
      CHECK(m->moe_layers()[0]->last.expert_rows == peak * 4);
      CHECK(max_abs(plain - padded) < 1e-5);
      CHECK(max_abs(plain_grad - padded_grad) < 1e-4 * std::max(1.0, max_abs(plain_grad)));
      m->set_expert_padding(false);
    }
    if (!tables.empty()) {
      // Bias-free probe: the same routing with and without the prior table.
      const routing_trace with_prior = probe(*m, probe_set);
      m->set_prior({});
      const routing_trace without_prior = probe(*m, probe_set);
      CHECK(with_prior.indices == without_prior.indices);
      const auto ret = retention(base_trace, with_prior, {});
      CHECK(ret["topk_overlap"].get<double>() >= 0.0);
      CHECK(ret["topk_overlap"].get<double>() <= 1.0);
    }
    const auto metrics = evaluate(*m, data.eval);
    CHECK(metrics.size() == 3);
  }
  std::remove(ckpt.c_str());
}

}  // namespace

TEST_CASE("smoke (softmax preset): pretraining, then post-training under every condition and admission") {
  smoke(gating_preset::softmax,
        {{condition::sft, "dropless"}, {condition::lbl, "dropless"}, {condition::rpb, "dropless"},
         {condition::rpb_hard, "dropless"}, {condition::router_l2, "dropless"}, {condition::kl_to_base, "dropless"},
         {condition::logit_l2, "dropless"}, {condition::z_loss, "dropless"}, {condition::within_soft, "dropless"},
         {condition::within_hard, "dropless"}, {condition::global_hard, "dropless"}, {condition::sft, "cipher_strict"},
         {condition::sft, "cipher_reroute", 2}, {condition::rpb_hard, "cipher_strict", 2},
         {condition::sft, "cipher_strict", 2, 0.05f}, {condition::sft, "dropless", 2, 0.0f, true}});
}

TEST_CASE("smoke (group_limited, sqrt_softplus and softmax_after_topk presets)") {
  for (gating_preset p : {gating_preset::group_limited, gating_preset::sqrt_softplus, gating_preset::softmax_after_topk}) {
    CAPTURE(preset_name(p));
    smoke(p, {{condition::sft, "dropless"}, {condition::lbl, "dropless"}, {condition::rpb, "dropless"},
              {condition::rpb_hard, "cipher_strict", 2}});
  }
}

TEST_CASE("smoke (sigmoid_bias preset): the same with the aux-loss-free bias") {
  smoke(gating_preset::sigmoid_bias,
        {{condition::sft, "dropless"}, {condition::lbl, "dropless"}, {condition::rpb, "dropless"},
         {condition::rpb_hard, "dropless"}, {condition::kl_to_base, "dropless"}, {condition::logit_l2, "dropless"},
         {condition::sft, "cipher_strict", 2}});
}

TEST_CASE("exact match from one teacher-forced forward equals greedy decoding") {
  const split data = default_data(6, 8, 4, 8, 4);
  torch::manual_seed(3);
  auto m = std::make_shared<model>(tiny_config(gating_preset::softmax));
  const std::vector<example> memorised{data.train[0], data.train[8], data.train[16], data.train[17]};
  train_options o;
  o.steps = 80;
  o.batch_size = 4;
  o.lr = 1e-2;
  train(*m, memorised, o);
  std::vector<example> mixed = memorised;
  for (std::size_t i : {0, 1, 8, 9, 16, 17}) mixed.push_back(data.eval[i]);
  int exact = 0;
  for (const example& x : mixed) {
    CAPTURE(x.prompt);
    bool eos = false;
    const std::string greedy = generate(*m, x.prompt, static_cast<int>(x.answer.size()) + 1, &eos);
    const bool greedy_exact = eos && greedy == x.answer;
    exact += greedy_exact;
    CHECK(greedy_exact == (evaluate(*m, {x}).front().accuracy == 1.0));
  }
  CHECK(exact > 0);  // the memorised examples make the comparison non-vacuous
  CHECK(evaluate(*m, mixed).size() == 3);
}

TEST_CASE("the prior acts in training: a large beta changes the training-mode routing, not the eval-mode one") {
  const split data = default_data(2, 10, 20, 4, 4);
  torch::manual_seed(1);
  auto m = std::make_shared<model>(tiny_config(gating_preset::softmax));
  const auto set = of_domain(data.post, domain::code);
  m->set_prior(prepare_prior(build_prior(*m, set).pi, 4));
  rt::router_config r = preset_router(m->config());
  r.prior = rt::prior_kind::log_prior_bias;
  r.prior_bias.beta = 20.0f;
  const batch b = make_batch(set, {0, 1, 2, 3}, 48);
  torch::NoGradGuard g;
  const auto routed = [&](moe_route::mode mode, bool prior_on) {
    m->set_router(prior_on ? r : preset_router(m->config()));
    routing_context ctx;
    ctx.mode = mode;
    ctx.prior_rows = &b.prior_rows;
    m->forward(b.tokens, ctx);
    return m->moe_layers()[0]->last.routed.clone();
  };
  CHECK(!torch::equal(routed(moe_route::mode::train, true), routed(moe_route::mode::train, false)));
  CHECK(torch::equal(routed(moe_route::mode::eval, true), routed(moe_route::mode::eval, false)));
}

TEST_CASE("sigmoid_bias preset: the expert bias moves with the loads during training") {
  const split data = default_data(4, 40, 10, 4, 4);
  torch::manual_seed(2);
  auto m = std::make_shared<model>(tiny_config(gating_preset::sigmoid_bias));
  train_options o;
  o.steps = 5;
  o.batch_size = 8;
  o.threads = 1;
  train(*m, data.train, o);
  // Each step moves every bias by at most the update rate.
  const double moved = max_abs(m->moe_layers()[0]->expert_bias);
  CHECK(moved > 0.0);
  CHECK(moved <= 5 * 1e-2 + 1e-6);
}

TEST_CASE("training is deterministic for a seed (with admission groups and a penalty)") {
  const split data = default_data(5, 30, 10, 4, 4);
  const auto run = [&] {
    torch::manual_seed(9);
    auto m = std::make_shared<model>(tiny_config(gating_preset::sigmoid_bias));
    rt::router_config r = preset_router(m->config());
    r.z_loss.coefficient = 1e-3f;
    m->set_router(r);
    rt::admission_config a;
    a.dropless = false;
    a.capacity_factor = 1.0;
    m->set_admission(a);
    train_options o;
    o.steps = 6;
    o.batch_size = 8;
    o.seed = 4;
    o.admission_groups = 2;
    std::vector<double> losses;
    for (const auto& s : train(*m, data.train, o).log) losses.push_back(s.task_loss + s.aux_loss);
    return losses;
  };
  CHECK(run() == run());
}


TEST_CASE("prior forms: the softmax of the router logits on every preset, or the gate scores normalised") {
  const split data = default_data(7, 8, 6, 4, 4);
  torch::manual_seed(4);
  auto m = std::make_shared<model>(tiny_config(gating_preset::sigmoid_bias));
  const auto set = of_domain(data.post, domain::words);
  // The reference: the same batch's logits, through torch's softmax or sigmoid, averaged per span row.
  std::vector<std::size_t> all(set.size());
  std::iota(all.begin(), all.end(), std::size_t{0});
  const batch b = make_batch(set, all, 48);
  routing_context ctx;
  ctx.mode = moe_route::mode::eval;
  ctx.keep_logits = true;
  torch::NoGradGuard g;
  m->eval();
  m->forward(b.tokens, ctx);
  const auto rows = torch::tensor(b.prior_rows, torch::kInt64);
  const auto counts = torch::bincount(rows, {}, 2 * static_cast<std::int64_t>(set.size())).to(torch::kFloat64);
  for (prior_form form : {prior_form::softmax, prior_form::gate_scores}) {
    CAPTURE(prior_form_name(form));
    const base_prior bp = build_prior(*m, set, form);
    REQUIRE(bp.pi.size() == 2);
    for (std::size_t l = 0; l < 2; ++l) {
      const auto z = m->moe_layers()[l]->last.logits.to(torch::kFloat64);
      const auto p = form == prior_form::softmax ? torch::softmax(z, 1)
                                                 : torch::sigmoid(z) / torch::sigmoid(z).sum(1, true);
      const auto expected = torch::zeros({counts.size(0), 4}, torch::kFloat64).index_add_(0, rows, p) /
                            counts.unsqueeze(1);
      const auto got = torch::from_blob(const_cast<float*>(bp.pi[l].data()), {counts.size(0), 4}, torch::kFloat32)
                           .to(torch::kFloat64);
      CHECK(max_abs(got - expected) < 1e-6);
      // The logits' spread: per token the population sd and range over experts, then the mean.
      CHECK(bp.logits[l].sd == doctest::Approx(z.std(1, false).mean().item<double>()).epsilon(1e-6));
      CHECK(bp.logits[l].range ==
            doctest::Approx((std::get<0>(z.max(1)) - std::get<0>(z.min(1))).mean().item<double>()).epsilon(1e-6));
    }
  }
  CHECK_THROWS_WITH_AS(parse_prior_form("sigmoid"), "unknown prior form \"sigmoid\" (softmax, gate_scores)",
                       std::invalid_argument);
}

TEST_CASE("row spread: hand values") {
  const row_spread r = spread({1.0f, 3.0f, 0.0f, 0.0f, 0.0f, 4.0f}, 2);  // rows (1,3), (0,0), (0,4)
  CHECK(r.sd == doctest::Approx((1.0 + 0.0 + 2.0) / 3.0));
  CHECK(r.range == doctest::Approx((2.0 + 0.0 + 4.0) / 3.0));
  CHECK(spread({}, 3).sd == 0.0);
}

TEST_CASE("AdamW: weight decay moves the weight matrices, never the norm gains") {
  const split data = default_data(8, 20, 4, 4, 4);
  const auto step = [&](double decay) {
    torch::manual_seed(6);
    auto m = std::make_shared<model>(tiny_config(gating_preset::softmax));
    train_options o;
    o.steps = 1;
    o.batch_size = 8;
    o.warmup = 0;
    o.weight_decay = decay;
    train(*m, data.train, o);
    return m;
  };
  const auto plain = step(0.0), decayed = step(0.5);
  const auto a = plain->named_parameters(), b = decayed->named_parameters();
  int gains = 0, matrices = 0;
  for (const auto& item : a) {
    CAPTURE(item.key());
    const auto& other = b[item.key()];
    if (item.value().dim() >= 2) {
      CHECK(!torch::equal(item.value(), other));
      ++matrices;
    } else {
      CHECK(torch::equal(item.value(), other));
      ++gains;
    }
  }
  CHECK(gains > 0);
  CHECK(matrices > 0);
}

TEST_CASE("retention: the detector seed is the settings', and the sweep covers every seed, rho and detector") {
  routing_trace base, post;
  base.layers = post.layers = 1;
  base.tokens = post.tokens = 6;
  base.k = post.k = 2;
  base.experts = post.experts = 4;
  base.indices = {0, 1, 0, 1, 2, 3, 2, 3, 0, 1, 2, 3};
  post.indices = {0, 2, 1, 3, 0, 1, 2, 3, 0, 3, 1, 2};
  base.domains = post.domains = std::vector<std::int32_t>(6, 0);
  retention_settings s;
  s.nulls = 3;
  s.seed = 7;
  s.detector = community_detector::leiden;
  const auto r = retention(base, post, s);
  CHECK(r["seed"] == 7);
  CHECK(r["detector"] == "leiden");
  CHECK(r["edges_base"].get<double>() == 1.0);  // ceil(0.1 * 2 nonzero pairs)
  CHECK(r["isolated_base"].get<double>() == 2.0);
  REQUIRE(r["sweep"].size() == 24);
  std::set<std::string> seen;
  for (const auto& x : r["sweep"])
    seen.insert(x["detector"].get<std::string>() + "/" + std::to_string(x["rho"].get<double>()) + "/" +
                std::to_string(x["seed"].get<int>()));
  CHECK(seen.size() == 24);
  CHECK(parse_detector("louvain") == community_detector::louvain);
  CHECK_THROWS_AS(parse_detector("infomap"), std::invalid_argument);
}

TEST_CASE("routing structure: sharpness, divergence and span cosines of a hand trace") {
  routing_trace t;
  t.layers = 2;
  t.tokens = 4;
  t.k = 1;
  t.experts = 2;
  // Tokens: (domain, span) = (0, Q), (0, A), (1, Q), (1, A). Layer 0: experts 0 0 1 0; layer 1: 0 1 1 1.
  t.domains = {0, 0, 1, 1};
  t.spans = {0, 1, 0, 1};
  t.indices = {0, 0, 1, 0, 0, 1, 1, 1};
  const auto j = routing_structure(t, {"x", "y"});
  // All tokens: layer 0 u = (3/4, 1/4), layer 1 (1/4, 3/4); p = (1/2, 1/2): sharpness 0.
  CHECK(j["sharpness"].get<double>() == doctest::Approx(0.0));
  // Domain x: (1, 0) and (1/2, 1/2) -> p = (3/4, 1/4); domain y: (1/2, 1/2), (0, 1) -> (1/4, 3/4).
  CHECK(j["domains"]["x"]["sharpness"].get<double>() == doctest::Approx(0.5));
  REQUIRE(j["domain_pairs"].size() == 1);
  const auto& pair = j["domain_pairs"][0];
  CHECK(pair["divergence"].get<double>() == doctest::Approx(1.0));
  CHECK(pair["cosine"].get<double>() == doctest::Approx((3.0 / 16 + 3.0 / 16) / (10.0 / 16)));
  // Q spans: x's token takes expert 0 in both layers, (1, 0); y's expert 1, (0, 1): cosine 0.
  CHECK(pair["cosine_q"].get<double>() == doctest::Approx(0.0));
  // A spans: both tokens take expert 0, then 1: (1/2, 1/2) each, cosine 1.
  CHECK(pair["cosine_a"].get<double>() == doctest::Approx(1.0));
}

TEST_CASE("shuffle validation: the identity shuffle changes nothing; a swap of the top experts changes all") {
  const std::vector<std::vector<float>> pi{{0.7f, 0.2f, 0.1f, 0.0f, 0.4f, 0.3f, 0.2f, 0.1f}};
  const auto same = shuffle_validation(pi, pi, 4, 1, 1.0f);
  CHECK(same["topk_overlap"].get<double>() == 1.0);
  CHECK(same["p90_abs_bias_change"].get<double>() == 0.0);
  const std::vector<std::vector<float>> swapped{{0.1f, 0.2f, 0.7f, 0.0f, 0.2f, 0.3f, 0.4f, 0.1f}};
  const auto all = shuffle_validation(pi, swapped, 4, 1, 1.0f);
  CHECK(all["change_rate"].get<double>() == 1.0);
  CHECK(all["p90_abs_bias_change"].get<double>() > 0.0);
  CHECK_THROWS_AS(shuffle_validation(pi, {}, 4, 1, 1.0f), std::invalid_argument);
}
