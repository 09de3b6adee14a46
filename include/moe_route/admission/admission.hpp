// moe_route: capacity / admission policies (docs/policies.md section 4, CIPHER §3.2).
//
// Admission runs after token-choice routing (cpu::route / cuda::route wrote the
// routed indices [N x K] and gates [N x K]). Each expert e of each admission
// group g looks at its candidate pool
//
//     P_e = { (t, k) : routed[t, k] = e, group(t) = g }
//
// and keeps T_e = the top min(C_e, |P_e^tau|) of P_e^tau = { a(t, e) >= tau } by
// affinity a, ties to the lower token index (CIPHER eq. 5). The rejection of
// (t, e) never removes t's other experts. Rejected slots are dropped, or
// offered to other experts in deterministic reroute rounds.
//
// An admission policy is a value of type policy<Affinity, Overflow>:
//   affinity  position | probability | gate | logit | cosine (compile time)
//   threshold tau (assignments with a < tau are rejected; -inf: none)
//   capacity  C_e = max(min_capacity, ceil(N_g * K / E * capacity_factor)),
//             N_g = tokens of the group, or a caller per-expert array
//             (admission_inputs::capacity, the same C_e in every group)
//   overflow  drop{renormalize} | reroute{fill_factor, max_rounds}
// plus dropless_policy (no admission). The presets at the end of this file name
// the policies of docs/policies.md section 4.
//
// The gate of every slot after admission is defined in admission/gates.hpp;
// the backends are backend/cpu/admit.hpp and backend/cuda/admit.cuh.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include <moe_route/config.hpp>
#include <moe_route/detail/numerics.hpp>

