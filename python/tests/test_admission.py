"""Admission (docs/policies.md section 4, docs/admission.md), the dispatch metadata and
expert choice against the reference: indices, status, gates and dL/dz."""

import math

import pytest
import torch

import moe_route as mr
import reference as ref
from helpers import GATINGS, PENALTY_UPSTREAM, assert_close, assert_grad, fields, randn

Adm = mr.Admission


def compare_admission(cfg, adm, z32, *, check_grad=True, dispatch_align=1, num_ranks=None, **inputs):
    """Route + admit with the extension and the reference; indices, status, gates,
    the dispatch metadata and dL/dz of sum(gates * w) + 3 * sum(penalties)."""
    z = z32.clone().requires_grad_(True)
    res = mr.route(z, cfg, admission=adm, dispatch_align=dispatch_align, num_ranks=num_ranks, **inputs)
    z64 = z32.double().requires_grad_(True)
    routed, routed_gates = ref.route(z64, **fields(cfg), **inputs)
    assert torch.equal(res.routed_indices.long(), routed)
    admitted, status = ref.admit(z32, routed, gating=cfg.gating, routed_gates=routed_gates.detach(), **fields(adm),
                                 **inputs)
    assert torch.equal(res.indices.long(), admitted), f"admitted:\n{res.indices}\nreference:\n{admitted}"
    assert torch.equal(res.status.long(), status)
    gates = ref.admitted_gates(z64, routed, admitted, **fields(cfg), renormalize=adm.renormalizes)
    assert_close(res.gates, gates, rtol=1e-5, atol=1e-6)
    assert bool((res.gates[res.indices < 0] == 0).all())
    rep = res.admission_report
    assert rep["kept"] == int((status == ref.KEPT).sum()) and rep["dropped"] == int((status == ref.DROPPED).sum())
    assert rep["rerouted"] == int((status == ref.REROUTED).sum()) and rep["offered"] == status.numel()
    assert rep["tokens_without_experts"] == int((admitted < 0).all(dim=1).sum())
    ranks = 1 if num_ranks is None else num_ranks
    want = ref.dispatch(admitted, z32.shape[1], dispatch_align, ranks, inputs.get("expert_rank"))
    got = res.dispatch
    for a, b in zip((got.tokens_per_expert, got.offsets, got.permutation, got.inverse, got.rank_counts), want):
        assert torch.equal(a, b)
    if check_grad:
        w = torch.randn(admitted.shape)
        ((res.gates * w).sum() + (res.penalty_values * PENALTY_UPSTREAM).sum()).backward()
        values = ref.penalties(z64, routed, **fields(cfg), **inputs)  # on the router's own selection
        ((gates * w.double()).sum() + (values * PENALTY_UPSTREAM.double()).sum()).backward()
        assert_grad(z.grad, z64.grad)
    return res


# ---------------------------------------------------------------------------
# The worked example of docs/admission.md section 2

EXAMPLE_Z = torch.tensor([[2.0, 1.0, 0.1, -1.0], [1.8, 0.2, 1.1, 0.7], [1.5, 1.2, 0.8, 0.0],
                          [2.2, -0.4, 0.9, 0.3], [0.4, 1.6, 0.2, -0.2], [1.9, 0.1, -0.8, 0.6]])
EXAMPLE_CFG = mr.RouterConfig(gating="softmax", top_k=2, normalize=True)
UNIT = dict(hidden_norms=torch.ones(6), weight_norms=torch.ones(4))


