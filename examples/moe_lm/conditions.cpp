#include "conditions.hpp"

#include <stdexcept>

namespace moe_lm {

namespace rt = moe_route::runtime;

namespace {
constexpr condition every_condition[] = {condition::sft,        condition::lbl,        condition::rpb,
                                         condition::router_l2,  condition::kl_to_base, condition::logit_l2,
                                         condition::z_loss,     condition::rpb_hard,   condition::within_soft,
                                         condition::within_hard, condition::global_hard};
}

const char* condition_name(condition c) {
  switch (c) {
    case condition::sft: return "sft";
    case condition::lbl: return "lbl";
    case condition::rpb: return "rpb";
    case condition::router_l2: return "router_l2";
    case condition::kl_to_base: return "kl_to_base";
    case condition::logit_l2: return "logit_l2";
    case condition::z_loss: return "z_loss";
    case condition::rpb_hard: return "rpb_hard";
    case condition::within_soft: return "within_soft";
    case condition::within_hard: return "within_hard";
    case condition::global_hard: return "global_hard";
  }
  return "?";
}

condition parse_condition(const std::string& name) {
  std::string known;
  for (condition c : every_condition) {
    if (name == condition_name(c)) return c;
    known += std::string(known.empty() ? "" : ", ") + condition_name(c);
  }
  throw std::invalid_argument("unknown condition \"" + name + "\" (" + known + ")");
}

std::vector<condition> all_conditions() { return {std::begin(every_condition), std::end(every_condition)}; }

condition_setup setup(condition c, const rt::router_config& base, const condition_params& p) {
  condition_setup s;
  s.router = base;
  s.router.prior = rt::prior_kind::none;
  s.router.load_balance.coefficient = 0.0f;
  s.router.z_loss.coefficient = 0.0f;
  s.router.kl_to_base.coefficient = 0.0f;
  s.router.logit_l2.coefficient = 0.0f;
  s.router.locality.coefficient = 0.0f;
  const auto soft = [&](prior_source from) {
    s.router.prior = rt::prior_kind::log_prior_bias;
    s.router.prior_bias.beta = p.beta;
    s.prior = from;
    s.update_expert_bias = false;
  };
  const auto hard = [&](prior_source from) {
    s.router.prior = rt::prior_kind::prior_override;
    s.prior = from;
    s.update_expert_bias = false;
  };
  switch (c) {
    case condition::sft: break;
    case condition::lbl: s.router.load_balance.coefficient = p.lbl_alpha; break;
    case condition::rpb: soft(prior_source::base); break;
    case condition::router_l2: s.router_l2 = p.router_l2; break;
    case condition::kl_to_base:
      s.router.kl_to_base.coefficient = p.kl_to_base;
      s.prior = prior_source::base;
      break;
    case condition::logit_l2:
      s.router.logit_l2.coefficient = p.logit_l2;
      s.prior = prior_source::base;
      break;
    case condition::z_loss: s.router.z_loss.coefficient = p.z_loss; break;
    case condition::rpb_hard: hard(prior_source::base); break;
    case condition::within_soft: soft(prior_source::within_shuffle); break;
    case condition::within_hard: hard(prior_source::within_shuffle); break;
    case condition::global_hard: hard(prior_source::global_shuffle); break;
  }
  return s;
}

}  // namespace moe_lm
