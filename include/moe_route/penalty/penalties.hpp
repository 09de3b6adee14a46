// moe_route: every penalty (auxiliary loss). docs/policies.md section 5.
#pragma once

#include <moe_route/penalty/kl_to_base.hpp>
#include <moe_route/penalty/load_balance.hpp>
#include <moe_route/penalty/locality.hpp>
#include <moe_route/penalty/logit_l2.hpp>
#include <moe_route/penalty/router_l2.hpp>
#include <moe_route/penalty/z_loss.hpp>
