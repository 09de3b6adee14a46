"""moe_route: Mixture-of-Experts router policies (gating, selection, Router Prior
Bias, penalties, CIPHER-style admission, expert choice) with fused, deterministic
forward and backward, as PyTorch ops and modules. See docs/python.md."""

import torch  # noqa: F401  (first: it loads the libtorch symbols that _C resolves at import)

from . import _C, _ops, prior  # noqa: F401  (_ops: the operators' fakes and autograd)
from .balance import GlobalLoadBalance
from .config import GATINGS, PENALTIES, PRIORS, SELECTIONS, Admission, RouterConfig
from .functional import (Dispatch, ExpertChoiceResult, RouteResult, dispatch, expert_choice, route, router_l2,
                         select_experts, update_expert_bias)
from .modules import Router

with_cuda = bool(_C.with_cuda)
router_max_k = int(_C.router_max_k)


def cpu_isa() -> str:
    """The instruction set the CPU operators run with: "x86-64-v3" (AVX2 + FMA) where
    the CPU has it, else "baseline"; the environment variable MOE_ROUTE_CPU_ISA
    (baseline, x86-64-v3) forces one. Every path gives the same bits (docs/python.md)."""
    return _C.cpu_isa()


__all__ = ["Admission", "Dispatch", "ExpertChoiceResult", "GATINGS", "GlobalLoadBalance", "PENALTIES", "PRIORS",
           "Router", "RouteResult", "cpu_isa", "RouterConfig", "SELECTIONS", "dispatch", "expert_choice",
           "router_max_k", "prior", "route", "router_l2", "select_experts", "update_expert_bias", "with_cuda"]
