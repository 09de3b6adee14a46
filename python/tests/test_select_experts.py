"""select_experts, the inference routing of a decode step
(torch.ops.moe_route.select_experts): the indices of the float64 reference in
evaluation mode and its gates to fp32 accuracy, the bits of route(...,
training=False), edge cases, the refusal of differentiable logits, opcheck, a
compiled decode step, and bad input (docs/python.md)."""

import pytest
import torch

import moe_route as mr
import reference as ref
from helpers import GATE_TOL, assert_close, fields, randn
from moe_route._ops import ops

PRESETS = ("deepseek_v2_lite", "moonlight", "deepseek_v3", "qwen3", "mixtral", "deepseek_v4")
# Training configurations: select_experts routes them as evaluation does, without prior or penalties.
TRAINING = {
    "rpb_softmax": mr.RouterConfig(top_k=3, prior="log_prior_bias", kl_to_base=0.1, load_balance=1e-2),
    "sqrt_softplus_grouped": mr.RouterConfig(gating="sqrt_softplus", selection="group_limited", top_k=4, groups=4,
                                             top_groups=2, z_loss=1e-3),
    "softmax_after_topk": mr.RouterConfig(gating="softmax_after_topk", top_k=2, scaling_factor=2.5),
    "override": mr.RouterConfig(gating="sigmoid", top_k=2, prior="prior_override", normalize=False),
}


def _bias(cfg, e, gen):
    return torch.randn(e, generator=gen) * 0.3 if cfg.uses_expert_bias else None


def _check(cfg, z, bias=None):
    """select_experts against the reference (evaluation) and against route(training=False)."""
    gates, indices = mr.select_experts(z, cfg, expert_bias=bias)
    assert gates.dtype == torch.float32 and indices.dtype == torch.int32
    want_idx, want_gates = ref.route(z.double(), **fields(cfg), training=False, expert_bias=bias)
    assert torch.equal(indices.long(), want_idx)
    assert_close(gates, want_gates, **GATE_TOL)
    res = mr.route(z, cfg, training=False, expert_bias=bias, num_ranks=1)
    assert torch.equal(gates, res.gates) and torch.equal(indices, res.indices)
    return gates, indices


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_match_reference_and_eval_route(preset, gen):
    cfg = mr.RouterConfig.preset(preset)
    e = mr.RouterConfig.preset_experts(preset)
    for n in (1, 16, 300):
        z = randn(n, e, gen=gen)
        _check(cfg, z, _bias(cfg, e, gen))


@pytest.mark.parametrize("name", sorted(TRAINING))
def test_training_configurations_route_as_evaluation(name, gen):
    cfg = TRAINING[name]
    _check(cfg, randn(50, 16, gen=gen))


def test_edge_cases(gen):
    cfg = mr.RouterConfig(top_k=3)
    assert [t.shape for t in mr.select_experts(torch.empty(0, 33), cfg)] == [(0, 3), (0, 3)]  # N = 0
    _check(mr.RouterConfig(top_k=13), randn(5, 13, gen=gen))  # K = E
    _check(cfg, randn(40, 33, gen=gen))  # E not a multiple of 32
    z = randn(8, 33, gen=gen)
    z[1] = 0.25  # an all-equal row: ties go to the lower expert
    z[2, 4] = float("nan")
    z[3, 7] = float("inf")
    z[4, :] = float("-inf")
    _check(cfg, z)
    assert mr.select_experts(z, cfg)[1][1].tolist() == [0, 1, 2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_widen_exactly(dtype, gen):
    cfg = mr.RouterConfig.preset("qwen3")
    z = randn(20, 128, gen=gen).to(dtype)
    gates, indices = mr.select_experts(z, cfg)
    want = mr.select_experts(z.float(), cfg)
    assert torch.equal(gates, want[0]) and torch.equal(indices, want[1])


def test_refuses_logits_that_need_a_gradient(gen):
    cfg = mr.RouterConfig(top_k=2)
    z = randn(4, 8, gen=gen).requires_grad_(True)
    with pytest.raises(ValueError, match="select_experts is inference routing .* logits requires grad"):
        mr.select_experts(z, cfg)
    with torch.no_grad():
        gates, _ = mr.select_experts(z, cfg)
    with torch.inference_mode():
        again, _ = mr.select_experts(z, cfg)
    assert not gates.requires_grad and torch.equal(gates, again)
    mr.select_experts(z.detach(), cfg)  # grad mode on, but nothing to differentiate


def test_router_module_select_experts_is_eval_forward(gen):
    router = mr.Router(16, 64, mr.RouterConfig.preset("deepseek_v3"))
    with torch.no_grad():
        router.expert_bias.copy_(torch.randn(64, generator=gen) * 0.1)
        x = randn(3, 5, 16, gen=gen)
        gates, indices = router.select_experts(x)
        router.eval()
        res = router(x, num_ranks=1)
    assert torch.equal(gates, res.gates) and torch.equal(indices, res.indices)


def test_opcheck(gen):
    for preset in ("deepseek_v3", "mixtral"):
        cfg = mr.RouterConfig.preset(preset)
        e = mr.RouterConfig.preset_experts(preset)
        args = (randn(24, e, gen=gen), cfg.to_text(), _bias(cfg, e, gen), None, 1)
        torch.library.opcheck(ops.select_experts.default, args)


def test_compiled_decode_step_has_no_graph_breaks(gen):
    cfg = mr.RouterConfig.preset("deepseek_v3")
    w = torch.randn(256, 32, generator=gen) * 0.1
    bias = torch.randn(256, generator=gen) * 0.1

    def decode(x):
        gates, indices = mr.select_experts(x @ w.t(), cfg, expert_bias=bias)
        return gates, indices

    x = torch.randn(8, 32, generator=gen)
    with torch.no_grad():
        explained = torch._dynamo.explain(decode)(x)
        assert explained.graph_break_count == 0 and explained.graph_count == 1
        torch._dynamo.reset()
        compiled = torch.compile(decode, fullgraph=True, dynamic=True)
        for n in (8, 3):
            xs = torch.randn(n, 32, generator=gen)
            for got, want in zip(compiled(xs), decode(xs)):
                assert torch.equal(got, want)


def test_bad_input(gen):
    cfg = mr.RouterConfig(top_k=3)
    z = randn(4, 8, gen=gen)
    with pytest.raises(TypeError, match="config must be a RouterConfig"):
        mr.select_experts(z, "top_k=3")
    with pytest.raises(TypeError, match="logits must be torch.float32, got torch.float64"):
        mr.select_experts(z.double(), cfg)
    with pytest.raises(ValueError, match=r"logits must have shape \[\*, \*\], got \[8\]"):
        mr.select_experts(z[0], cfg)
    with pytest.raises(ValueError, match=r"top_k \(= 9\) exceeds the number of experts \(= 8\)"):
        mr.select_experts(z, mr.RouterConfig(top_k=9))
    with pytest.raises(ValueError, match="expert_bias"):
        mr.select_experts(z, mr.RouterConfig(selection="expert_bias", top_k=3))
    with pytest.raises(ValueError, match=r"expert_bias must have shape \[8\], got \[9\]"):
        mr.select_experts(z, mr.RouterConfig(selection="expert_bias", top_k=3), expert_bias=torch.zeros(9))
    with pytest.raises(ValueError, match=r"threads \(= 4294967297\) is outside the int32 range"):
        mr.select_experts(z, cfg, threads=2**32 + 1)
