"""torch.nn modules over the functional ops."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from . import prior as _prior
from .config import Admission, RouterConfig
from .functional import RouteResult, route, select_experts, update_expert_bias


class Router(nn.Module):
    """A MoE router layer: logits = x W^T, then the library's routing, optional
    admission and the dispatch metadata.

    Holds the router weight [E, d], the expert bias (a buffer, for expert_bias
    selections, updated with update_expert_bias) and the prepared prior (buffers,
    set with set_prior). In eval mode the prior and penalties are off.
    """

    def __init__(self, hidden_size: int, num_experts: int, config: RouterConfig,
                 admission: Optional[Admission] = None, *, dtype=None, device=None):
        super().__init__()
        if not isinstance(config, RouterConfig):
            raise TypeError(f"moe_route: config must be a RouterConfig, got {type(config).__name__}")
        if num_experts < config.top_k:
            raise ValueError(f"moe_route: num_experts (= {num_experts}) must be >= top_k (= {config.top_k})")
        self.config = config
        self.admission = admission
        self.num_experts = num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device)
                             if config.uses_expert_bias else None)
        self.register_buffer("prior_bias", None)
        self.register_buffer("prior_probs", None)

    def set_prior(self, pi: torch.Tensor, *, epsilon: float = 0.05, cap: float = 5.0) -> _prior.PreparedPrior:
        """Prepare the prior pi [S, E] (prior.build) and keep it for routing."""
        prepared = _prior.prepare(pi, epsilon=epsilon, cap=cap)
        self.prior_bias, self.prior_probs = prepared.bias, prepared.probs
        return prepared

    def update_expert_bias(self, loads: torch.Tensor) -> None:
        """One aux-loss-free step from per-expert loads (e.g. result.tokens_per_expert,
        all-reduced over data-parallel ranks by the caller)."""
        if self.expert_bias is None:
            raise ValueError(f"moe_route: selection '{self.config.selection}' has no expert bias")
        update_expert_bias(self.expert_bias, loads, self.config.bias_update_rate)

    def forward(self, hidden: torch.Tensor, **kwargs) -> RouteResult:
        """Route hidden states [..., d]; keyword arguments go to moe_route.route
        (token_prior_row, sequence_ids, load_fractions, expert_rank, rank, group_ids, ...)."""
        x = hidden.reshape(-1, hidden.shape[-1])
        logits = nn.functional.linear(x, self.weight)
        if self.admission is not None and self.admission.needs_norms:
            kwargs.setdefault("hidden_norms", x.detach().float().norm(dim=1))
            kwargs.setdefault("weight_norms", self.weight.detach().float().norm(dim=1))
        return route(logits, self.config, training=self.training, expert_bias=self.expert_bias,
                     prior_bias=self.prior_bias, prior_probs=self.prior_probs, admission=self.admission, **kwargs)

    def select_experts(self, hidden: torch.Tensor, token_mask: Optional[torch.Tensor] = None):
        """Inference routing of hidden states [..., d] (moe_route.select_experts):
        (gates [N, K] float32, indices [N, K] int32), as forward() in eval mode
        gives them. Call under torch.no_grad() or torch.inference_mode()."""
        logits = nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]), self.weight)
        return select_experts(logits, self.config, expert_bias=self.expert_bias, token_mask=token_mask)