def test_worked_example_strict():
    res = compare_admission(EXAMPLE_CFG, Adm.cipher_strict(0.5, capacity_factor=1.0), EXAMPLE_Z, **UNIT)
    assert res.routed_indices.tolist() == [[0, 1], [0, 2], [0, 1], [0, 2], [1, 0], [0, 3]]
    assert res.indices.tolist() == [[0, 1], [-1, 2], [-1, 1], [0, 2], [1, -1], [0, 3]]
    assert_close(res.gates, torch.tensor([[0.7311, 0.2689], [0, 0.3318], [0, 0.4256], [0.7858, 0.2142],
                                          [0.7685, 0], [0.7858, 0.2142]]), rtol=0, atol=6e-5)
    assert res.tokens_per_expert.tolist() == [3, 3, 2, 1]
    d = mr.dispatch(res.indices, 4, align=4, num_ranks=2)
    assert d.offsets.tolist() == [0, 4, 8, 12, 16]
    # 16 rows used of the bound N*K + E*(align - 1) = 24
    assert d.permutation.tolist() == [0, 6, 10, -1, 1, 5, 8, -1, 3, 7, -1, -1, 11, -1, -1, -1] + [-1] * 8
    assert int(d.rows) == 16
    assert d.inverse.tolist() == [0, 4, -1, 8, -1, 5, 1, 9, 6, -1, 2, 12]
    assert d.rank_counts.tolist() == [6, 3]


def test_worked_example_renormalize_and_reroute():
    res = compare_admission(EXAMPLE_CFG, Adm.cipher_strict(0.5, capacity_factor=1.0, renormalize=True),
                            EXAMPLE_Z, **UNIT)
    assert_close(res.gates[[1, 2, 4]], torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0]]), rtol=0, atol=1e-6)
    rr = compare_admission(EXAMPLE_CFG, Adm.cipher_reroute(0.5, capacity_factor=1.0, fill_factor=1.0),
                           EXAMPLE_Z, **UNIT)
    assert rr.indices.tolist() == [[0, 1], [3, 2], [2, 1], [0, 2], [1, -1], [0, 3]]
    assert rr.status.tolist() == [[0, 0], [2, 0], [2, 0], [0, 0], [0, 1], [0, 0]]
    assert_close(rr.gates[1:3], torch.tensor([[0.2224, 0.3318], [0.2853, 0.4256]]), rtol=0, atol=6e-5)
    assert rr.tokens_per_expert.tolist() == [3, 3, 3, 2]


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_reroute_away_from_routed_scores_of_zero_has_a_finite_gradient(gating):
    """A replay routes each token to experts of score 0 (beside a +inf logit under softmax, at -inf logits
    under sigmoid), so the normaliser is 1e-20 and dL/dsigma leaves fp32's range; CIPHER reroute moves
    slots to the expert with a real score. dL/dz was NaN there (docs/admission.md section 4)."""
    cfg = mr.RouterConfig(gating=gating, top_k=2, normalize=True)
    z = torch.tensor([[0.5, -1.0, 3.0, 2.0, 0.25]] * 4)
    z[:, 2] = math.inf if gating == "softmax" else 3.0
    replay = torch.tensor([[0, 1], [3, 4], [0, 3], [1, 4]], dtype=torch.int32)
    if gating == "sigmoid":
        for t, row in enumerate(replay.tolist()):
            z[t, row] = -math.inf  # sigmoid scores of 0
    a = z.clone().requires_grad_(True)
    res = mr.route(a, cfg, replay_indices=replay, admission=Adm.cipher_reroute(0.0, 0.5, 2.0),
                   hidden_norms=torch.ones(4), weight_norms=torch.ones(5))
    assert bool((res.indices == 2).any()), res.indices  # some slot moved to the expert with the real score
    w = torch.tensor([[0.75, -0.5], [0.25, 1.0], [-1.0, 0.5], [0.5, 0.5]])
    (res.gates * w).sum().backward()
    z64 = z.double().requires_grad_(True)
    gates = ref.admitted_gates(z64, replay.long(), res.indices.long(), **fields(cfg))
    (gates * w.double()).sum().backward()
    assert_close(res.gates, gates, rtol=1e-5, atol=1e-6)
    assert bool(torch.isfinite(a.grad).all()), a.grad
    assert_grad(a.grad, z64.grad)


# ---------------------------------------------------------------------------
# Random inputs: every policy under every gating, with and without groups

