// moe_route: the CUDA umbrella header. Everything in moe_route.hpp (policies,
// router, presets, CPU backend) plus the CUDA backend, moe_route::cuda.
// Include from .cu files compiled by nvcc (target moe_route::cuda).
#pragma once

#include <moe_route/backend/cuda/admit.cuh>
#include <moe_route/backend/cuda/dispatch.cuh>
#include <moe_route/backend/cuda/expert_choice.cuh>
#include <moe_route/backend/cuda/prior_build.cuh>
#include <moe_route/backend/cuda/route.cuh>
#include <moe_route/backend/cuda/router_l2.cuh>
#include <moe_route/moe_route.hpp>
