// moe_route: Router Prior Bias tools (RPB): prepare, build, shuffle, validate.
#pragma once

#include <moe_route/prior/build.hpp>
#include <moe_route/prior/prepare.hpp>
#include <moe_route/prior/shuffle.hpp>
#include <moe_route/prior/shuffle_validation.hpp>
