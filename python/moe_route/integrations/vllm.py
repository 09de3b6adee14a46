"""The library's decode routing as the custom routing function of vLLM's
FusedMoE (and SGLang's select_experts, which takes the same signature):
routing_function(config) returns f(hidden_states=, gating_output=, topk=,
renormalize=) -> (topk_weights float32 [N, K], topk_ids int32 [N, K]),
computed by the select_experts operator (docs/integration.md)."""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ..config import RouterConfig
from ..functional import select_experts


def routing_function(config: RouterConfig, *, expert_bias: Optional[torch.Tensor] = None,
                     threads: Optional[int] = None) -> Callable[..., Tuple[torch.Tensor, torch.Tensor]]:
    """A custom_routing_function routing with `config`. The engine's topk and
    renormalize must be the configuration's (ValueError naming them otherwise),
    so the engine's own bookkeeping agrees with what the library computes."""
    if not isinstance(config, RouterConfig):
        raise TypeError(f"moe_route: config must be a RouterConfig, got {type(config).__name__}")
    normalizes = config.normalizes

    def route_tokens(hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
                     renormalize: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        if topk != config.top_k:
            raise ValueError(f"moe_route: the engine asks for topk={topk}, the RouterConfig has top_k={config.top_k}")
        if bool(renormalize) != normalizes:
            raise ValueError(f"moe_route: the engine asks for renormalize={renormalize}, the RouterConfig "
                             f"normalizes={normalizes}")
        return select_experts(gating_output, config, expert_bias=expert_bias, threads=threads)

    return route_tokens
