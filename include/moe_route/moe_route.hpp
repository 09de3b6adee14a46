// moe_route: the host umbrella header (policies, router, presets, training
// machinery, admission, prior tools, the CPU backend). Compiles with any C++17
// host compiler; no CUDA toolkit needed. The layers, lowest first, are in
// tools/check_layers/layers.txt (docs/development.md).
#pragma once

#include <moe_route/admission/admission.hpp>
#include <moe_route/admission/dispatch.hpp>
#include <moe_route/analysis/capacity_bounds.hpp>
#include <moe_route/analysis/signal_retention.hpp>
#include <moe_route/analysis/workload.hpp>
#include <moe_route/backend/cpu/admit.hpp>
#include <moe_route/backend/cpu/backward.hpp>
#include <moe_route/backend/cpu/dispatch.hpp>
#include <moe_route/backend/cpu/expert_choice.hpp>
#include <moe_route/backend/cpu/isa.hpp>
#include <moe_route/backend/cpu/route.hpp>
#include <moe_route/conditions.hpp>
#include <moe_route/config.hpp>
#include <moe_route/gating/sigmoid.hpp>
#include <moe_route/gating/softmax.hpp>
#include <moe_route/gating/softmax_after_topk.hpp>
#include <moe_route/gating/sqrt_softplus.hpp>
#include <moe_route/penalty/penalties.hpp>
#include <moe_route/presets.hpp>
#include <moe_route/prior/policy.hpp>
#include <moe_route/prior/prior.hpp>
#include <moe_route/router.hpp>
#include <moe_route/selection/expert_bias.hpp>
#include <moe_route/selection/expert_choice.hpp>
#include <moe_route/selection/fixed.hpp>
#include <moe_route/selection/by_score.hpp>
#include <moe_route/selection/group_limited.hpp>
#include <moe_route/selection/top_k.hpp>
#include <moe_route/training/load_fractions.hpp>
#include <moe_route/training/workspace.hpp>
#include <moe_route/types.hpp>
