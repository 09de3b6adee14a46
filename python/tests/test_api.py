"""The Router module, presets, and argument errors (docs/python.md: TypeError for
a wrong dtype, ValueError for a wrong shape, device, value or configuration;
the message names the argument)."""

import math

import pytest
import torch

import moe_route as mr
import reference as ref
from helpers import assert_close, assert_grad, compare_route, fields, prepared_prior, randn

# ---------------------------------------------------------------------------
# Router module


def test_router_forward_matches_route_and_reference(gen):
    d, e = 16, 12
    cfg = mr.RouterConfig(gating="sigmoid", top_k=3, load_balance=0.5, z_loss=0.1)
    router = mr.Router(d, e, cfg)
    x = randn(2, 10, d, scale=1.0, gen=gen)  # [batch, seq, d]: tokens are flattened
    out = router(x)
    logits = x.reshape(-1, d) @ router.weight.detach().t()
    direct = mr.route(logits, cfg)
    assert torch.equal(out.indices, direct.indices)
    assert_close(out.gates, direct.gates, rtol=1e-6, atol=1e-7)
    # the gradient reaches the weight: against autograd of the reference through x W^T
    w = torch.randn(20, 3)
    ((out.gates * w).sum() + 3 * out.aux_loss).backward()
    w64 = router.weight.detach().double().requires_grad_(True)
    z64 = x.reshape(-1, d).double() @ w64.t()
    idx, gates = ref.route(z64, **fields(cfg))
    assert torch.equal(out.indices.long(), idx)
    ((gates * w.double()).sum() + 3 * ref.penalties(z64, idx, **fields(cfg)).sum()).backward()
    assert router.weight.grad is not None
    assert_grad(router.weight.grad, w64.grad)


