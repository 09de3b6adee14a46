// moe_route: the post-training conditions of RPB Table 1 for any base router
// (any gating, selection and K). Each function returns the base router with
// the condition's policies; its data (which prior table, shuffled or not) is
// what the caller passes in route_inputs. Switching a training run between
// conditions is changing one call here (docs/training.md).
//
//   condition     router policies                 data / companion
//   sft (NoAux)   none                            task loss only
//   lbl           load_balance{alpha}             (alpha 1e-3 in RPB App. F.6)
//   rpb           log_prior_bias{beta}            prior::prepare(base prior)
//   rpb_hard      prior_override                  prior::prepare(base prior)
//   router_l2     none                            penalty::router_l2{1e4} on the router weights
//   kl_to_base    kl_to_base{c}                   prior::prepare(base prior): bias and probs
//   logit_l2      logit_l2{c}                     prior::prepare(base prior)
//   z_loss        z_loss{c}                       (ST-MoE baseline, RPB Table 8)
//   within_soft   log_prior_bias{beta}            prior::shuffle within communities, then prepare
//   within_hard   prior_override                  prior::shuffle within communities, then prepare
//   global_hard   prior_override                  prior::shuffle globally, then prepare
//
// RPB runs also stop the aux-loss-free bias update (selection::expert_bias::
// update) so the prior is the only router-side signal (RPB App. F.6).
#pragma once

#include <moe_route/penalty/kl_to_base.hpp>
#include <moe_route/penalty/load_balance.hpp>
#include <moe_route/penalty/logit_l2.hpp>
#include <moe_route/penalty/router_l2.hpp>
#include <moe_route/penalty/z_loss.hpp>
#include <moe_route/prior/policy.hpp>
#include <moe_route/router.hpp>

namespace moe_route::conditions {

template <class G, class S, int K, class... P>
router<G, S, K> sft(const router<G, S, K, P...>& base) {
  return with_policies(base);
}

template <class G, class S, int K, class... P>
router<G, S, K, penalty::load_balance> lbl(const router<G, S, K, P...>& base, float alpha = 1e-3f) {
  return with_policies(base, penalty::load_balance{alpha});
}

template <class G, class S, int K, class... P>
router<G, S, K, prior::log_prior_bias> rpb(const router<G, S, K, P...>& base, float beta = 1.0f) {
  return with_policies(base, prior::log_prior_bias{beta});
}

template <class G, class S, int K, class... P>
router<G, S, K, prior::prior_override> rpb_hard(const router<G, S, K, P...>& base) {
  return with_policies(base, prior::prior_override{});
}

// The router is the plain one: the anchor acts on its weights, through
// penalty::router_l2 (value and gradient) next to the router's backward.
template <class G, class S, int K, class... P>
router<G, S, K> router_l2(const router<G, S, K, P...>& base) {
  return with_policies(base);
}

template <class G, class S, int K, class... P>
router<G, S, K, penalty::kl_to_base> kl_to_base(const router<G, S, K, P...>& base, float c = 1e-2f) {
  return with_policies(base, penalty::kl_to_base{c});
}

template <class G, class S, int K, class... P>
router<G, S, K, penalty::logit_l2> logit_l2(const router<G, S, K, P...>& base, float c = 1e-2f) {
  return with_policies(base, penalty::logit_l2{c});
}

template <class G, class S, int K, class... P>
router<G, S, K, penalty::z_loss> z_loss(const router<G, S, K, P...>& base, float c = 1e-3f) {
  return with_policies(base, penalty::z_loss{c});
}

// The shuffled controls: the same routers as rpb and rpb_hard; the caller
// passes the prior shuffled with prior::shuffle (within communities or global).
template <class G, class S, int K, class... P>
router<G, S, K, prior::log_prior_bias> within_soft(const router<G, S, K, P...>& base, float beta = 1.0f) {
  return rpb(base, beta);
}

template <class G, class S, int K, class... P>
router<G, S, K, prior::prior_override> within_hard(const router<G, S, K, P...>& base) {
  return rpb_hard(base);
}

template <class G, class S, int K, class... P>
router<G, S, K, prior::prior_override> global_hard(const router<G, S, K, P...>& base) {
  return rpb_hard(base);
}

}  // namespace moe_route::conditions
