"""Load balance over a global batch: the loads of every micro-batch of one
optimizer step, on every data-parallel rank (Megatron-Core's global_aux_loss,
arXiv 2501.11873), for route's load_balance_scope="global_batch"."""

from __future__ import annotations

from typing import Callable, Optional

import torch

Tensor = torch.Tensor


class GlobalLoadBalance:
    """Accumulates each micro-batch's expert loads over the gradient-accumulation
    steps of one optimizer step and gives route() the load fractions of the
    global batch:

        f_e = (mean over the steps so far of the loads of e) * n / (K * T^2)

    with the loads counted, as Megatron counts them, on a plain top-K of the
    logits (whatever bias or group limit the router applies), n the
    micro-batch's tokens and T its tokens on all ranks. With route's
    P_e = (1/n) sum_t p_t,e this is Megatron's global_aux_loss on each rank.

    all_reduce, when given, sums a tensor in place over the data-parallel
    ranks (e.g. torch.distributed.all_reduce); without it there is one rank.
    Call reset() after each optimizer step."""

    def __init__(self, num_experts: int, top_k: int, all_reduce: Optional[Callable[[Tensor], object]] = None):
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ValueError(f"moe_route: GlobalLoadBalance needs 1 <= top_k (= {top_k}) <= num_experts "
                             f"(= {num_experts})")
        self.num_experts, self.top_k, self.all_reduce = int(num_experts), int(top_k), all_reduce
        self.loads: Optional[Tensor] = None  # float32 [E]: summed over the steps so far
        self.steps = 0

    def load_fractions(self, logits: Tensor, token_mask: Optional[Tensor] = None) -> Tensor:
        """Adds the loads of this micro-batch's logits [n, E] and returns f [E] float32.
        token_mask [n] bool (False: padding) leaves padding rows out of the loads
        and of n and T, as route leaves them out of P (pass route the same mask)."""
        if logits.dim() != 2 or logits.shape[1] != self.num_experts:
            raise ValueError(f"moe_route: GlobalLoadBalance expects logits [tokens, {self.num_experts}], "
                             f"got {list(logits.shape)}")
        if token_mask is not None and (token_mask.dtype != torch.bool or token_mask.shape != logits.shape[:1]):
            raise ValueError(f"moe_route: GlobalLoadBalance token_mask must be torch.bool [{logits.shape[0]}], got "
                             f"{token_mask.dtype} {list(token_mask.shape)}")
        with torch.no_grad():
            chosen = torch.topk(logits.float(), self.top_k, dim=1).indices
            weight = torch.ones_like(chosen, dtype=torch.float32)
            if token_mask is not None:
                weight = weight * token_mask.to(torch.float32).unsqueeze(1)
            loads = torch.zeros(self.num_experts, dtype=torch.float32, device=logits.device)
            loads.index_add_(0, chosen.reshape(-1), weight.reshape(-1))
            local = weight[:, 0].sum() if token_mask is not None else torch.full(
                (), float(logits.shape[0]), dtype=torch.float32, device=logits.device)
            tokens = local.clone()
            if self.all_reduce is not None:
                self.all_reduce(loads)
                self.all_reduce(tokens)
            self.loads = loads if self.loads is None else self.loads + loads
            self.steps += 1
            # An all-padding global batch has no loads: f = 0 rather than 0/0.
            return self.loads / self.steps * local / (self.top_k * torch.clamp(tokens, min=1.0) ** 2)

    def reset(self) -> None:
        """Starts the next optimizer step's global batch."""
        self.loads, self.steps = None, 0
