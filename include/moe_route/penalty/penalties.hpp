// moe_route: every penalty (auxiliary loss). POLICIES.md section 5.
#pragma once

#include "kl_to_base.hpp"
#include "load_balance.hpp"
#include "load_fractions.hpp"
#include "locality.hpp"
#include "logit_l2.hpp"
#include "router_l2.hpp"
#include "workspace.hpp"
#include "z_loss.hpp"