@pytest.mark.parametrize("admission", [None, mr.Admission.capacity_probs(0.9)])
def test_route_without_dispatch_is_the_same_call_without_its_metadata(admission, gen):
    # with_dispatch=False (what the engine integrations pass) skips only the dispatch metadata.
    z = randn(50, 12, gen=gen)
    cfg = mr.RouterConfig(top_k=3, load_balance=0.5, z_loss=0.1)
    w = torch.randn(50, 3, generator=gen)
    results = []
    for with_dispatch in (True, False):
        a = z.clone().requires_grad_(True)
        res = mr.route(a, cfg, admission=admission, with_dispatch=with_dispatch)
        ((res.gates * w).sum() + res.aux_loss).backward()
        results.append((res, a.grad))
    (full, full_grad), (bare, bare_grad) = results
    for name in ("indices", "gates", "routed_indices", "routed_gates", "status", "penalty_values", "nonfinite_rows",
                 "admission_counts"):
        a, b = getattr(full, name), getattr(bare, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert torch.equal(full_grad, bare_grad)
    assert full.dispatch is not None and bare.dispatch is None
    with pytest.raises(ValueError, match="with_dispatch=False"):
        bare.tokens_per_expert


def test_router_training_and_eval(gen):
    d, e, s = 8, 10, 3
    cfg = mr.RouterConfig(top_k=2, prior="log_prior_bias", kl_to_base=0.3, load_balance=0.2)
    router = mr.Router(d, e, cfg)
    pi = torch.distributions.Dirichlet(torch.full((e,), 0.3)).sample((s,)).float()
    prepared = router.set_prior(pi)
    bias, probs, _, _ = ref.prior_prepare(pi)
    assert_close(router.prior_bias, bias, rtol=1e-6, atol=1e-6)
    assert torch.equal(router.prior_probs, prepared.probs)
    assert set(router.state_dict()) == {"weight", "prior_bias", "prior_probs"}
    x = randn(30, d, gen=gen)
    rows = torch.randint(-1, s, (30,), generator=gen)
    trained = router(x, token_prior_row=rows)
    logits = (x @ router.weight.detach().t())
    compare_route(cfg, logits, prior_bias=router.prior_bias, prior_probs=router.prior_probs, token_prior_row=rows)
    assert bool((trained.penalty_values[[0, 2]] != 0).all())
    router.eval()
    probe = router(x, token_prior_row=rows)
    plain = mr.route(logits, mr.RouterConfig(top_k=2))
    assert torch.equal(probe.indices, plain.indices)
    assert torch.equal(probe.penalty_values, torch.zeros(5))
    assert not torch.equal(trained.indices, plain.indices)


def test_router_expert_bias_buffer_and_update(gen):
    d, e = 8, 6
    cfg = mr.RouterConfig.preset("moonlight", top_k=2, bias_update_rate=0.01)
    router = mr.Router(d, e, cfg)
    assert torch.equal(router.expert_bias, torch.zeros(e)) and "expert_bias" in router.state_dict()
    x = randn(40, d, gen=gen)
    out = router(x)
    before = router.expert_bias.clone()
    router.update_expert_bias(out.tokens_per_expert)
    assert torch.equal(router.expert_bias, ref.update_expert_bias(before, out.tokens_per_expert, 0.01))
    assert not torch.equal(router.expert_bias, before)
    # the next call selects on s + b
    out2 = router(x)
    compare_route(cfg, x @ router.weight.detach().t(), expert_bias=router.expert_bias)
    assert out2.indices.shape == (40, 2)
    with pytest.raises(ValueError, match="has no expert bias"):
        mr.Router(d, e, mr.RouterConfig()).update_expert_bias(out.tokens_per_expert)


def test_router_cosine_admission_uses_the_norms(gen):
    d, e = 8, 6
    adm = mr.Admission.cipher_strict(0.2, capacity_factor=1.0)
    router = mr.Router(d, e, mr.RouterConfig(top_k=2), admission=adm)
    x = randn(24, d, gen=gen)
    out = router(x)
    explicit = mr.route(x @ router.weight.detach().t(), router.config, admission=adm,
                        hidden_norms=x.norm(dim=1), weight_norms=router.weight.detach().norm(dim=1))
    assert torch.equal(out.indices, explicit.indices) and torch.equal(out.status, explicit.status)
    assert out.admission_report["dropped"] > 0


def test_router_in_bfloat16(gen):
    router = mr.Router(8, 6, mr.RouterConfig(top_k=2), dtype=torch.bfloat16)
    x = randn(12, 8, gen=gen).bfloat16()
    out = router(x)
    assert out.gates.dtype == torch.float32
    out.gates.sum().backward()
    assert router.weight.grad.dtype == torch.bfloat16
    assert torch.equal(out.indices, mr.route((x @ router.weight.detach().t()).float(), router.config).indices)


def test_router_rejects_bad_construction():
    with pytest.raises(ValueError, match=r"num_experts \(= 2\) must be >= top_k \(= 3\)"):
        mr.Router(8, 2, mr.RouterConfig(top_k=3))
    with pytest.raises(TypeError, match="config must be a RouterConfig"):
        mr.Router(8, 4, {"top_k": 2})


def test_presets():
    for name in ("deepseek_v2_lite", "moonlight", "deepseek_v3", "qwen3", "mixtral", "deepseek_v4"):
        cfg = mr.RouterConfig.preset(name)
        e = mr.RouterConfig.preset_experts(name)
        z = randn(16, e)
        compare_route(cfg, z, expert_bias=torch.zeros(e) if cfg.uses_expert_bias else None)
    assert mr.RouterConfig.preset("mixtral").gating == "softmax_after_topk"
    assert mr.RouterConfig.preset("qwen3", top_k=3).top_k == 3
    with pytest.raises(ValueError, match="no preset named 'gpt'"):
        mr.RouterConfig.preset("gpt")


# ---------------------------------------------------------------------------
# Argument errors name the argument


def test_logits_errors():
    cfg = mr.RouterConfig()
    with pytest.raises(TypeError, match="logits must be float32, bfloat16 or float16, got torch.float64"):
        mr.route(torch.randn(4, 8, dtype=torch.float64), cfg)
    with pytest.raises(TypeError, match="logits must be float32"):
        mr.route(torch.zeros(4, 8, dtype=torch.int32), cfg)
    with pytest.raises(TypeError, match="logits must be a torch.Tensor"):
        mr.route([[1.0, 2.0]], cfg)
    with pytest.raises(TypeError, match="logits must be a torch.Tensor"):
        mr.expert_choice([[1.0, 2.0]])
    for shape in ((8,), (2, 4, 8)):
        with pytest.raises(ValueError, match=r"logits must have shape \[tokens, experts\]"):
            mr.route(torch.randn(*shape), cfg)
    with pytest.raises(ValueError, match="logits must have at least one expert"):
        mr.route(torch.randn(4, 0), cfg)
    # meta tensors take the operators' fake implementations: shapes, no values
    meta = mr.route(torch.empty(4, 8, device="meta"), cfg)
    assert meta.indices.shape == (4, 2) and meta.indices.device.type == "meta"


def test_config_errors():
    z = torch.randn(4, 8)
    cases = [
        (mr.RouterConfig(top_k=9), r"top_k \(= 9\) exceeds the number of experts \(= 8\)"),
        (mr.RouterConfig(top_k=17), r"top_k \(= 17\) must be in \[1, 16\]"),
        (mr.RouterConfig(top_k=0), r"top_k \(= 0\)"),
        (mr.RouterConfig(gating="relu"), "gating = 'relu' is not one of"),
        (mr.RouterConfig(selection="top_p"), "selection = 'top_p' is not one of"),
        (mr.RouterConfig(prior="soft"), "prior = 'soft' is not one of"),
        (mr.RouterConfig(selection="group_limited", groups=3), r"groups \(= 3\) must be positive and divide"),
        (mr.RouterConfig(selection="group_limited", groups=4, top_groups=5), "top_groups"),
        (mr.RouterConfig(selection="group_limited", groups=4, per_group_k=3), "per_group_k"),
        (mr.RouterConfig(selection="group_limited", groups=4, top_groups=1, top_k=3), "kept groups"),
        (mr.RouterConfig(scaling_factor=math.inf), "scaling_factor must be finite"),
        (mr.RouterConfig(prior="log_prior_bias", prior_beta=math.nan), "beta must be finite"),
        (mr.RouterConfig(locality=0.1, locality_epsilon=1.5), "locality.epsilon"),
        (mr.RouterConfig(locality=0.1, locality_epsilon=0.0), r"locality.epsilon must be in \(0, 1\)"),
    ]
    with pytest.raises(ValueError, match=r"num_experts \(= 4097\) must be in \[1, 4096\]"):
        mr.route(torch.randn(2, 4097), mr.RouterConfig())
    for cfg, match in cases:
        with pytest.raises(ValueError, match=match):
            mr.route(z, cfg)
    with pytest.raises(ValueError, match="selection 'expert_bias' needs expert_bias"):
        mr.route(z, mr.RouterConfig(selection="expert_bias"))
    with pytest.raises(ValueError, match="cannot key on s \\+ b"):
        mr.route(z, mr.RouterConfig(gating="softmax_after_topk", selection="expert_bias"), expert_bias=torch.zeros(8))
    with pytest.raises(ValueError, match=r"expert_bias must have shape \[8\], got \[7\]"):
        mr.route(z, mr.RouterConfig(selection="expert_bias"), expert_bias=torch.zeros(7))
    with pytest.raises(TypeError, match="expert_bias must be torch.float32, got torch.float64"):
        mr.route(z, mr.RouterConfig(selection="expert_bias"), expert_bias=torch.zeros(8, dtype=torch.float64))
    with pytest.raises(TypeError, match="config must be a RouterConfig"):
        mr.route(z, "qwen3")


def test_unknown_config_fields():
    with pytest.raises(TypeError, match="topk"):
        mr.RouterConfig(topk=3)
    with pytest.raises(TypeError, match="tau"):
        mr.RouterConfig.preset("qwen3", tau=0.1)
    cfg = mr.RouterConfig()
    with pytest.raises(AttributeError, match="RouterConfig has no field 'topk'"):
        cfg.topk = 4  # a misspelt option must not be silently ignored
    adm = mr.Admission.cipher_strict(0.1)
    with pytest.raises(AttributeError, match="Admission has no field 'tau'"):
        adm.tau = 0.2
    cfg.top_k = 4
    assert mr.route(torch.randn(3, 8), cfg).indices.shape == (3, 4)


def test_index_tensors_int32_or_int64():
    z = torch.randn(4, 8)
    _, prep = prepared_prior(2, 8)
    cfg = mr.RouterConfig(prior="log_prior_bias")
    rows = torch.tensor([0, 1, -1, 0])
    a = mr.route(z, cfg, prior_bias=prep.bias, token_prior_row=rows)
    b = mr.route(z, cfg, prior_bias=prep.bias, token_prior_row=rows.int())
    assert torch.equal(a.indices, b.indices) and torch.equal(a.gates, b.gates)
    with pytest.raises(ValueError, match="token_prior_row has values outside the int32 range"):
        mr.route(z, cfg, prior_bias=prep.bias, token_prior_row=torch.tensor([0, 1, 2 ** 40, 0]))
    with pytest.raises(TypeError, match="token_prior_row must be torch.int32 or torch.int64"):
        mr.route(z, cfg, prior_bias=prep.bias, token_prior_row=rows.float())


def test_double_backward_is_refused():
    z = torch.randn(4, 8, requires_grad=True)
    res = mr.route(z, mr.RouterConfig(z_loss=0.1))
    (g,) = torch.autograd.grad(res.gates.sum() + res.aux_loss, z, create_graph=True)
    with pytest.raises(RuntimeError, match="the router's backward is not differentiable"):
        g.sum().backward()
