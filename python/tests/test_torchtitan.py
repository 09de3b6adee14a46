"""torchtitan's own router and MoE layer as the oracle (torchtitan 0.3.0,
torchtitan.models.common.moe): for every router setting
RouterConfig.from_torchtitan has a rule for, the library's route on the
router's logits gives torchtitan's experts and gates and the gradient of the
gate weight; MoERouteTokenChoiceTopKRouter returns what TokenChoiceTopKRouter
returns; a MoE layer patched with it gives the original's output, gradients
and token counts; update_expert_bias is the step of torchtitan's optimizer
pre-hook. Tiny random configurations on the CPU, nothing downloaded."""

import copy
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import moe_route as mr
from helpers import import_engine

import_engine("torchtitan")
from torchtitan.components.optimizer.optimizer import register_moe_load_balancing_hook  # noqa: E402
from torchtitan.models.common.feed_forward import FeedForward  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.moe import (GroupedExperts, MoE, RoutedExperts,  # noqa: E402
                                          TokenChoiceTopKRouter)
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher  # noqa: E402

from moe_route.integrations import torchtitan as integration  # noqa: E402

B, L, D = 2, 24, 32

# The router's Config fields (besides num_experts and the gate), the MoE layer's
# load_balance_coeff (None: no expert bias) and whether the gate linear has a bias.
CASES = {
    "softmax": dict(fields=dict(score_func="softmax", top_k=2), experts=12),
    "softmax_norm_scaled": dict(fields=dict(score_func="softmax", top_k=4, route_norm=True, route_scale=2.0),
                                experts=33),
    "softmax_k1": dict(fields=dict(score_func="softmax", top_k=1), experts=20),
    "softmax_k1_norm_scaled": dict(fields=dict(score_func="softmax", top_k=1, route_norm=True, route_scale=1.5),
                                   experts=20),
    "softmax_bias": dict(fields=dict(score_func="softmax", top_k=4), experts=24, coeff=1e-3),
    "softmax_groups": dict(fields=dict(score_func="softmax", top_k=4, route_norm=True, num_expert_groups=4,
                                       num_limited_groups=2), experts=24),
    "softmax_groups_bias": dict(fields=dict(score_func="softmax", top_k=4, num_expert_groups=3,
                                            num_limited_groups=2), experts=33, coeff=1e-3),
    "sigmoid_k1": dict(fields=dict(score_func="sigmoid", top_k=1), experts=16),  # torchtitan's defaults
    "sigmoid_norm_scaled": dict(fields=dict(score_func="sigmoid", top_k=4, route_norm=True, route_scale=2.5),
                                experts=33),
    "sigmoid_unnormalised": dict(fields=dict(score_func="sigmoid", top_k=3), experts=20),
    "sigmoid_bias": dict(fields=dict(score_func="sigmoid", top_k=2, route_norm=True), experts=20, coeff=1e-3),
    "sigmoid_groups": dict(fields=dict(score_func="sigmoid", top_k=3, route_norm=True, num_expert_groups=5,
                                       num_limited_groups=2), experts=40),
    # DeepSeek-V3's router at a small size
    "sigmoid_groups_bias": dict(fields=dict(score_func="sigmoid", top_k=6, route_norm=True, route_scale=2.5,
                                            num_expert_groups=8, num_limited_groups=3), experts=64, coeff=1e-3),
    "sigmoid_groups_bias_k1": dict(fields=dict(score_func="sigmoid", top_k=1, num_expert_groups=3,
                                               num_limited_groups=1), experts=18, coeff=2e-3),
    "sigmoid_gate_bias": dict(fields=dict(score_func="sigmoid", top_k=2, route_norm=True), experts=12,
                              gate_bias=True),
    "debug_force_load_balance": dict(fields=dict(score_func="softmax", top_k=3, route_norm=True,
                                                 _debug_force_load_balance=True), experts=12),
    "debug_force_load_balance_biased_groups": dict(
        fields=dict(score_func="sigmoid", top_k=4, num_expert_groups=4, num_limited_groups=2,
                    _debug_force_load_balance=True), experts=24, coeff=1e-3),
}