namespace moe_route::admission {

// ---------------------------------------------------------------------------
// Affinity a(t, e): how an expert ranks the tokens that offer themselves.
// All values are exact fp32 computed with detail:: math, identical on both
// backends, from the sanitised logit v = sanitize(z) (NaN -> -inf, +-inf ->
// +-FLT_MAX).

enum class affinity_kind { position, probability, logit, cosine, gate };

// Earlier token first (GShard / Switch "position" policy). Expert-independent,
// so it cannot choose a reroute target and has no value to threshold: a policy
// with position affinity must keep threshold = -inf.
struct position {
  static constexpr affinity_kind kind = affinity_kind::position;
  static constexpr bool needs_norms = false;
  static constexpr bool ranks_experts = false;
  static constexpr const char* name = "position";
};

// The gating score s_{t,e} of the router (softmax: the full softmax; sigmoid,
// sqrt_softplus: the elementwise score; softmax_after_topk: the full softmax of
// the logits, i.e. the gating's distribution). Megatron's "probs" drop policy.
struct probability {
  static constexpr affinity_kind kind = affinity_kind::probability;
  static constexpr bool needs_norms = false;
  static constexpr bool ranks_experts = true;
  static constexpr const char* name = "probability";
};

// The gate the router gave the slot (route_outputs::gates: after its
// normalisation and scaling), as Megatron's "probs" drop policy ranks under
// any router. It exists for routed slots only, so like position it cannot
// choose a reroute target.
struct gate {
  static constexpr affinity_kind kind = affinity_kind::gate;
  static constexpr bool needs_norms = false;
  static constexpr bool ranks_experts = false;
  static constexpr const char* name = "gate";
};

// The sanitised logit z_{t,e}.
struct logit {
  static constexpr affinity_kind kind = affinity_kind::logit;
  static constexpr bool needs_norms = false;
  static constexpr bool ranks_experts = true;
  static constexpr const char* name = "logit";
};

// c_{t,e} = z_{t,e} / (||x_t|| * ||w_e||) (CIPHER eq. 4), from the raw, unbiased
// logits and caller-supplied norms (admission_inputs::hidden_norms [N] and
// weight_norms [E]; both must be finite and > 0). Computed as
// div(sanitize(z), hidden_norm * weight_norm): one rounded product, one
// rounded division. A router bias term, if the host model has one, is the
// caller's to remove from z.
struct cosine {
  static constexpr affinity_kind kind = affinity_kind::cosine;
  static constexpr bool needs_norms = true;
  static constexpr bool ranks_experts = true;
  static constexpr const char* name = "cosine";
};

template <class A>
inline constexpr bool is_affinity = false;
template <>
inline constexpr bool is_affinity<position> = true;
template <>
inline constexpr bool is_affinity<probability> = true;
template <>
inline constexpr bool is_affinity<logit> = true;
template <>
inline constexpr bool is_affinity<cosine> = true;
template <>
inline constexpr bool is_affinity<gate> = true;

// ---------------------------------------------------------------------------
// Overflow: what happens to a rejected slot.

// CIPHER-strict: a rejected slot gets index -1 and gate 0. With `renormalize`,
// a token that lost at least one slot has its surviving gates rescaled so they
// sum to the token's original gate sum (admission/gates.hpp gives the exact
// rule). A token with every slot dropped has zero routed output.
struct drop {
  static constexpr bool reroutes = false;
  bool renormalize = false;
};

// CIPHER-reroute: every strictly accepted slot is kept; rejected slots are
// offered to other experts in rounds 1..max_rounds (max_rounds < 0: K rounds).
// In a round, every pending slot (t, k), in slot order within its token,
// proposes the expert e' with the highest affinity a(t, e') (ties: lower
// expert index) such that
//   a(t, e') >= tau,
//   e' is not held by t (a kept or rerouted slot of t) and not proposed by an
//      earlier pending slot of t in this round,
//   load(g, e') < limit(g, e') = min(F_g, C_e) at the start of the round, where
//      F_g = ceil(N_g * K / E * fill_factor) is the fill target.
// An expert at its limit rejects every proposal, and every expert that ever
// rejected t is at its limit or below tau for t, so this is exactly "not yet
// tried" of docs/policies.md §4 with the pointless proposals skipped. Each expert
// accepts its proposals in (affinity desc, token asc) order while load <
// limit; the rest stay pending. A slot with no eligible expert, or still
// pending after max_rounds, is dropped (gate 0, index -1). Hence T_e^S is a
// subset of T_e^R and |T_e^R| <= C_e (CIPHER eq. 27); no token holds an expert
// twice; every decision is a function of the inputs only.
struct reroute {
  static constexpr bool reroutes = true;
  double fill_factor = 4.0;
  int max_rounds = -1;  // < 0: K (the router's top_k)
};

template <class O>
inline constexpr bool is_overflow = false;
template <>
inline constexpr bool is_overflow<drop> = true;
template <>
inline constexpr bool is_overflow<reroute> = true;

// ---------------------------------------------------------------------------
// The policy.

template <class Affinity, class Overflow>
struct policy {
  static_assert(is_affinity<Affinity>,
                "admission::policy<Affinity, Overflow>: Affinity must be position, probability, logit or cosine");
  static_assert(is_overflow<Overflow>, "admission::policy<Affinity, Overflow>: Overflow must be drop or reroute");
  static_assert(!(Overflow::reroutes && !Affinity::ranks_experts),
                "admission::policy<position, reroute>: position affinity ranks tokens, not experts, so it cannot "
                "choose a reroute target; use probability, logit or cosine affinity with reroute");

  using affinity_type = Affinity;
  using overflow_type = Overflow;
  static constexpr bool is_cross_token = true;
  static constexpr bool is_dropless = false;
  static constexpr bool needs_norms = Affinity::needs_norms;
  static constexpr bool reroutes = Overflow::reroutes;

