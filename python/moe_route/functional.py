"""Functional ops with autograd: route (with admission and dispatch metadata),
expert_choice, router_l2 and the expert-bias update; select_experts, the
inference routing of a decode step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple, Union

import torch

from ._ops import ADMISSION_REPORT, EXPERT_CHOICE_REPORT, ops
from .config import PENALTIES, Admission, RouterConfig

Tensor = torch.Tensor
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@torch.compiler.assume_constant_result
def _default_threads() -> int:
    """torch's intra-op thread count; a constant of the graph under torch.compile."""
    return torch.get_num_threads()


def _threads(threads: Optional[int]) -> int:
    return _default_threads() if threads is None else int(threads)


def _as_logits(logits: Tensor) -> Tensor:
    """fp32 logits for the library. bf16 and fp16 widen exactly, which is what the
    library does with 16-bit logits itself, so the results are the same."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"moe_route: logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"moe_route: logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.dim() != 2:
        raise ValueError(f"moe_route: logits must have shape [tokens, experts], got {list(logits.shape)}")
    return logits.to(torch.float32)


@dataclass
class Dispatch:
    """Where each admitted assignment goes (docs/admission.md §5): expert e owns rows
    [offsets[e], offsets[e+1]) of the expert-major buffer; permutation maps a row
    to its slot id t*S + j (-1 = padding, and every row from offsets[E] on: its
    length is the bound N*S + E*(align - 1), so no count is read back; with a
    fixed capacity C every expert owns ceil(C / align) * align rows); inverse
    maps a slot to its row (-1 = not executed); rank_counts are the assignments
    sent to each expert-parallel rank."""

    tokens_per_expert: Tensor
    offsets: Tensor
    permutation: Tensor
    inverse: Tensor
    rank_counts: Tensor

    @property
    def rows(self) -> Tensor:
        """The rows used, offsets[E], a 0-d tensor on the indices' device."""
        return self.offsets[-1]


def dispatch(indices: Tensor, num_experts: int, *, align: int = 1, num_ranks: int = 1,
             expert_rank: Optional[Tensor] = None, capacity: int = 0) -> Dispatch:
    """Dispatch metadata for indices [N, S] (-1 = not executed). capacity C > 0
    gives the fixed layout of Megatron's moe_pad_expert_input_to_capacity: E
    blocks of C rows (rounded up to align), an expert's unused rows -1; an
    expert with more than C slots is an error on the CPU, and on a GPU keeps
    its first C (docs/admission.md)."""
    return Dispatch(*ops.dispatch(indices, int(num_experts), int(align), int(num_ranks), expert_rank, int(capacity)))


def _report(counts: Tensor, names) -> dict:
    return dict(zip(names, counts.tolist()))


@dataclass
class RouteResult:
    """What a Megatron-style MoE layer consumes from one routing call. Every field
    is a tensor on the logits' device; admission_report reads its counters back
    only when asked."""

    indices: Tensor  # [N, K] int32: the admitted experts (-1 = dropped)
    gates: Tensor  # [N, K] float32, differentiable w.r.t. the logits
    routed_indices: Tensor  # [N, K] int32 before admission
    routed_gates: Tensor  # [N, K] float32 before admission (no grad)
    status: Optional[Tensor]  # [N, K] int8: 0 kept, 1 dropped, 2 rerouted; None without admission
    penalty_values: Tensor  # [5] float32 in PENALTIES order, differentiable
    dispatch: Optional[Dispatch]  # None when route() was called with with_dispatch=False
    nonfinite_rows: Tensor  # int64 []: rows with a non-finite logit
    admission_counts: Optional[Tensor]  # int64 [8] (ADMISSION_REPORT order); None without admission

    @property
    def admission_report(self) -> Optional[dict]:
        return None if self.admission_counts is None else _report(self.admission_counts, ADMISSION_REPORT)

    @property
    def penalties(self) -> Dict[str, Tensor]:
        return {name: self.penalty_values[i] for i, name in enumerate(PENALTIES)}

    @property
    def aux_loss(self) -> Tensor:
        """The sum of the penalty values (add it to the task loss)."""
        return self.penalty_values.sum()

    @property
    def tokens_per_expert(self) -> Tensor:
        if self.dispatch is None:
            raise ValueError("moe_route: route(..., with_dispatch=False) computed no dispatch, so no "
                             "tokens_per_expert; call it with with_dispatch=True, or count the indices")
        return self.dispatch.tokens_per_expert


