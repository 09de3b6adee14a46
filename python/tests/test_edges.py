"""No tokens and one token (N = 0 and N = 1) through every part of the Python layer that takes
tokens, against the float64 reference (reference.py): routing with every gating, selection,
penalty and the prior, admission, dispatch, expert choice, inference selection and the prior
builder; and the largest router, E = 4096 (docs/reliability.md, "Integer edges"). The
operators' opcheck at these sizes is in test_operators.py (TOKENS)."""

import pytest
import torch

import moe_route as mr
import reference as ref
from helpers import GATINGS, assert_close, compare_route, prepared_prior, randn
from test_admission import compare_admission

E, K, S = 12, 3, 4
SIZES = (0, 1)


def _logits(n, seed=11):
    return randn(n, E, gen=torch.Generator().manual_seed(seed))


def _training_inputs(n):
    """Every per-token input a training route can take, for n tokens."""
    _, prep = prepared_prior(S, E)
    return dict(prior_bias=prep.bias, prior_probs=prep.probs, token_prior_row=torch.zeros(n, dtype=torch.int64),
                sequence_ids=torch.zeros(n, dtype=torch.int64), num_sequences=2,
                load_fractions=torch.full((E,), 1.0 / E), expert_rank=torch.arange(E) // (E // 4), rank=1)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("gating", GATINGS)
def test_route(gating, n):
    z = _logits(n)
    for k in (K, E):  # K = E selects every expert
        compare_route(mr.RouterConfig(gating=gating, top_k=k), z)
    compare_route(mr.RouterConfig(gating=gating, top_k=4, selection="group_limited", groups=4, top_groups=2), z)
    if gating != "softmax_after_topk":
        compare_route(mr.RouterConfig(gating=gating, top_k=K, selection="expert_bias"), z,
                      expert_bias=randn(E, scale=0.1, gen=torch.Generator().manual_seed(2)))
    res = compare_route(mr.RouterConfig(gating=gating, top_k=K), z, training=False)
    assert res.nonfinite_rows == 0


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("gating", GATINGS)
def test_every_penalty_and_the_prior(gating, n):
    z = _logits(n)
    inputs = _training_inputs(n)
    every = dict(load_balance=0.5, z_loss=0.2, kl_to_base=0.3, logit_l2=0.05, locality=0.5)
    for scope in ("batch", "sequence", "global_batch"):
        res = compare_route(mr.RouterConfig(gating=gating, top_k=K, load_balance_scope=scope, **every), z, **inputs)
        if n == 0:  # no token: nothing to average, every value and count 0
            assert torch.equal(res.penalty_values.detach(), torch.zeros(5))
            assert torch.equal(res.tokens_per_expert, torch.zeros(E, dtype=torch.int64))
    compare_route(mr.RouterConfig(gating=gating, top_k=K, prior="log_prior_bias", prior_beta=0.8, **every), z,
                  **inputs)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("admission", [mr.Admission.capacity_probs(1.0), mr.Admission.capacity_position(1.0),
                                       mr.Admission.cipher_reroute(0.05, capacity_factor=1.0)],
                         ids=["capacity_probs", "capacity_position", "cipher_reroute"])
def test_admission_and_dispatch(admission, n):
    z = _logits(n)
    norms = dict(hidden_norms=torch.rand(n) + 0.5, weight_norms=torch.rand(E) + 0.5) if admission.needs_norms else {}
    res = compare_admission(mr.RouterConfig(top_k=K, load_balance=0.5), admission, z, dispatch_align=4,
                            num_ranks=2, **norms)
    assert res.admission_report["offered"] == n * K


@pytest.mark.parametrize("n", SIZES)
def test_expert_choice(n):
    z32 = _logits(n)
    z = z32.clone().requires_grad_(True)
    res = mr.expert_choice(z, top_k=2, capacity_factor=1.0, min_capacity=1)
    z64 = z32.double().requires_grad_(True)
    idx, gates, per_token = ref.expert_choice(z64, top_k=2, capacity_factor=1.0, min_capacity=1)
    assert torch.equal(res.indices.long(), idx) and torch.equal(res.experts_per_token.long(), per_token)
    assert_close(res.gates, gates, rtol=1e-5, atol=1e-6)
    w = torch.randn(n, E)
    (res.gates * w).sum().backward()
    (gates * w.double()).sum().backward()
    assert_close(z.grad, z64.grad, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("gating", GATINGS)
def test_select_experts(gating, n):
    z = _logits(n)
    cfg = mr.RouterConfig(gating=gating, top_k=K)
    gates, indices = mr.select_experts(z, cfg)
    want_indices, want_gates = ref.route(z.double(), gating=gating, top_k=K, training=False)
    assert torch.equal(indices.long(), want_indices)
    assert_close(gates, want_gates, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("gating", GATINGS)
def test_prior_build(gating, n):
    z = _logits(n)
    rows = torch.full((n,), 2, dtype=torch.int32)  # one row used at most; the others stay empty
    for threads in (1, 2):
        pi, empty = mr.prior.build(z, rows, S, gating, threads=threads)
        want, want_empty = ref.prior_build(z, rows, S, gating)
        assert pi.shape == (S, E) and empty == want_empty == ([0, 1, 2, 3] if n == 0 else [0, 1, 3])
        assert_close(pi, want, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("gating", GATINGS)
def test_largest_router(gating):
    """E = 4096 (the library's largest) with K = 16 (the runtime routers' largest; the typed C++
    routers go to 32, tests/cpu/selection_test.cpp), plain, grouped, with penalties and admitted."""
    e, k = 4096, 16
    z = randn(5, e, gen=torch.Generator().manual_seed(4))
    compare_route(mr.RouterConfig(gating=gating, top_k=k, load_balance=0.5, z_loss=0.2), z)
    compare_route(mr.RouterConfig(gating=gating, top_k=k, selection="group_limited", groups=32, top_groups=4), z)
    compare_admission(mr.RouterConfig(gating=gating, top_k=k), mr.Admission.capacity_probs(1.0), z, dispatch_align=8)
    with pytest.raises(ValueError, match=r"top_k \(= 17\) must be in \[1, 16\]"):
        mr.route(z, mr.RouterConfig(gating=gating, top_k=k + 1))