POLICIES = {
    "capacity_probs": Adm.capacity_probs(1.0),
    "capacity_probs_min": Adm.capacity_probs(0.3, min_capacity=4),
    "capacity_position": Adm.capacity_position(1.25),
    "capacity_gate": Adm.capacity_gate(1.0),
    "gate_threshold": Adm("capacity", "gate", "drop", threshold=0.45, capacity_factor=0.6),
    "logit_threshold": Adm("capacity", "logit", "drop", threshold=1.0, capacity_factor=1.1),
    "cipher_strict": Adm.cipher_strict(0.5, capacity_factor=1.25),
    "cipher_strict_renormalize": Adm.cipher_strict(0.8, capacity_factor=1.0, renormalize=True),
    "locmoe": Adm.locmoe(1.0),
    "cipher_reroute": Adm.cipher_reroute(0.5, capacity_factor=1.25, fill_factor=1.0),
    "probability_reroute": Adm("capacity", "probability", "reroute", capacity_factor=1.0, fill_factor=1.1,
                               max_rounds=1),
}


def _inputs(gen, n, e, groups):
    inputs = dict(hidden_norms=torch.rand(n, generator=gen) * 2 + 0.5, weight_norms=torch.rand(e, generator=gen) + 0.5)
    if groups > 1:
        inputs.update(group_ids=torch.randint(0, groups, (n,), generator=gen), num_groups=groups + 1)  # one empty
    return inputs


@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("groups", [1, 3])
def test_admission_matches_reference(gating, policy, groups, gen):
    n, e, k = 60, 12, 3
    # skewed logits so that some experts overflow
    z = randn(n, e, gen=gen) + torch.linspace(1.5, -1.5, e)
    cfg = mr.RouterConfig(gating=gating, top_k=k, scaling_factor=1.5)
    res = compare_admission(cfg, POLICIES[policy], z, dispatch_align=4, **_inputs(gen, n, e, groups))
    rep = res.admission_report
    assert rep["over_capacity"] > 0  # the policy did something
    assert (rep["below_threshold"] > 0) == (POLICIES[policy].threshold > 0.1)
    assert (rep["rerouted"] > 0) == (POLICIES[policy].overflow == "reroute")


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_admission_with_per_expert_capacity_and_penalties(gating, gen):
    n, e = 50, 10
    z = randn(n, e, gen=gen) + torch.linspace(1.0, -1.0, e)
    cfg = mr.RouterConfig(gating=gating, top_k=2, load_balance=0.5, z_loss=0.1)
    capacity = torch.tensor([0, 3, 5, 100, 8, 8, 2, 1, 0, 4])
    for adm in (Adm.capacity_probs(1.0), Adm.cipher_reroute(-1.0, capacity_factor=1.0, fill_factor=2.0),
                Adm.cipher_strict(0.0, renormalize=True)):
        compare_admission(cfg, adm, z, capacity=capacity, expert_rank=torch.arange(e) // 5, num_ranks=2,
                          **_inputs(gen, n, e, 1))


@pytest.mark.parametrize("renormalize", [False, True])
def test_drop_admission_under_log_prior_bias(renormalize, gen):
    """Routed on z' = z + beta b[r(t)]; admission ranks by the unbiased logits;
    kept gates are the routed ones and the backward runs through z'."""
    n, e, s = 48, 10, 4
    z32 = randn(n, e, gen=gen) + torch.linspace(1.0, -1.0, e)
    pi = torch.distributions.Dirichlet(torch.full((e,), 0.5)).sample((s,)).float()
    prep = mr.prior.prepare(pi)
    rows = torch.randint(-1, s, (n,), generator=gen)
    cfg = mr.RouterConfig(gating="sigmoid", top_k=2, prior="log_prior_bias", prior_beta=0.9)
    adm = Adm("capacity", "logit", "drop", capacity_factor=1.0, renormalize=renormalize)
    z = z32.clone().requires_grad_(True)
    res = mr.route(z, cfg, admission=adm, prior_bias=prep.bias, token_prior_row=rows)
    z64 = z32.double().requires_grad_(True)
    routed, _ = ref.route(z64, **fields(cfg), prior_bias=prep.bias, token_prior_row=rows)
    assert torch.equal(res.routed_indices.long(), routed)
    admitted, status = ref.admit(z32, routed, gating="sigmoid", **fields(adm))
    assert torch.equal(res.indices.long(), admitted) and torch.equal(res.status.long(), status)
    active = (rows >= 0).unsqueeze(1)
    zb = torch.where(active, ref.biased_logits(z64, 0.9, prep.bias[rows.clamp(min=0)]), z64)
    gates = ref.admitted_gates(zb, routed, admitted, **fields(cfg), renormalize=renormalize)
    assert_close(res.gates, gates, rtol=1e-5, atol=1e-6)
    w = torch.randn(n, 2)
    (res.gates * w).sum().backward()
    (gates * w.double()).sum().backward()
    assert_grad(z.grad, z64.grad)