@pytest.fixture(autouse=True)
def _quiet_cpu_autocast():
    """torchtitan's router runs its gate under autocast(float32), which the CPU
    does not support: it warns and leaves the dtype (float32 here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CPU Autocast only supports.*")
        warnings.filterwarnings("ignore", message=".*In CPU autocast, but the target dtype.*")
        yield


def _router_config(name):
    case = CASES[name]
    e = case["experts"]
    return TokenChoiceTopKRouter.Config(num_experts=e, gate=Linear.Config(in_features=D, out_features=e,
                                                                          bias=case.get("gate_bias", False)),
                                        **case["fields"])


def _moe_config(name, router=None, shared=False):
    case = CASES[name]
    e, k = case["experts"], case["fields"]["top_k"]
    shared_experts = None
    if shared:
        shared_experts = FeedForward.Config(w1=Linear.Config(in_features=D, out_features=16),
                                            w2=Linear.Config(in_features=16, out_features=D),
                                            w3=Linear.Config(in_features=D, out_features=16))
    return MoE.Config(num_experts=e, router=router or _router_config(name), load_balance_coeff=case.get("coeff"),
                      shared_experts=shared_experts,
                      routed_experts=RoutedExperts.Config(
                          inner_experts=GroupedExperts.Config(dim=D, hidden_dim=16, num_experts=e),
                          token_dispatcher=LocalTokenDispatcher.Config(num_experts=e, top_k=k)))


def _randomise(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


def _bias(name, seed):
    """A selection bias of the size of the scores (MoE.expert_bias_E, learnt; here random)."""
    if CASES[name].get("coeff") is None:
        return None
    e = CASES[name]["experts"]
    return torch.rand(e, generator=torch.Generator().manual_seed(seed + 30)) * 2.0 / e


def _dense(indices, gates, e):
    indices, gates = indices.reshape(-1, indices.shape[-1]), gates.reshape(-1, gates.shape[-1])
    return torch.zeros(indices.shape[0], e, dtype=gates.dtype).scatter_add(1, indices.long(), gates)


def _assert_grad(got, want, constant_gates=False, scale=1.0):
    """Within 1e-5 relative to the largest entry. A single normalised gate is
    route_scale whatever the logits: its gradient is 0 and both sides hold only
    round-off, which must be as small against `scale` (the size of the
    gradients around it)."""
    scale = scale if constant_gates else float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


def _constant_gates(name):
    f = CASES[name]["fields"]
    return f["top_k"] == 1 and f.get("route_norm", False)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(CASES))
def test_route_equals_the_torchtitan_router(name, seed):
    case = CASES[name]
    e = case["experts"]
    router = _randomise(_router_config(name).build(), seed)
    bias = _bias(name, seed)
    cfg = mr.RouterConfig.from_torchtitan(_router_config(name), load_balance_coeff=case.get("coeff"))
    x = torch.randn(B, L, D, generator=torch.Generator().manual_seed(seed + 10))
    upstream = torch.randn(B * L, e, generator=torch.Generator().manual_seed(seed + 20))

    scores, ids, _ = router(x, bias)
    want = _dense(ids, scores, e)
    (want * upstream).sum().backward()

    weight = router.gate.weight.detach().clone().requires_grad_()
    gate_bias = None if router.gate.bias is None else router.gate.bias.detach().clone().requires_grad_()
    logits = F.linear(x, weight, gate_bias).reshape(-1, e)
    res = mr.route(logits, cfg, expert_bias=bias)
    got = _dense(res.indices, res.gates, e)
    ((got * upstream).sum() + res.aux_loss).backward()

    assert torch.equal(got.detach() != 0, want.detach() != 0)
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-7)
    assert float(res.aux_loss.detach()) == 0.0  # torchtitan's router has no auxiliary loss
    _assert_grad(weight.grad, router.gate.weight.grad, _constant_gates(name))
    if gate_bias is not None:
        _assert_grad(gate_bias.grad, router.gate.bias.grad, _constant_gates(name))
    if case["fields"].get("_debug_force_load_balance"):  # the round-robin, in torchtitan's slot order
        assert torch.equal(res.indices.long(), ids.reshape(-1, cfg.top_k))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_moe_route_router_returns_what_torchtitans_returns(name, seed):
    e = CASES[name]["experts"]
    original = _randomise(_router_config(name).build(), seed)
    ours = integration.router_config(_router_config(name)).build()
    assert type(ours) is integration.MoERouteTokenChoiceTopKRouter
    assert ours.state_dict().keys() == original.state_dict().keys()
    ours.load_state_dict(original.state_dict())  # a torchtitan checkpoint loads as it is
    bias = _bias(name, seed)
    x = torch.randn(B, L, D, generator=torch.Generator().manual_seed(seed + 10))
    upstream = torch.randn(B * L, e, generator=torch.Generator().manual_seed(seed + 20))

    outputs = {}
    for label, router in (("torchtitan", original), ("moe_route", ours)):
        scores, ids, full = router(x, bias)
        assert scores.shape == ids.shape == (B, L, CASES[name]["fields"]["top_k"]) and full.shape == (B, L, e)
        assert ids.dtype == torch.int64 and scores.dtype == full.dtype == torch.float32
        dense = _dense(ids, scores, e)
        ((dense * upstream).sum() + full.sum()).backward()
        with torch.no_grad():  # select_experts' path
            s, i, f = router(x, bias)
        outputs[label] = dense.detach(), full.detach(), router.gate.weight.grad, _dense(i, s, e), f

    (want, want_full, want_grad, want_ng, want_ng_full), (got, got_full, got_grad, got_ng, got_ng_full) = (
        outputs["torchtitan"], outputs["moe_route"])
    assert torch.equal(got != 0, want != 0) and torch.equal(got_ng != 0, want_ng != 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_ng, want_ng, rtol=1e-5, atol=1e-7)
    assert torch.equal(got_full, want_full) and torch.equal(got_ng_full, want_ng_full)
    _assert_grad(got_grad, want_grad, _constant_gates(name))


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_patched_torchtitan_moe_layer_equals_the_original(name):
    """Output, every parameter's gradient, the tokens_per_expert_E the layer
    counts in training and its state-dict keys: the same after patch()."""
    original = _randomise(_moe_config(name, shared=name == "sigmoid_groups_bias").build(), 5)
    if original.expert_bias_E is not None:
        original.expert_bias_E.copy_(_bias(name, 5))
    patched = copy.deepcopy(original)
    assert integration.patch(patched) == 1
    assert type(patched.router) is integration.MoERouteTokenChoiceTopKRouter
    assert type(original.router) is TokenChoiceTopKRouter
    assert patched.state_dict().keys() == original.state_dict().keys()
    x = torch.randn(B, L, D, generator=torch.Generator().manual_seed(6))
    w = torch.randn(B, L, D, generator=torch.Generator().manual_seed(7))

    results = []
    for model in (original, patched):
        model.train()
        xi = x.clone().requires_grad_()
        out = model(xi)
        (out * w).sum().backward()
        results.append((out.detach(), xi.grad, {n: p.grad for n, p in model.named_parameters()},
                        model.tokens_per_expert_E.clone()))
    (want, want_x, want_p, want_counts), (got, got_x, got_p, got_counts) = results
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * scale)
    _assert_grad(got_x, want_x)
    assert got_p.keys() == want_p.keys()
    for n in want_p:
        _assert_grad(got_p[n], want_p[n], n.startswith("router.") and _constant_gates(name),
                     scale=float(want_x.abs().max()))
    assert torch.equal(got_counts, want_counts) and float(want_counts.sum()) == B * L * CASES[name]["fields"]["top_k"]


def _model_parts(moes):
    """What torchtitan's load-balancing hook walks: a model part whose
    .layers is a ModuleDict of transformer blocks with moe_enabled and .moe."""
    part = torch.nn.Module()
    part.layers = torch.nn.ModuleDict()
    for i, moe in enumerate(moes):
        block = torch.nn.Module()
        block.moe_enabled, block.moe = True, moe
        part.layers[str(i)] = block
    return part


@pytest.mark.parametrize("name", sorted(n for n in CASES if CASES[n].get("coeff") is not None))
def test_update_expert_bias_equals_torchtitans_optimizer_hook(name):
    """Two MoE layers, three micro-batches of training: the library's counts
    (res.tokens_per_expert) are the layers' tokens_per_expert_E, and
    update_expert_bias over them is the step torchtitan's optimizer pre-hook
    (register_moe_load_balancing_hook) takes."""
    coeff = CASES[name]["coeff"]
    e = CASES[name]["experts"]
    moes = [_randomise(_moe_config(name).build(), 40 + i) for i in range(2)]
    for i, moe in enumerate(moes):
        moe.expert_bias_E.copy_(_bias(name, i))
        moe.train()
    cfg = mr.RouterConfig.from_torchtitan(moes[0])
    assert cfg.bias_update_rate == coeff
    start = [moe.expert_bias_E.clone() for moe in moes]
    counts = [torch.zeros(e, dtype=torch.int64) for _ in moes]
    hidden = torch.randn(3, B, L, D, generator=torch.Generator().manual_seed(9))
    for step in range(3):
        for i, moe in enumerate(moes):
            with torch.no_grad():
                logits = moe.router.gate(hidden[step]).reshape(-1, e)
                res = mr.route(logits, cfg, expert_bias=moe.expert_bias_E)
                counts[i] += res.tokens_per_expert.long()
            moe(hidden[step])
    for i, moe in enumerate(moes):
        assert torch.equal(counts[i].float(), moe.tokens_per_expert_E)

    hooks = []
    optimizers = SimpleNamespace(register_step_pre_hook=hooks.append)
    # one rank, no parallelism: no mesh to all-reduce over
    parallel_dims = SimpleNamespace(get_optional_mesh=lambda *a, **k: None, ep_enabled=False, tp=1)
    register_moe_load_balancing_hook(optimizers, [_model_parts(moes)], parallel_dims)
    assert len(hooks) == 1
    hooks[0]()
    uncentred_steps = 0
    for i, moe in enumerate(moes):
        got = start[i].clone()
        integration.update_expert_bias(got, counts[i], cfg.bias_update_rate)
        torch.testing.assert_close(got, moe.expert_bias_E, rtol=0, atol=1e-9)
        assert float(moe.tokens_per_expert_E.abs().sum()) == 0.0  # the hook starts the next step's counts
        uncentred = start[i].clone()
        mr.update_expert_bias(uncentred, counts[i], cfg.bias_update_rate)
        step = torch.sign(counts[i].double().mean() - counts[i].double())
        if float(step.mean()) != 0.0:  # torchtitan centres the step; the library's plain step does not
            assert not torch.allclose(uncentred, moe.expert_bias_E, rtol=0, atol=1e-9)
            uncentred_steps += 1
    # the centring mattered here, unless the loads are equal (the debug round-robin balances exactly)
    assert uncentred_steps > 0 or all(bool((c == c[0]).all()) for c in counts)


def test_from_torchtitan_takes_the_moe_layer_or_the_router():
    name = "sigmoid_groups_bias"
    moe_config = _moe_config(name)
    moe = moe_config.build()
    want = mr.RouterConfig.from_torchtitan(_router_config(name), load_balance_coeff=1e-3)
    assert mr.RouterConfig.from_torchtitan(moe_config) == want
    assert mr.RouterConfig.from_torchtitan(moe) == want
    assert mr.RouterConfig.from_torchtitan(moe.router, load_balance_coeff=1e-3) == want
    assert want.selection == "group_limited_bias" and (want.groups, want.top_groups, want.per_group_k) == (8, 3, 2)
    assert want.gating == "sigmoid" and want.normalize is True and want.scaling_factor == 2.5 and want.top_k == 6
    unbiased = mr.RouterConfig.from_torchtitan(_router_config(name))
    assert unbiased.selection == "group_limited_score"
    with pytest.raises(TypeError, match="load_balance_coeff from the MoE layer"):
        mr.RouterConfig.from_torchtitan(moe_config, load_balance_coeff=1e-3)
    with pytest.raises(TypeError, match="takes a torchtitan MoE or TokenChoiceTopKRouter"):
        mr.RouterConfig.from_torchtitan(object())


def test_patch_config_builds_routers_on_the_library():
    name = "softmax_groups_bias"
    config = _moe_config(name)
    assert integration.patch_config(config) == 1
    assert integration.patch_config(config) == 0  # already the library's
    moe = config.build()
    assert type(moe.router) is integration.MoERouteTokenChoiceTopKRouter
    original = _randomise(_moe_config(name).build(), 8)
    original.expert_bias_E.copy_(_bias(name, 8))
    moe.load_state_dict(original.state_dict())
    x = torch.randn(B, L, D, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(moe(x), original(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="use router_config"):
        integration.patch_config(_router_config(name))


def _call(fields, e=24):
    """torchtitan's router with these fields, called once (its own check of them)."""
    router = TokenChoiceTopKRouter.Config(num_experts=e, gate=Linear.Config(in_features=D, out_features=e),
                                          **fields).build()
    return router(torch.randn(1, 4, D))


