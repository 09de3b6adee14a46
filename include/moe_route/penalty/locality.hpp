// moe_route: the locality loss (LocMoE; CIPHER eq. 9-10). docs/policies.md section 5.
#pragma once

#include <moe_route/penalty/penalty.hpp>

namespace moe_route::penalty {

// One call routes one admission group: the micro-batch of expert-parallel rank
// r = route_inputs::rank, whose local experts are those with
// route_inputs::expert_rank[e] == r. D_c = (1/N) sum_t p(z_t) is the group's
// expert distribution, D_l the fully local target ((1 - eps)/|E_r| on local
// experts, eps/(E - |E_r|) elsewhere; 1/E everywhere when every expert is
// local), and L = lambda * KL(D_c || D_l) = lambda * sum_e D_c,e log(D_c,e / D_l,e)
// (terms with D_c,e = 0 are 0). dL/dp(z_t)_e = (lambda/N) (log(D_c,e / D_l,e) + 1),
// with D_c,e floored at 1e-30 inside the log so the gradient stays finite.
struct locality {
  static constexpr penalty::space space = penalty::space::distribution;
  static constexpr const char* name = "locality";

  float coefficient = 1e-2f;  // lambda_loc
  float epsilon = 1e-3f;      // eps_l, the target mass off the local experts
};

template <>
inline constexpr bool is_penalty<locality> = true;

}  // namespace moe_route::penalty