def test_reroute_under_log_prior_bias_without_bias_gates(gen):
    n, e, s = 40, 8, 3
    z = randn(n, e, gen=gen) + torch.linspace(1.0, -1.0, e)
    prep = mr.prior.prepare(torch.distributions.Dirichlet(torch.full((e,), 0.5)).sample((s,)).float())
    rows = torch.randint(-1, s, (n,), generator=gen)
    cfg = mr.RouterConfig(top_k=2, normalize=True, prior="log_prior_bias", bias_gates=False, load_balance=0.2)
    res = compare_admission(cfg, Adm.cipher_reroute(0.2, capacity_factor=1.0, fill_factor=1.2), z,
                            prior_bias=prep.bias, token_prior_row=rows, **_inputs(gen, n, e, 1))
    assert res.admission_report["rerouted"] > 0


def test_no_tokens():
    z = torch.zeros(0, 8, requires_grad=True)
    res = mr.route(z, mr.RouterConfig(top_k=2, load_balance=0.1), admission=Adm.cipher_reroute(0.1),
                   hidden_norms=torch.zeros(0), weight_norms=torch.ones(8))
    assert res.indices.shape == res.status.shape == (0, 2) and res.admission_report["offered"] == 0
    (res.gates.sum() + res.aux_loss).backward()
    assert z.grad.shape == (0, 8)
    z = torch.zeros(0, 8, requires_grad=True)
    ec = mr.expert_choice(z)
    assert ec.indices.shape == (0, 8) and ec.report["assignments"] == 0
    ec.gates.sum().backward()
    assert z.grad.shape == (0, 8)


def test_ties_in_affinity_go_to_the_lower_token():
    z = torch.zeros(8, 4)
    z[:, 2] = 1.0  # every token routes to expert 2 (K = 1): capacity ceil(8 / 4 * 1.0) = 2
    for adm in (Adm.capacity_position(1.0), Adm.capacity_probs(1.0), Adm.capacity_gate(1.0)):
        res = compare_admission(mr.RouterConfig(top_k=1), adm, z)
        assert res.indices[:, 0].tolist() == [2, 2] + [-1] * 6
    # position: the earliest tokens, whatever their affinity
    z[5, 2] = 9.0
    res = compare_admission(mr.RouterConfig(top_k=1), Adm.capacity_position(1.0), z)
    assert res.indices[:, 0].tolist() == [2, 2] + [-1] * 6
    res = compare_admission(mr.RouterConfig(top_k=1), Adm.capacity_probs(1.0), z)
    assert res.indices[:, 0].tolist() == [2, -1, -1, -1, -1, 2, -1, -1]


def test_gate_ranks_by_the_routed_gate_where_the_score_ranks_otherwise():
    # Two tokens compete for expert 0 (capacity 1). Token 0 has the larger softmax score
    # for it (0.52 against 0.43), token 1 the larger gate after the top-2 normalisation
    # (0.69 against 0.52): token 1 spreads its mass over experts it does not select.
    # capacity_probs keeps token 0, capacity_gate token 1.
    z = torch.tensor([[3.0, 2.9, -9.0, -9.0], [1.0, 0.2, 0.2, 0.2]])
    cfg = mr.RouterConfig(top_k=2, normalize=True)
    probs = compare_admission(cfg, Adm.capacity_probs(0.5), z)  # C = ceil(2 * 2 / 4 * 0.5) = 1
    gate = compare_admission(cfg, Adm.capacity_gate(0.5), z)
    assert probs.indices[:, 0].tolist() == [0, -1] and gate.indices[:, 0].tolist() == [-1, 0]