def test_settings_the_library_does_not_reproduce_are_refused_by_name():
    def refused(match, fields, e=24, coeff=None):
        config = TokenChoiceTopKRouter.Config(num_experts=e, gate=Linear.Config(in_features=D, out_features=e),
                                              **fields)
        with pytest.raises(ValueError, match=match):
            mr.RouterConfig.from_torchtitan(config, load_balance_coeff=coeff)
        return config

    refused(r"torchtitan's score_func='relu' is not reproduced: torchtitan's score functions", dict(score_func="relu"))
    with pytest.raises(NotImplementedError):
        _call(dict(score_func="relu"))
    refused(r"torchtitan's num_limited_groups=None is not reproduced: torchtitan raises",
            dict(top_k=2, num_expert_groups=4))
    with pytest.raises(ValueError, match="num_limited_groups must be set"):
        _call(dict(top_k=2, num_expert_groups=4))
    refused(r"torchtitan's num_expert_groups=5 is not reproduced: it must divide num_experts \(= 24\)",
            dict(top_k=2, num_expert_groups=5, num_limited_groups=2))
    with pytest.raises(ValueError, match="must be divisible"):
        _call(dict(top_k=2, num_expert_groups=5, num_limited_groups=2))
    refused(r"torchtitan's num_expert_groups=24 is not reproduced: .* at least 2 experts a group",
            dict(top_k=2, num_expert_groups=24, num_limited_groups=2))
    with pytest.raises(ValueError, match="experts_per_group"):
        _call(dict(top_k=2, num_expert_groups=24, num_limited_groups=2))
    refused(r"torchtitan's num_limited_groups=5 is not reproduced", dict(top_k=2, num_expert_groups=4,
                                                                         num_limited_groups=5))
    with pytest.raises(RuntimeError):
        _call(dict(top_k=2, num_expert_groups=4, num_limited_groups=5))
    refused(r"torchtitan's top_k=8 is not reproduced: the 1 kept groups hold 6 experts",
            dict(top_k=8, num_expert_groups=4, num_limited_groups=1))
    refused(r"torchtitan's top_k=25 is not reproduced", dict(top_k=25))
    with pytest.raises(RuntimeError):
        _call(dict(top_k=25))
    refused(r"torchtitan's load_balance_coeff=0.0 is not reproduced", dict(top_k=2), coeff=0.0)
    with pytest.raises(ValueError, match="no torchtitan TokenChoiceTopKRouter"):
        integration.patch(torch.nn.Linear(2, 2))


