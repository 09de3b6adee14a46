"""Gating and selection (docs/policies.md sections 1-2) against the reference: indices,
gates and dL/dz; ties, non-finite logits, shapes at the edges, 16-bit logits,
non-contiguous inputs and determinism."""

import math

import pytest
import torch

import moe_route as mr
import reference as ref
from helpers import GATINGS, assert_close, assert_grad, compare_route, fields, prepared_prior, randn

nan, inf = math.nan, math.inf
SELECTIONS = ("top_k", "expert_bias", "group_limited", "group_limited_bias", "group_limited_score", "fixed")


# softmax_after_topk has no scores before selection, so it cannot key on s or s + b
COMBINATIONS = [(g, s) for g in GATINGS for s in SELECTIONS
                if not (g == "softmax_after_topk" and s in ("expert_bias", "group_limited_bias", "group_limited_score"))]


@pytest.mark.parametrize("gating,selection", COMBINATIONS)
@pytest.mark.parametrize("normalize", [False, True])
def test_gating_and_selection_match_reference(gating, selection, normalize, gen):
    cfg = mr.RouterConfig(gating=gating, selection=selection, top_k=3, normalize=normalize, scaling_factor=1.7,
                          groups=4, top_groups=2, per_group_k=2)
    z = randn(48, 36, gen=gen)
    bias = randn(36, scale=0.05, gen=gen)
    compare_route(cfg, z, expert_bias=bias if cfg.uses_expert_bias else None)


@pytest.mark.parametrize("gating", GATINGS)
def test_default_normalisation_and_scaling(gating, gen):
    z = randn(32, 16, gen=gen)
    res = compare_route(mr.RouterConfig(gating=gating, top_k=4), z)
    sums = res.gates.detach().sum(dim=1)
    if gating in ("sigmoid", "sqrt_softplus", "softmax_after_topk"):  # normalised by default (or by construction)
        assert_close(sums, torch.ones(32), rtol=1e-6, atol=1e-6)
    else:
        assert bool((sums < 1).all())
    scaled = mr.route(z, mr.RouterConfig(gating=gating, top_k=4, scaling_factor=2.5))
    assert torch.equal(scaled.indices, res.indices)
    assert_close(scaled.gates, res.gates.detach() * 2.5, rtol=1e-6, atol=0)


@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("e,k", [(37, 5), (37, 1), (13, 13), (16, 16), (1, 1), (100, 16)])
def test_shapes_at_the_edges(gating, e, k, gen):
    z = randn(20, e, gen=gen)
    compare_route(mr.RouterConfig(gating=gating, top_k=k), z)
    if gating != "softmax_after_topk":
        compare_route(mr.RouterConfig(gating=gating, selection="expert_bias", top_k=k), z,
                      expert_bias=randn(e, scale=0.1, gen=gen))
    compare_route(mr.RouterConfig(gating=gating, selection="fixed", top_k=k), z)


def test_no_tokens():
    for gating in GATINGS:
        z = torch.zeros(0, 12, requires_grad=True)
        res = mr.route(z, mr.RouterConfig(gating=gating, top_k=3, load_balance=0.1, z_loss=0.1))
        assert res.indices.shape == (0, 3) and res.gates.shape == (0, 3)
        assert res.nonfinite_rows == 0
        assert torch.equal(res.penalty_values, torch.zeros(5))
        assert torch.equal(res.tokens_per_expert, torch.zeros(12, dtype=torch.int64))
        (res.gates.sum() + res.aux_loss).backward()
        assert z.grad.shape == (0, 12)


# ---------------------------------------------------------------------------
# Ties: the lower expert index wins (torch.topk does not promise that).