def test_reroute_rounds_and_ties_to_the_lower_expert():
    # every token prefers expert 0 and ties on the others; C = 1 per expert (N K / E = 1)
    z = torch.tensor([[2.0, 1.0, 1.0, 1.0]] * 4)
    cfg = mr.RouterConfig(top_k=1)
    res = compare_admission(cfg, Adm("capacity", "logit", "reroute", capacity_factor=1.0, max_rounds=3), z)
    assert res.indices[:, 0].tolist() == [0, 1, 2, 3]  # one reroute per round, lower expert and token first
    assert res.status[:, 0].tolist() == [0, 2, 2, 2]
    res = compare_admission(cfg, Adm("capacity", "logit", "reroute", capacity_factor=1.0), z)  # K = 1 round
    assert res.indices[:, 0].tolist() == [0, 1, -1, -1]


def test_capacity_rule_is_megatrons():
    # C = max(min_capacity, ceil((N K / E) * factor)) in double: N K / E = 7.5, * 0.3 = 2.25 -> 3
    n, e, k = 15, 4, 2
    z = torch.zeros(n, e)
    z[:, 1], z[:, 3] = 2.0, 1.0
    res = compare_admission(mr.RouterConfig(top_k=k), Adm.capacity_probs(0.3), z)
    assert res.tokens_per_expert.tolist() == [0, 3, 0, 3]
    res = compare_admission(mr.RouterConfig(top_k=k), Adm.capacity_probs(0.3, min_capacity=5), z)
    assert res.tokens_per_expert.tolist() == [0, 5, 0, 5]


def test_everything_or_nothing_dropped(gen):
    z = randn(16, 6, gen=gen)
    cfg = mr.RouterConfig(gating="sigmoid", top_k=2)
    res = compare_admission(cfg, Adm.capacity_probs(1.0), z, capacity=torch.zeros(6, dtype=torch.int64))
    assert bool((res.indices == -1).all()) and res.admission_report["tokens_without_experts"] == 16
    assert bool((res.gates == 0).all())
    a, b = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    plain = mr.route(a, cfg)
    loose = mr.route(b, cfg, admission=Adm.capacity_probs(100.0))
    assert torch.equal(loose.indices, plain.indices) and torch.equal(loose.gates, plain.gates)
    assert bool((loose.status == 0).all())
    w = torch.randn(16, 2)
    (plain.gates * w).sum().backward()
    (loose.gates * w).sum().backward()
    assert torch.equal(a.grad, b.grad)  # nothing dropped: the plain backward, bit for bit
    tau = compare_admission(cfg, Adm.cipher_strict(1e9), z, **_inputs(gen, 16, 6, 1))
    assert tau.admission_report["below_threshold"] == 32


def test_k_equals_e_and_one_expert(gen):
    z = randn(20, 5, gen=gen)
    compare_admission(mr.RouterConfig(top_k=5), Adm.cipher_reroute(0.0, capacity_factor=0.5), z,
                      **_inputs(gen, 20, 5, 1))
    compare_admission(mr.RouterConfig(top_k=1), Adm.capacity_probs(0.5), randn(9, 1, gen=gen))
    compare_admission(mr.RouterConfig(top_k=5, normalize=True), Adm.capacity_gate(0.5), z)