def route(logits: Tensor, config: RouterConfig, *, training: bool = True,
          expert_bias: Optional[Tensor] = None,
          prior_bias: Optional[Tensor] = None, prior_probs: Optional[Tensor] = None,
          token_prior_row: Optional[Tensor] = None,
          sequence_ids: Optional[Tensor] = None, num_sequences: Optional[int] = None,
          load_fractions: Optional[Tensor] = None,
          expert_rank: Optional[Tensor] = None, rank: int = 0,
          admission: Optional[Admission] = None,
          group_ids: Optional[Tensor] = None, num_groups: int = 1,
          hidden_norms: Optional[Tensor] = None, weight_norms: Optional[Tensor] = None,
          capacity: Optional[Tensor] = None,
          token_mask: Optional[Tensor] = None, replay_indices: Optional[Tensor] = None,
          dispatch_align: int = 1, dispatch_capacity: int = 0, num_ranks: Optional[int] = None,
          with_dispatch: bool = True, threads: Optional[int] = None) -> RouteResult:
    """Route logits [N, E] with `config`; optionally admit with `admission`
    (torch.ops.moe_route.route, then torch.ops.moe_route.dispatch).

    training=False is evaluation: no prior, penalty values 0 (the bias-free probe).
    The prior tensors come from moe_route.prior.prepare; token_prior_row [N] holds
    each token's row (-1: none). expert_rank [E] and rank serve the locality
    penalty and the per-rank dispatch counts (num_ranks: the number of ranks,
    by default read from expert_rank, which waits for its device); group_ids [N]
    are the admission groups (one per expert-parallel rank's micro-batch).
    token_mask [N] bool marks the valid tokens (False: padding): a padding token
    gets indices -1 and gates 0 and is in no loss, count, capacity or gradient
    (docs/policies.md, "Token mask"). replay_indices [N, K] int32 are experts
    chosen elsewhere (an inference engine's, for RL on its routing): the call
    routes to them instead of selecting, with gates, penalties, admission and
    gradients as for its own choice (docs/policies.md §2.9). dispatch_capacity
    C > 0 lays the dispatch out in E blocks of C rows (dispatch(), and
    Admission.capacity for the C of a capacity admission). with_dispatch=False
    skips the dispatch metadata (res.dispatch is None): for a caller that
    builds its own, as the engine integrations do.
    """
    if not isinstance(config, RouterConfig):
        raise TypeError(f"moe_route: config must be a RouterConfig, got {type(config).__name__}")
    if admission is not None and not isinstance(admission, Admission):
        raise TypeError(f"moe_route: admission must be an Admission, got {type(admission).__name__}")
    z = _as_logits(logits)
    if config.uses_expert_bias and expert_bias is None:
        raise ValueError(f"moe_route: selection '{config.selection}' needs expert_bias [E]")
    if (admission is not None and not admission.is_dropless and admission.overflow == "reroute" and training
            and config.prior == "log_prior_bias" and config.bias_gates and config.prior_beta != 0.0):
        raise ValueError("moe_route: reroute admission under log_prior_bias with bias_gates is not supported: "
                         "rerouted gates would come from the unbiased logits while the routed ones come from "
                         "the biased logits; use drop admission or bias_gates=False")
    if admission is not None and admission.needs_norms and (hidden_norms is None or weight_norms is None):
        raise ValueError("moe_route: cosine affinity needs hidden_norms [N] and weight_norms [E]")
    admitting = admission is not None and not admission.is_dropless
    (gates, values, indices, routed_indices, routed_gates, status, _, nonfinite, counts) = ops.route(
        z, config.to_text(), expert_bias, prior_bias, prior_probs, token_prior_row, sequence_ids,
        0 if num_sequences is None else int(num_sequences), load_fractions, expert_rank, int(rank), bool(training),
        admission.to_text() if admitting else "", hidden_norms, weight_norms, group_ids, int(num_groups), capacity,
        token_mask, replay_indices, _threads(threads))
    meta = None
    if with_dispatch:
        if num_ranks is None:
            num_ranks = int(expert_rank.max().item()) + 1 if expert_rank is not None and expert_rank.numel() else 1
        meta = dispatch(indices, z.shape[1], align=dispatch_align, num_ranks=num_ranks, expert_rank=expert_rank,
                        capacity=dispatch_capacity)
    if not admitting:  # the operator returns the routing once: [0, K] in its routed_* outputs
        routed_indices, routed_gates = indices, gates.detach()
    return RouteResult(indices, gates, routed_indices, routed_gates, status if admitting else None, values, meta,
                       nonfinite, counts if admitting else None)