@pytest.mark.parametrize("gating", GATINGS)
def test_ties_go_to_the_lower_expert(gating):
    z = torch.tensor([[1.0, 2.0, 2.0, 1.0, 2.0, 0.0],
                      [0.5] * 6,
                      [3.0, -1.0, 3.0, -1.0, 3.0, 3.0],
                      [-0.0, 0.0, -1.0, 0.0, -0.0, -2.0]])
    res = compare_route(mr.RouterConfig(gating=gating, top_k=4), z)
    expected = [[1, 2, 4, 0], [0, 1, 2, 3], [0, 2, 4, 5], [0, 1, 3, 4]]
    assert res.indices.tolist() == expected


@pytest.mark.parametrize("gating", ["softmax", "sigmoid", "sqrt_softplus"])
def test_expert_bias_keys_ties_and_gates(gating):
    z = torch.tensor([[0.3, 0.3, 0.3, 0.3, 0.3, 0.3],
                      [1.0, 0.0, 1.0, 0.0, 1.0, 0.0],
                      [2.0, 1.0, 0.5, -1.0, 0.0, 0.0]])
    bias = torch.tensor([0.0, 0.25, 0.0, 0.25, 0.0, 0.0])
    cfg = mr.RouterConfig(gating=gating, selection="expert_bias", top_k=3)
    res = compare_route(cfg, z, expert_bias=bias)
    # row 0: keys s + b tie pairwise, so experts 1 and 3 (bias) then the lowest of the rest
    assert res.indices[0].tolist() == [1, 3, 0]
    # a huge bias selects an expert without changing the gates (they use the unbiased s)
    huge = torch.tensor([0.0, 0.0, 0.0, 100.0, 0.0, 0.0])
    pushed = compare_route(cfg, z, expert_bias=huge)
    assert bool((pushed.indices[:, 0] == 3).all())
    scores = ref.scores(gating, z.double())
    sel = scores.gather(1, pushed.indices.long())
    assert_close(pushed.gates, ref.gate_weights(gating, sel, gating != "softmax", 1.0), rtol=1e-5, atol=1e-6)


def test_group_limited_picks_groups_by_sum_of_top_keys():
    # E = 8 in 4 groups of 2; per_group_k = 2: group scores 1.9, -2.0, 1.95, 0.2. Plain top-2 takes
    # experts 2 and 0; group-limited keeps groups 2 and 0 and takes 0 and 4 (1.0 each, the lower first).
    z = torch.tensor([[1.0, 0.9, 3.0, -5.0, 1.0, 0.95, 0.1, 0.1]])
    cfg = mr.RouterConfig(selection="group_limited", top_k=2, groups=4, top_groups=2, per_group_k=2)
    res = compare_route(cfg, z)
    assert res.indices.tolist() == [[0, 4]]
    assert compare_route(mr.RouterConfig(top_k=2), z).indices.tolist() == [[2, 0]]
    # per_group_k = 1: group 1 (3.0) then groups 0 and 2 tie at 1.0 -> the lower group, 0
    res1 = compare_route(mr.RouterConfig(selection="group_limited", top_k=2, groups=4, top_groups=2,
                                         per_group_k=1), z)
    assert res1.indices.tolist() == [[2, 0]]
    # identical groups tie: the lower groups are kept
    same = torch.tensor([[0.5, 0.2, 0.5, 0.2, 0.5, 0.2, 0.5, 0.2]])
    cfg3 = mr.RouterConfig(selection="group_limited", top_k=3, groups=4, top_groups=2, per_group_k=2)
    assert compare_route(cfg3, same).indices.tolist() == [[0, 2, 1]]


@pytest.mark.parametrize("gating", GATINGS)
def test_group_limited_with_non_finite_logits(gating, gen):
    n, e = 40, 16
    z = randn(n, e, gen=gen)
    kind = torch.randint(0, 12, (n, e), generator=gen)
    z[kind == 0], z[kind == 1], z[kind == 2] = nan, inf, -inf
    z[0] = nan  # all NaN: groups tie at -inf, the lowest kept
    z[1, :8] = nan  # groups made only of NaN rank last
    cfg = mr.RouterConfig(gating=gating, selection="group_limited", top_k=4, groups=4, top_groups=2)
    res = mr.route(z, cfg)
    idx, gates = ref.route(z.double(), **fields(cfg))
    assert torch.equal(res.indices.long(), idx)
    assert res.indices[0].tolist() == [0, 1, 2, 3]
    assert bool((res.indices[1] >= 8).all())
    assert_close(res.gates, gates, rtol=1e-5, atol=1e-6)