def test_admission_thread_count_independent(gen):
    n, e = 2048, 16
    z = randn(n, e, gen=gen) + torch.linspace(1, -1, e)
    cfg = mr.RouterConfig(gating="sigmoid", top_k=4)
    inputs = _inputs(gen, n, e, 2)
    adm = Adm.cipher_reroute(0.05, capacity_factor=1.0, fill_factor=1.2)
    runs = []
    for threads in (1, 2, 2):
        a = z.clone().requires_grad_(True)
        res = mr.route(a, cfg, admission=adm, threads=threads, **inputs)
        (res.gates * torch.linspace(-1, 1, n * 4).reshape(n, 4)).sum().backward()
        runs.append((res, a.grad))
    for res, grad in runs[1:]:
        assert torch.equal(res.indices, runs[0][0].indices) and torch.equal(res.gates, runs[0][0].gates)
        assert torch.equal(grad, runs[0][1])
    assert runs[0][0].admission_report["rerouted"] > 0
    # 16-bit logits admit as their fp32 values
    r16 = mr.route(z.bfloat16(), cfg, admission=adm, **inputs)
    r32 = mr.route(z.bfloat16().float(), cfg, admission=adm, **inputs)
    assert torch.equal(r16.indices, r32.indices) and torch.equal(r16.gates, r32.gates)
    # expert choice too
    ec = []
    for threads in (1, 2):
        a = z.clone().requires_grad_(True)
        res = mr.expert_choice(a, group_ids=inputs["group_ids"], num_groups=inputs["num_groups"], threads=threads)
        (res.gates * torch.linspace(-1, 1, n * e).reshape(n, e)).sum().backward()
        ec.append((res, a.grad))
    assert torch.equal(ec[0][0].indices, ec[1][0].indices) and torch.equal(ec[0][0].gates, ec[1][0].gates)
    assert torch.equal(ec[0][1], ec[1][1])


def test_non_contiguous_admission_inputs(gen):
    n, e = 30, 8
    z = randn(e, n, gen=gen).t()
    norms = (torch.rand(2 * n, generator=gen) + 0.5)[::2]
    wn = (torch.rand(e, 2, generator=gen) + 0.5)[:, 1]
    groups = torch.randint(0, 2, (n, 2), generator=gen)[:, 0]
    cap = torch.tensor([[2, 9]] * e)[:, 0]
    assert not any(t.is_contiguous() for t in (z, norms, wn, groups, cap))
    cfg = mr.RouterConfig(top_k=2)
    adm = Adm.cipher_reroute(0.1, capacity_factor=1.0, fill_factor=1.0)
    kw = dict(hidden_norms=norms, weight_norms=wn, group_ids=groups, num_groups=2, capacity=cap)
    got = mr.route(z, cfg, admission=adm, **kw)
    want = mr.route(z.contiguous(), cfg, admission=adm, **{k: v.contiguous() if torch.is_tensor(v) else v
                                                             for k, v in kw.items()})
    assert torch.equal(got.indices, want.indices) and torch.equal(got.gates, want.gates)
    compare_admission(cfg, adm, z.contiguous(), **kw)
    ec = mr.expert_choice(z, capacity=cap)
    assert torch.equal(ec.indices, mr.expert_choice(z.contiguous(), capacity=cap.contiguous()).indices)


def test_bad_admission_arguments(gen):
    z = randn(8, 4, gen=gen)
    cfg = mr.RouterConfig(top_k=2)
    norms = _inputs(gen, 8, 4, 1)
    cases = [
        (Adm("capacity", "position", "reroute"), {}, "overflow"),
        (Adm("capacity", "gate", "reroute"), {}, "gate affinity exists for the routed slots only"),
        (Adm.capacity_probs(0.0), {}, "capacity_factor"),
        (Adm.capacity_probs(-1.0), {}, "capacity_factor"),
        (Adm("capacity", "position", "drop", threshold=0.1), {}, "threshold"),
        (Adm("capacity", "distance", "drop"), {}, "affinity"),
        (Adm("capacity", "probability", "spill"), {}, "overflow"),
        (Adm("bounded"), {}, "kind"),
        (Adm.capacity_probs(1.0, min_capacity=-1), {}, "min_capacity"),
        (Adm.cipher_strict(0.1), {}, "hidden_norms"),
        (Adm.cipher_strict(0.1), dict(norms, hidden_norms=torch.tensor([1.0, 1, 0, 1, 1, 1, 1, 1])),
         r"hidden_norms\[2\]"),
        (Adm.capacity_probs(1.0), dict(group_ids=torch.tensor([0, 1, 2, 0, 0, 0, 0, 0]), num_groups=2),
         r"group_ids\[2\]"),
        (Adm.capacity_probs(1.0), dict(capacity=torch.tensor([1, 1, -1, 1])), r"capacity\[2\]"),
        (Adm.capacity_probs(1.0), dict(capacity=torch.tensor([1, 1, 1])), "capacity must have shape"),
    ]
    for adm, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            mr.route(z, cfg, admission=adm, **kw)
    with pytest.raises(TypeError, match="capacity must be torch.int64, got torch.float32"):
        mr.route(z, cfg, admission=Adm.capacity_probs(1.0), capacity=torch.ones(4))
    with pytest.raises(TypeError, match="admission must be an Admission"):
        mr.route(z, cfg, admission="cipher_strict")
    with pytest.raises(ValueError, match="reroute admission under log_prior_bias"):
        mr.route(z, mr.RouterConfig(prior="log_prior_bias"), admission=Adm.cipher_reroute(0.1), **norms)


