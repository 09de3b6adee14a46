"""A Megatron-Core router whose routing runs on the library: TopKRouter
(megatron.core.transformer.moe.router.TopKRouter) with its routing() replaced,
so a MoE layer built with it is Megatron's in everything else: the gating
linear, the aux-loss attachment and logging, the expert-bias bookkeeping that
finalize_model_grads updates, the global-batch reset (docs/integration.md).
The configuration comes from the TransformerConfig (RouterConfig.from_megatron,
Admission.from_megatron), which refuses what the library does not reproduce."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from ..balance import GlobalLoadBalance
from ..config import Admission, RouterConfig
from ..functional import route

# The names Megatron logs each load-balancing scope under.
_LOSS_NAMES = {"batch": "load_balancing_loss", "sequence": "seq_load_balancing_loss",
               "global_batch": "global_load_balancing_loss"}


def _padded_to_capacity(routing_map, capacity):
    """Megatron's moe_pad_expert_input_to_capacity map: each expert's column filled
    up to min(capacity, tokens) with tokens it did not admit, whose probs stay 0.
    The fillers are the lowest-index such tokens (Megatron's dispatcher takes them
    in that order too); Megatron's router takes whichever its topk over the zero
    probs returns, so only the admitted entries and the counts are the same."""
    fill = min(capacity, routing_map.shape[0])
    chosen = routing_map.T.to(torch.int8).argsort(dim=1, descending=True, stable=True)[:, :fill]
    return torch.zeros_like(routing_map.T).scatter_(1, chosen, True).T


class MoERouteTopKRouter(TopKRouter):
    """TopKRouter whose routing() calls moe_route's operators."""

    def __init__(self, config, pg_collection=None) -> None:
        super().__init__(config, pg_collection=pg_collection)
        route_config = RouterConfig.from_megatron(config)
        # Megatron divides the z-loss coefficient over the tensor x context parallel ranks.
        self.route_config = dataclasses.replace(route_config, z_loss=route_config.z_loss / self.tp_cp_group.size())
        self.admission = Admission.from_megatron(config)
        self.pad_to_capacity = bool(config.moe_pad_expert_input_to_capacity) and not self.admission.is_dropless
        self.global_load_balance: Optional[GlobalLoadBalance] = None
        if self.route_config.load_balance_scope == "global_batch":
            group = self.tp_dp_cp_group
            self.global_load_balance = GlobalLoadBalance(
                config.num_moe_experts, config.moe_router_topk,
                lambda t: torch.distributed.all_reduce(t, group=group))

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """(probs [tokens, E], routing_map [tokens, E]) of logits [seq_length, batch, E], as TopKRouter.routing.

        padding_mask [seq_length, batch] (True: padding) leaves the padding tokens out
        of the losses and the expert-bias loads, as Megatron does. Dropless, it also
        routes them nowhere (empty routing_map rows, probs 0), unlike Megatron; with a
        capacity factor they are routed and take capacity, as in Megatron."""
        seq_length, batch = logits.shape[:2]
        z = logits.reshape(-1, self.config.num_moe_experts)
        recorded = self.training and torch.is_grad_enabled()
        cfg = self.route_config
        valid = token_mask = None
        if padding_mask is not None:
            if padding_mask.shape != (seq_length, batch):
                raise ValueError(f"moe_route: padding_mask must be [seq_length, batch] = [{seq_length}, {batch}], "
                                 f"got {list(padding_mask.shape)}")
            valid = ~padding_mask.reshape(-1).to(device=z.device, dtype=torch.bool)
            # Megatron's padding competes for (and sizes) the capacity: under token dropping
            # it is routed, and only the losses and the loads leave it out.
            token_mask = valid if self.admission.is_dropless else None
        extra = {}
        if cfg.load_balance_scope == "sequence":  # Megatron's tokens are [seq_length, batch]
            extra = dict(sequence_ids=torch.arange(z.shape[0], device=z.device) % batch, num_sequences=batch)
        elif self.global_load_balance is not None:
            extra = dict(load_fractions=self.global_load_balance.load_fractions(z.detach(), valid) if recorded
                         else torch.zeros(z.shape[1], device=z.device))
        action = self.router_replay.router_replay_action if self.router_replay is not None else None
        replay = None
        if action == RouterReplayAction.REPLAY_FORWARD:
            replay = self.router_replay.target_topk_idx
        elif action == RouterReplayAction.REPLAY_BACKWARD:
            replay = self.router_replay.replay_backward_list.pop(0)
        if replay is not None:
            replay = replay.to(device=z.device, dtype=torch.int32)
            if cfg.load_balance and cfg.load_balance_scope != "global_batch":
                # Megatron's aux loss counts the router's own top-k, not the replayed experts
                # (global_aux_loss: GlobalLoadBalance counts that top-k already).
                cfg = dataclasses.replace(cfg, load_balance_counts="top_k")
        penalized = recorded and bool(cfg.load_balance or cfg.z_loss)
        # Padding that is routed but in no loss: the penalties come from a second call
        # that masks it (token-choice routing is per token, so its valid rows are the same).
        separate = penalized and valid is not None and token_mask is None
        res = route(z, dataclasses.replace(cfg, load_balance=0.0, z_loss=0.0) if separate else cfg,
                    training=recorded, expert_bias=self.expert_bias, token_mask=token_mask, replay_indices=replay,
                    admission=None if self.admission.is_dropless else self.admission, with_dispatch=False,
                    **extra)
        penalties = route(z, cfg, expert_bias=self.expert_bias, token_mask=valid, replay_indices=replay,
                          with_dispatch=False, **extra) if separate else res
        if action == RouterReplayAction.RECORD:  # the experts chosen, before any token dropping, as Megatron
            self.router_replay.record_indices(res.routed_indices.long())
        kept = res.indices >= 0
        slots = res.indices.clamp(min=0).long()
        probs = torch.zeros_like(z, dtype=res.gates.dtype).scatter_add(1, slots, res.gates * kept)
        routing_map = torch.zeros_like(z, dtype=torch.bool).scatter_add(1, slots, kept)
        if penalized:
            probs = self._attach_penalties(probs, penalties, z.shape[0] if valid is None else valid.sum())
        if self.pad_to_capacity:
            routing_map = _padded_to_capacity(routing_map, self.admission.capacity(z.shape[0], cfg.top_k, z.shape[1]))
        # Megatron's expert-bias loads leave the padding out (its mask broadcast over the experts)
        self._apply_expert_bias(routing_map if valid is None else routing_map & valid[:, None])
        return probs.type_as(logits), routing_map

    def _attach_penalties(self, probs, res, num_tokens):
        """Megatron's attachment: the penalties' gradient joins the main loss's backward
        through MoEAuxLossAutoScaler; their values go to the aux-loss tracker."""
        cfg, penalties = self.route_config, res.penalties
        num_layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
        if cfg.load_balance:
            moe_utils.save_to_aux_losses_tracker(
                _LOSS_NAMES[cfg.load_balance_scope], penalties["load_balance"].detach() / cfg.load_balance,
                self.layer_number, num_layers, reduce_group=self.tp_cp_group,
                reduce_group_has_dp=cfg.load_balance_scope == "global_batch")
        if cfg.z_loss:
            moe_utils.save_to_aux_losses_tracker("z_loss", penalties["z_loss"].detach() / cfg.z_loss,
                                                 self.layer_number, num_layers)
        total = res.aux_loss
        if self.calculate_per_token_loss:  # Megatron scales by the tokens so the per-token normalisation undoes it
            total = total * num_tokens
        return moe_utils.MoEAuxLossAutoScaler.apply(probs, total)

    def reset_global_aux_loss_tracker(self):
        """Called by finalize_model_grads after each optimizer step."""
        super().reset_global_aux_loss_tracker()
        if self.global_load_balance is not None:
            self.global_load_balance.reset()
