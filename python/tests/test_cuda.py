"""The extension's CUDA branch against its CPU branch: every op on CUDA tensors
must give the CPU results bit for bit (indices, gates, penalty values,
gradients, admission decisions and reports, dispatch metadata). The CPU branch
is itself tested against the float64 reference in the other files.

Skipped, with the reason in pytest's summary, unless the extension was built
against a CUDA PyTorch (moe_route.with_cuda) and a GPU is visible.
"""

from __future__ import annotations

import re

import pytest
import torch

import moe_route as mr
from helpers import GATINGS, prepared_prior, randn

pytestmark = pytest.mark.skipif(
    not (mr.with_cuda and torch.cuda.is_available()),
    reason="CUDA branch not built (moe_route.with_cuda is False)" if not mr.with_cuda else "no CUDA device")

DEV = torch.device("cuda")
UPSTREAM = torch.tensor([1.5, 0.5, 2.0, 1.0, 0.75])


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (so -0.0 != 0.0 and NaN == NaN with the same payload)."""
    got, want = got.detach().cpu().contiguous(), want.detach().cpu().contiguous()
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.is_floating_point():
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
        got, want = got.view(bits), want.view(bits)
    return torch.equal(got, want)


def to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: to(v, device) for k, v in x.items()}
    return x


def route_on(device, cfg, z, weights, admission, training, inputs):
    """mr.route on `device` and the backward of loss = sum(gates * w) + UPSTREAM . penalties."""
    zd = z.to(device).requires_grad_(True)
    res = mr.route(zd, cfg, training=training, admission=admission, **to(inputs, device))
    ((res.gates * weights.to(device)).sum() + (res.penalty_values * UPSTREAM.to(device)).sum()).backward()
    return res, zd.grad


def route_both(cfg, z, weights, *, admission=None, training=True, **inputs):
    """(cpu result, cpu dL/dz, cuda result, cuda dL/dz); None when the CPU rejects the
    configuration, after checking that CUDA rejects it with the same message."""
    try:
        cpu = route_on("cpu", cfg, z, weights, admission, training, inputs)
    except ValueError as rejected:
        with pytest.raises(ValueError, match=re.escape(str(rejected))):
            route_on(DEV, cfg, z, weights, admission, training, inputs)
        return None
    return (*cpu, *route_on(DEV, cfg, z, weights, admission, training, inputs))


def assert_same_route(results):
    if results is None:  # rejected alike on both devices (route_both)
        return
    cpu, cpu_grad, gpu, gpu_grad = results
    assert gpu.indices.is_cuda and gpu.gates.is_cuda and gpu_grad.is_cuda
    for name in ("indices", "gates", "routed_indices", "routed_gates", "penalty_values"):
        assert same_bits(getattr(gpu, name), getattr(cpu, name)), name
    assert same_bits(gpu_grad, cpu_grad), "dL/dz"
    assert gpu.nonfinite_rows == cpu.nonfinite_rows
    assert (gpu.status is None) == (cpu.status is None)
    if cpu.status is not None:
        assert same_bits(gpu.status, cpu.status), "status"
        assert gpu.admission_report == cpu.admission_report
    for name in ("tokens_per_expert", "offsets", "permutation", "inverse", "rank_counts"):
        assert same_bits(getattr(gpu.dispatch, name), getattr(cpu.dispatch, name)), f"dispatch.{name}"


def training_inputs(n, e, rows, gen):
    _, prepared = prepared_prior(rows, e)
    return dict(prior_bias=prepared.bias, prior_probs=prepared.probs,
                token_prior_row=torch.randint(-1, rows, (n,), generator=gen),
                sequence_ids=torch.sort(torch.randint(0, 4, (n,), generator=gen)).values, num_sequences=4,
                load_fractions=torch.rand(e, generator=gen),
                expert_rank=torch.arange(e) * 4 // e, rank=1)


def logits_with_edge_rows(n, e, gen):
    """Random logits with a NaN row, a +inf row, a row of ties and a row of -0.0/+0.0."""
    z = randn(n, e, gen=gen)
    z[1, 3] = float("nan")
    z[2, 0] = float("inf")
    z[3] = 0.25
    z[4] = torch.where(torch.arange(e) % 2 == 0, torch.tensor(-0.0), torch.tensor(0.0))
    return z


SELECTIONS = {
    "top_k": dict(selection="top_k", top_k=4),
    "expert_bias": dict(selection="expert_bias", top_k=4),
    "group_limited": dict(selection="group_limited", top_k=4, groups=8, top_groups=3, per_group_k=2),
    "group_limited_bias": dict(selection="group_limited_bias", top_k=4, groups=8, top_groups=3, per_group_k=2),
    "fixed": dict(selection="fixed", top_k=4),
}
PENALTIES = dict(load_balance=0.3, z_loss=0.01, kl_to_base=0.2, logit_l2=0.02, locality=0.4)


@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("selection", list(SELECTIONS))
@pytest.mark.parametrize("prior", ["none", "log_prior_bias", "prior_override"])
def test_route_every_policy_equals_cpu(gating, selection, prior, gen):
    e = 64 if "group" in selection else 37
    n = 300
    scope = "sequence" if prior == "none" else "global_batch"
    cfg = mr.RouterConfig(gating=gating, prior=prior, prior_beta=0.7, load_balance_scope=scope,
                          **SELECTIONS[selection], **PENALTIES)
    inputs = training_inputs(n, e, 5, gen)
    if cfg.uses_expert_bias:
        inputs["expert_bias"] = randn(e, scale=0.1, gen=gen)
    z = logits_with_edge_rows(n, e, gen)
    w = torch.randn(n, cfg.top_k, generator=gen)
    assert_same_route(route_both(cfg, z, w, dispatch_align=8, num_ranks=4, **inputs))


@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("selection", ["top_k", "group_limited_bias", "fixed"])
def test_token_mask_and_replay_equal_cpu(gating, selection, gen):
    """Padding tokens (their rows NaN) and routing replay, alone and together,
    through the training kernels (prior and penalties) and the plain kernels."""
    e, n = 64, 300
    inputs = training_inputs(n, e, 5, gen)
    inputs["expert_bias"] = randn(e, scale=0.1, gen=gen)
    z = logits_with_edge_rows(n, e, gen)
    mask = torch.rand(n, generator=gen) > 0.3
    z[~mask] = float("nan")
    for cfg in (mr.RouterConfig(gating=gating, prior="log_prior_bias", prior_beta=0.7, **SELECTIONS[selection],
                                **PENALTIES),
                mr.RouterConfig(gating=gating, load_balance=0.3, load_balance_scope="sequence",  # Megatron's
                                load_balance_sequence_length="batch_mean", **SELECTIONS[selection]),  # seq_aux_loss
                mr.RouterConfig(gating=gating, **SELECTIONS[selection])):
        replay = torch.stack([torch.randperm(e, generator=gen)[:cfg.top_k] for _ in range(n)]).int()
        w = torch.randn(n, cfg.top_k, generator=gen)
        for extra in (dict(token_mask=mask), dict(replay_indices=replay), dict(token_mask=mask, replay_indices=replay)):
            assert_same_route(route_both(cfg, z, w, dispatch_align=8, num_ranks=4, **inputs, **extra))
        assert_same_route(route_both(cfg, z, w, admission=ADMISSIONS["cipher_reroute"], token_mask=mask,
                                     hidden_norms=torch.rand(n, generator=gen) + 0.5,
                                     weight_norms=torch.rand(e, generator=gen) + 0.5, **inputs))


@pytest.mark.parametrize("gating", GATINGS)
def test_route_without_inputs_and_in_eval(gating, gen):
    """Neutral inputs (the device scratch path) and the evaluation mode."""
    n, e = 129, 40
    z = randn(n, e, gen=gen)
    w = torch.randn(n, 3, generator=gen)
    for training in (True, False):
        cfg = mr.RouterConfig(gating=gating, top_k=3, load_balance=0.1, z_loss=0.01)
        assert_same_route(route_both(cfg, z, w, training=training))


ADMISSIONS = {
    "capacity_probs": mr.Admission.capacity_probs(1.0),
    "capacity_position": mr.Admission.capacity_position(1.25, min_capacity=2),
    "logit_threshold": mr.Admission("capacity", "logit", "drop", threshold=1.0, capacity_factor=1.1),
    "cipher_strict_renormalize": mr.Admission.cipher_strict(0.5, capacity_factor=1.0, renormalize=True),
    "cipher_reroute": mr.Admission.cipher_reroute(0.5, capacity_factor=1.25, fill_factor=1.0),
    "probability_reroute": mr.Admission("capacity", "probability", "reroute", capacity_factor=1.0, fill_factor=1.1,
                                        max_rounds=1),
}


@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("policy", list(ADMISSIONS))
@pytest.mark.parametrize("groups", [1, 3])
def test_admission_equals_cpu(gating, policy, groups, gen):
    n, e, k = 400, 24, 3
    z = randn(n, e, gen=gen) + torch.linspace(1.5, -1.5, e)  # skewed: some experts overflow
    cfg = mr.RouterConfig(gating=gating, top_k=k, load_balance=0.2)
    inputs = dict(hidden_norms=torch.rand(n, generator=gen) * 2 + 0.5, weight_norms=torch.rand(e, generator=gen) + 0.5)
    if groups > 1:
        inputs.update(group_ids=torch.randint(0, groups, (n,), generator=gen), num_groups=groups + 1)
    w = torch.randn(n, k, generator=gen)
    results = route_both(cfg, z, w, admission=ADMISSIONS[policy], **inputs)
    assert results[0].admission_report["over_capacity"] > 0
    assert_same_route(results)


def test_admission_with_per_expert_capacity(gen):
    n, e = 200, 10
    z = randn(n, e, gen=gen) + torch.linspace(1.0, -1.0, e)
    capacity = torch.tensor([0, 3, 5, 100, 8, 8, 2, 1, 0, 4])
    w = torch.randn(n, 2, generator=gen)
    assert_same_route(route_both(mr.RouterConfig(top_k=2), z, w, admission=mr.Admission.capacity_probs(1.0),
                                  capacity=capacity))


def test_no_tokens():
    cfg = mr.RouterConfig(top_k=2, load_balance=0.1)
    for admission in (None, mr.Admission.capacity_probs(1.0)):
        res = mr.route(torch.empty(0, 8, device=DEV), cfg, admission=admission)
        assert res.indices.shape == (0, 2) and res.indices.is_cuda
        assert res.dispatch.tokens_per_expert.tolist() == [0] * 8


def test_bf16_logits_and_determinism(gen):
    n, e = 500, 64
    z = randn(n, e, gen=gen).to(torch.bfloat16)
    cfg = mr.RouterConfig(gating="sigmoid", top_k=6, z_loss=0.01)
    w = torch.randn(n, 6, generator=gen)
    results = route_both(cfg, z, w)
    gpu = results[2]
    assert results[3].dtype == torch.bfloat16
    assert_same_route(results)
    again = mr.route(z.to(DEV), cfg)
    assert same_bits(again.gates, gpu.gates) and same_bits(again.indices, gpu.indices)


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_expert_choice_equals_cpu(groups, masked, gen):
    n, e = 300, 16
    z = randn(n, e, gen=gen)
    z[5] = 0.5  # ties
    kw = dict(top_k=2, capacity_factor=1.25, min_capacity=1, dispatch_align=4)
    if groups > 1:
        kw.update(group_ids=torch.randint(0, groups, (n,), generator=gen), num_groups=groups)
    if masked:
        kw.update(token_mask=torch.arange(n) % 4 != 1)
        z[~kw["token_mask"]] = float("inf")
    w = torch.randn(n, e, generator=gen)
    out = []
    for device in ("cpu", DEV):
        zd = z.to(device).requires_grad_(True)
        res = mr.expert_choice(zd, **to(kw, device))
        (res.gates * w.to(device)).sum().backward()
        out.append((res, zd.grad))
    (cpu, cpu_grad), (gpu, gpu_grad) = out
    for name in ("indices", "gates", "experts_per_token"):
        assert same_bits(getattr(gpu, name), getattr(cpu, name)), name
    assert same_bits(gpu_grad, cpu_grad)
    assert gpu.report == cpu.report
    assert same_bits(gpu.dispatch.permutation, cpu.dispatch.permutation)


def test_router_l2_equals_cpu(gen):
    weights = [randn(16, 32, gen=gen), randn(16, 32, gen=gen), randn(8, 4, gen=gen)]
    base = [w + 0.01 * randn(*w.shape, gen=gen) for w in weights]
    out = []
    for device in ("cpu", DEV):
        ws = [w.to(device).requires_grad_(True) for w in weights]
        value = mr.router_l2(ws, [b.to(device) for b in base], coefficient=300.0)
        (2.0 * value).backward()
        out.append((value, [w.grad for w in ws]))
    (cpu, cpu_grads), (gpu, gpu_grads) = out
    assert gpu.is_cuda and same_bits(gpu, cpu)
    for g, c in zip(gpu_grads, cpu_grads):
        assert same_bits(g, c)


@pytest.mark.parametrize("gating", GATINGS)
def test_prior_build_prepare_and_bias_update(gating, gen):
    n, e, rows = 500, 24, 7
    z = randn(n, e, gen=gen)
    row = torch.randint(-1, rows - 1, (n,), generator=gen)  # row 6 stays empty
    pi, empty = mr.prior.build(z, row, rows, gating)
    pi_gpu, empty_gpu = mr.prior.build(z.to(DEV), row.to(DEV), rows, gating)
    assert pi_gpu.is_cuda and same_bits(pi_gpu, pi) and empty_gpu == empty == [6]
    pi[6] = 1.0 / e
    pi_gpu[6] = 1.0 / e
    cpu, gpu = mr.prior.prepare(pi), mr.prior.prepare(pi_gpu)
    assert gpu.bias.is_cuda and same_bits(gpu.bias, cpu.bias) and same_bits(gpu.probs, cpu.probs)
    bias, loads = randn(e, scale=0.1, gen=gen), torch.randint(0, 50, (e,), generator=gen)
    bias_gpu = bias.to(DEV)
    mr.update_expert_bias(bias, loads, 0.01)
    mr.update_expert_bias(bias_gpu, loads.to(DEV), 0.01)
    assert same_bits(bias_gpu, bias)


def test_router_module_on_cuda(gen):
    cfg = mr.RouterConfig.preset("deepseek_v3", z_loss=0.001, load_balance=0.01)
    cpu = mr.Router(32, 256, cfg, mr.Admission.cipher_reroute(0.1, capacity_factor=1.5))
    gpu = mr.Router(32, 256, cfg, mr.Admission.cipher_reroute(0.1, capacity_factor=1.5))
    # Dyadic weights and inputs: every product and sum of x W^T is exact in fp32, so both
    # devices' matmuls give the same logits (with many ties) and the routing must agree bit for bit.
    with torch.no_grad():
        cpu.weight.copy_(torch.round(torch.randn(256, 32, generator=gen) * 16) / 64)
    gpu.load_state_dict(cpu.state_dict())
    gpu.to(DEV)
    x = torch.round(torch.randn(2, 64, 32, generator=gen) * 4) / 8
    out = []
    for module, device in ((cpu, "cpu"), (gpu, DEV)):
        res = module(x.to(device))
        (res.gates.sum() + res.aux_loss).backward()
        module.update_expert_bias(res.tokens_per_expert)
        out.append((res, module.weight.grad, module.expert_bias))
    (c, c_grad, c_bias), (g, g_grad, g_bias) = out
    assert same_bits(g.indices, c.indices) and same_bits(g.gates, c.gates)
    assert same_bits(g_bias, c_bias)
    # The weight gradient goes through torch's matmul, whose CPU and CUDA kernels round differently.
    torch.testing.assert_close(g_grad.cpu(), c_grad, rtol=1e-4, atol=1e-5)


def test_bad_device_arguments(gen):
    n, e = 10, 8
    z = randn(n, e, gen=gen).to(DEV)
    with pytest.raises(ValueError, match="expert_bias is on cpu, but logits is on cuda"):
        mr.route(z, mr.RouterConfig(selection="expert_bias"), expert_bias=torch.zeros(e))
    with pytest.raises(ValueError, match="group_ids is on cpu"):
        mr.route(z, mr.RouterConfig(), admission=mr.Admission.capacity_probs(1.0),
                 group_ids=torch.zeros(n, dtype=torch.int32), num_groups=1)
    with pytest.raises(ValueError, match="rows must be -1 or in"):
        mr.prior.build(z, torch.full((n,), 9, device=DEV), 3)


def test_bad_values_are_dropped_and_counted_on_the_device(gen):
    """Where the CPU raises for a bad group id, the device drops the slots and
    counts them (docs/gpu.md): raising would wait for the stream."""
    n, e, k = 10, 8, 2
    z = randn(n, e, gen=gen)
    bad_groups = torch.full((n,), 5, dtype=torch.int32)
    admission = mr.Admission.capacity_probs(1.0)
    with pytest.raises(ValueError, match="group_ids"):
        mr.route(z, mr.RouterConfig(top_k=k), admission=admission, group_ids=bad_groups, num_groups=2)
    res = mr.route(z.to(DEV), mr.RouterConfig(top_k=k), admission=admission, group_ids=bad_groups.to(DEV),
                   num_groups=2)
    assert res.admission_report["invalid"] == n * k
    assert (res.indices == -1).all() and (res.status == 1).all()
    with pytest.raises(ValueError, match="group_ids"):
        mr.expert_choice(z, group_ids=bad_groups, num_groups=2)
    assert mr.expert_choice(z.to(DEV), group_ids=bad_groups.to(DEV), num_groups=2).report["invalid"] == n


def test_select_experts_equals_cpu_and_eval_route(gen):
    for preset in ("deepseek_v3", "mixtral", "qwen3"):
        cfg = mr.RouterConfig.preset(preset)
        e = mr.RouterConfig.preset_experts(preset)
        z = randn(37, e, gen=gen)
        bias = torch.randn(e, generator=gen) if cfg.uses_expert_bias else None
        cpu = mr.select_experts(z, cfg, expert_bias=bias)
        gpu = mr.select_experts(z.to(DEV), cfg, expert_bias=to(bias, DEV))
        ref = mr.route(z.to(DEV), cfg, training=False, expert_bias=to(bias, DEV), num_ranks=1)
        for got, want in zip(gpu, cpu):
            assert same_bits(got, want)
        assert same_bits(gpu[0], ref.gates) and same_bits(gpu[1], ref.indices)


# ---------------------------------------------------------------------------
# No host synchronisation, and CUDA-graph capture (issue 15, item 4).

_STEP_CONFIG = mr.RouterConfig(gating="softmax", top_k=4, load_balance=1e-2, z_loss=1e-3)
_STEP_ADMISSION = mr.Admission.capacity_probs(1.25)


def _training_step(z, w):
    res = mr.route(z, _STEP_CONFIG, admission=_STEP_ADMISSION, num_ranks=1)
    (grad,) = torch.autograd.grad((res.gates * w).sum() + res.aux_loss, z)
    return (res.indices, res.gates.detach(), res.penalty_values.detach(), res.dispatch.permutation,
            res.admission_counts, grad)


def test_training_step_does_not_synchronise():
    z = randn(512, 64).cuda().requires_grad_(True)
    w = randn(512, 4).cuda()
    _training_step(z, w)  # first call: allocator growth and lazy initialisation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _training_step(z, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_replay_equals_eager():
    static_z = randn(512, 64).cuda().requires_grad_(True)
    w = randn(512, 4).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm up on a side stream, as torch.cuda.graph asks
            _training_step(static_z, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _training_step(static_z, w)
    fresh = randn(512, 64, scale=2.0).cuda()
    with torch.no_grad():
        static_z.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    eager = _training_step(fresh.clone().requires_grad_(True), w)
    for got, want in zip(captured, eager):
        assert same_bits(got, want)


def test_decode_step_captured_equals_eager():
    """select_experts, the decode path, in a captured graph (as vLLM and SGLang capture decode)."""
    cfg = mr.RouterConfig.preset("deepseek_v3")
    e = mr.RouterConfig.preset_experts("deepseek_v3")
    static_z, bias = randn(16, e).cuda(), randn(e).cuda()
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            mr.select_experts(static_z, cfg, expert_bias=bias)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = mr.select_experts(static_z, cfg, expert_bias=bias)
        fresh = randn(16, e, scale=2.0).cuda()
        static_z.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, mr.select_experts(fresh, cfg, expert_bias=bias)):
            assert same_bits(got, want)