# ---------------------------------------------------------------------------
# Dispatch metadata on its own

@pytest.mark.parametrize("align", [1, 4, 128])
def test_dispatch_matches_reference(align, gen):
    n, s, e = 40, 3, 12
    idx = torch.stack([torch.randperm(e, generator=gen)[:s] for _ in range(n)]).int()
    idx[torch.rand(n, s, generator=gen) < 0.2] = -1
    for ranks, expert_rank in ((1, None), (3, None), (2, torch.tensor([1, 0] * 6))):
        got = mr.dispatch(idx, e, align=align, num_ranks=ranks, expert_rank=expert_rank)
        want = ref.dispatch(idx, e, align, ranks, expert_rank)
        for a, b in zip((got.tokens_per_expert, got.offsets, got.permutation, got.inverse, got.rank_counts), want):
            assert a.dtype == torch.int64 and torch.equal(a, b)
    empty = mr.dispatch(torch.zeros(0, 2, dtype=torch.int32), 4, align=8)
    assert empty.offsets.tolist() == [0] * 5 and int(empty.rows) == 0
    assert empty.permutation.numel() == 4 * 7 and bool((empty.permutation == -1).all())  # the bound, unused
    with pytest.raises(ValueError, match=r"indices\[1\]"):
        mr.dispatch(torch.tensor([[0, 12]]), e)
    with pytest.raises(ValueError, match="num_ranks"):
        mr.dispatch(idx, e, num_ranks=5)
    with pytest.raises(ValueError, match="align"):
        mr.dispatch(idx, e, align=0)
    with pytest.raises(ValueError, match=r"expert_rank\[0\]"):
        mr.dispatch(idx, e, num_ranks=2, expert_rank=torch.full((e,), 2))


