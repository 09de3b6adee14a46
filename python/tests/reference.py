"""A pure-PyTorch reference of moe_route's contract, written from the documents
(docs/policies.md, docs/numerics.md, docs/training.md, docs/admission.md,
docs/prior.md) and independent of the library: it never imports moe_route.

Inputs are float32-valued tensors; everything is computed in float64. Gates and
penalty values are differentiable with respect to the float64 logits passed in,
so torch.autograd gives the reference gradient. Index tensors are int64.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

F64 = torch.float64
FLT_MAX = float(torch.finfo(torch.float32).max)
INF = math.inf

KEPT, DROPPED, REROUTED = 0, 1, 2  # admission status codes (docs/admission.md section 2)


def f32(x: float) -> float:
    """x rounded to float32: the library's configuration fields are fp32."""
    return float(torch.tensor(float(x), dtype=torch.float32))


def normalizes_by_default(gating: str) -> bool:
    return gating in ("sigmoid", "sqrt_softplus")


# ---------------------------------------------------------------------------
# Gating (docs/policies.md section 1, numerics.md "Tie-breaking and keys")

class _Sanitize(torch.autograd.Function):
    """NaN -> -inf, +-inf -> +-FLT_MAX. The gradient passes unchanged at +-inf (an infinite logit is
    the limit of a huge finite one, docs/policies.md section 1) and is 0 at NaN; a clamp would give 0
    at +-inf."""

    @staticmethod
    def forward(ctx, z):
        nan = torch.isnan(z)
        ctx.save_for_backward(nan)
        return torch.where(nan, torch.full_like(z, -INF), z.clamp(-FLT_MAX, FLT_MAX))

    @staticmethod
    def backward(ctx, grad):
        (nan,) = ctx.saved_tensors
        return torch.where(nan, torch.zeros_like(grad), grad)


