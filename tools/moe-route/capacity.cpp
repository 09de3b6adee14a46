// moe-route capacity: the CIPHER capacity bounds (moe_route/analysis/capacity_bounds.hpp,
// docs/policies.md section 7).
#include "common.hpp"

#include <moe_route/analysis/capacity_bounds.hpp>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <memory>
#include <optional>

namespace moe_route_cli {

namespace cb = moe_route::analysis::capacity_bounds;

namespace {

struct capacity_options {
  double experts = 0, epsilon = 0, eta = 0, mu = 0, a0 = 0, beta = 1;
  std::int64_t pool = 0;
  std::optional<double> delta, kappa, dimension, pi;
  std::string json;
};

void run_capacity(const capacity_options& o) {
  if ((o.kappa.has_value() || o.dimension.has_value()) && !o.delta)
    throw usage_error("--kappa and --dimension need --delta (the certified margin)");
  nlohmann::json j;
  const std::int64_t b_e = cb::cipher_budget(o.pool, o.mu, o.epsilon, o.eta);
  const double l = cb::ell(o.epsilon, o.eta);
  std::printf("CIPHER capacity bounds (E = %g, eps = %g, eta = %g, mu = %g, a0 = %g, beta = %g, N_e = %lld)\n",
              o.experts, o.epsilon, o.eta, o.mu, o.a0, o.beta, static_cast<long long>(o.pool));
  std::printf("  ell = log(1/(eps - eta))                  %.6g\n", l);
  std::printf("  B_e (eq. 7), C*_CIPHER <= B_e            %lld\n", static_cast<long long>(b_e));
  j["ell"] = l;
  j["B_e"] = b_e;
  if (o.delta) {
    if (o.kappa) {
      const double d_star = cb::dimension_condition(*o.kappa, o.beta, o.experts, static_cast<double>(b_e), o.epsilon, o.a0, *o.delta);
      const std::int64_t d_min = cb::min_dimension(*o.kappa, o.beta, o.experts, static_cast<double>(b_e), o.epsilon, o.a0, *o.delta);
      std::printf("  dimension condition (eq. 16): d >= %.6g, smallest d = %lld for a factor-%g reduction\n", d_star,
                  static_cast<long long>(d_min), *o.kappa);
      j["dimension_condition"] = {{"kappa", *o.kappa}, {"d_bound", d_star}, {"min_dimension", d_min}};
    }
    if (o.dimension) {
      const double g = cb::geometric_exponent(*o.dimension, *o.delta);
      const double lower = cb::natural_order_lower_bound(o.epsilon, o.a0, o.beta, o.experts, *o.dimension, *o.delta);
      std::printf("  G(d = %g, delta = %g) (eq. 7)              %.6g\n", *o.dimension, *o.delta, g);
      std::printf("  natural-order lower bound (eq. 8/20)      C*_natural >= %.6g (ratio to B_e %.6g)\n", lower,
                  lower / static_cast<double>(b_e));
      j["natural_order_lower_bound"] = {{"d", *o.dimension}, {"delta", *o.delta}, {"G", g}, {"bound", lower}};
    }
  }
  if (o.pi) {
    const std::int64_t exact = cb::natural_order_capacity(*o.pi, o.pool, o.epsilon);
    const double avail = cb::availability_bound(o.a0, *o.pi);
    std::printf("  exact natural-order capacity (eq. 19)     C*_natural = %lld (pi_e = %g)\n",
                static_cast<long long>(exact), *o.pi);
    std::printf("  availability (eq. 26)                     N_e >= %.6g (pool %s)\n", avail,
                static_cast<double>(o.pool) >= avail ? "satisfies it" : "is too small");
    j["natural_order_capacity"] = {{"pi_e", *o.pi}, {"capacity", exact}, {"availability_bound", avail}};
  }
  if (!o.delta && !o.pi)
    std::printf("  (add --delta with --kappa for the dimension condition, --delta with --dimension for the natural-order "
                "lower bound, --pi for the exact natural-order capacity)\n");
  if (!o.json.empty()) {
    staged_outputs out;
    out.save_text(o.json, j.dump(2) + "\n");
    out.commit();
  }
}

}  // namespace

void add_capacity(CLI::App& app) {
  auto o = std::make_shared<capacity_options>();
  CLI::App* c = app.add_subcommand("capacity", "CIPHER capacity bounds: B_e, natural-order bounds, dimension condition");
  c->add_option("--experts", o->experts, "number of experts E")->required();
  c->add_option("--epsilon", o->epsilon, "target failure probability eps in (0, 1)")->required();
  c->add_option("--eta", o->eta, "candidate recall failure eta in [0, eps)")->required();
  c->add_option("--mu", o->mu, "bound on competitors ranked ahead of the witness, >= 0")->required();
  c->add_option("--a0", o->a0, "signal availability a0 in (0, 1)")->required();
  c->add_option("--beta-exposure", o->beta, "exposure factor beta >= 1")->required();
  c->add_option("--pool", o->pool, "candidate pool size N_e >= 1")->required();
  c->add_option("--delta", o->delta, "certified signal margin delta in (0, 1)");
  c->add_option("--kappa", o->kappa, "desired capacity reduction factor kappa > 1 (dimension condition)");
  c->add_option("--dimension", o->dimension, "representation dimension d >= 2 (natural-order lower bound)");
  c->add_option("--pi", o->pi, "discriminative-token probability pi_e in (0, 1) (exact natural-order capacity)");
  c->add_option("--json", o->json, "write the values as JSON");
  c->callback([o] { run_capacity(*o); });
}

}  // namespace moe_route_cli
