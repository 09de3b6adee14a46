"""A torchtitan router whose routing runs on the library (torchtitan 0.3.0):
MoERouteTokenChoiceTopKRouter is torchtitan's TokenChoiceTopKRouter
(torchtitan.models.common.moe) with forward() on the library's operators, so a
MoE layer built with it is torchtitan's in everything else: the gate linear
(the same parameters and state-dict keys), the expert_bias_E the layer passes
in, the tokens_per_expert_E it counts, the optimizer pre-hook that updates the
bias (docs/integration.md). patch(model) swaps the routers of a built model,
patch_config(config) those of a model's configuration before it is built.
The configuration comes from the router's own fields
(RouterConfig.from_torchtitan), which refuses what the library does not
reproduce."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torchtitan.models.common.moe import TokenChoiceTopKRouter

from .. import _torchtitan
from ..config import RouterConfig
from ..functional import route, select_experts
from ..functional import update_expert_bias as _update_expert_bias


def _configs(router) -> Dict[bool, RouterConfig]:
    """The router's RouterConfig called without (False) and with (True) an expert
    bias: the layer passes one exactly when its load_balance_coeff is set, and
    the coefficient does not change the routing."""
    return {False: RouterConfig(**_torchtitan.router_fields(router, None)),
            True: RouterConfig(**_torchtitan.router_fields(router, 1.0))}


class MoERouteTokenChoiceTopKRouter(TokenChoiceTopKRouter):
    """TokenChoiceTopKRouter whose forward() calls moe_route's operators: with
    grad on, route (differentiable gates); otherwise select_experts. Returns
    what torchtitan's returns: (topk_scores [..., K], topk_expert_ids [..., K]
    int64, scores [..., E]); the experts of a token come in the library's order
    (torchtitan's topk is unsorted), which the MoE layer does not depend on."""

    @dataclass(kw_only=True, slots=True)
    class Config(TokenChoiceTopKRouter.Config):
        threads: Optional[int] = None  # the library's CPU threads (None: torch's)

    def __init__(self, config: TokenChoiceTopKRouter.Config):
        super().__init__(config)
        self._moe_route_threads = getattr(config, "threads", None)
        self._moe_route_configs = _configs(self)

    def forward(self, x_BLD: torch.Tensor, expert_bias_E: Optional[torch.Tensor] = None):
        # As torchtitan: the gate in float32 (autocast; on the CPU it warns and leaves the dtype).
        with torch.autocast(device_type=x_BLD.device.type, dtype=torch.float32):
            logits_BLE = self.gate(x_BLD)
        scores_BLE = torch.sigmoid(logits_BLE) if self.score_func == "sigmoid" else F.softmax(logits_BLE, dim=-1)
        logits_TE = logits_BLE.reshape(-1, logits_BLE.shape[-1])
        config = self._moe_route_configs[expert_bias_E is not None]
        bias = expert_bias_E.float() if config.uses_expert_bias else None
        if torch.is_grad_enabled() and logits_TE.requires_grad:
            res = route(logits_TE, config, training=self.training, expert_bias=bias, with_dispatch=False,
                        threads=self._moe_route_threads)
            gates, indices = res.gates, res.indices
        else:
            gates, indices = select_experts(logits_TE, config, expert_bias=bias, threads=self._moe_route_threads)
        shape = (*logits_BLE.shape[:-1], config.top_k)
        return gates.to(scores_BLE.dtype).reshape(shape), indices.long().reshape(shape), scores_BLE


def patch(model: torch.nn.Module, *, threads: Optional[int] = None) -> int:
    """Makes every TokenChoiceTopKRouter of a built torchtitan model (or MoE
    layer) route with the library; returns how many were patched. Each keeps
    its parameters, buffers and state-dict keys; only its class changes.
    Raises ValueError for a router setting the library does not reproduce, and
    for a model without routers."""
    routers = [m for m in model.modules() if isinstance(m, TokenChoiceTopKRouter)]
    if not routers:
        raise ValueError("moe_route: the model has no torchtitan TokenChoiceTopKRouter to patch")
    configs = [_configs(m) for m in routers]  # refuses before anything changes
    for module, config in zip(routers, configs):
        module.__class__ = MoERouteTokenChoiceTopKRouter
        module._moe_route_configs = config
        module._moe_route_threads = threads
    return len(routers)


def router_config(config: TokenChoiceTopKRouter.Config, *, threads: Optional[int] = None):
    """A MoERouteTokenChoiceTopKRouter.Config with the fields of torchtitan's router Config."""
    values = {f.name: getattr(config, f.name) for f in fields(TokenChoiceTopKRouter.Config) if f.init}
    return MoERouteTokenChoiceTopKRouter.Config(**values, threads=threads)


def patch_config(config, *, threads: Optional[int] = None) -> int:
    """Replaces, in place, every TokenChoiceTopKRouter.Config inside a torchtitan
    model's (or MoE layer's) configuration with router_config's, so that what
    it builds routes with the library; returns how many were replaced. The
    configuration itself must not be a router's (use router_config)."""
    found = [(parent, attr, c) for _, c, parent, attr in config.traverse(TokenChoiceTopKRouter.Config)
             if not isinstance(c, MoERouteTokenChoiceTopKRouter.Config)]
    if any(parent is None for parent, _, _ in found):
        raise TypeError("moe_route: patch_config takes a model's or MoE layer's configuration; "
                        "for a router's use router_config")
    for parent, attr, c in found:
        _configs(c)  # refuses by name
    for parent, attr, c in found:
        if isinstance(parent, list):
            parent[attr] = router_config(c, threads=threads)
        else:
            setattr(parent, attr, router_config(c, threads=threads))
    return len(found)


@torch.no_grad()
def update_expert_bias(expert_bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float) -> None:
    """torchtitan's aux-loss-free step, in place (its optimizer pre-hook,
    torchtitan.components.optimizer): delta_e = rate * sign(mean load - load_e),
    centred, b_e += delta_e - mean(delta). moe_route.update_expert_bias takes
    the first step without the centring; this adds it. tokens_per_expert: the
    loads [E] (route's res.tokens_per_expert, summed over the micro-batches)."""
    delta = torch.zeros_like(expert_bias)
    _update_expert_bias(delta, tokens_per_expert.to(delta.device, torch.float32), rate)
    expert_bias.add_(delta - delta.mean())
