// moe-route analyze: the routing-retention table of a post-trained router
// against its base router (moe_route::analysis::compare_routing).
#include "common.hpp"
#include "plot.hpp"

#include <moe_route/analysis/routing_retention.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>

namespace moe_route_cli {

namespace an = moe_route::analysis;

namespace {

struct analyze_options {
  std::string base, post, json, plot, domains;
  double rho = 0.10;
  std::string detector = "louvain";
  std::uint64_t seed = 0;
  int nulls = 100;
  int experts = 0;
};

nlohmann::json pairs_json(const std::vector<an::domain_pair>& ps) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& p : ps)
    j.push_back({{"domains", {p.a, p.b}}, {"divergence_base", p.divergence_base}, {"divergence_post", p.divergence_post},
                 {"centroid_cosine_base", p.cosine_base}, {"centroid_cosine_post", p.cosine_post}});
  return j;
}

void run_analyze(const analyze_options& o) {
  if (!(o.rho > 0.0 && o.rho <= 1.0)) throw usage_error("--rho must be in (0, 1]");
  if (o.nulls < 0) throw usage_error("--nulls must be >= 0");
  if (o.experts < 0) throw usage_error("--experts must be >= 1");
  const array<std::int32_t> b = load_i32(o.base, "--base"), p = load_i32(o.post, "--post");
  for (const auto* a : {&b, &p})
    if (a->shape.size() != 2 && a->shape.size() != 3)
      throw data_error(std::string(a == &b ? "--base: " + o.base : "--post: " + o.post) + " has shape " +
                       shape_string(a->shape) + "; expected [L, N, K] or [N, K]");
  if (b.shape != p.shape)
    throw data_error("--base " + shape_string(b.shape) + " and --post " + shape_string(p.shape) +
                     " must have the same shape (the same probe tokens)");
  an::trace_shape s;
  const bool layered = b.shape.size() == 3;
  s.layers = layered ? static_cast<std::int64_t>(b.dim(0)) : 1;
  s.tokens = static_cast<std::int64_t>(b.dim(layered ? 1 : 0));
  s.k = static_cast<int>(b.dim(layered ? 2 : 1));
  if (s.layers < 1 || s.tokens < 1 || s.k < 1) throw data_error("traces must have at least one layer, token and slot");
  std::int32_t max_index = -1, min_index = 0;
  for (const auto* a : {&b, &p})
    for (std::int32_t v : a->data) max_index = std::max(max_index, v), min_index = std::min(min_index, v);
  if (min_index < -1) throw data_error("traces contain an expert index < -1 (" + std::to_string(min_index) + ")");
  s.experts = o.experts > 0 ? o.experts : max_index + 1;
  if (max_index >= s.experts)
    throw data_error("traces contain expert " + std::to_string(max_index) + " but --experts is " + std::to_string(s.experts));
  if (s.k > s.experts) throw data_error("K = " + std::to_string(s.k) + " slots but only " + std::to_string(s.experts) + " experts");
  an::retention_options opt;
  opt.rho = o.rho;
  opt.method = o.detector == "leiden" ? an::detector::leiden : an::detector::louvain;
  opt.seed = o.seed;
  opt.nulls = o.nulls;
  array<std::int32_t> dom;
  if (!o.domains.empty()) {
    dom = load_i32(o.domains, "--domains");
    if (dom.shape.size() != 1 || dom.dim(0) != static_cast<std::size_t>(s.tokens))
      throw data_error("--domains: " + o.domains + " has shape " + shape_string(dom.shape) + "; expected [N] = (" +
                       std::to_string(s.tokens) + ",)");
    int d_max = -1;
    for (std::int32_t d : dom.data) d_max = std::max(d_max, d);
    if (d_max < 1) throw data_error("--domains: needs at least two domains (labels 0 and 1)");
    opt.domains = dom.data.data();
    opt.num_domains = d_max + 1;
  }
  const an::retention_result r = an::compare_routing(b.data.data(), p.data.data(), s, opt);

  // The retention table.
  std::printf("routing retention: %lld layer(s), %lld tokens, K = %d, E = %d, rho = %.3g, %s, seed %llu, %d null "
              "resamples\n",
              static_cast<long long>(s.layers), static_cast<long long>(s.tokens), s.k, s.experts, o.rho,
              an::detector_name(opt.method), static_cast<unsigned long long>(o.seed), o.nulls);
  std::printf("%6s %8s %8s %8s %8s %8s %8s %8s %6s %6s %8s %8s\n", "layer", "TVD", "JSD", "top-k", "NMI", "Q_base",
              "Q_post", "dQ", "C_b", "C_p", "Q_margin", "NMI_marg");
  for (std::size_t l = 0; l < r.layers.size(); ++l) {
    const auto& x = r.layers[l];
    std::printf("%6zu %8.4f %8.4f %8.4f %8.4f %8.4f %8.4f %8.4f %6d %6d %8.4f %8.4f\n", l, x.tvd, x.jsd, x.topk_overlap,
                x.nmi, x.q_base, x.q_post, x.delta_q, x.communities_base.communities, x.communities_post.communities,
                x.q_margin, x.nmi_margin);
  }
  const auto& m = r.mean;
  std::printf("%6s %8.4f %8.4f %8.4f %8.4f %8.4f %8.4f %8.4f %6s %6s %8.4f %8.4f\n", "mean", m.tvd, m.jsd, m.topk_overlap,
              m.nmi, m.q_base, m.q_post, m.delta_q, "", "", m.q_margin, m.nmi_margin);
  if (o.nulls > 0) std::printf("layers beating the null model on Q: %.0f%%\n", 100.0 * m.beats_null_share);
  std::printf("sharpness ||u - U||_1: base %.4f, post %.4f; effective expert fraction: base %.4f, post %.4f\n",
              m.sharpness_base, m.sharpness_post, m.effective_fraction_base, m.effective_fraction_post);
  for (const auto& d : m.domain_pairs)
    std::printf("domains %d-%d: divergence base %.4f post %.4f; centroid cosine base %.4f post %.4f\n", d.a, d.b,
                d.divergence_base, d.divergence_post, d.cosine_base, d.cosine_post);

  staged_outputs out;
  if (!o.json.empty()) {
    nlohmann::json j;
    j["shape"] = {{"layers", s.layers}, {"tokens", s.tokens}, {"k", s.k}, {"experts", s.experts}};
    j["options"] = {{"rho", o.rho}, {"detector", an::detector_name(opt.method)}, {"seed", o.seed}, {"nulls", o.nulls},
                    {"resolution", opt.resolution}};
    nlohmann::json layers = nlohmann::json::array();
    for (const auto& x : r.layers)
      layers.push_back({{"tvd", x.tvd}, {"jsd", x.jsd}, {"topk_overlap", x.topk_overlap}, {"nmi", x.nmi},
                        {"q_base", x.q_base}, {"q_post", x.q_post}, {"delta_q", x.delta_q},
                        {"edges_base", x.edges_base}, {"edges_post", x.edges_post},
                        {"isolated_base", x.isolated_base}, {"isolated_post", x.isolated_post},
                        {"communities_base", x.communities_base.membership},
                        {"communities_post", x.communities_post.membership},
                        {"utilisation_base", x.utilisation_base}, {"utilisation_post", x.utilisation_post},
                        {"sharpness_base", x.sharpness_base}, {"sharpness_post", x.sharpness_post},
                        {"effective_fraction_base", x.effective_fraction_base},
                        {"effective_fraction_post", x.effective_fraction_post},
                        {"null", {{"q_mean", x.null_q_mean}, {"nmi_mean", x.null_nmi_mean}, {"q_margin", x.q_margin},
                                  {"nmi_margin", x.nmi_margin}, {"beats_null", x.beats_null}}},
                        {"domain_pairs", pairs_json(x.domain_pairs)}});
    j["layers"] = layers;
    j["mean"] = {{"tvd", m.tvd}, {"jsd", m.jsd}, {"topk_overlap", m.topk_overlap}, {"nmi", m.nmi},
                 {"q_base", m.q_base}, {"q_post", m.q_post}, {"delta_q", m.delta_q},
                 {"sharpness_base", m.sharpness_base}, {"sharpness_post", m.sharpness_post},
                 {"effective_fraction_base", m.effective_fraction_base},
                 {"effective_fraction_post", m.effective_fraction_post},
                 {"null", {{"q_mean", m.null_q_mean}, {"nmi_mean", m.null_nmi_mean}, {"q_margin", m.q_margin},
                           {"nmi_margin", m.nmi_margin}, {"beats_null_share", m.beats_null_share}}},
                 {"domain_pairs", pairs_json(m.domain_pairs)}};
    const auto parent = std::filesystem::path(o.json).parent_path();
    if (!parent.empty()) ensure_directory(parent.string());
    out.save_text(o.json, j.dump(2) + "\n");
  }
  if (!o.plot.empty()) write_plots(o.plot, r, b.data.data(), p.data.data(), out);
  out.commit();
}

}  // namespace

void add_analyze(CLI::App& app) {
  auto o = std::make_shared<analyze_options>();
  CLI::App* c = app.add_subcommand("analyze", "Compare base and post-trained routing traces (TVD, JSD, top-k overlap, "
                                              "community NMI, Q, dQ, null model)");
  c->add_option("--base", o->base, "base router's indices, int32 [L, N, K] or [N, K]")->required();
  c->add_option("--post", o->post, "post-trained router's indices on the same tokens, same shape")->required();
  c->add_option("--rho", o->rho, "retained edge fraction");
  c->add_option("--detector", o->detector, "community detector")->check(CLI::IsMember({"louvain", "leiden"}));
  c->add_option("--seed", o->seed, "detector and null-model seed");
  c->add_option("--nulls", o->nulls, "null-model resamples per layer (0: none)");
  c->add_option("--experts", o->experts, "number of experts E (default: largest index + 1)");
  c->add_option("--domains", o->domains, "domain label per token, int32 [N] (-1 = none): cross-domain statistics");
  c->add_option("--json", o->json, "write the full result as JSON");
  c->add_option("--plot", o->plot, "write PNG figures (gnuplot) into this directory");
  c->callback([o] { run_analyze(*o); });
}

}  // namespace moe_route_cli
