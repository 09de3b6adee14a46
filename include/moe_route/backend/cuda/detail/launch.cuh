// moe_route CUDA backend: kernel launch. Picks the register bucket for E (or the
// general path), computes the launch shape from tuning.cuh and the group
// layout, and launches on the caller's stream. Arguments are validated by the
// caller (route.cuh); nothing here allocates or synchronises.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include <moe_route/backend/cuda/detail/agent_common.cuh>
#include <moe_route/backend/cuda/detail/error.cuh>
#include <moe_route/backend/cuda/detail/kernels.cuh>
#include <moe_route/backend/cuda/detail/tuning.cuh>
#include <moe_route/gating/gating.hpp>
#include <moe_route/router.hpp>
#include <moe_route/selection/selection.hpp>
#include <moe_route/selection/top_k.hpp>
#include <moe_route/types.hpp>

namespace moe_route::cuda::detail {

inline unsigned grid_blocks(const tuning::launch_policy& policy, std::int64_t tokens) {
  return static_cast<unsigned>(policy.blocks_for(tokens));
}

template <class Router, class T, int Slots>
void launch_route_bucket(const Router& r, const route_params<T>& p, std::int64_t* nonfinite, cudaStream_t stream) {
  constexpr bool grouped = Router::selection_type::shape == selection::kind::grouped;
  constexpr tuning::launch_policy policy = tuning::route_bucket;
  const std::size_t shared = grouped && p.groups.active
                                 ? static_cast<std::size_t>(policy.warps_per_block) * Slots * warp_threads * sizeof(std::uint64_t)
                                 : 0;
  route_bucket_kernel<Router, T, Slots>
      <<<grid_blocks(policy, p.num_tokens), policy.block_threads(), shared, stream>>>(r, p, nonfinite);
  check_launch("moe_route::cuda::route: launch of the register-bucket kernel");
}

template <class Router, class T>
void launch_route_general(const Router& r, const route_params<T>& p, std::int64_t* nonfinite, cudaStream_t stream) {
  constexpr bool keyed = Router::selection_type::shape != selection::kind::fixed;
  tuning::launch_policy policy = tuning::route_general;
  std::size_t shared = 0;
  if (keyed) {
    const std::size_t per_warp = static_cast<std::size_t>(p.num_experts) * sizeof(std::uint64_t);
    int warps = static_cast<int>(tuning::general_shared_bytes / per_warp);
    warps = warps < 1 ? 1 : (warps > policy.warps_per_block ? policy.warps_per_block : warps);
    policy.warps_per_block = warps;
    shared = per_warp * static_cast<std::size_t>(warps);
  }
  route_general_kernel<Router, T>
      <<<grid_blocks(policy, p.num_tokens), policy.block_threads(), shared, stream>>>(r, p, nonfinite);
  check_launch("moe_route::cuda::route: launch of the general kernel");
}

// The fixed selection needs no keys, only the row's non-finite check (and,
// for row_softmax, its maximum and sum): it streams the row with the general
// kernel at every E. Keyed selections keep the row in registers up to E = 512.
template <class Router, class T>
void launch_route(const Router& r, const route_params<T>& p, std::int64_t* nonfinite, cudaStream_t stream) {
  if constexpr (Router::selection_type::shape == selection::kind::fixed) {
    launch_route_general<Router, T>(r, p, nonfinite, stream);
  } else {
    switch (tuning::bucket_for(p.num_experts)) {
      case 64: launch_route_bucket<Router, T, 2>(r, p, nonfinite, stream); break;
      case 128: launch_route_bucket<Router, T, 4>(r, p, nonfinite, stream); break;
      case 256: launch_route_bucket<Router, T, 8>(r, p, nonfinite, stream); break;
      case 384: launch_route_bucket<Router, T, 12>(r, p, nonfinite, stream); break;
      case 512: launch_route_bucket<Router, T, 16>(r, p, nonfinite, stream); break;
      default: launch_route_general<Router, T>(r, p, nonfinite, stream); break;
    }
  }
}

template <class Router, class T, int Slots>
void launch_backward_bucket(const Router& r, const backward_params<T>& p, cudaStream_t stream) {
  constexpr tuning::launch_policy policy = tuning::backward_bucket;
  backward_bucket_kernel<Router, T, Slots><<<grid_blocks(policy, p.num_tokens), policy.block_threads(), 0, stream>>>(r, p);
  check_launch("moe_route::cuda::backward: launch of the register-bucket kernel");
}

template <class Router, class T>
void launch_backward_general(const Router& r, const backward_params<T>& p, cudaStream_t stream) {
  constexpr tuning::launch_policy policy = tuning::backward_general;
  backward_general_kernel<Router, T><<<grid_blocks(policy, p.num_tokens), policy.block_threads(), 0, stream>>>(r, p);
  check_launch("moe_route::cuda::backward: launch of the general kernel");
}

// The backward depends on the gating, K and the gate parameters (normalize,
// scaling_factor), never on the selection: routers that differ only in their
// selection share one set of backward kernels by running as the equivalent
// router<Gating, top_k, MaxK>. A router field added later that the backward
// needs must be copied here; the size check below catches most additions.
template <class Router>
using backward_router_t = router<typename Router::gating_type, selection::top_k, Router::max_k>;

template <class Router>
backward_router_t<Router> backward_router(const Router& r) {
  struct known_fields {  // the members of router<G, top_k, K> this function copies
    typename Router::gating_type gating;
    selection::top_k selection;
    int top_k;
    bool normalize;
    float scaling_factor;
    moe_route::detail::policy_pack<> policies;  // none: the training policies run in training.cuh
  };
  static_assert(sizeof(backward_router_t<Router>) == sizeof(known_fields),
                "moe_route::router changed: update cuda::detail::backward_router");
  backward_router_t<Router> b;
  b.gating = r.gating;
  b.top_k = r.top_k;
  b.normalize = r.normalize;
  b.scaling_factor = r.scaling_factor;
  return b;
}

// Row-softmax gatings keep the row in registers; the others read only the
// selected logits, so one kernel serves every E. `r` is a backward_router.
template <class Router, class T>
void launch_backward(const Router& r, const backward_params<T>& p, cudaStream_t stream) {
  if constexpr (Router::gating_type::shape == gating::kind::row_softmax) {
    switch (tuning::bucket_for(p.num_experts)) {
      case 64: launch_backward_bucket<Router, T, 2>(r, p, stream); return;
      case 128: launch_backward_bucket<Router, T, 4>(r, p, stream); return;
      case 256: launch_backward_bucket<Router, T, 8>(r, p, stream); return;
      case 384: launch_backward_bucket<Router, T, 12>(r, p, stream); return;
      case 512: launch_backward_bucket<Router, T, 16>(r, p, stream); return;
      default: break;
    }
  }
  launch_backward_general<Router, T>(r, p, stream);
}

}  // namespace moe_route::cuda::detail
