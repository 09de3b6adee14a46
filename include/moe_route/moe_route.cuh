// moe_route: the CUDA umbrella header. Everything in moe_route.hpp (policies,
// router, presets, CPU backend) plus the CUDA backend, moe_route::cuda.
// Include from .cu files compiled by nvcc (target moe_route::cuda).
#pragma once

#include "moe_route.hpp"
#include "backend/cuda/route.cuh"
#include "backend/cuda/admission.cuh"
#include "backend/cuda/expert_choice.cuh"
#include "backend/cuda/dispatch_metadata.cuh"
#include "backend/cuda/prior_build.cuh"
#include "backend/cuda/router_l2.cuh"