  float threshold = -std::numeric_limits<float>::infinity();  // tau
  double capacity_factor = 1.0;                               // C_e = max(min_capacity, ceil((N_g K / E) cf))
  std::int64_t min_capacity = 0;
  Overflow overflow{};
};

// No admission: the routed indices and gates pass through unchanged.
struct dropless_policy {
  static constexpr bool is_cross_token = false;
  static constexpr bool is_dropless = true;
  static constexpr bool needs_norms = false;
  static constexpr bool reroutes = false;
};

template <class P>
inline constexpr bool is_policy = false;
template <class A, class O>
inline constexpr bool is_policy<policy<A, O>> = true;
template <>
inline constexpr bool is_policy<dropless_policy> = true;

// Whether a policy rescales the survivors of a token that lost a slot.
template <class P>
constexpr bool renormalizes(const P& p) {
  if constexpr (P::is_dropless) {
    (void)p;
    return false;
  } else if constexpr (P::reroutes) {
    (void)p;
    return false;
  } else {
    return p.overflow.renormalize;
  }
}

// ---------------------------------------------------------------------------
// Per-slot status after admission (the optional admission_outputs::status).
// It is also a function of (routed index, admitted index): dropped if the
// admitted index is -1, kept if it equals the routed index, rerouted otherwise.
enum class slot_status : std::int8_t { kept = 0, dropped = 1, rerouted = 2 };

MOE_ROUTE_HD slot_status status_of(std::int32_t routed, std::int32_t admitted) {
  return admitted < 0 ? slot_status::dropped : (admitted == routed ? slot_status::kept : slot_status::rerouted);
}

namespace detail {

// Internal per-slot state shared by the backends: the low two bits are the
// status (slot_status, or pending during reroute rounds), the others record
// why the strict pass rejected the slot.
inline constexpr std::uint8_t state_kept = 0;
inline constexpr std::uint8_t state_dropped = 1;
inline constexpr std::uint8_t state_rerouted = 2;
inline constexpr std::uint8_t state_pending = 3;
inline constexpr std::uint8_t state_status_mask = 3;
inline constexpr std::uint8_t state_below_threshold = 4;
inline constexpr std::uint8_t state_over_capacity = 8;
inline constexpr std::uint8_t state_invalid = 16;
inline constexpr std::uint8_t state_masked = 32;  // a padding token's slot: dropped, in no report count

}  // namespace detail

}  // namespace moe_route::admission

namespace moe_route {

// What a call did. The CPU backend returns it; the CUDA backend writes it to a
// device pointer (admission_outputs::report), overwriting it.
struct admission_report {
  std::int64_t offered = 0;                 // N * K routed slots, less those of padding tokens
  std::int64_t kept = 0;                    // accepted by the strict pass (the T_e^S)
  std::int64_t rerouted = 0;                // accepted in a reroute round
  std::int64_t dropped = 0;                 // final index -1, gate 0
  std::int64_t below_threshold = 0;         // strict-pass rejections by tau
  std::int64_t over_capacity = 0;           // strict-pass rejections by capacity
  std::int64_t tokens_without_experts = 0;  // tokens with every slot dropped
  // CUDA only (the CPU backend throws instead): slots dropped because their
  // routed index was outside [0, E), their group id outside [0, num_groups),
  // or (cosine) a norm was not finite and > 0.
  std::int64_t invalid = 0;
};

// Inputs of admit(). All pointers are caller-owned, in the memory space of the
// backend called (host for cpu::, device for cuda::).
template <class T>
struct admission_inputs {
  const T* logits = nullptr;                     // [N x E] the logits the router saw (raw, unbiased)
  std::int64_t num_tokens = 0;                   // N, with N * K < 2^31 - 1
  int num_experts = 0;                           // E
  const std::int32_t* routed_indices = nullptr;  // [N x K] from route (distinct per token)
  const float* routed_gates = nullptr;           // [N x K] from route, for the same logits
  const float* hidden_norms = nullptr;           // [N] ||x_t||, cosine affinity only
  const float* weight_norms = nullptr;           // [E] ||w_e||, cosine affinity only
  const std::int32_t* group_ids = nullptr;       // [N] admission group in [0, num_groups); null: one group
  int num_groups = 1;                            // G >= 1, G * E < 2^31 - 1
  const std::int64_t* capacity = nullptr;        // [E] C_e >= 0 for every group; null: capacity_factor rule
  const std::uint8_t* token_mask = nullptr;      // [N] 0: a padding token, its slots -1 and unread; null: all valid
};

// Outputs of admit(), written for every slot.
struct admission_outputs {
  std::int32_t* indices = nullptr;     // [N x K] the admitted expert, -1 = dropped (rerouted: the new expert)
  float* gates = nullptr;              // [N x K] admitted gates (admission/gates.hpp)
  std::int8_t* status = nullptr;       // [N x K] optional: slot_status
  admission_report* report = nullptr;  // optional (CUDA: a device pointer, overwritten)
};

// Inputs of the backward of admitted gates (cpu::admission_backward): the
// routed and admitted indices of the forward and dL/d(admitted gates).
struct admission_backward_args {
  const std::int32_t* routed_indices = nullptr;    // [N x K] route's indices
  const std::int32_t* admitted_indices = nullptr;  // [N x K] admit's indices
  const float* grad_gates = nullptr;               // [N x K] dL/d(admitted gates)
  float* grad_logits = nullptr;                    // [N x E] dL/dz, overwritten
};

}  // namespace moe_route

