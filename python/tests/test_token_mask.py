"""The valid-token mask (docs/policies.md, "Token mask"): a padding token gets
indices -1 and gates 0, is in no loss, count, capacity or gradient, and its
inputs are never read. Each check runs the masked call and a reference on the
batch with the padding rows removed: the float64 reference for routing,
penalties and gradients, the library's own unmasked call for admission,
dispatch and expert choice (which the reference suite checks separately)."""

import pytest
import torch

import moe_route as mr
import reference as ref
from helpers import GATE_TOL, VALUE_TOL, assert_close, assert_grad, fields, randn

N, E, S, Q = 40, 13, 3, 4  # E not a multiple of 32

CONFIGS = {
    "softmax": mr.RouterConfig(top_k=3, load_balance=0.5, z_loss=0.1),
    "softmax_after_topk": mr.RouterConfig(gating="softmax_after_topk", top_k=2, load_balance=0.5, z_loss=0.1),
    "sigmoid_expert_bias": mr.RouterConfig(gating="sigmoid", selection="expert_bias", top_k=4, load_balance=0.3),
    "sequence_scope": mr.RouterConfig(top_k=2, load_balance=0.5, load_balance_scope="sequence"),
    "sequence_scope_batch_mean": mr.RouterConfig(top_k=2, load_balance=0.5, load_balance_scope="sequence",
                                                 load_balance_sequence_length="batch_mean"),
    "prior": mr.RouterConfig(top_k=3, prior="log_prior_bias", kl_to_base=0.2, logit_l2=0.05, z_loss=0.1),
    "k_equals_e": mr.RouterConfig(top_k=E, load_balance=0.5),
}


def _mask(n=N):
    mask = torch.ones(n, dtype=torch.bool)
    mask[1::4] = False
    mask[-3:] = False
    return mask


