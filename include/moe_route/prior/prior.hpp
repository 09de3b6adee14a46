// moe_route: Router Prior Bias tools (RPB): prepare, build, shuffle, validate.
#pragma once

#include "build.hpp"
#include "prepare.hpp"
#include "shuffle.hpp"
#include "validation.hpp"
