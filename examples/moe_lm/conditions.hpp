// moe_lm: the post-training conditions of RPB Table 1 (and the z-loss
// baseline) as run-time router settings of the driver, following
// moe_route::conditions: which penalties and prior policy the routers carry,
// which prior table they read, and what happens next to the router's backward.
#pragma once

#include <string>
#include <vector>

#include <moe_route/runtime/cpu.hpp>

namespace moe_lm {

enum class condition {
  sft, lbl, rpb, router_l2, kl_to_base, logit_l2, z_loss, rpb_hard, within_soft, within_hard, global_hard
};
const char* condition_name(condition c);
// Throws std::invalid_argument naming the known conditions.
condition parse_condition(const std::string& name);
std::vector<condition> all_conditions();

// The coefficients; the defaults are RPB App. F.6's (lambda 1e4 for Router-L2,
// alpha 1e-3 for LBL, beta 1 for the soft prior).
struct condition_params {
  float lbl_alpha = 1e-3f;
  float beta = 1.0f;
  float router_l2 = 1e4f;
  float kl_to_base = 1e-2f;
  float logit_l2 = 1e-2f;
  float z_loss = 1e-3f;
};

// Which prior table the routers read.
enum class prior_source { none, base, within_shuffle, global_shuffle };

struct condition_setup {
  moe_route::runtime::router_config router;
  prior_source prior = prior_source::none;
  float router_l2 = 0.0f;           // lambda of penalty::router_l2 (0: off)
  bool update_expert_bias = true;   // false under a prior: the prior is then the only router-side signal
};

// The condition applied to the base model's router (its gating, selection and K are kept).
condition_setup setup(condition c, const moe_route::runtime::router_config& base, const condition_params& p);

}  // namespace moe_lm
