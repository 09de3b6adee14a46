"""Penalties (docs/policies.md section 5, docs/training.md): values and their gradient
contributions against autograd of the float64 reference; eval mode, zero
coefficients, excluded rows; router_l2 and the expert-bias update."""

import math

import pytest
import torch

import moe_route as mr
import reference as ref
from helpers import GATINGS, assert_close, assert_grad, compare_route, fields, prepared_prior, randn

N, E, S = 72, 24, 5


@pytest.fixture
def batch(gen):
    z = randn(N, E, gen=gen)
    _, prep = prepared_prior(S, E, concentration=0.5)
    rows = torch.randint(-1, S, (N,), generator=gen)
    seq = torch.randint(0, 3, (N,), generator=gen)  # sequence 3 of 4 stays empty
    fractions = torch.rand(E, generator=gen)
    return dict(z=z, prior_bias=prep.bias, prior_probs=prep.probs, token_prior_row=rows, sequence_ids=seq,
                num_sequences=4, load_fractions=fractions / fractions.sum(),
                expert_rank=torch.arange(E) // (E // 4), rank=2)


PENALTY_CASES = {
    "load_balance": dict(load_balance=0.5),
    "load_balance_sequence": dict(load_balance=0.5, load_balance_scope="sequence"),
    "load_balance_global_batch": dict(load_balance=0.5, load_balance_scope="global_batch"),
    "z_loss": dict(z_loss=0.2),
    "kl_to_base": dict(kl_to_base=0.3),
    "logit_l2": dict(logit_l2=0.05),
    "locality": dict(locality=0.5, locality_epsilon=0.01),
}


@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("case", list(PENALTY_CASES))
def test_each_penalty_value_and_gradient(gating, case, batch):
    z = batch.pop("z")
    cfg = mr.RouterConfig(gating=gating, top_k=3, **PENALTY_CASES[case])
    res = compare_route(cfg, z, **batch)
    slot = mr.PENALTIES.index(case.split("_sequence")[0].split("_global")[0])
    assert float(res.penalty_values[slot].detach()) != 0.0
    others = [j for j in range(5) if j != slot]
    assert bool((res.penalty_values[others] == 0).all())


@pytest.mark.parametrize("gating", GATINGS)
def test_all_penalties_with_a_prior_policy(gating, batch):
    z = batch.pop("z")
    selection = "top_k" if gating == "softmax_after_topk" else "expert_bias"
    cfg = mr.RouterConfig(gating=gating, selection=selection, top_k=4, prior="log_prior_bias", prior_beta=0.8,
                          load_balance=0.3, z_loss=0.01, kl_to_base=0.2, logit_l2=0.02, locality=0.4)
    compare_route(cfg, z, expert_bias=randn(E, scale=0.05), **batch)
    # prior_override: the penalties still see the unbiased logits and the (overridden) selection
    cfg.prior = "prior_override"
    compare_route(cfg, z, expert_bias=randn(E, scale=0.05), **batch)


@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("scope", ["batch", "sequence"])
@pytest.mark.parametrize("selection", ["expert_bias", "group_limited_bias", "group_limited", "prior"])
def test_load_balance_counting_the_top_k_of_the_unbiased_logits(gating, scope, selection, batch):
    # load_balance_counts="top_k" (docs/policies.md section 5.2): f counts each token's K
    # largest logits while the router selects with a bias, groups or a prior.
    z = batch.pop("z")
    if selection in ("expert_bias", "group_limited_bias") and gating == "softmax_after_topk":
        pytest.skip("softmax_after_topk takes no expert bias")
    extra = dict(prior="log_prior_bias", prior_beta=2.0) if selection == "prior" else dict(
        selection=selection, groups=4, top_groups=2, per_group_k=2)
    bias = randn(E, scale=2.0, gen=torch.Generator().manual_seed(3))
    cfg = mr.RouterConfig(gating=gating, top_k=4, load_balance=0.5, load_balance_scope=scope,
                          load_balance_counts="top_k", z_loss=0.01, **extra)
    counted = compare_route(cfg, z, expert_bias=bias, **batch)
    cfg.load_balance_counts = "selected"
    selected = compare_route(cfg, z, expert_bias=bias, **batch)
    assert torch.equal(counted.indices, selected.indices)  # the count changes no routing
    assert float(counted.penalty_values[0].detach()) != float(selected.penalty_values[0].detach())


def test_load_balance_counting_the_top_k_equals_selected_on_a_plain_router(batch):
    z = batch.pop("z")
    cfg = mr.RouterConfig(top_k=3, load_balance=0.5, load_balance_counts="top_k")
    a = z.clone().requires_grad_(True)
    counted = mr.route(a, cfg)
    counted.penalty_values.sum().backward()
    cfg.load_balance_counts = "selected"
    b = z.clone().requires_grad_(True)
    selected = mr.route(b, cfg)
    selected.penalty_values.sum().backward()
    assert torch.equal(counted.penalty_values, selected.penalty_values)
    assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("gating", GATINGS)
def test_load_balance_over_sequences_normalised_by_the_batch_mean_length(gating, batch):
    # load_balance_sequence_length="batch_mean" (docs/policies.md section 5.2): every sequence
    # divided by the mean valid length, averaged over all of them (sequence 3 is empty).
    # Under a token mask: test_token_mask.py.
    z = batch.pop("z")
    cfg = mr.RouterConfig(gating=gating, top_k=3, load_balance=0.5, load_balance_scope="sequence",
                          load_balance_sequence_length="batch_mean", z_loss=0.01)
    mean = compare_route(cfg, z, **batch)
    cfg.load_balance_sequence_length = "own"
    own = compare_route(cfg, z, **batch)
    assert float(mean.penalty_values[0].detach()) != float(own.penalty_values[0].detach())


def test_load_balance_over_sequences_of_equal_length_is_the_same_either_way(batch):
    z = batch.pop("z")
    seq = torch.arange(N) % 4
    results = []
    for length in ("own", "batch_mean"):
        a = z.clone().requires_grad_(True)
        res = mr.route(a, mr.RouterConfig(top_k=3, load_balance=0.5, load_balance_scope="sequence",
                                          load_balance_sequence_length=length), sequence_ids=seq, num_sequences=4)
        res.penalty_values.sum().backward()
        results.append((res.penalty_values.detach(), a.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_load_balance_counts_are_checked_by_name(batch):
    z = batch.pop("z")
    with pytest.raises(ValueError, match="load_balance_counts = 'top_two' is not one of: selected, top_k"):
        mr.route(z, mr.RouterConfig(load_balance=0.5, load_balance_counts="top_two"))
    with pytest.raises(ValueError, match="load_balance.counts"):
        mr.route(z, mr.RouterConfig(load_balance=0.5, load_balance_scope="global_batch", load_balance_counts="top_k"),
                 load_fractions=batch["load_fractions"])
    with pytest.raises(ValueError, match="load_balance_sequence_length = 'mean' is not one of: own, batch_mean"):
        mr.route(z, mr.RouterConfig(load_balance=0.5, load_balance_scope="sequence", load_balance_sequence_length="mean"),
                 sequence_ids=batch["sequence_ids"], num_sequences=4)
    with pytest.raises(ValueError, match="load_balance.sequence_length"):
        mr.route(z, mr.RouterConfig(load_balance=0.5, load_balance_sequence_length="batch_mean"))


def test_locality_with_every_expert_local_is_kl_to_uniform(batch):
    z = batch.pop("z")
    batch.update(expert_rank=None, rank=0)
    res = compare_route(mr.RouterConfig(top_k=2, locality=1.0), z, **batch)
    dc = torch.softmax(z.double(), dim=1).mean(dim=0)
    assert_close(res.penalty_values[4], (dc * torch.log(dc * E)).sum(), rtol=1e-5, atol=1e-7)


def test_upstream_gradients_weight_each_penalty(batch):
    z = batch.pop("z")
    cfg = mr.RouterConfig(gating="sigmoid", top_k=3, load_balance=0.5, z_loss=0.1, kl_to_base=0.2, logit_l2=0.05,
                          locality=0.3)
    u = torch.tensor([1.0, -2.0, 0.5, 4.0, -1.5])
    a = z.clone().requires_grad_(True)
    res = mr.route(a, cfg, **batch)
    (res.penalty_values * u).sum().backward()  # no gradient on the gates at all
    z64 = z.double().requires_grad_(True)
    idx, _ = ref.route(z64, **fields(cfg), **batch)
    (ref.penalties(z64, idx, **fields(cfg), **batch) * u.double()).sum().backward()
    assert_grad(a.grad, z64.grad)


def test_reference_penalty_gradients_pass_gradcheck(batch):
    """The reference's autograd itself, against finite differences in double."""
    n, e = 10, 6
    z = batch.pop("z")[:n, :e].double()
    _, prep = prepared_prior(S, e)
    batch.update(prior_bias=prep.bias, prior_probs=prep.probs, token_prior_row=batch["token_prior_row"][:n],
                 sequence_ids=batch["sequence_ids"][:n], load_fractions=batch["load_fractions"][:e],
                 expert_rank=torch.arange(e) // 2, rank=1)
    u = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.float64)
    for gating, scope in zip(GATINGS, ("batch", "sequence", "global_batch", "sequence")):
        cfg = fields(mr.RouterConfig(gating=gating, top_k=2, normalize=True, load_balance=0.5, load_balance_scope=scope,
                                     z_loss=0.1, kl_to_base=0.2, logit_l2=0.05, locality=0.3))
        idx, _ = ref.route(z, **cfg, **batch)
        assert torch.autograd.gradcheck(lambda x: (ref.penalties(x, idx, **cfg, **batch) * u).sum(),
                                        (z.clone().requires_grad_(True),), fast_mode=True)
        assert torch.autograd.gradcheck(lambda x: ref.route(x, **cfg, **batch)[1],
                                        (z.clone().requires_grad_(True),), fast_mode=True)


def test_no_prior_tokens_no_prior_penalties(batch):
    z = batch.pop("z")
    batch["token_prior_row"] = torch.full((N,), -1)
    res = compare_route(mr.RouterConfig(top_k=2, kl_to_base=0.5, logit_l2=0.5, z_loss=0.1), z, **batch)
    assert res.penalty_values[2] == 0 and res.penalty_values[3] == 0 and res.penalty_values[1] > 0


def test_hand_computed_values():
    # all-equal logits: every token picks expert 0 (ties), f = (1, 0, ...), P = 1/E -> alpha
    z = torch.zeros(10, 8)
    res = mr.route(z, mr.RouterConfig(top_k=1, load_balance=0.25, z_loss=0.5))
    assert_close(res.penalty_values[0], torch.tensor(0.25), rtol=1e-6, atol=0)
    assert_close(res.penalty_values[1], torch.tensor(0.5 * math.log(8) ** 2), rtol=1e-6, atol=0)
    # logit_l2 of logits equal to the prior bias (plus a constant) is 0
    _, prep = prepared_prior(1, 8)
    zz = prep.bias.repeat(4, 1) + 3.0
    res = mr.route(zz, mr.RouterConfig(logit_l2=1.0), prior_bias=prep.bias,
                   token_prior_row=torch.zeros(4, dtype=torch.int32))
    assert abs(float(res.penalty_values[3])) < 1e-10
    # kl_to_base of softmax logits equal to log(probs) is 0
    zk = torch.log(prep.probs).repeat(4, 1)
    res = mr.route(zk, mr.RouterConfig(kl_to_base=1.0), prior_probs=prep.probs,
                   token_prior_row=torch.zeros(4, dtype=torch.int64))
    assert abs(float(res.penalty_values[2])) < 1e-6


@pytest.mark.parametrize("gating", GATINGS)
def test_eval_mode_and_zero_coefficients_are_plain(gating, batch):
    z = batch.pop("z")
    on = mr.RouterConfig(gating=gating, top_k=3, load_balance=0.5, z_loss=0.1, kl_to_base=0.2, logit_l2=0.05,
                         locality=0.3)
    off = mr.RouterConfig(gating=gating, top_k=3, load_balance=0.0)
    w = torch.randn(N, 3)

    def run(cfg, training):
        a = z.clone().requires_grad_(True)
        res = mr.route(a, cfg, training=training, **batch)
        ((res.gates * w).sum() + 3 * res.aux_loss).backward()
        return res, a.grad

    plain, g_plain = run(off, True)
    assert torch.equal(plain.penalty_values, torch.zeros(5))
    evaluated, g_eval = run(on, False)
    assert torch.equal(evaluated.penalty_values, torch.zeros(5))
    assert torch.equal(evaluated.indices, plain.indices) and torch.equal(evaluated.gates, plain.gates)
    assert torch.equal(g_eval, g_plain)
    # eval mode needs none of the penalty inputs
    mr.route(z, mr.RouterConfig(load_balance=1.0, load_balance_scope="sequence", kl_to_base=1.0), training=False)


@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("scope", ["batch", "sequence"])
def test_non_finite_rows_take_no_part(gating, scope, batch):
    z = batch.pop("z")
    z[3, 5] = math.nan
    z[10, 0] = math.inf
    z[11, 2] = -math.inf
    if gating in ("sigmoid", "sqrt_softplus"):
        z[20] = -100.0  # every score underflows to 0: excluded as well
    batch["sequence_ids"][[3, 10]] = 3  # a sequence of excluded rows only: not averaged over
    cfg = mr.RouterConfig(gating=gating, top_k=3, load_balance=0.5, load_balance_scope=scope, z_loss=0.1,
                          kl_to_base=0.2, logit_l2=0.05, locality=0.3)
    a = z.clone().requires_grad_(True)
    res = mr.route(a, cfg, **batch)
    assert res.nonfinite_rows == 3
    z64 = z.double()
    idx, _ = ref.route(z64, **fields(cfg), **batch)
    assert torch.equal(res.indices.long(), idx)
    assert_close(res.penalty_values, ref.penalties(z64, idx, **fields(cfg), **batch), rtol=1e-5, atol=1e-6)
    w = torch.randn(N, 3)
    ((res.gates * w).sum() + 3 * res.aux_loss).backward()
    b = z.clone().requires_grad_(True)
    (mr.route(b, cfg, **batch).gates * w).sum().backward()
    bad = [3, 10, 11] + ([20] if gating in ("sigmoid", "sqrt_softplus") else [])
    assert torch.equal(a.grad[bad], b.grad[bad])  # their gate gradient only
    good = torch.ones(N, dtype=torch.bool)
    good[bad] = False
    z64 = z.double().requires_grad_(True)
    idx, gates = ref.route(z64, **fields(cfg), **batch)
    ((gates * w.double()).sum() + 3 * ref.penalties(z64, idx, **fields(cfg), **batch).sum()).backward()
    assert_grad(a.grad[good], z64.grad[good])


def test_penalty_inputs_are_required_and_checked(batch):
    z = batch.pop("z")
    with pytest.raises(ValueError, match="sequence_ids"):
        mr.route(z, mr.RouterConfig(load_balance=0.1, load_balance_scope="sequence"))
    with pytest.raises(ValueError, match="num_sequences"):
        mr.route(z, mr.RouterConfig(load_balance=0.1, load_balance_scope="sequence"),
                 sequence_ids=batch["sequence_ids"])
    with pytest.raises(ValueError, match=r"sequence_ids\[\d+\]"):
        mr.route(z, mr.RouterConfig(load_balance=0.1, load_balance_scope="sequence"),
                 sequence_ids=batch["sequence_ids"], num_sequences=2)
    with pytest.raises(ValueError, match="load_fractions"):
        mr.route(z, mr.RouterConfig(load_balance=0.1, load_balance_scope="global_batch"))
    bad = batch["load_fractions"].clone()
    bad[4] = -1.0
    with pytest.raises(ValueError, match=r"load_fractions\[4\]"):
        mr.route(z, mr.RouterConfig(load_balance=0.1, load_balance_scope="global_batch"), load_fractions=bad)
    with pytest.raises(ValueError, match="rank"):
        mr.route(z, mr.RouterConfig(locality=0.1), expert_rank=batch["expert_rank"], rank=7)
    with pytest.raises(ValueError, match="load_balance_scope"):
        mr.route(z, mr.RouterConfig(load_balance=0.1, load_balance_scope="global"))
    with pytest.raises(ValueError, match="z_loss"):
        mr.route(z, mr.RouterConfig(z_loss=math.nan))
    with pytest.raises(ValueError, match="prior_probs row 0"):
        mr.route(z, mr.RouterConfig(kl_to_base=0.1), prior_probs=torch.zeros(S, E),
                 token_prior_row=batch["token_prior_row"])


# ---------------------------------------------------------------------------
# router_l2 and the expert-bias update

def test_router_l2_value_and_gradient(gen):
    shapes = [(16, 32), (16, 32), (8, 5)]
    weights = [randn(*s, scale=0.1, gen=gen).requires_grad_(True) for s in shapes]
    base = [w.detach() + randn(*w.shape, scale=0.01, gen=gen) for w in weights]
    value = mr.router_l2(weights, base, coefficient=1e3)
    w64 = [w.detach().double().requires_grad_(True) for w in weights]
    want = ref.router_l2(w64, base, 1e3)
    assert_close(value, want, rtol=1e-6, atol=0)
    (2.5 * value).backward()
    (2.5 * want).backward()
    for w, r, b in zip(weights, w64, base):
        assert_grad(w.grad, r.grad)
        assert_close(w.grad, 2.5 * 2 * 1e3 / 3 * (w.detach().double() - b.double()), rtol=1e-5, atol=1e-7)
    # one tensor works too; base tensors get no gradient
    single = mr.router_l2(weights[2], base[2], coefficient=2.0)
    assert_close(single, ref.router_l2([weights[2].detach().double()], [base[2]], 2.0), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="router_l2"):
        mr.router_l2(weights, base[:2])
    with pytest.raises(ValueError, match="layer 1 base"):
        mr.router_l2(weights[:2], [base[0], base[2]])


def test_update_expert_bias(gen):
    bias = randn(10, scale=0.01, gen=gen)
    loads = torch.tensor([5, 1, 3, 3, 0, 9, 3, 2, 4, 0])  # mean 3: experts at the mean do not move
    want = ref.update_expert_bias(bias, loads, 1e-3)
    got = bias.clone()
    mr.update_expert_bias(got, loads, 1e-3)
    assert torch.equal(got, want)
    assert torch.equal(got[[2, 3, 6]], bias[[2, 3, 6]])
    got2 = bias.clone()
    mr.update_expert_bias(got2, loads.double() / 7, 0.5)  # any load measure
    assert torch.equal(got2, ref.update_expert_bias(bias, loads.double() / 7, 0.5))
    with pytest.raises(ValueError, match="expert_bias"):
        mr.update_expert_bias(torch.zeros(20)[::2], loads, 1e-3)
    with pytest.raises(ValueError, match="loads"):
        mr.update_expert_bias(bias.clone(), loads[:5], 1e-3)
