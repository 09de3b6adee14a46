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

    def load_fractions(self, logits: Tensor) -> Tensor:
        """Adds the loads of this micro-batch's logits [n, E] and returns f [E] float32."""
        if logits.dim() != 2 or logits.shape[1] != self.num_experts:
            raise ValueError(f"moe_route: GlobalLoadBalance expects logits [tokens, {self.num_experts}], "
                             f"got {list(logits.shape)}")
        with torch.no_grad():
            chosen = torch.topk(logits.float(), self.top_k, dim=1).indices.reshape(-1)
            loads = torch.zeros(self.num_experts, dtype=torch.float32, device=logits.device)
            loads.index_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float32))
            tokens = torch.full((), float(logits.shape[0]), dtype=torch.float32, device=logits.device)
            if self.all_reduce is not None:
                self.all_reduce(loads)
                self.all_reduce(tokens)
            self.loads = loads if self.loads is None else self.loads + loads
            self.steps += 1
            return self.loads / self.steps * float(logits.shape[0]) / (self.top_k * tokens * tokens)

    def reset(self) -> None:
        """Starts the next optimizer step's global batch."""
        self.loads, self.steps = None, 0