@pytest.mark.parametrize("align", [1, 4])
def test_dispatch_with_a_fixed_capacity_matches_reference(align, gen):
    n, s, e = 40, 3, 12
    idx = torch.stack([torch.randperm(e, generator=gen)[:s] for _ in range(n)]).int()
    idx[torch.rand(n, s, generator=gen) < 0.2] = -1
    most = int(torch.bincount(idx[idx >= 0].long(), minlength=e).max())
    for capacity in (most, most + 3, 3 * n):
        got = mr.dispatch(idx, e, align=align, num_ranks=2, capacity=capacity)
        want = ref.dispatch(idx, e, align, 2, capacity=capacity)
        for a, b in zip((got.tokens_per_expert, got.offsets, got.permutation, got.inverse, got.rank_counts), want):
            assert torch.equal(a, b)
        assert got.permutation.numel() == e * ((capacity + align - 1) // align * align) == int(got.rows)
    with pytest.raises(ValueError, match=rf"more than capacity \(= {most - 1}\) slots"):
        mr.dispatch(idx, e, capacity=most - 1)
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        mr.dispatch(idx, e, capacity=-1)
    # A capacity whose padded rows cannot be counted is refused by name before anything is allocated.
    with pytest.raises(ValueError, match=r"capacity \(= 9223372036854775807\) padded to align \(= 4\)"):
        mr.dispatch(idx, e, align=4, capacity=2**63 - 1)
    # The capacity of an admission: the rule's C, which its admitted indices keep within.
    adm = mr.Admission.capacity_gate(1.0)
    assert adm.capacity(n, s, e) == math.ceil(n * s / e)
    assert mr.Admission.capacity_position(0.1, min_capacity=7).capacity(n, s, e) == 7
    with pytest.raises(ValueError, match="dropless admission has no capacity"):
        mr.Admission.dropless().capacity(n, s, e)
    z = randn(n, e, gen=gen)
    cfg = mr.RouterConfig(top_k=s)
    res = mr.route(z, cfg, admission=adm, dispatch_capacity=adm.capacity(n, s, e), dispatch_align=align)
    want = ref.dispatch(res.indices, e, align, 1, capacity=adm.capacity(n, s, e))
    assert torch.equal(res.dispatch.permutation, want[2]) and torch.equal(res.dispatch.offsets, want[1])


# ---------------------------------------------------------------------------
# Expert choice

@pytest.mark.parametrize("top_k,cf,min_cap,groups", [(2, 1.0, 0, 1), (1, 0.5, 3, 1), (3, 1.5, 0, 3), (2, 0.2, 0, 2)])
def test_expert_choice_matches_reference(top_k, cf, min_cap, groups, gen):
    n, e = 45, 10
    z32 = randn(n, e, gen=gen)
    kw = dict(top_k=top_k, capacity_factor=cf, min_capacity=min_cap)
    if groups > 1:
        kw.update(group_ids=torch.randint(0, groups, (n,), generator=gen), num_groups=groups)
    z = z32.clone().requires_grad_(True)
    res = mr.expert_choice(z, dispatch_align=2, num_ranks=2, **kw)
    z64 = z32.double().requires_grad_(True)
    idx, gates, per_token = ref.expert_choice(z64, **kw)
    assert torch.equal(res.indices.long(), idx)
    assert torch.equal(res.experts_per_token.long(), per_token)
    assert_close(res.gates, gates, rtol=1e-5, atol=1e-6)
    assert res.report["assignments"] == int(per_token.sum())
    assert res.report["tokens_without_experts"] == int((per_token == 0).sum())
    assert res.report["max_experts_per_token"] == int(per_token.max())
    want = ref.dispatch(idx, e, 2, 2)
    got = res.dispatch
    for a, b in zip((got.tokens_per_expert, got.offsets, got.permutation, got.inverse, got.rank_counts), want):
        assert torch.equal(a, b)
    w = torch.randn(n, e)
    (res.gates * w).sum().backward()
    (gates * w.double()).sum().backward()
    assert_grad(z.grad, z64.grad)


def test_expert_choice_ties_capacity_array_and_16bit(gen):
    z = torch.zeros(6, 3)  # every score ties: each expert takes the lowest tokens
    res = mr.expert_choice(z, top_k=1, capacity_factor=1.0)  # C = 2
    assert res.indices.tolist() == [[0, 1, 2], [0, 1, 2], [-1] * 3, [-1] * 3, [-1] * 3, [-1] * 3]
    cap = torch.tensor([0, 6, 1])
    z = randn(6, 3, gen=gen)
    res = mr.expert_choice(z, capacity=cap)
    idx, gates, _ = ref.expert_choice(z.double(), capacity=cap)
    assert torch.equal(res.indices.long(), idx)
    assert_close(res.gates, gates, rtol=1e-5, atol=1e-6)
    zb = randn(30, 8, gen=gen).bfloat16().requires_grad_(True)
    rb = mr.expert_choice(zb)
    assert torch.equal(rb.indices, mr.expert_choice(zb.detach().float()).indices)
    rb.gates.sum().backward()
    assert zb.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="capacity_factor"):
        mr.expert_choice(z, capacity_factor=-1.0)
    with pytest.raises(ValueError, match=r"group_ids\[0\]"):
        mr.expert_choice(z, group_ids=torch.full((6,), 3), num_groups=2)
