"""The RPB prior (docs/policies.md section 3, docs/prior.md, docs/training.md):
prior.prepare and prior.build against the reference, and the prior policies
log_prior_bias and prior_override inside route()."""

import math

import pytest
import torch

import moe_route as mr
import reference as ref
from helpers import GATINGS, assert_close, compare_route, prepared_prior, randn


# ---------------------------------------------------------------------------
# prepare and build

@pytest.mark.parametrize("epsilon,cap", [(0.05, 5.0), (0.2, 2.0), (1.0, 1.0)])
def test_prepare_matches_reference(epsilon, cap, gen):
    e = 37
    pi = torch.distributions.Dirichlet(torch.full((e,), 0.3)).sample((6,)).float()
    pi[0] = 0.0
    pi[0, 3] = 1.0  # one-hot: clamps at both ends
    pi[1] = 2.5  # not normalised: the clamp acts on the given values
    prep = mr.prior.prepare(pi, epsilon=epsilon, cap=cap)
    bias, probs, upper, lower = ref.prior_prepare(pi, epsilon, cap)
    assert prep.bias.dtype == torch.float32 and prep.probs.shape == pi.shape
    assert_close(prep.bias, bias, rtol=1e-6, atol=1e-6)
    assert_close(prep.probs, probs, rtol=1e-6, atol=1e-9)
    assert (prep.upper_clamped, prep.lower_clamped) == (upper, lower)
    assert float(prep.bias.double().mean(dim=1).abs().max()) < 1e-6
    assert_close(prep.probs.double().sum(dim=1), torch.ones(6, dtype=torch.float64), rtol=0, atol=1e-6)


def test_prepare_counts_entries_on_the_bounds():
    # eps = 0.4, cap = 2 over E = 4: bounds 0.1 and 0.5, hit exactly in fp32
    pi = torch.tensor([[0.1, 0.5, 0.25, 0.15], [0.05, 0.6, 0.2, 0.15]])
    prep = mr.prior.prepare(pi, epsilon=0.4, cap=2.0)
    bias, probs, upper, lower = ref.prior_prepare(pi, 0.4, 2.0)
    assert (prep.upper_clamped, prep.lower_clamped) == (upper, lower) == (2, 2)
    assert_close(prep.bias, bias, rtol=1e-6, atol=1e-6)
    assert_close(prep.probs, probs, rtol=1e-6, atol=1e-9)


def test_prepare_rejects_bad_rows():
    good = torch.full((2, 4), 0.25)
    negative = good.clone().index_fill_(1, torch.tensor([1]), -0.1)
    nonfinite = good.clone().index_fill_(1, torch.tensor([2]), math.nan)
    for bad, what in ((torch.zeros(2, 4), "all zeros"), (negative, "negative"), (nonfinite, "non-finite")):
        with pytest.raises(ValueError, match=what):
            mr.prior.prepare(bad)
    with pytest.raises(ValueError, match="epsilon"):
        mr.prior.prepare(good, epsilon=0.0)
    with pytest.raises(TypeError, match="pi"):
        mr.prior.prepare(good.double())


@pytest.mark.parametrize("gating", GATINGS)
def test_build_is_the_mean_base_distribution_per_row(gating, gen):
    n, e, s = 90, 20, 5
    z = randn(n, e, gen=gen)
    rows = torch.randint(-1, s - 1, (n,), generator=gen)  # row s - 1 gets no token
    pi, empty = mr.prior.build(z, rows, s, gating)
    want, want_empty = ref.prior_build(z, rows, s, gating)
    assert empty == want_empty == [s - 1]
    assert_close(pi, want, rtol=1e-5, atol=1e-8)
    assert bool((pi[s - 1] == 0).all())
    # an empty row must not silently become a uniform prior
    with pytest.raises(ValueError, match="row 4"):
        mr.prior.prepare(pi)
    # bf16 base logits: the result of their fp32 values
    pi16, _ = mr.prior.build(z.bfloat16(), rows.int(), s, gating)
    assert torch.equal(pi16, mr.prior.build(z.bfloat16().float(), rows, s, gating)[0])
    # the same bits on any number of threads
    for threads in (1, 3, 0):
        assert torch.equal(mr.prior.build(z, rows, s, gating, threads=threads)[0], pi)


# ---------------------------------------------------------------------------
# log_prior_bias: z' = z + beta b[r(t)] in training

def _prior_batch(gen, n=64, e=24, s=6):
    z = randn(n, e, gen=gen)
    _, prep = prepared_prior(s, e, concentration=0.5)
    rows = torch.randint(-1, s, (n,), generator=gen)
    return z, prep, rows


@pytest.mark.parametrize("gating,selection", [(g, s) for g in GATINGS for s in ("top_k", "expert_bias", "group_limited")
                                               if not (g == "softmax_after_topk" and s == "expert_bias")])
