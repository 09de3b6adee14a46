// moe_route: routers of published models. Each preset is a router value whose
// parameters come from the model's released configuration (cited per preset);
// every field can be changed afterwards. E is a property of the logits, not of
// the router: each preset names the E of its model as `<preset>_experts`.
#pragma once

#include <moe_route/gating/sigmoid.hpp>
#include <moe_route/gating/softmax.hpp>
#include <moe_route/gating/softmax_after_topk.hpp>
#include <moe_route/gating/sqrt_softplus.hpp>
#include <moe_route/router.hpp>
#include <moe_route/selection/expert_bias.hpp>
#include <moe_route/selection/group_limited.hpp>
#include <moe_route/selection/top_k.hpp>

namespace moe_route::presets {

// DeepSeek-V2-Lite (config.json: n_routed_experts 64, num_experts_per_tok 6,
// scoring_func "softmax", topk_method "greedy", norm_topk_prob false,
// routed_scaling_factor 1.0).
using deepseek_v2_lite_router = router<gating::softmax, selection::top_k, 8>;
inline constexpr int deepseek_v2_lite_experts = 64;
inline deepseek_v2_lite_router deepseek_v2_lite() {
  deepseek_v2_lite_router r;
  r.top_k = 6;
  r.normalize = false;
  r.scaling_factor = 1.0f;
  return r;
}

// Moonlight-16B-A3B (config.json: n_routed_experts 64, num_experts_per_tok 6,
// scoring_func "sigmoid", topk_method "noaux_tc", n_group 1, topk_group 1,
// norm_topk_prob true, routed_scaling_factor 2.446). The e_score_correction_bias
// is the expert bias.
using moonlight_router = router<gating::sigmoid, selection::expert_bias, 8>;
inline constexpr int moonlight_experts = 64;
inline moonlight_router moonlight() {
  moonlight_router r;
  r.top_k = 6;
  r.normalize = true;
  r.scaling_factor = 2.446f;
  return r;
}

// DeepSeek-V3 (config.json: n_routed_experts 256, num_experts_per_tok 8,
// scoring_func "sigmoid", topk_method "noaux_tc", n_group 8, topk_group 4,
// norm_topk_prob true, routed_scaling_factor 2.5; group score = sum of the two
// best biased scores of the group, as in the reference implementation).
using deepseek_v3_router = router<gating::sigmoid, selection::group_limited<selection::expert_bias>, 8>;
inline constexpr int deepseek_v3_experts = 256;
inline deepseek_v3_router deepseek_v3() {
  deepseek_v3_router r;
  r.top_k = 8;
  r.selection.groups = 8;
  r.selection.top_groups = 4;
  r.selection.per_group_k = 2;
  r.normalize = true;
  r.scaling_factor = 2.5f;
  return r;
}

// Qwen3 MoE (Qwen3-30B-A3B and Qwen3-235B-A22B config.json: num_experts 128,
// num_experts_per_tok 8, norm_topk_prob true; softmax router).
using qwen3_router = router<gating::softmax, selection::top_k, 8>;
inline constexpr int qwen3_experts = 128;
inline qwen3_router qwen3() {
  qwen3_router r;
  r.top_k = 8;
  r.normalize = true;
  return r;
}

// Mixtral-8x7B (config.json: num_local_experts 8, num_experts_per_tok 2; the
// reference implementation takes top-2 of the logits and softmaxes those two).
using mixtral_router = router<gating::softmax_after_topk, selection::top_k, 2>;
inline constexpr int mixtral_experts = 8;
inline mixtral_router mixtral() {
  mixtral_router r;
  r.top_k = 2;
  return r;
}

// DeepSeek-V4-Flash (config.json: n_routed_experts 256, num_experts_per_tok 6,
// scoring_func "sqrtsoftplus", topk_method "noaux_tc", norm_topk_prob true,
// routed_scaling_factor 1.5).
using deepseek_v4_router = router<gating::sqrt_softplus, selection::expert_bias, 8>;
inline constexpr int deepseek_v4_experts = 256;
inline deepseek_v4_router deepseek_v4() {
  deepseek_v4_router r;
  r.top_k = 6;
  r.normalize = true;
  r.scaling_factor = 1.5f;
  return r;
}

}  // namespace moe_route::presets