_select_experts = ops.select_experts.default
# The same operator called without OpOverload.__call__'s Python frame (about
# 0.4 us of a 4 us decode call); torch.compile traces the OpOverload instead.
_select_experts_eager = _select_experts._op


def select_experts(logits: Tensor, config: RouterConfig, *, expert_bias: Optional[Tensor] = None,
                   token_mask: Optional[Tensor] = None, threads: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Inference routing, the decode path (torch.ops.moe_route.select_experts):
    (gates [N, K] float32, indices [N, K] int32) of logits [N, E] float32,
    bfloat16 or float16 -- the gates and indices route(..., training=False)
    gives, with nothing else computed. For calls under torch.no_grad() or
    torch.inference_mode(): its gates have no gradient, so it refuses logits
    that require one (use route to train). token_mask [N] bool: padding rows
    (False) get indices -1 and gates 0, as SGLang's num_token_non_padded."""
    if not isinstance(config, RouterConfig):
        raise TypeError(f"moe_route: config must be a RouterConfig, got {type(config).__name__}")
    if torch.compiler.is_compiling():
        return _select_experts(logits, config.to_text(), expert_bias, token_mask,
                               _default_threads() if threads is None else threads)
    return _select_experts_eager(logits, config._text or config.to_text(), expert_bias, token_mask,
                                 torch.get_num_threads() if threads is None else threads)


@dataclass
class ExpertChoiceResult:
    indices: Tensor  # [N, E] int32: the experts that chose token t, in expert order, then -1
    gates: Tensor  # [N, E] float32, differentiable
    experts_per_token: Tensor  # [N] int32
    dispatch: Dispatch  # slots per token = E
    counts: Tensor  # int64 [4] (EXPERT_CHOICE_REPORT order)

    @property
    def report(self) -> dict:
        return _report(self.counts, EXPERT_CHOICE_REPORT)


def expert_choice(logits: Tensor, *, top_k: int = 2, capacity_factor: float = 1.0, min_capacity: int = 0,
                  group_ids: Optional[Tensor] = None, num_groups: int = 1, capacity: Optional[Tensor] = None,
                  token_mask: Optional[Tensor] = None,
                  dispatch_align: int = 1, num_ranks: int = 1, expert_rank: Optional[Tensor] = None,
                  threads: Optional[int] = None) -> ExpertChoiceResult:
    """Expert-choice routing (each expert picks its top-C tokens by softmax score);
    no expert picks a padding token (token_mask [N] bool False)."""
    z = _as_logits(logits)
    gates, indices, per_token, counts = ops.expert_choice(z, int(top_k), float(capacity_factor), int(min_capacity),
                                                          group_ids, int(num_groups), capacity, token_mask,
                                                          _threads(threads))
    meta = dispatch(indices, z.shape[1], align=dispatch_align, num_ranks=num_ranks, expert_rank=expert_rank)
    return ExpertChoiceResult(indices, gates, per_token, meta, counts)


def router_l2(weights: Union[Tensor, Sequence[Tensor]], base: Union[Tensor, Sequence[Tensor]],
              coefficient: float = 1e4) -> Tensor:
    """Router-L2 (RPB eq. 5): coefficient * mean over layers of ||W_l - W_l^base||^2,
    differentiable w.r.t. the weights (the base copies are constants)."""
    weights = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    base = [base] if isinstance(base, torch.Tensor) else list(base)
    if len(weights) != len(base):
        raise ValueError(f"moe_route: router_l2 got {len(weights)} weight and {len(base)} base tensors")
    value, _ = ops.router_l2(weights, [b.detach() for b in base], float(coefficient))
    return value.to(torch.float32)


@torch.no_grad()
def update_expert_bias(expert_bias: Tensor, loads: Tensor, rate: float) -> None:
    """Aux-loss-free step, in place: b_e += rate * sign(mean load - load_e)."""
    ops.expert_bias_update(expert_bias, loads, float(rate))