@pytest.mark.parametrize("bias_gates", [True, False])
def test_log_prior_bias_matches_reference(gating, bias_gates, selection, gen):
    z, prep, rows = _prior_batch(gen)
    cfg = mr.RouterConfig(gating=gating, selection=selection, top_k=3, prior="log_prior_bias", prior_beta=0.7,
                          bias_gates=bias_gates, groups=4, top_groups=2)
    eb = randn(24, scale=0.05, gen=gen) if cfg.uses_expert_bias else None
    res = compare_route(cfg, z, prior_bias=prep.bias, token_prior_row=rows, expert_bias=eb)
    plain = mr.route(z, mr.RouterConfig(gating=gating, selection=selection, top_k=3, groups=4, top_groups=2),
                     expert_bias=eb)
    none = rows < 0
    assert torch.equal(res.indices[none], plain.indices[none])  # tokens without a row are untouched
    assert torch.equal(res.gates[none], plain.gates[none])
    assert not torch.equal(res.indices[~none], plain.indices[~none])  # the prior moved some selections


@pytest.mark.parametrize("gating", GATINGS)
def test_beta_zero_and_eval_mode_are_plain_routing(gating, gen):
    z, prep, rows = _prior_batch(gen)
    kw = dict(prior_bias=prep.bias, token_prior_row=rows)
    w = torch.randn(64, 3)

    def run(cfg, training=True, **inputs):
        a = z.clone().requires_grad_(True)
        res = mr.route(a, cfg, training=training, **inputs)
        (res.gates * w).sum().backward()
        return res, a.grad

    plain, g_plain = run(mr.RouterConfig(gating=gating, top_k=3))
    for cfg, training in ((mr.RouterConfig(gating=gating, top_k=3, prior="log_prior_bias", prior_beta=0.0), True),
                          (mr.RouterConfig(gating=gating, top_k=3, prior="log_prior_bias", prior_beta=2.0), False),
                          (mr.RouterConfig(gating=gating, top_k=3, prior="prior_override"), False)):
        res, grad = run(cfg, training, **kw)
        assert torch.equal(res.indices, plain.indices)
        assert torch.equal(res.gates, plain.gates)
        assert torch.equal(grad, g_plain)
    # eval needs no prior tensors at all
    res, _ = run(mr.RouterConfig(gating=gating, top_k=3, prior="log_prior_bias"), False)
    assert torch.equal(res.indices, plain.indices)


@pytest.mark.parametrize("gating", GATINGS)
def test_prior_override_takes_the_priors_top_k(gating, gen):
    z, prep, rows = _prior_batch(gen)
    cfg = mr.RouterConfig(gating=gating, top_k=4, prior="prior_override", scaling_factor=1.3)
    res = compare_route(cfg, z, prior_bias=prep.bias, token_prior_row=rows)
    has = rows >= 0
    want = ref.order_desc(prep.bias.double()[rows[has]])[:, :4]
    assert torch.equal(res.indices[has].long(), want)
    plain = mr.route(z, mr.RouterConfig(gating=gating, top_k=4, scaling_factor=1.3))
    assert torch.equal(res.indices[~has], plain.indices[~has])


def test_prior_override_ties_go_to_the_lower_expert():
    bias = torch.tensor([[0.0, 1.0, 1.0, -2.0, 1.0, 0.0]])
    z = torch.randn(3, 6)
    cfg = mr.RouterConfig(top_k=4, prior="prior_override")
    res = mr.route(z, cfg, prior_bias=bias, token_prior_row=torch.tensor([0, -1, 0]))
    assert res.indices[0].tolist() == [1, 2, 4, 0] and res.indices[2].tolist() == [1, 2, 4, 0]


def test_prior_needs_its_tensors():
    z = torch.randn(4, 8)
    _, prep = prepared_prior(2, 8)
    rows = torch.tensor([0, 1, -1, 0])
    cfg = mr.RouterConfig(prior="log_prior_bias")
    with pytest.raises(ValueError, match="token_prior_row"):
        mr.route(z, cfg, prior_bias=prep.bias)
    with pytest.raises(ValueError, match="prior_bias"):
        mr.route(z, cfg, token_prior_row=rows)
    with pytest.raises(ValueError, match="prior_probs"):
        mr.route(z, mr.RouterConfig(kl_to_base=0.1), prior_bias=prep.bias, token_prior_row=rows)
    with pytest.raises(ValueError, match=r"token_prior_row\[1\]"):
        mr.route(z, cfg, prior_bias=prep.bias, token_prior_row=torch.tensor([0, 2, -1, 0]))
    with pytest.raises(ValueError, match="prior_bias must have shape"):
        mr.route(z, cfg, prior_bias=prep.bias[:, :7], token_prior_row=rows)
    with pytest.raises(ValueError, match="token_prior_row must have shape"):
        mr.route(z, cfg, prior_bias=prep.bias, token_prior_row=rows[:3])
    with pytest.raises(TypeError, match="prior_bias must be torch.float32, got torch.float64"):
        mr.route(z, cfg, prior_bias=prep.bias.double(), token_prior_row=rows)
    bad = prep.bias.clone()
    bad[1, 2] = math.inf
    with pytest.raises(ValueError, match="prior_bias row 1"):
        mr.route(z, cfg, prior_bias=bad, token_prior_row=rows)