namespace moe_route::admission {

// C = max(min_capacity, ceil((tokens * top_k / num_experts) * factor)) in
// double, in Megatron-LM's order (get_capacity: ceil(num_tokens / num_experts *
// capacity_factor) with num_tokens = N K), so a factor written as a decimal
// (0.3, 1.25) gives the integer a Python implementation gets. IEEE double
// divide and multiply and an exact ceil: both backends get the same integer.
// Also the fill target F (min_capacity = 0).
MOE_ROUTE_HD std::int64_t capacity_from_factor(double factor, std::int64_t min_capacity, std::int64_t tokens,
                                               int top_k, int num_experts) {
  const double x = static_cast<double>(tokens * top_k) / static_cast<double>(num_experts) * factor;
#if defined(__CUDA_ARCH__)
  double c = ::ceil(x);
#else
  double c = std::ceil(x);
#endif
  if (!(c < 9.0e18)) c = 9.0e18;  // factor is finite: only astronomically large values clamp
  if (!(c > 0.0)) c = 0.0;
  const std::int64_t v = static_cast<std::int64_t>(c);
  return v < min_capacity ? min_capacity : v;
}

// The 64-bit key by which an expert ranks its candidates: affinity descending,
// then token ascending (detail::pack_key with the token as the index; tokens
// are < 2^31). 0 is below every key.
MOE_ROUTE_HD std::uint64_t rank_key(float affinity, std::int64_t token) {
  return moe_route::detail::pack_key(affinity, static_cast<int>(token));
}

// ---------------------------------------------------------------------------
// Presets (docs/policies.md section 4). tau is the affinity threshold; capacity and
// fill factors are multiples of the uniform load N_g * K / E.

// CIPHER-strict: cosine affinity, threshold tau, capacity factor 8, drop.
inline policy<cosine, drop> cipher_strict(float tau, double capacity_factor = 8.0) {
  policy<cosine, drop> p;
  p.threshold = tau;
  p.capacity_factor = capacity_factor;
  return p;
}

// CIPHER-reroute: cosine, tau, capacity factor 8, fill target factor 4, reroute
// for K rounds.
inline policy<cosine, reroute> cipher_reroute(float tau, double capacity_factor = 8.0, double fill_factor = 4.0) {
  policy<cosine, reroute> p;
  p.threshold = tau;
  p.capacity_factor = capacity_factor;
  p.overflow.fill_factor = fill_factor;
  return p;
}

// LocMoE: cosine affinity, tau = 0.01 (the value CIPHER §A.5 adopts), a
// capacity factor, drop.
inline policy<cosine, drop> locmoe(double capacity_factor, float tau = 0.01f) {
  policy<cosine, drop> p;
  p.threshold = tau;
  p.capacity_factor = capacity_factor;
  return p;
}

// GShard / Switch: earliest tokens first, no threshold, drop.
inline policy<position, drop> capacity_position(double capacity_factor, std::int64_t min_capacity = 0) {
  policy<position, drop> p;
  p.capacity_factor = capacity_factor;
  p.min_capacity = min_capacity;
  return p;
}

// Highest gating score first, no threshold, drop: Megatron-LM's drop_policy
// "probs" under moe_router_pre_softmax=True.
inline policy<probability, drop> capacity_probs(double capacity_factor, std::int64_t min_capacity = 0) {
  policy<probability, drop> p;
  p.capacity_factor = capacity_factor;
  p.min_capacity = min_capacity;
  return p;
}

// Highest routed gate first, no threshold, drop: Megatron-LM's drop_policy
// "probs" under any router (its default ranks the normalised top-k gate).
inline policy<gate, drop> capacity_gate(double capacity_factor, std::int64_t min_capacity = 0) {
  policy<gate, drop> p;
  p.capacity_factor = capacity_factor;
  p.min_capacity = min_capacity;
  return p;
}

// No admission (MegaBlocks-style dropless execution).
inline dropless_policy dropless() { return {}; }

}  // namespace moe_route::admission