def test_group_limited_bias_matches_reference_deepseek_v3_shape(gen):
    cfg = mr.RouterConfig.preset("deepseek_v3")
    e = mr.RouterConfig.preset_experts("deepseek_v3")
    assert (cfg.gating, cfg.selection, cfg.top_k) == ("sigmoid", "group_limited_bias", 8)
    z = randn(24, e, scale=1.0, gen=gen)
    compare_route(cfg, z, expert_bias=randn(e, scale=0.02, gen=gen))


def test_fixed_assignment_ignores_logits():
    n, e, k = 9, 7, 3
    z = torch.full((n, e), nan)
    z[:, 0] = 5.0
    res = mr.route(z, mr.RouterConfig(selection="fixed", top_k=k))
    expected = [[(t * k + j) % e for j in range(k)] for t in range(n)]
    assert res.indices.tolist() == expected
    compare_route(mr.RouterConfig(selection="fixed", top_k=k, gating="sigmoid"), randn(n, e))


# ---------------------------------------------------------------------------
# Non-finite logits (numerics.md): NaN -> -inf key, +-inf saturate.

def test_top_k_keys_on_sanitised_logits():
    big = torch.finfo(torch.float32).max
    cfg = mr.RouterConfig(gating="sigmoid", top_k=2)
    cases = [([big, inf, 1.0], [0, 1]), ([1.0, inf, big], [1, 2]), ([nan, -inf, -big], [1, 2]),
             ([nan, nan, -inf], [2, 0]), ([-big, nan, -inf], [0, 2])]
    for row, want in cases:
        z = torch.tensor([row])
        res = mr.route(z, cfg)
        assert res.indices[0].tolist() == want, row
        assert torch.equal(res.indices.long(), ref.route(z.double(), gating="sigmoid", top_k=2)[0])


def test_saturated_scores_still_rank_by_logit():
    res = compare_route(mr.RouterConfig(gating="sigmoid", top_k=3), torch.tensor([[20.0, 30.0, 25.0, 0.0]]))
    assert res.indices.tolist() == [[1, 2, 0]]
    assert_close(res.gates, torch.full((1, 3), 1 / 3), rtol=1e-6, atol=0)
    huge = torch.tensor([[1e30, -1e30, 1.0000001e30, 80.0, -80.0]])
    assert compare_route(mr.RouterConfig(top_k=3), huge).indices.tolist() == [[2, 0, 3]]


@pytest.mark.parametrize("e,k", [(256, 8), (300, 16), (4096, 16), (64, 1)])
@pytest.mark.parametrize("selection", ["top_k", "expert_bias"])
def test_wide_rows_with_many_ties(e, k, selection, gen):
    """Few distinct values per row: the selection's candidate paths see many ties."""
    n = 6 if e == 4096 else 24
    z = torch.randint(-3, 4, (n, e), generator=gen).float() * 0.5
    z[0] = 1.0  # one fully tied row
    cfg = mr.RouterConfig(gating="sigmoid", selection=selection, top_k=k)
    bias = (torch.randint(0, 2, (e,), generator=gen).float() * 0.25) if selection == "expert_bias" else None
    res = compare_route(cfg, z, expert_bias=bias)
    assert res.indices[0].tolist() == (list(range(k)) if bias is None else
                                       torch.nonzero(bias == bias.max()).reshape(-1)[:k].tolist())