def _batch(gen):
    pi = torch.softmax(randn(S, E, gen=gen), dim=1)
    prep = mr.prior.prepare(pi)
    return dict(prior_bias=prep.bias, prior_probs=prep.probs,
                token_prior_row=torch.randint(-1, S, (N,), generator=gen, dtype=torch.int32),
                sequence_ids=(torch.arange(N, dtype=torch.int32) * Q) // N, num_sequences=Q)


def _rows(batch, mask):
    """The per-token inputs of the valid rows."""
    return {k: (v[mask] if k in ("token_prior_row", "sequence_ids") else v) for k, v in batch.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_route_and_backward_equal_the_reference_without_the_padding_rows(name):
    gen = torch.Generator().manual_seed(3)
    cfg = CONFIGS[name]
    z, batch, mask = randn(N, E, gen=gen), _batch(gen), _mask()
    bias = torch.linspace(-0.2, 0.2, E) if cfg.uses_expert_bias else None
    z[~mask] = float("nan")  # padding rows are never read (nor counted as non-finite)
    padded = dict(batch, token_prior_row=batch["token_prior_row"].clone(), sequence_ids=batch["sequence_ids"].clone())
    padded["token_prior_row"][~mask] = 1 << 20
    padded["sequence_ids"][~mask] = -9
    a = z.clone().requires_grad_(True)
    res = mr.route(a, cfg, expert_bias=bias, token_mask=mask, **padded)
    w = randn(N, cfg.top_k, gen=gen)
    ((res.gates * w).sum() + 3 * res.aux_loss).backward()

    assert int(res.nonfinite_rows) == 0
    assert torch.equal(res.indices[~mask], torch.full_like(res.indices[~mask], -1))
    assert torch.equal(res.gates[~mask], torch.zeros_like(res.gates[~mask]))
    assert torch.equal(a.grad[~mask], torch.zeros_like(a.grad[~mask]))
    z64 = z[mask].double().requires_grad_(True)
    rows = _rows(batch, mask)
    idx, gates = ref.route(z64, **fields(cfg), expert_bias=bias, **rows)
    penalties = ref.penalties(z64, idx, **fields(cfg), **rows)
    assert torch.equal(res.indices[mask].long(), idx)
    assert_close(res.gates[mask], gates, **GATE_TOL)
    assert_close(res.penalty_values, penalties, **VALUE_TOL)
    ((gates * w[mask].double()).sum() + 3 * penalties.sum()).backward()
    assert_grad(a.grad[mask], z64.grad)
    # the dispatch counts, and so the expert-bias loads, leave the padding out
    assert torch.equal(res.tokens_per_expert.long(), torch.bincount(idx.reshape(-1), minlength=E))


ADMISSIONS = {
    "capacity_probs": mr.Admission.capacity_probs(0.8),
    "capacity_position": mr.Admission.capacity_position(0.8),
    "cipher_reroute": mr.Admission.cipher_reroute(-1.0, capacity_factor=0.8),
    "dropless": mr.Admission.dropless(),
}


@pytest.mark.parametrize("name", sorted(ADMISSIONS))
def test_admission_equals_admitting_the_valid_tokens_only(name):
    gen = torch.Generator().manual_seed(4)
    cfg, admission, mask = mr.RouterConfig(top_k=2, z_loss=0.1), ADMISSIONS[name], _mask()
    z = randn(N, E, gen=gen)
    z[:, :3] += 2.0  # hot experts overflow
    norms = dict(hidden_norms=torch.rand(N, generator=gen) + 0.5, weight_norms=torch.rand(E, generator=gen) + 0.5)
    a = z.clone().requires_grad_(True)
    got = mr.route(a, cfg, admission=admission, token_mask=mask, **norms)
    w = randn(N, 2, gen=gen)
    ((got.gates * w).sum() + got.aux_loss).backward()
    b = z[mask].clone().requires_grad_(True)
    want = mr.route(b, cfg, admission=admission, hidden_norms=norms["hidden_norms"][mask],
                    weight_norms=norms["weight_norms"])
    ((want.gates * w[mask]).sum() + want.aux_loss).backward()
    assert torch.equal(got.indices[mask], want.indices)
    assert torch.equal(got.gates[mask], want.gates)
    assert torch.equal(got.indices[~mask], torch.full_like(got.indices[~mask], -1))
    assert torch.equal(got.gates[~mask], torch.zeros_like(got.gates[~mask]))
    if got.status is not None:
        assert torch.equal(got.status[mask], want.status) and bool((got.status[~mask] == 1).all())
        assert got.admission_report == want.admission_report
    assert torch.equal(got.tokens_per_expert, want.tokens_per_expert)
    torch.testing.assert_close(got.penalty_values, want.penalty_values, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(a.grad[mask], b.grad, rtol=1e-6, atol=1e-7)
    assert torch.equal(a.grad[~mask], torch.zeros_like(a.grad[~mask]))


def test_expert_choice_gives_padding_tokens_no_expert():
    gen = torch.Generator().manual_seed(5)
    z, mask = randn(N, E, gen=gen), _mask()
    z[~mask] = float("inf")  # would win every expert if it were read
    a = z.clone().requires_grad_(True)
    got = mr.expert_choice(a, top_k=2, capacity_factor=1.5, token_mask=mask)
    (got.gates * torch.arange(E).float()).sum().backward()
    b = z[mask].clone().requires_grad_(True)
    want = mr.expert_choice(b, top_k=2, capacity_factor=1.5)
    (want.gates * torch.arange(E).float()).sum().backward()
    assert torch.equal(got.indices[mask], want.indices) and torch.equal(got.gates[mask], want.gates)
    assert bool((got.indices[~mask] == -1).all()) and bool((got.experts_per_token[~mask] == 0).all())
    assert got.report == want.report
    assert torch.equal(a.grad[mask], b.grad) and torch.equal(a.grad[~mask], torch.zeros_like(a.grad[~mask]))


def test_select_experts_with_a_mask_is_the_routing_of_the_valid_rows():
    gen = torch.Generator().manual_seed(6)
    cfg = mr.RouterConfig.preset("deepseek_v3")
    e = mr.RouterConfig.preset_experts("deepseek_v3")
    z, bias = randn(N, e, gen=gen), torch.randn(e, generator=gen) * 0.1
    mask = _mask()
    z[~mask] = float("nan")
    gates, indices = mr.select_experts(z, cfg, expert_bias=bias, token_mask=mask)
    want_gates, want_indices = mr.select_experts(z[mask], cfg, expert_bias=bias)
    assert torch.equal(indices[mask], want_indices) and torch.equal(gates[mask], want_gates)
    assert bool((indices[~mask] == -1).all()) and bool((gates[~mask] == 0).all())


def test_global_load_balance_counts_the_valid_tokens():
    gen = torch.Generator().manual_seed(7)
    z, mask = randn(N, E, gen=gen), _mask()
    masked, compact = mr.GlobalLoadBalance(E, 2), mr.GlobalLoadBalance(E, 2)
    for _ in range(2):
        got = masked.load_fractions(z, mask)
        want = compact.load_fractions(z[mask])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)
    with pytest.raises(ValueError, match="token_mask must be torch.bool"):
        masked.load_fractions(z, mask.int())


def test_every_token_masked_and_no_token_masked():
    gen = torch.Generator().manual_seed(8)
    cfg, z = CONFIGS["softmax"], randn(N, E, gen=gen)
    none = mr.route(z, cfg, token_mask=torch.zeros(N, dtype=torch.bool))
    assert bool((none.indices == -1).all()) and bool((none.penalty_values == 0).all())
    assert int(none.tokens_per_expert.sum()) == 0
    every = mr.route(z, cfg, token_mask=torch.ones(N, dtype=torch.bool))
    plain = mr.route(z, cfg)
    assert torch.equal(every.indices, plain.indices) and torch.equal(every.gates, plain.gates)
    assert torch.equal(every.penalty_values, plain.penalty_values)


@pytest.mark.parametrize("call", ["route", "select_experts", "expert_choice"])
def test_a_bad_mask_is_refused_by_name(call):
    z = randn(N, E, gen=torch.Generator().manual_seed(9))
    cfg = mr.RouterConfig(top_k=2)
    run = {"route": lambda m: mr.route(z, cfg, token_mask=m),
           "select_experts": lambda m: mr.select_experts(z, cfg, token_mask=m),
           "expert_choice": lambda m: mr.expert_choice(z, token_mask=m)}[call]
    with pytest.raises(TypeError, match="token_mask must be torch.bool, got torch.uint8"):
        run(torch.ones(N, dtype=torch.uint8))
    with pytest.raises(ValueError, match="token_mask"):
        run(torch.ones(N - 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="token_mask"):
        run(torch.ones(N, 1, dtype=torch.bool))
