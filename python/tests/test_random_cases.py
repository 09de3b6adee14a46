"""Random cases through the Python operators (docs/reliability.md, "Random cases through the Python
operators"): each case draws a router configuration (every gating, selection, prior and penalty with
its scope), a batch shape with E not a multiple of 32, a memory layout (contiguous, transposed, or a
strided slice) and logits on a grid of 1/8 in [-8, 8] (so exact ties happen and are resolved alike, but
no two distinct keys are within float rounding of each other), with now and then a row holding a NaN,
a -inf or a +inf; and an admission (by position, probability or CIPHER, strict or reroute) for one case in
three. Routing, penalties and dL/dz are compared with the float64 reference (compare_route), admission
and dispatch with compare_admission. MOE_ROUTE_RANDOM_CASES sets how many cases run (default 40); a
failure names its seed, and one seed replays one case."""

import os

import pytest
import torch

import moe_route as mr
from helpers import GATINGS, compare_route, prepared_prior
from test_admission import compare_admission

CASES = int(os.environ.get("MOE_ROUTE_RANDOM_CASES", "40"))


def _logits(g, n, e, layout):
    z = torch.randint(-64, 65, (n, e), generator=g).to(torch.float32) / 8
    for t in range(n):
        kind = int(torch.randint(0, 10, (1,), generator=g))
        if kind == 0:
            z[t, int(torch.randint(0, e, (1,), generator=g))] = float("nan")
        elif kind in (1, 2):
            z[t, int(torch.randint(0, e, (1,), generator=g))] = float("-inf") if kind == 1 else float("inf")
    if layout == "transposed":  # column-major storage, the same values
        return z.t().contiguous().t()
    if layout == "strided":  # every other column of a wider buffer
        wide = torch.zeros(n, 2 * e)
        wide[:, ::2] = z
        return wide[:, ::2]
    return z


def _config(g, e):
    pick = lambda seq: seq[int(torch.randint(0, len(seq), (1,), generator=g))]  # noqa: E731
    gating = pick(GATINGS)
    selections = ["top_k", "group_limited", "fixed"]
    if gating != "softmax_after_topk":
        selections += ["expert_bias", "group_limited_bias", "group_limited_score"]
    selection = pick(selections)
    if selection in ("expert_bias", "group_limited_bias"):
        # Keys s + b, with b a multiple of 4: experts with different b are apart by more than any s
        # range, and no s is small enough to vanish in s + b in fp32 (a softmax's can).
        gating = pick(["sigmoid", "sqrt_softplus"])
    fields = dict(gating=gating, selection=selection, normalize=bool(pick([0, 1])),
                  scaling_factor=pick([1.0, 2.5, 0.5]))
    selectable = e
    if selection.startswith("group_limited"):
        groups = pick([g_ for g_ in (1, 2, 3, 5, 7) if e % g_ == 0])
        top_groups = int(torch.randint(1, groups + 1, (1,), generator=g))
        fields.update(groups=groups, top_groups=top_groups, per_group_k=e // groups)
        selectable = top_groups * (e // groups)
    fields["top_k"] = int(torch.randint(1, min(selectable, 8) + 1, (1,), generator=g))
    fields["prior"] = pick(["none", "log_prior_bias", "prior_override"])
    if fields["prior"] == "log_prior_bias":
        fields.update(prior_beta=pick([0.5, 1.0, 3.0]), bias_gates=bool(pick([0, 1])))
    for name in ("load_balance", "z_loss", "kl_to_base", "logit_l2", "locality"):
        fields[name] = pick([0.0, 0.0, 0.01, 0.5])
    fields["load_balance_scope"] = pick(["batch", "sequence", "global_batch"])
    if fields["load_balance_scope"] != "global_batch":
        fields["load_balance_counts"] = pick(["selected", "top_k"])
    if fields["load_balance_scope"] == "sequence":
        fields["load_balance_sequence_length"] = pick(["own", "batch_mean"])
    fields["locality_epsilon"] = pick([1e-3, 0.1, 0.5])
    return mr.RouterConfig(**fields)


def _inputs(g, n, e, cfg):
    s = 3
    _, prep = prepared_prior(s, e)
    ranks = torch.randint(0, 3, (e,), generator=g)
    inputs = dict(prior_bias=prep.bias, prior_probs=prep.probs,
                  token_prior_row=torch.randint(-1, s, (n,), generator=g),
                  sequence_ids=torch.randint(0, 3, (n,), generator=g), num_sequences=3,
                  load_fractions=torch.full((e,), 1.0 / e), expert_rank=ranks, rank=int(ranks[0]))
    if cfg.selection in ("expert_bias", "group_limited_bias"):
        inputs["expert_bias"] = torch.randint(-2, 3, (e,), generator=g).to(torch.float32) * 4
    return inputs


@pytest.mark.parametrize("seed", range(CASES))
def test_random_case(seed):
    g = torch.Generator().manual_seed(20261206 + seed)
    torch.manual_seed(seed)  # prepared_prior's and compare_route's draws
    e = int(torch.randint(1, 41, (1,), generator=g))
    if e % 32 == 0:
        e += 1
    n = int(torch.randint(0, 24, (1,), generator=g))
    cfg = _config(g, e)
    layout = ["contiguous", "transposed", "strided"][int(torch.randint(0, 3, (1,), generator=g))]
    z = _logits(g, n, e, layout)
    inputs = _inputs(g, n, e, cfg)
    compare_route(cfg, z, **inputs)
    # compare_admission's reference gates come from z, not from the soft prior's z'.
    soft_prior_gates = cfg.prior == "log_prior_bias" and cfg.bias_gates
    if int(torch.randint(0, 3, (1,), generator=g)) == 0 and not soft_prior_gates:
        adm = [mr.Admission.capacity_position(1.0), mr.Admission.capacity_probs(0.75, 1),
               mr.Admission.cipher_strict(0.01, 1.0),
               mr.Admission.cipher_reroute(0.0, 1.25, 1.0)][int(torch.randint(0, 4, (1,), generator=g))]
        norms = dict(hidden_norms=torch.randint(1, 9, (n,), generator=g).to(torch.float32),
                     weight_norms=torch.randint(1, 9, (e,), generator=g).to(torch.float32))
        align = int(torch.randint(1, 5, (1,), generator=g))
        compare_admission(cfg, adm, z, dispatch_align=align, num_ranks=3, **inputs, **norms)