def sanitize(z: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf, +-inf -> +-FLT_MAX (a NaN logit ranks below a real -inf)."""
    return _Sanitize.apply(z)


def _safe_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / b where b > 0, else 0 (no NaN in values or gradients)."""
    ok = b > 0
    return torch.where(ok, a / torch.where(ok, b, torch.ones_like(b)), torch.zeros_like(a))


def softmax_rows(v: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim; a row whose terms all vanish (all NaN) is 0."""
    m = v.detach().max(dim=-1, keepdim=True).values.clamp(min=-FLT_MAX)
    t = torch.exp(v - m)
    return _safe_div(t, t.sum(dim=-1, keepdim=True))


def sqrt_softplus(v: torch.Tensor) -> torch.Tensor:
    sp = torch.nn.functional.softplus(v, beta=1, threshold=50)
    return torch.where(sp > 0, torch.sqrt(torch.where(sp > 0, sp, torch.ones_like(sp))), torch.zeros_like(sp))


def scores(gating: str, v: torch.Tensor) -> torch.Tensor:
    """s = g(v) of sanitised logits; softmax_after_topk's full-row score is the softmax."""
    if gating in ("softmax", "softmax_after_topk"):
        return softmax_rows(v)
    if gating == "sigmoid":
        return torch.sigmoid(v)
    if gating == "sqrt_softplus":
        return sqrt_softplus(v)
    raise ValueError(gating)


def gate_inputs(gating: str, v: torch.Tensor) -> torch.Tensor:
    """What the gate weights consume per expert: the score, or the logit for softmax_after_topk."""
    return v if gating == "softmax_after_topk" else scores(gating, v)


def distribution(gating: str, z: torch.Tensor) -> torch.Tensor:
    """The routing distribution p(z) of the penalties and the prior builder (training.md)."""
    v = sanitize(z)
    if gating in ("softmax", "softmax_after_topk"):
        return softmax_rows(v)
    s = scores(gating, v)
    return s / s.sum(dim=-1, keepdim=True)


def gate_weights(gating: str, selected: torch.Tensor, normalize: bool, scale: float) -> torch.Tensor:
    """w from the K selected gate inputs (docs/policies.md section 1)."""
    if gating == "softmax_after_topk":
        return softmax_rows(selected) * scale
    if normalize:
        return selected / (selected.sum(dim=-1, keepdim=True) + 1e-20) * scale
    return selected * scale


# ---------------------------------------------------------------------------
# Selection (docs/policies.md section 2)

def order_desc(keys: torch.Tensor, level: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per row, the column order by key descending with ties to the lower index;
    NaN keys come after every number, and columns of a lower `level` after
    those of a higher one. -0.0 and +0.0 are the same key."""
    nan = torch.isnan(keys)
    k = torch.where(nan, torch.full_like(keys, -INF), keys) + 0.0
    o = torch.sort(k, dim=-1, descending=True, stable=True).indices
    rank = -nan.long() if level is None else 2 * level.long() - nan.long()
    o2 = torch.sort(rank.gather(-1, o), dim=-1, descending=True, stable=True).indices
    return o.gather(-1, o2)


def selection_keys(selection: str, gating: str, v: torch.Tensor, expert_bias: Optional[torch.Tensor]) -> torch.Tensor:
    """top_k keys on the sanitised logit; group_limited_score on s and expert_bias
    on s + b, with a NaN logit at -inf."""
    v = v.detach()
    if selection in ("top_k", "group_limited"):
        return v.clone()
    s = scores(gating, v)
    key = s if selection == "group_limited_score" else s + expert_bias.to(F64)
    return torch.where(v == -INF, torch.full_like(key, -INF), key)


def select(v: torch.Tensor, *, gating: str, selection: str, top_k: int, groups: int = 1, top_groups: int = 1,
           per_group_k: int = 2, expert_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Indices [N, K] (int64) from sanitised logits v [N, E]."""
    n, e = v.shape
    if selection == "fixed":
        t = torch.arange(n).unsqueeze(1)
        return (t * top_k + torch.arange(top_k).unsqueeze(0)) % e
    keys = selection_keys(selection, gating, v, expert_bias)
    if selection in ("group_limited", "group_limited_bias", "group_limited_score"):
        size = e // groups
        per_group = keys.reshape(n, groups, size)
        best = per_group.gather(-1, order_desc(per_group)[..., :per_group_k]).to(torch.float32)
        group_score = torch.zeros(n, groups, dtype=torch.float32)
        for j in range(per_group_k):  # the per_group_k largest keys, added in fp32 in descending order
            group_score = group_score + best[..., j]
        kept_groups = order_desc(group_score)[:, :top_groups]
        keep = torch.zeros(n, groups, dtype=torch.bool)
        keep.scatter_(1, kept_groups, True)
        level = keep.repeat_interleave(size, dim=1)  # experts outside the kept groups rank last
        return order_desc(keys, level)[:, :top_k]
    return order_desc(keys)[:, :top_k]


def biased_logits(z: torch.Tensor, beta: float, b: torch.Tensor) -> torch.Tensor:
    """z' = fma(beta, b, z) rounded to fp32 (training.md); dz' / dz = 1."""
    exact = (z.detach() + f32(beta) * b.to(F64)).to(torch.float32).to(F64)
    # z' of an infinite or NaN z is z itself (inf - inf would make it NaN).
    shift = torch.where(torch.isfinite(z.detach()), exact - z.detach(), torch.zeros_like(exact))
    return z + shift


def route(z: torch.Tensor, *, gating: str = "softmax", selection: str = "top_k", top_k: int = 2,
          normalize: Optional[bool] = None, scaling_factor: float = 1.0, groups: int = 1, top_groups: int = 1,
          per_group_k: int = 2, prior: str = "none", prior_beta: float = 1.0, bias_gates: bool = True,
          training: bool = True, expert_bias: Optional[torch.Tensor] = None,
          prior_bias: Optional[torch.Tensor] = None, token_prior_row: Optional[torch.Tensor] = None,
          **_ignored) -> Tuple[torch.Tensor, torch.Tensor]:
    """(indices [N, K] int64, gates [N, K] float64) of one routing call."""
    n, e = z.shape
    normalize = normalizes_by_default(gating) if normalize is None else normalize
    scale = f32(scaling_factor)
    rows = torch.full((n,), -1, dtype=torch.long) if token_prior_row is None else token_prior_row.long()
    prior_on = training and prior != "none" and not (prior == "log_prior_bias" and prior_beta == 0.0)
    active = (rows >= 0) & prior_on
    b = prior_bias.to(F64)[rows.clamp(min=0)] if prior_bias is not None and n > 0 else torch.zeros(n, e, dtype=F64)

    z_select = z_gate = z
    if prior == "log_prior_bias" and bool(active.any()):
        zb = torch.where(active.unsqueeze(1), biased_logits(z, prior_beta, b), z)
        z_select = zb
        z_gate = zb if bias_gates else z
    indices = select(sanitize(z_select), gating=gating, selection=selection, top_k=top_k, groups=groups,
                     top_groups=top_groups, per_group_k=per_group_k, expert_bias=expert_bias)
    if prior == "prior_override" and bool(active.any()):
        indices = torch.where(active.unsqueeze(1), order_desc(b)[:, :top_k], indices)
    selected = gate_inputs(gating, sanitize(z_gate)).gather(1, indices)
    return indices, gate_weights(gating, selected, normalize, scale)


# ---------------------------------------------------------------------------
# Penalties (docs/policies.md section 5, training.md)

def valid_rows(gating: str, z: torch.Tensor) -> torch.Tensor:
    """Rows that take part in the penalties: finite logits, and scores that do not
    all vanish (an elementwise score underflows to 0 below z = -87, numerics.md)."""
    ok = torch.isfinite(z).all(dim=1)
    if gating in ("sigmoid", "sqrt_softplus") and z.shape[1] > 0:
        ok &= z.detach().max(dim=1).values >= -87.0
    return ok


def log_distribution(gating: str, z: torch.Tensor) -> torch.Tensor:
    if gating in ("softmax", "softmax_after_topk"):
        return torch.log_softmax(z, dim=-1)
    s = scores(gating, z)
    return torch.log(s) - torch.log(s.sum(dim=-1, keepdim=True))


def penalties(z: torch.Tensor, indices: torch.Tensor, *, gating: str = "softmax", top_k: int = 2,
              training: bool = True, load_balance: float = 0.0, load_balance_scope: str = "batch",
              load_balance_counts: str = "selected", load_balance_sequence_length: str = "own",
              z_loss: float = 0.0, kl_to_base: float = 0.0, logit_l2: float = 0.0, locality: float = 0.0,
              locality_epsilon: float = 1e-3, prior_bias: Optional[torch.Tensor] = None,
              prior_probs: Optional[torch.Tensor] = None, token_prior_row: Optional[torch.Tensor] = None,
              sequence_ids: Optional[torch.Tensor] = None, num_sequences: Optional[int] = None,
              load_fractions: Optional[torch.Tensor] = None, expert_rank: Optional[torch.Tensor] = None,
              rank: int = 0, **_ignored) -> torch.Tensor:
    """The five penalty values (load_balance, z_loss, kl_to_base, logit_l2, locality), float64 [5].
    The loads f count `indices`, or under load_balance_counts="top_k" each token's
    top_k largest logits (ties to the lower expert). Over sequences, each is
    normalised by its own valid length, or under load_balance_sequence_length=
    "batch_mean" by the mean over all num_sequences, which the loss then averages over."""
    n, e = z.shape
    zero = torch.zeros((), dtype=F64)
    out = [zero] * 5
    if not training or n == 0:
        return torch.stack(out)
    valid = valid_rows(gating, z)
    zv, iv = z[valid], indices[valid].long()
    if load_balance_counts == "top_k":
        iv = order_desc(zv.detach())[:, :top_k]
    nv = zv.shape[0]
    rows = torch.full((n,), -1, dtype=torch.long) if token_prior_row is None else token_prior_row.long()
    if nv > 0:
        p = distribution(gating, zv)
        if load_balance != 0.0:
            alpha = f32(load_balance)
            if load_balance_scope == "sequence":
                seq = sequence_ids.long()[valid]
                total, averaged = zero, 0
                for q in range(int(num_sequences)):
                    m = seq == q
                    if not bool(m.any()):
                        continue
                    averaged += 1
                    length = int(m.sum()) if load_balance_sequence_length == "own" else nv / int(num_sequences)
                    f = torch.bincount(iv[m].reshape(-1), minlength=e).to(F64) / (length * top_k)
                    total = total + (f * p[m].sum(dim=0) / length).sum()
                if load_balance_sequence_length == "batch_mean":
                    averaged = int(num_sequences)
                out[0] = alpha * e * total / averaged
            else:
                if load_balance_scope == "global_batch":
                    f = load_fractions.to(F64)
                else:
                    f = torch.bincount(iv.reshape(-1), minlength=e).to(F64) / (nv * top_k)
                out[0] = alpha * e * (f * p.mean(dim=0)).sum()
        if z_loss != 0.0:
            out[1] = f32(z_loss) * (torch.logsumexp(zv, dim=-1) ** 2).mean()
        if locality != 0.0:
            dc = p.mean(dim=0)
            ranks = torch.zeros(e, dtype=torch.long) if expert_rank is None else expert_rank.long()
            local = ranks == rank
            count = int(local.sum())
            eps = f32(locality_epsilon)
            if count == e:
                dl = torch.full((e,), 1.0 / e, dtype=F64)
            else:
                dl = torch.where(local, torch.full((e,), (1 - eps) / count, dtype=F64),
                                 torch.full((e,), eps / (e - count), dtype=F64))
            pos = dc > 0
            out[4] = f32(locality) * (dc[pos] * torch.log(dc[pos] / dl[pos])).sum()
    prior_tokens = valid & (rows >= 0)
    if bool(prior_tokens.any()):
        zt, rt = z[prior_tokens], rows[prior_tokens]
        if kl_to_base != 0.0:
            pi = prior_probs.to(F64)[rt]
            kl = (pi * (torch.log(pi) - log_distribution(gating, zt))).sum(dim=-1)
            out[2] = f32(kl_to_base) * kl.mean()
        if logit_l2 != 0.0:
            d = zt - prior_bias.to(F64)[rt]
            d = d - d.mean(dim=-1, keepdim=True)
            out[3] = f32(logit_l2) * (d ** 2).sum(dim=-1).mean()
    return torch.stack(out)


def router_l2(weights: List[torch.Tensor], base: List[torch.Tensor], coefficient: float) -> torch.Tensor:
    """coefficient * mean over layers of ||W - W_base||_F^2."""
    terms = [((w - b.to(w.dtype)) ** 2).sum() for w, b in zip(weights, base)]
    return f32(coefficient) * torch.stack(terms).mean()


def update_expert_bias(bias: torch.Tensor, loads: torch.Tensor, rate: float) -> torch.Tensor:
    """b_e + u * sign(mean load - load_e), in float32."""
    loads = loads.to(F64)
    step = torch.sign(loads.mean() - loads).to(torch.float32) * f32(rate)
    return bias + step


# ---------------------------------------------------------------------------
# Prior tools (docs/policies.md section 3, docs/prior.md)

def prior_prepare(pi: torch.Tensor, epsilon: float = 0.05, cap: float = 5.0):
    """(bias, probs, upper_clamped, lower_clamped): clamp to [eps/E, cap/E],
    renormalise, centred log; in float64."""
    e = pi.shape[1]
    p = pi.to(F64)
    lo, hi = f32(epsilon) / e, f32(cap) / e
    upper = int((p >= hi).sum())
    lower = int(((p <= lo) & (p < hi)).sum())
    c = p.clamp(lo, hi)
    c = c / c.sum(dim=1, keepdim=True)
    logc = torch.log(c)
    return logc - logc.mean(dim=1, keepdim=True), c, upper, lower


def prior_build(z: torch.Tensor, rows: torch.Tensor, num_rows: int, gating: str = "softmax"):
    """(pi [S, E], empty rows): the mean base distribution of each row's tokens."""
    p = distribution(gating, z.to(F64))
    pi = torch.zeros(num_rows, z.shape[1], dtype=F64)
    empty = []
    for r in range(num_rows):
        m = rows.long() == r
        if bool(m.any()):
            pi[r] = p[m].mean(dim=0)
        else:
            empty.append(r)
    return pi, empty


# ---------------------------------------------------------------------------
# Admission (docs/policies.md section 4, docs/admission.md)

def capacity_rule(factor: float, min_capacity: int, tokens: int, top_k: int, num_experts: int) -> int:
    """C = max(min_capacity, ceil((N_g * K / E) * factor)), in Python floats as Megatron does."""
    return max(int(min_capacity), max(0, math.ceil(tokens * top_k / num_experts * factor)))


def affinities(kind: str, gating: str, z32: torch.Tensor, hidden_norms=None, weight_norms=None, routed=None,
               routed_gates=None) -> torch.Tensor:
    """a(t, e) for every (t, e) as float64. cosine is evaluated in fp32 as
    documented (div(v, ||x|| * ||w||)), so thresholds compare the same value;
    gate is the routed gate of the slot holding e (-inf where none does)."""
    v = sanitize(z32.to(torch.float32))
    if kind == "position":
        return torch.zeros(v.shape, dtype=F64)
    if kind == "gate":
        a = torch.full(v.shape, -INF, dtype=F64)
        return a.scatter(1, routed.long(), routed_gates.to(F64))
    if kind == "logit":
        return v.to(F64)
    if kind == "cosine":
        return (v / (hidden_norms.to(torch.float32).unsqueeze(1) * weight_norms.to(torch.float32).unsqueeze(0))).to(F64)
    return scores(gating, v.to(F64))  # probability: the full softmax for softmax_after_topk


def admit(z32: torch.Tensor, routed: torch.Tensor, *, gating: str, affinity: str = "probability",
          overflow: str = "drop", threshold: float = -INF, capacity_factor: float = 1.0, min_capacity: int = 0,
          fill_factor: float = 4.0, max_rounds: int = -1, group_ids: Optional[torch.Tensor] = None,
          num_groups: int = 1, capacity: Optional[torch.Tensor] = None, hidden_norms=None, weight_norms=None,
          routed_gates: Optional[torch.Tensor] = None, **_ignored) -> Tuple[torch.Tensor, torch.Tensor]:
    """(admitted indices [N, K] int64 with -1 = dropped, status [N, K]) by the
    rules of docs/admission.md sections 1 and 3, written as plain loops
    (routed_gates [N, K]: the router's gates, for the gate affinity)."""
    n, e = z32.shape
    k = routed.shape[1]
    a = affinities(affinity, gating, z32, hidden_norms, weight_norms, routed, routed_gates).tolist()
    tau = f32(threshold) if math.isfinite(threshold) else threshold
    routed_l = routed.long().tolist()
    group = [0] * n if group_ids is None else group_ids.long().tolist()
    tokens_in = [group.count(g) for g in range(num_groups)]

    def cap(g, x):
        if capacity is not None:
            return int(capacity[x])
        return capacity_rule(capacity_factor, min_capacity, tokens_in[g], k, e)

    status = [[DROPPED] * k for _ in range(n)]
    target = [row[:] for row in routed_l]
    load = {}
    # Strict pass: per (group, expert) the top C of {a >= tau} by (a desc, token asc).
    pools = {}
    for t in range(n):
        for j in range(k):
            x = routed_l[t][j]
            if not a[t][x] < tau:
                pools.setdefault((group[t], x), []).append((t, j))
    for (g, x), pool in pools.items():
        pool.sort(key=lambda tj: (-a[tj[0]][x], tj[0]))
        kept = pool[:cap(g, x)]
        for t, j in kept:
            status[t][j] = KEPT
        load[(g, x)] = len(kept)

    if overflow == "reroute":
        fill = [capacity_rule(fill_factor, 0, tokens_in[g], k, e) for g in range(num_groups)]
        limit = {(g, x): min(fill[g], cap(g, x)) for g in range(num_groups) for x in range(e)}
        pending = [[status[t][j] == DROPPED for j in range(k)] for t in range(n)]
        for _ in range(k if max_rounds < 0 else max_rounds):
            open_ = {gx: load.get(gx, 0) < limit[gx] for gx in limit}  # at the start of the round
            proposals = {}
            for t in range(n):
                if not any(pending[t]):
                    continue
                taken = {target[t][j] for j in range(k) if not pending[t][j]}  # kept or rerouted
                for j in range(k):
                    if not pending[t][j]:
                        continue
                    best = None
                    for x in range(e):  # highest affinity, ties to the lower expert
                        if x in taken or not open_[(group[t], x)] or a[t][x] < tau:
                            continue
                        if best is None or a[t][x] > a[t][best]:
                            best = x
                    if best is not None:
                        taken.add(best)
                        proposals.setdefault((group[t], best), []).append((t, j))
            if not proposals:
                break
            for (g, x), props in proposals.items():
                props.sort(key=lambda tj: (-a[tj[0]][x], tj[0]))
                room = max(0, limit[(g, x)] - load.get((g, x), 0))
                for t, j in props[:room]:
                    status[t][j] = REROUTED
                    target[t][j] = x
                    pending[t][j] = False
                load[(g, x)] = load.get((g, x), 0) + min(room, len(props))

    admitted = [[target[t][j] if status[t][j] != DROPPED else -1 for j in range(k)] for t in range(n)]
    return (torch.tensor(admitted, dtype=torch.long).reshape(n, k),
            torch.tensor(status, dtype=torch.long).reshape(n, k))


def admitted_gates(z: torch.Tensor, routed: torch.Tensor, admitted: torch.Tensor, *, gating: str,
                   normalize: Optional[bool] = None, scaling_factor: float = 1.0, renormalize: bool = False,
                   **_ignored) -> torch.Tensor:
    """The gates after admission (docs/admission.md section 4), differentiable in z."""
    normalize = normalizes_by_default(gating) if normalize is None else normalize
    scale = f32(scaling_factor)
    x = gate_inputs(gating, sanitize(z))
    routed = routed.long()
    admitted = admitted.long()
    sigma = x.gather(1, routed)
    phi = x.gather(1, admitted.clamp(min=0))
    w = gate_weights(gating, sigma, normalize, scale)
    # y(.): one value through the routed normaliser, then the scaling factor
    if gating == "softmax_after_topk":
        m = sigma.detach().max(dim=1, keepdim=True).values.clamp(min=-FLT_MAX)
        # Only rerouted slots use y: elsewhere exp(phi - m) may overflow (m = -FLT_MAX when every
        # routed logit is -inf), and inf times a zero upstream gradient is NaN.
        rerouted = (admitted >= 0) & (admitted != routed)
        phi = torch.where(rerouted, phi, m.expand_as(phi))
        y = _safe_div(torch.exp(phi - m), torch.exp(sigma - m).sum(dim=1, keepdim=True)) * scale
    elif normalize:
        y = phi / (sigma.sum(dim=1, keepdim=True) + 1e-20) * scale
    else:
        y = phi * scale
    kept = admitted == routed
    dropped = admitted < 0
    base = torch.where(kept, w, torch.where(dropped, torch.zeros_like(w), y))
    if renormalize:
        survived = base.sum(dim=1, keepdim=True)
        ratio = _safe_div(w.sum(dim=1, keepdim=True), survived)
        on = dropped.any(dim=1, keepdim=True) & (survived != 0)
        base = torch.where(on & ~dropped, base * ratio, base)
    return base


# ---------------------------------------------------------------------------
# Dispatch metadata (docs/admission.md section 5) and expert choice (section 6)

def dispatch(indices: torch.Tensor, num_experts: int, align: int = 1, num_ranks: int = 1,
             expert_rank: Optional[torch.Tensor] = None, capacity: int = 0):
    """(counts, offsets, permutation, inverse, rank_counts), int64; the permutation
    has the bound's N*S + E*(align - 1) rows, -1 past the rows used; with a fixed
    capacity C every expert owns ceil(C / align) * align rows."""
    flat = indices.long().reshape(-1)
    counts = torch.tensor([int((flat == x).sum()) for x in range(num_experts)], dtype=torch.long)
    rows_of = torch.full_like(counts, capacity) if capacity > 0 else counts
    padded = (rows_of + align - 1) // align * align
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(padded, 0)])
    bound = int(offsets[-1]) if capacity > 0 else flat.numel() + num_experts * (align - 1)
    permutation = torch.full((bound,), -1, dtype=torch.long)
    inverse = torch.full((flat.numel(),), -1, dtype=torch.long)
    for x in range(num_experts):
        slots = torch.nonzero(flat == x).reshape(-1)  # ascending slot id = (token, slot) order
        rows = torch.arange(int(offsets[x]), int(offsets[x]) + slots.numel())
        permutation[rows] = slots
        inverse[slots] = rows
    ranks = (torch.arange(num_experts) // (num_experts // num_ranks) if expert_rank is None
             else expert_rank.long())
    rank_counts = torch.tensor([int(counts[ranks == r].sum()) for r in range(num_ranks)], dtype=torch.long)
    return counts, offsets, permutation, inverse, rank_counts


def expert_choice(z: torch.Tensor, *, top_k: int = 2, capacity_factor: float = 1.0, min_capacity: int = 0,
                  group_ids: Optional[torch.Tensor] = None, num_groups: int = 1,
                  capacity: Optional[torch.Tensor] = None):
    """(indices [N, E] int64, gates [N, E] float64 differentiable, experts_per_token [N])."""
    n, e = z.shape
    s = softmax_rows(sanitize(z))
    sd = s.detach().tolist()
    group = [0] * n if group_ids is None else group_ids.long().tolist()
    chosen = torch.zeros(n, e, dtype=torch.bool)
    for g in range(num_groups):
        members = [t for t in range(n) if group[t] == g]
        if not members:
            continue
        for x in range(e):
            c = int(capacity[x]) if capacity is not None else capacity_rule(capacity_factor, min_capacity,
                                                                             len(members), top_k, e)
            for t in sorted(members, key=lambda t: (-sd[t][x], t))[:c]:
                chosen[t, x] = True
    indices = torch.full((n, e), -1, dtype=torch.long)
    for t in range(n):
        picked = torch.nonzero(chosen[t]).reshape(-1)
        indices[t, :picked.numel()] = picked
    gates = torch.where(indices >= 0, s.gather(1, indices.clamp(min=0)), torch.zeros_like(s))
    return indices, gates, chosen.sum(dim=1)
