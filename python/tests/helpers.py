"""Comparisons of the extension against the reference, shared by the tests.

Tolerances (float32 library against the float64 reference):
  gates and penalty values  rtol 1e-5, atol 1e-6
  dL/dlogits                rtol 1e-5, atol 2e-6 (times max(1, max |reference|))
Indices must be exactly equal.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

import moe_route as mr
import reference as ref

GATE_TOL = dict(rtol=1e-5, atol=1e-6)
VALUE_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_RTOL, GRAD_ATOL = 1e-5, 2e-6
PENALTY_UPSTREAM = torch.tensor([3.0, 3.0, 3.0, 3.0, 3.0])  # loss = sum(gates * w) + 3 * sum(penalties)

GATINGS = ("softmax", "sigmoid", "sqrt_softplus", "softmax_after_topk")


def fields(cfg) -> dict:
    return dataclasses.asdict(cfg)


def assert_close(got: torch.Tensor, want: torch.Tensor, **tol):
    torch.testing.assert_close(got.detach().double(), want.detach().double(), **tol)


def assert_grad(got: torch.Tensor, want: torch.Tensor):
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(got.double(), want.double(), rtol=GRAD_RTOL, atol=GRAD_ATOL * scale)


def randn(*shape, scale: float = 1.5, gen: Optional[torch.Generator] = None) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def prepared_prior(num_rows: int, num_experts: int, concentration: float = 1.0):
    """A random prior pi [S, E] (rows sum to 1; the global RNG, seeded per test) and
    moe_route.prior.prepare's result."""
    pi = torch.distributions.Dirichlet(torch.full((num_experts,), concentration)).sample((num_rows,))
    pi = pi.to(torch.float32)
    return pi, mr.prior.prepare(pi)


def compare_route(cfg, z32: torch.Tensor, *, training: bool = True, upstream=None, check_grad: bool = True,
                  penalties: bool = True, **inputs):
    """Route z32 with the extension and the reference; require equal indices and
    close gates, penalty values and dL/dz for loss = sum(gates * w) + 3 * sum(penalties).
    Returns the extension's RouteResult."""
    z = z32.clone().requires_grad_(True)
    res = mr.route(z, cfg, training=training, **inputs)
    z64 = z32.double().requires_grad_(True)
    idx, gates = ref.route(z64, **fields(cfg), training=training, **inputs)
    assert res.indices.dtype == torch.int32
    assert torch.equal(res.indices.long(), idx), f"indices differ:\n{res.indices}\n{idx}"
    assert_close(res.gates, gates, **GATE_TOL)
    values = ref.penalties(z64, idx, **fields(cfg), training=training, **inputs)
    if penalties:
        assert_close(res.penalty_values, values, **VALUE_TOL)
    if check_grad:
        w = torch.randn(idx.shape) if upstream is None else upstream
        loss = (res.gates * w).sum() + (res.penalty_values * PENALTY_UPSTREAM).sum()
        loss.backward()
        ref_loss = (gates * w.double()).sum() + (values * PENALTY_UPSTREAM.double()).sum()
        ref_loss.backward()
        assert z.grad.dtype == z32.dtype
        assert_grad(z.grad, z64.grad)
    return res


def import_engine(module: str):
    """An engine whose own code is a test oracle (megatron.core, transformers,
    torchtitan). scripts/setup.sh installs them and scripts/test.sh requires
    them (MOE_ROUTE_REQUIRE_ENGINES=1), so the suite fails there if one is
    missing; elsewhere, as on the GPU machine, which has none, their tests skip
    visibly."""
    import importlib
    import os

    import pytest

    if os.environ.get("MOE_ROUTE_REQUIRE_ENGINES") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is not installed (scripts/setup.sh installs it)")
