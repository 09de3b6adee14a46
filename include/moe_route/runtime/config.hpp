// moe_route: routers and admission policies configured at run time, for host
// frameworks (the PyTorch extension, LibTorch drivers, MPI jobs) that read
// their policies from a configuration instead of a type.
//
// A router_config names the gating, the selection and the prior, and carries
// every penalty with its coefficient. visit_router(config, f) calls f once
// with the compile-time router the configuration describes, so the per-token
// code is the same as for a router written as a type; a framework instantiates
// the library once per (gating, selection, prior) and never dispatches per
// token. Every runtime router carries all five logit-space penalties: one with
// coefficient 0 is off (value 0, no work, no gradient), so switching a
// penalty on or off between steps needs no other type. The calls are in
// runtime/cpu.hpp and runtime/cuda.hpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include <moe_route/admission/admission.hpp>
#include <moe_route/config.hpp>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/gating/sigmoid.hpp>
#include <moe_route/gating/softmax.hpp>
#include <moe_route/gating/softmax_after_topk.hpp>
#include <moe_route/gating/sqrt_softplus.hpp>
#include <moe_route/penalty/penalties.hpp>
#include <moe_route/prior/policy.hpp>
#include <moe_route/router.hpp>
#include <moe_route/selection/expert_bias.hpp>
#include <moe_route/selection/fixed.hpp>
#include <moe_route/selection/by_score.hpp>
#include <moe_route/selection/group_limited.hpp>
#include <moe_route/selection/top_k.hpp>
#include <moe_route/training/workspace.hpp>
#include <moe_route/types.hpp>

