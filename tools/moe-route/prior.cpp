// moe-route prior build | shuffle | validate: the RPB prior tools
// (moe_route/prior/{build,shuffle,validation}.hpp).
#include "common.hpp"

#include <moe_route/moe_route.hpp>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <memory>

namespace moe_route_cli {

namespace mr = moe_route;

namespace {

struct prior_options {
  // build
  std::string logits, rows, gating = "softmax", out;
  std::int64_t num_rows = 0;
  int threads = 1;
  // shuffle
  std::string prior, communities, scope = "within";
  std::uint64_t seed = 0;
  // validate
  std::string shuffled, json;
  int k = 0;
  float beta = 1.0f, eps = 0.05f, cap = 5.0f;
};

void run_build(const prior_options& o) {
  if (o.num_rows < 0) throw usage_error("--rows must be >= 1");
  if (o.threads < 0) throw usage_error("--threads must be >= 0");
  const array<float> z = load_f32(o.logits, "--logits");
  if (z.shape.size() != 2) throw data_error("--logits: " + o.logits + " has shape " + shape_string(z.shape) + "; expected [N, E]");
  const array<std::int32_t> r = load_i32(o.rows, "--prior-rows");
  if (r.shape.size() != 1 || r.dim(0) != z.dim(0))
    throw data_error("--prior-rows: " + o.rows + " has shape " + shape_string(r.shape) + "; expected [N] = (" +
                     std::to_string(z.dim(0)) + ",)");
  std::int64_t s = o.num_rows;
  if (s == 0)
    for (std::int32_t v : r.data) s = std::max<std::int64_t>(s, v + 1);
  const auto n = static_cast<std::int64_t>(z.dim(0));
  const int e = static_cast<int>(z.dim(1));
  std::vector<float> pi(static_cast<std::size_t>(s) * e);
  const mr::route_inputs<float> in{z.data.data(), n, e};
  const mr::cpu::execution ex{o.threads};
  mr::prior::build_report rep;
  if (o.gating == "softmax") rep = mr::prior::build<mr::gating::softmax>(in, r.data.data(), s, pi.data(), ex);
  else if (o.gating == "sigmoid") rep = mr::prior::build<mr::gating::sigmoid>(in, r.data.data(), s, pi.data(), ex);
  else if (o.gating == "sqrt_softplus") rep = mr::prior::build<mr::gating::sqrt_softplus>(in, r.data.data(), s, pi.data(), ex);
  else rep = mr::prior::build<mr::gating::softmax_after_topk>(in, r.data.data(), s, pi.data(), ex);
  staged_outputs out;
  out.save_f32(o.out, pi.data(), {static_cast<std::size_t>(s), static_cast<std::size_t>(e)});
  out.commit();
  std::printf("prior [%lld x %d] from %lld tokens -> %s\n", static_cast<long long>(s), e,
              static_cast<long long>(rep.tokens_used), o.out.c_str());
  if (!rep.empty_rows.empty()) {
    std::fprintf(stderr, "moe-route: warning: %zu prior row(s) received no token and are all zeros:", rep.empty_rows.size());
    for (std::size_t i = 0; i < rep.empty_rows.size() && i < 20; ++i) std::fprintf(stderr, " %lld", static_cast<long long>(rep.empty_rows[i]));
    std::fprintf(stderr, "%s\n", rep.empty_rows.size() > 20 ? " ..." : "");
  }
}

void run_shuffle(const prior_options& o) {
  if (o.scope == "within" && o.communities.empty()) throw usage_error("--scope within needs --communities C.npy");
  if (o.scope == "global" && !o.communities.empty()) throw usage_error("--scope global takes no --communities");
  const array<float> pi = load_f32(o.prior, "--prior");
  if (pi.shape.size() != 2) throw data_error("--prior: " + o.prior + " has shape " + shape_string(pi.shape) + "; expected [S, E]");
  const int e = static_cast<int>(pi.dim(1));
  std::vector<int> sigma;
  if (o.scope == "within") {
    const array<std::int32_t> c = load_i32(o.communities, "--communities");
    if (c.shape.size() != 1 || c.dim(0) != static_cast<std::size_t>(e))
      throw data_error("--communities: " + o.communities + " has shape " + shape_string(c.shape) + "; expected [E] = (" +
                       std::to_string(e) + ",)");
    const std::vector<int> labels(c.data.begin(), c.data.end());
    sigma = mr::prior::within_community_permutation(labels.data(), e, o.seed);
  } else {
    sigma = mr::prior::global_permutation(e, o.seed);
  }
  std::vector<float> shuffled(pi.data.size());
  mr::prior::apply_permutation(pi.data.data(), static_cast<std::int64_t>(pi.dim(0)), e, sigma, shuffled.data());
  staged_outputs out;
  out.save_f32(o.out, shuffled.data(), pi.shape);
  out.commit();
  int moved = 0;
  for (int x = 0; x < e; ++x) moved += sigma[x] != x;
  std::printf("%s shuffle (seed %llu): %d of %d experts moved -> %s\n", o.scope.c_str(),
              static_cast<unsigned long long>(o.seed), moved, e, o.out.c_str());
}

void run_validate(const prior_options& o) {
  if (o.k < 1) throw usage_error("--k must be >= 1");
  const array<float> a = load_f32(o.prior, "--prior"), b = load_f32(o.shuffled, "--shuffled");
  if (a.shape.size() != 2) throw data_error("--prior: " + o.prior + " has shape " + shape_string(a.shape) + "; expected [S, E]");
  if (a.shape != b.shape)
    throw data_error("--shuffled " + shape_string(b.shape) + " must have the shape of --prior " + shape_string(a.shape));
  const int e = static_cast<int>(a.dim(1));
  if (o.k > e) throw data_error("--k (= " + std::to_string(o.k) + ") exceeds E = " + std::to_string(e));
  const mr::prior::shuffle_validation v = mr::prior::validate_shuffle(
      a.data.data(), b.data.data(), static_cast<std::int64_t>(a.dim(0)), e, o.k, o.beta, {o.eps, o.cap});
  std::printf("prior-side validation (K = %d, beta = %g, eps = %g, cap = %g)\n", o.k, o.beta, o.eps, o.cap);
  std::printf("  top-k overlap          %.4f\n  change rate            %.4f\n  p90 |beta db|          %.4f\n"
              "  upper-clamp fraction   %.4f\n",
              v.topk_overlap, v.change_rate, v.p90_abs_bias_change, v.upper_clamp_fraction);
  if (!o.json.empty()) {
    const nlohmann::json j = {{"k", o.k}, {"beta", o.beta}, {"eps", o.eps}, {"cap", o.cap},
                              {"topk_overlap", v.topk_overlap}, {"change_rate", v.change_rate},
                              {"p90_abs_bias_change", v.p90_abs_bias_change},
                              {"upper_clamp_fraction", v.upper_clamp_fraction}};
    staged_outputs out;
    out.save_text(o.json, j.dump(2) + "\n");
    out.commit();
  }
}

}  // namespace

void add_prior(CLI::App& app) {
  auto o = std::make_shared<prior_options>();
  CLI::App* p = app.add_subcommand("prior", "RPB prior tools: build, shuffle, validate");
  p->require_subcommand(1);

  CLI::App* b = p->add_subcommand("build", "pi[r, e] = mean over tokens of row r of the base gating distribution");
  b->add_option("--logits", o->logits, "base router logits, float32 [N, E]")->required();
  b->add_option("--prior-rows", o->rows, "prior row per token, int32 [N] (-1 = none)")->required();
  b->add_option("--rows", o->num_rows, "number of prior rows S (default: largest row + 1)");
  b->add_option("--gating", o->gating, "base gating")
      ->check(CLI::IsMember({"softmax", "sigmoid", "sqrt_softplus", "softmax_after_topk"}));
  b->add_option("--out", o->out, "output PI.npy, float32 [S, E]")->required();
  b->add_option("--threads", o->threads, "CPU threads (default 1, 0 = every hardware thread; same result)");
  b->callback([o] { run_build(*o); });

  CLI::App* s = p->add_subcommand("shuffle", "pi'[r, sigma(e)] = pi[r, e], sigma within communities or global");
  s->add_option("--prior", o->prior, "prior PI.npy, float32 [S, E]")->required();
  s->add_option("--scope", o->scope, "within: permute inside communities; global: all experts")
      ->check(CLI::IsMember({"within", "global"}));
  s->add_option("--communities", o->communities, "community label per expert, int32 [E] (scope within)");
  s->add_option("--seed", o->seed, "permutation seed");
  s->add_option("--out", o->out, "output shuffled prior, float32 [S, E]")->required();
  s->callback([o] { run_shuffle(*o); });

  CLI::App* v = p->add_subcommand("validate", "prior-side statistics of a shuffled prior (RPB Table 13)");
  v->add_option("--prior", o->prior, "original prior, float32 [S, E]")->required();
  v->add_option("--shuffled", o->shuffled, "shuffled prior, float32 [S, E]")->required();
  v->add_option("--k", o->k, "top-k of the comparison (the router's K)")->required();
  v->add_option("--beta", o->beta, "prior strength beta");
  v->add_option("--prior-eps", o->eps, "clamp lower bound eps/E");
  v->add_option("--prior-cap", o->cap, "clamp upper bound C/E");
  v->add_option("--json", o->json, "write the statistics as JSON");
  v->callback([o] { run_validate(*o); });
}

}  // namespace moe_route_cli
