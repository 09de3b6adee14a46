// moe_route: the host umbrella header (policies, router, presets, CPU backend).
// Compiles with any C++17 host compiler; no CUDA toolkit needed.
#pragma once

#include "config.hpp"
#include "types.hpp"
#include "detail/numerics.hpp"
#include "gating/gating.hpp"
#include "gating/softmax.hpp"
#include "gating/sigmoid.hpp"
#include "gating/sqrt_softplus.hpp"
#include "gating/softmax_after_topk.hpp"
#include "selection/selection.hpp"
#include "selection/top_k.hpp"
#include "selection/expert_bias.hpp"
#include "selection/group_limited.hpp"
#include "selection/fixed.hpp"
#include "router.hpp"
#include "presets.hpp"
#include "validate.hpp"
#include "backend/cpu/route.hpp"