@pytest.mark.parametrize("gating", GATINGS)
def test_nan_never_selected_while_a_number_exists(gating, gen):
    n, e, k = 60, 23, 6
    z = randn(n, e, gen=gen)
    finite = torch.randint(1, e + 1, (n,), generator=gen)
    for t in range(n):
        perm = torch.randperm(e, generator=gen)
        z[t, perm[finite[t]:]] = nan
    res = mr.route(z, mr.RouterConfig(gating=gating, top_k=k))
    picked_nan = torch.isnan(z.gather(1, res.indices.long()))
    assert torch.equal(picked_nan, torch.arange(k).unsqueeze(0) >= finite.unsqueeze(1))
    assert res.nonfinite_rows == int((finite < e).sum())
    idx, gates = ref.route(z.double(), gating=gating, top_k=k)
    assert torch.equal(res.indices.long(), idx)
    assert_close(res.gates, gates, rtol=1e-5, atol=1e-6)
    assert bool(torch.isfinite(res.gates).all())


@pytest.mark.parametrize("gating", GATINGS)
def test_all_nan_and_infinite_rows(gating):
    z = torch.tensor([[nan] * 5,
                      [1.0, inf, 2.0, nan, -inf],
                      [inf, 1.0, inf, 0.0, nan],
                      [-inf, -inf, -inf, -inf, -inf],
                      [0.1, 0.2, 0.3, 0.4, 0.5]])
    zz = z.clone().requires_grad_(True)
    res = mr.route(zz, mr.RouterConfig(gating=gating, top_k=3))
    assert res.nonfinite_rows == 4
    assert res.indices[0].tolist() == [0, 1, 2]
    assert res.gates[0].tolist() == [0.0, 0.0, 0.0]
    idx, gates = ref.route(z.double(), gating=gating, top_k=3)
    assert torch.equal(res.indices.long(), idx)
    assert_close(res.gates, gates, rtol=1e-5, atol=1e-6)
    res.gates.sum().backward()
    assert bool(torch.isfinite(zz.grad).all())
    # the finite row's gradient is the plain one
    z64 = z[4:].double().requires_grad_(True)
    ref.route(z64, gating=gating, top_k=3)[1].sum().backward()
    assert_grad(zz.grad[4:], z64.grad)


def test_nan_logit_under_expert_bias_stays_last():
    z = torch.tensor([[nan, 0.0, -inf, 1.0]])
    b = torch.tensor([100.0, 0.0, 0.0, 0.0])
    for k, want in ((2, [[3, 1]]), (4, [[3, 1, 2, 0]])):
        cfg = mr.RouterConfig(selection="expert_bias", top_k=k)
        got = mr.route(z, cfg, expert_bias=b).indices
        assert got.tolist() == want
        assert torch.equal(got.long(), ref.route(z.double(), **fields(cfg), expert_bias=b)[0])
    # a NaN bias entry makes that key NaN: it ranks below -inf
    zs = torch.zeros(1, 4)
    bn = torch.tensor([nan, -0.3, 0.0, -inf])
    cfg = mr.RouterConfig(gating="sigmoid", selection="expert_bias", top_k=4)
    got = mr.route(zs, cfg, expert_bias=bn).indices
    assert got.tolist() == [[2, 1, 3, 0]]
    assert torch.equal(got.long(), ref.route(zs.double(), **fields(cfg), expert_bias=bn)[0])


# ---------------------------------------------------------------------------
# 16-bit logits, non-contiguous inputs, determinism.

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gating", GATINGS)
def test_16bit_logits_route_as_their_fp32_values(dtype, gating, gen):
    z16 = randn(40, 24, gen=gen).to(dtype)
    cfg = mr.RouterConfig(gating=gating, top_k=4, load_balance=0.1, z_loss=0.01)
    a = z16.clone().requires_grad_(True)
    res16 = mr.route(a, cfg)
    res32 = compare_route(cfg, z16.float())
    assert torch.equal(res16.indices, res32.indices)
    assert torch.equal(res16.gates, res32.gates)
    assert torch.equal(res16.penalty_values, res32.penalty_values)
    w = torch.randn(40, 4)
    (res16.gates * w).sum().backward()
    assert a.grad.dtype == dtype
    b = z16.float().requires_grad_(True)
    (mr.route(b, cfg).gates * w).sum().backward()
    assert torch.equal(a.grad, b.grad.to(dtype))