def test_the_snippet_of_docs_integration_md_reproduces_torchtitan():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "integration.md").read_text()
    snippet = doc.split("## torchtitan", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    head, rest = snippet.split("res = mr.route(", 1)
    route_line, update = ("res = mr.route(" + rest).split("\n", 1)
    names = {}
    exec(head, names)  # noqa: S102  (the documentation's code)
    moe, cfg = names["moe"], names["cfg"]
    assert (cfg.gating, cfg.selection, cfg.top_k, cfg.groups, cfg.top_groups, cfg.per_group_k) == (
        "sigmoid", "group_limited_bias", 6, 8, 3, 2)
    _randomise(moe, 11)
    e = moe.router.num_experts
    moe.expert_bias_E.copy_(torch.rand(e, generator=torch.Generator().manual_seed(12)) * 0.1)
    x = torch.randn(B, L, names["dim"], generator=torch.Generator().manual_seed(13))
    names["logits"] = moe.router.gate(x).reshape(-1, e)
    exec(route_line, names)  # noqa: S102
    res = names["res"]
    scores, ids, _ = moe.router(x, moe.expert_bias_E)
    torch.testing.assert_close(_dense(res.indices, res.gates, e).detach(), _dense(ids, scores, e).detach(),
                               rtol=1e-5, atol=1e-7)
    before = moe.expert_bias_E.clone()
    exec(update, names)  # noqa: S102
    loads = res.tokens_per_expert.float()
    delta = 1e-3 * torch.sign(loads.mean() - loads)
    torch.testing.assert_close(moe.expert_bias_E, before + (delta - delta.mean()), rtol=0, atol=1e-9)
