// moe_route: admission on the CPU (docs/policies.md section 4; admission/admission.hpp
// defines the policies, admission/gates.hpp the gate rule).
//
//   cpu::admit(router, policy, admission_inputs, admission_outputs, execution)
//   cpu::admission_backward(router, policy, route_inputs, admission_backward_args, execution)
//
// admit runs after cpu::route / cuda::route on the same logits. It is the
// reference the CUDA backend (backend/cuda/admit.cuh) matches bit for bit:
// decisions come from exact fp32 affinities packed with the token index into
// 64-bit keys (affinity desc, token asc); the candidates of each (group,
// expert) are gathered by a counting sort and cut at the capacity with
// nth_element (the keys are distinct, so the kept set is unique). Any thread
// count gives the same bits.
#pragma once

#include <moe_route/admission/admission.hpp>
#include <moe_route/admission/detail/validate.hpp>
#include <moe_route/backend/cpu/backward.hpp>
#include <moe_route/backend/cpu/detail/admission.hpp>
#include <moe_route/backend/cpu/execution.hpp>
#include <moe_route/router.hpp>
#include <moe_route/types.hpp>

namespace moe_route::cpu {

// Admission after token-choice routing. Writes out.indices, out.gates (and
// out.status, out.report if set) for every slot; returns the report.
// Throws moe_route::error, writing nothing, if an argument is invalid
// (including routed indices outside [0, E) or repeated within a token, group
// ids outside [0, num_groups), negative capacities, and non-finite or
// non-positive norms with cosine affinity).
template <class Router, class Policy, class T>
admission_report admit(const Router& r, const Policy& p, const admission_inputs<T>& in, const admission_outputs& out,
                       execution ex = {}) {
  admission::detail::validate_admission(r, p, in, out);
  admission::detail::validate_admission_data(r, p, in);
  return admission_detail::admit(r, p, in, out, ex);
}

// The backward of admitted gates: dL/dz [N x E] (overwritten) from
// dL/d(admitted gates) [N x K], recomputing everything from the logits, the
// routed indices and the admitted indices (admission/gates.hpp). For tokens
// that lost nothing it gives the bits of cpu::backward. The policy supplies
// renormalize (drop) - nothing else of it is used. It is cpu::backward with
// backward_args::admitted_indices and renormalize set.
template <class Router, class Policy, class T>
void admission_backward(const Router& r, const Policy& p, const route_inputs<T>& in,
                        const admission_backward_args& args, execution ex = {}) {
  static_assert(is_router<Router>, "cpu::admission_backward: the first argument must be a moe_route::router");
  admission::detail::validate_policy(p);
  if (in.num_tokens > 0 && args.admitted_indices == nullptr) moe_route::detail::fail("admitted_indices is null");
  backward_args b;
  b.indices = args.routed_indices;
  b.admitted_indices = args.admitted_indices;
  b.renormalize = admission::renormalizes(p);
  b.grad_gates = args.grad_gates;
  b.grad_logits = args.grad_logits;
  backward(r, in, b, ex);
}

}  // namespace moe_route::cpu