def test_non_contiguous_inputs_give_the_contiguous_result(gen):
    zt = randn(24, 40, gen=gen).t()  # [40, 24], a transposed view
    assert not zt.is_contiguous()
    bias = randn(48, scale=0.1, gen=gen)[::2]  # strided [24]
    _, prep = prepared_prior(4, 24)
    rows = torch.randint(-1, 4, (80,), generator=gen)[::2]
    pb = prep.bias.t().contiguous().t()  # same values, column-major
    assert not pb.is_contiguous() and not rows.is_contiguous()
    cfg = mr.RouterConfig(gating="sigmoid", selection="expert_bias", top_k=3, prior="log_prior_bias",
                          kl_to_base=0.1, load_balance=0.1)
    kw = dict(prior_probs=prep.probs, token_prior_row=rows)
    a = zt.clone().requires_grad_(True)
    got = mr.route(a, cfg, expert_bias=bias, prior_bias=pb, **kw)
    b = zt.contiguous().requires_grad_(True)
    want = mr.route(b, cfg, expert_bias=bias.contiguous(), prior_bias=pb.contiguous(), **kw)
    assert torch.equal(got.indices, want.indices)
    assert torch.equal(got.gates, want.gates)
    assert torch.equal(got.penalty_values, want.penalty_values)
    w = torch.randn(40, 3)
    (got.gates * w).sum().add(got.aux_loss).backward()
    (want.gates * w).sum().add(want.aux_loss).backward()
    assert torch.equal(a.grad, b.grad)
    compare_route(cfg, zt.contiguous(), expert_bias=bias.contiguous(), prior_bias=prep.bias, **kw)


def test_route_result_fields(gen):
    z = randn(10, 8, gen=gen)
    res = mr.route(z, mr.RouterConfig(top_k=2, load_balance=0.1, z_loss=0.2))
    assert list(res.penalties) == list(mr.PENALTIES) == ["load_balance", "z_loss", "kl_to_base", "logit_l2",
                                                         "locality"]
    assert torch.equal(res.aux_loss, res.penalty_values.sum())
    assert res.status is None and res.admission_report is None
    assert torch.equal(res.routed_indices, res.indices) and torch.equal(res.routed_gates, res.gates.detach())
    assert torch.equal(res.tokens_per_expert, torch.bincount(res.indices.reshape(-1).long(), minlength=8))


def _run(z, cfg, threads, **kw):
    a = z.clone().requires_grad_(True)
    res = mr.route(a, cfg, threads=threads, **kw)
    w = torch.linspace(-1, 1, res.gates.numel()).reshape(res.gates.shape)
    ((res.gates * w).sum() + res.aux_loss).backward()
    return res, a.grad


@pytest.mark.parametrize("gating", GATINGS)
def test_deterministic_and_thread_count_independent(gating, gen):
    n, e = 2048, 40  # enough tokens for the CPU backend to split them over threads
    z = randn(n, e, gen=gen)
    _, prep = prepared_prior(8, e)
    rows = torch.randint(-1, 8, (n,), generator=gen)
    cfg = mr.RouterConfig(gating=gating, top_k=4, prior="log_prior_bias", load_balance=0.1, z_loss=0.01,
                          kl_to_base=0.1, logit_l2=0.01, locality=0.1)
    kw = dict(prior_bias=prep.bias, prior_probs=prep.probs, token_prior_row=rows,
              expert_rank=torch.arange(e) // 10, rank=1)
    r1, g1 = _run(z, cfg, 1, **kw)
    r1b, g1b = _run(z, cfg, 1, **kw)
    r2, g2 = _run(z, cfg, 2, **kw)
    for other, grad in ((r1b, g1b), (r2, g2)):
        assert torch.equal(r1.indices, other.indices)
        assert torch.equal(r1.gates, other.gates)
        assert torch.equal(r1.penalty_values, other.penalty_values)
        assert torch.equal(g1, grad)