namespace moe_route::runtime {

enum class gating_kind { softmax, sigmoid, sqrt_softplus, softmax_after_topk };
enum class selection_kind { top_k, expert_bias, group_limited, group_limited_bias, fixed, group_limited_score };
enum class prior_kind { none, log_prior_bias, prior_override };

// The MaxK of every runtime router: the largest top_k a router_config takes.
inline constexpr int router_max_k = default_max_k;

// The penalties of every runtime router, in the order of its penalty values.
inline constexpr int num_penalties = 5;
inline constexpr const char* penalty_names[num_penalties] = {"load_balance", "z_loss", "kl_to_base", "logit_l2",
                                                             "locality"};

struct router_config {
  gating_kind gating = gating_kind::softmax;
  selection_kind selection = selection_kind::top_k;
  int top_k = 2;
  bool normalize = false;
  float scaling_factor = 1.0f;
  // group_limited selections
  int groups = 1;
  int top_groups = 1;
  int per_group_k = 2;
  // expert_bias selections: the step of expert_bias::update
  float bias_update_rate = 1e-3f;
  // the prior policy; prior_bias holds log_prior_bias's beta and bias_gates
  prior_kind prior = prior_kind::none;
  prior::log_prior_bias prior_bias{};
  // penalties, all off by default
  penalty::load_balance load_balance{0.0f};
  penalty::z_loss z_loss{0.0f};
  penalty::kl_to_base kl_to_base{0.0f};
  penalty::logit_l2 logit_l2{0.0f};
  penalty::locality locality{0.0f};
};

inline const char* name(gating_kind g) {
  switch (g) {
    case gating_kind::softmax: return "softmax";
    case gating_kind::sigmoid: return "sigmoid";
    case gating_kind::sqrt_softplus: return "sqrt_softplus";
    case gating_kind::softmax_after_topk: return "softmax_after_topk";
  }
  return "?";
}

inline bool selection_uses_bias(selection_kind s) {
  return s == selection_kind::expert_bias || s == selection_kind::group_limited_bias;
}

inline bool selection_is_grouped(selection_kind s) {
  return s == selection_kind::group_limited || s == selection_kind::group_limited_bias ||
         s == selection_kind::group_limited_score;
}

// Checks what no router type can check at compile time here; the message
// names the field. Shape-dependent checks (K <= E, groups dividing E) are the
// backend's, made when the logits are known.
inline void validate(const router_config& c) {
  auto fail = [](const std::string& m) { throw error("moe_route: router_config." + m); };
  if (c.top_k < 1 || c.top_k > router_max_k)
    fail("top_k (= " + std::to_string(c.top_k) + ") must be in [1, " + std::to_string(router_max_k) + "]");
  if (c.gating == gating_kind::softmax_after_topk &&
      (selection_uses_bias(c.selection) || c.selection == selection_kind::group_limited_score))
    fail("selection: softmax_after_topk has scores only after selection, so it cannot key on s + b "
         "(expert_bias) or s (group_limited_score); use softmax or sigmoid gating");
  if (selection_is_grouped(c.selection)) {
    if (c.groups < 1 || c.groups > moe_route::detail::reduction_lanes)
      fail("groups (= " + std::to_string(c.groups) + ") must be in [1, " +
           std::to_string(moe_route::detail::reduction_lanes) + "]");
    if (c.top_groups < 1 || c.top_groups > c.groups)
      fail("top_groups (= " + std::to_string(c.top_groups) + ") must be in [1, groups]");
    if (c.per_group_k < 1) fail("per_group_k (= " + std::to_string(c.per_group_k) + ") must be >= 1");
  }
  const std::pair<const char*, float> coefficients[] = {
      {"load_balance.coefficient", c.load_balance.coefficient}, {"z_loss.coefficient", c.z_loss.coefficient},
      {"kl_to_base.coefficient", c.kl_to_base.coefficient},     {"logit_l2.coefficient", c.logit_l2.coefficient},
      {"locality.coefficient", c.locality.coefficient},         {"locality.epsilon", c.locality.epsilon},
      {"scaling_factor", c.scaling_factor},                     {"prior_bias.beta", c.prior_bias.beta}};
  for (const auto& [field, value] : coefficients)
    if (!(value == value) || value == std::numeric_limits<float>::infinity() ||
        value == -std::numeric_limits<float>::infinity())
      fail(std::string(field) + " must be finite");
  // 0 would give remote experts a target mass of 0, where the KL is infinite.
  if (!(c.locality.epsilon > 0.0f && c.locality.epsilon < 1.0f)) fail("locality.epsilon must be in (0, 1)");
  if (c.load_balance.counts == penalty::load_balance::count::top_k &&
      c.load_balance.over == penalty::load_balance::scope::global_batch)
    fail("load_balance.counts: top_k counts nothing over the global batch (f comes from load_fractions); use "
         "selected");
  if (c.load_balance.sequence_length != penalty::load_balance::length::own &&
      c.load_balance.over != penalty::load_balance::scope::sequence)
    fail("load_balance.sequence_length: batch_mean normalises sequences, but load_balance_scope is not sequence");
}

template <class Gating, class Selection, class Prior>
using router_type = router<Gating, Selection, router_max_k, Prior, penalty::load_balance, penalty::z_loss,
                           penalty::kl_to_base, penalty::logit_l2, penalty::locality>;

// The router value of a configuration, for known types. prior_kind::none is
// log_prior_bias with beta = 0, which routes exactly as the plain router.
template <class Gating, class Selection, class Prior>
router_type<Gating, Selection, Prior> make_router(const router_config& c) {
  router_type<Gating, Selection, Prior> r;
  r.top_k = c.top_k;
  r.normalize = c.normalize;
  r.scaling_factor = c.scaling_factor;
  if constexpr (std::is_same_v<Selection, selection::expert_bias>) r.selection.update_rate = c.bias_update_rate;
  if constexpr (Selection::shape == selection::kind::grouped) {
    r.selection.groups = c.groups;
    r.selection.top_groups = c.top_groups;
    r.selection.per_group_k = c.per_group_k;
    if constexpr (std::is_same_v<typename Selection::key_policy, selection::expert_bias>)
      r.selection.inner.update_rate = c.bias_update_rate;
  }
  if constexpr (std::is_same_v<Prior, prior::log_prior_bias>) {
    get<prior::log_prior_bias>(r) = c.prior_bias;
    if (c.prior == prior_kind::none) get<prior::log_prior_bias>(r).beta = 0.0f;
  }
  get<penalty::load_balance>(r) = c.load_balance;
  get<penalty::z_loss>(r) = c.z_loss;
  get<penalty::kl_to_base>(r) = c.kl_to_base;
  get<penalty::logit_l2>(r) = c.logit_l2;
  get<penalty::locality>(r) = c.locality;
  return r;
}

namespace detail {

template <class Gating, class Selection, class F>
decltype(auto) visit_prior(const router_config& c, F&& f) {
  if (c.prior == prior_kind::prior_override)
    return f(make_router<Gating, Selection, prior::prior_override>(c));
  return f(make_router<Gating, Selection, prior::log_prior_bias>(c));
}


// f(tag) with a value of the gating type g names.
template <class F>
decltype(auto) by_gating(gating_kind g, F&& f) {
  switch (g) {
    case gating_kind::sigmoid: return f(gating::sigmoid{});
    case gating_kind::sqrt_softplus: return f(gating::sqrt_softplus{});
    case gating_kind::softmax_after_topk: return f(gating::softmax_after_topk{});
    case gating_kind::softmax: break;
  }
  return f(gating::softmax{});
}

}  // namespace detail

// Whether a router of gating `g` normalises its gates when the caller does not
// say (Gating::normalize_by_default): the sigmoid-type gatings do.
inline bool normalizes_by_default(gating_kind g) {
  return detail::by_gating(g, [](auto gating) { return decltype(gating)::normalize_by_default; });
}

// f(router) for the router of `c`, whose gating must be Gating (a framework
// that splits its instantiations over translation units calls this per gating).
template <class Gating, class F>
decltype(auto) visit_router_with(const router_config& c, F&& f) {
  validate(c);
  using namespace selection;
  switch (c.selection) {
    case selection_kind::expert_bias:
    case selection_kind::group_limited_bias:
    case selection_kind::group_limited_score:
      if constexpr (Gating::shape == gating::kind::selected_softmax) {
        break;  // rejected by validate()
      } else if (c.selection == selection_kind::expert_bias) {
        return detail::visit_prior<Gating, expert_bias>(c, f);
      } else if (c.selection == selection_kind::group_limited_bias) {
        return detail::visit_prior<Gating, group_limited<expert_bias>>(c, f);
      } else {
        return detail::visit_prior<Gating, group_limited<by_score>>(c, f);
      }
    case selection_kind::group_limited: return detail::visit_prior<Gating, group_limited<top_k>>(c, f);
    case selection_kind::fixed: return detail::visit_prior<Gating, fixed>(c, f);
    case selection_kind::top_k: break;
  }
  return detail::visit_prior<Gating, top_k>(c, f);
}

template <class F>
decltype(auto) visit_router(const router_config& c, F&& f) {
  return detail::by_gating(c.gating, [&](auto g) -> decltype(auto) { return visit_router_with<decltype(g)>(c, f); });
}

// ---------------------------------------------------------------------------
// Admission configured at run time (admission/admission.hpp's policies).

enum class affinity_kind { position, probability, logit, cosine, gate };
enum class overflow_kind { drop, reroute };

struct admission_config {
  bool dropless = true;
  affinity_kind affinity = affinity_kind::probability;
  overflow_kind overflow = overflow_kind::drop;
  float threshold = -std::numeric_limits<float>::infinity();
  double capacity_factor = 1.0;
  std::int64_t min_capacity = 0;
  bool renormalize = false;   // drop
  double fill_factor = 4.0;   // reroute
  int max_rounds = -1;        // reroute; -1: K rounds
};

inline void validate(const admission_config& a) {
  auto fail = [](const std::string& m) { throw error("moe_route: admission_config." + m); };
  if (a.dropless) return;
  if (a.affinity == affinity_kind::position && a.overflow == overflow_kind::reroute)
    fail("overflow: position affinity ranks tokens, not experts, so it cannot choose a reroute target");
  if (a.affinity == affinity_kind::gate && a.overflow == overflow_kind::reroute)
    fail("overflow: gate affinity exists for the routed slots only, so it cannot choose a reroute target");
  if (!(a.capacity_factor > 0.0) || a.capacity_factor == std::numeric_limits<double>::infinity())
    fail("capacity_factor must be positive and finite");
  if (a.min_capacity < 0) fail("min_capacity must be >= 0");
  if (a.threshold != a.threshold) fail("threshold must not be NaN");
  if (a.affinity == affinity_kind::position && a.threshold != -std::numeric_limits<float>::infinity())
    fail("threshold must stay -inf with position affinity");
  if (a.overflow == overflow_kind::reroute) {
    if (!(a.fill_factor > 0.0) || a.fill_factor == std::numeric_limits<double>::infinity())
      fail("fill_factor must be positive and finite");
    if (a.max_rounds < -1) fail("max_rounds (= " + std::to_string(a.max_rounds) + ") must be >= 0, or -1 for K rounds");
  }
}

namespace detail {

template <class Affinity, class Overflow>
admission::policy<Affinity, Overflow> make_policy(const admission_config& a) {
  admission::policy<Affinity, Overflow> p;
  p.threshold = a.threshold;
  p.capacity_factor = a.capacity_factor;
  p.min_capacity = a.min_capacity;
  if constexpr (Overflow::reroutes) {
    p.overflow.fill_factor = a.fill_factor;
    p.overflow.max_rounds = a.max_rounds;
  } else {
    p.overflow.renormalize = a.renormalize;
  }
  return p;
}

template <class Affinity, class F>
decltype(auto) visit_overflow(const admission_config& a, F&& f) {
  if constexpr (Affinity::ranks_experts)
    if (a.overflow == overflow_kind::reroute) return f(make_policy<Affinity, admission::reroute>(a));
  return f(make_policy<Affinity, admission::drop>(a));
}

}  // namespace detail

// f(policy) for the admission policy of `a`.
template <class F>
decltype(auto) visit_admission(const admission_config& a, F&& f) {
  validate(a);
  if (a.dropless) return f(admission::dropless());
  switch (a.affinity) {
    case affinity_kind::position: return detail::visit_overflow<admission::position>(a, f);
    case affinity_kind::logit: return detail::visit_overflow<admission::logit>(a, f);
    case affinity_kind::cosine: return detail::visit_overflow<admission::cosine>(a, f);
    case affinity_kind::gate: return detail::visit_overflow<admission::gate>(a, f);
    case affinity_kind::probability: break;
  }
  return detail::visit_overflow<admission::probability>(a, f);
}

// ---------------------------------------------------------------------------

// Bytes of the training workspace route() fills and backward() reads.
inline std::size_t workspace_bytes(const router_config& c, std::int64_t num_tokens, int num_experts,
                                   std::int32_t num_sequences = 0) {
  return visit_router(c, [&](const auto& r) {
    return penalty::training_workspace_bytes(r, num_tokens, num_experts, std::max(num_sequences, 1));
  });
}

// workspace_bytes(c, N, E, S) as an affine form in N, for callers that know N
// only symbolically (PyTorch's fake tensors size the workspace output from
// it): fixed + per_value * (N + ceil(N / chunk)), chunk = penalty::value_chunk.
struct workspace_shape {
  std::size_t fixed = 0;      // bytes that do not depend on N
  std::size_t per_value = 0;  // bytes per token and per chunk of tokens
  std::int64_t chunk = penalty::value_chunk;
};

inline workspace_shape workspace_shape_of(const router_config& c, int num_experts, std::int32_t num_sequences = 0) {
  return visit_router(c, [&](const auto& r) {
    using router_type = std::decay_t<decltype(r)>;
    workspace_shape w;
    if constexpr (router_type::has_penalties) {
      w.fixed = penalty::training_layout<router_type>(0, num_experts, std::max(num_sequences, 1)).bytes;
      w.per_value = sizeof(double) * penalty::penalty_traits<router_type>::scalar_penalties;
    }
    return w;
  });
}

// Admission reads only the router's gating, K, normalisation and scaling, so
// both backends admit on the plain router of that gating.
template <class Gating>
router<Gating, selection::top_k, router_max_k> admission_router(const router_config& c) {
  validate(c);
  router<Gating, selection::top_k, router_max_k> r;
  r.top_k = c.top_k;
  r.normalize = c.normalize;
  r.scaling_factor = c.scaling_factor;
  return r;
}

// Whether admission's renormalisation applies (backward_args::renormalize).
inline bool renormalizes(const admission_config& a) {
  return !a.dropless && a.overflow == overflow_kind::drop && a.renormalize;
}

}  // namespace moe_route::runtime
