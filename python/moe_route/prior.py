"""The Router Prior Bias prior (RPB §3): build it from a frozen base router's
logits, then prepare it (clamp, renormalise, centred log) for routing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from ._ops import ops
from .functional import _as_logits, _threads


@dataclass
class PreparedPrior:
    bias: torch.Tensor  # [S, E] centred log prior b (route's prior_bias)
    probs: torch.Tensor  # [S, E] clamped, renormalised prior (route's prior_probs, for kl_to_base)
    upper_clamped: int
    lower_clamped: int


def prepare(pi: torch.Tensor, *, epsilon: float = 0.05, cap: float = 5.0) -> PreparedPrior:
    """Clamp each row of pi [S, E] to [epsilon/E, cap/E], renormalise, take the centred log."""
    bias, probs, report = ops.prior_prepare(pi, float(epsilon), float(cap))
    upper, lower = report.tolist()
    return PreparedPrior(bias, probs, upper, lower)


def build(logits: torch.Tensor, rows: torch.Tensor, num_rows: int, gating: str = "softmax", *,
          threads: Optional[int] = None):
    """pi[r] = mean of the base router's routing distribution over the tokens with
    rows[t] == r (rows[t] = -1: left out). Returns (pi [S, E], empty rows); the
    empty rows are read back from the device. CPU tensors use `threads` threads
    (default: torch.get_num_threads()); the result is the same for any count."""
    pi, row_tokens = ops.prior_build(_as_logits(logits).detach(), rows, int(num_rows), gating, _threads(threads))
    return pi, torch.nonzero(row_tokens == 0).flatten().tolist()
