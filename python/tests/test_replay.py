"""Routing replay (docs/policies.md §2.9): route and its backward at experts
chosen elsewhere (R3: an inference engine's routing replayed in training),
against the float64 reference held at the same experts; equal to a normal call
when the experts are the router's own; Megatron-Core's RouterReplay as a second
oracle; bad replays refused by name before anything is written."""

import warnings
from unittest import mock

import pytest
import torch

import moe_route as mr
import reference as ref
from helpers import GATE_TOL, GATINGS, VALUE_TOL, assert_close, assert_grad, fields, import_engine, randn

N, E, K = 30, 12, 3


def _experts(n=N, e=E, k=K, seed=0):
    """K distinct experts per token, in no particular order."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(torch.int32)


@pytest.mark.parametrize("gating", GATINGS)
def test_replayed_gates_penalties_and_gradients_equal_the_reference(gating):
    gen = torch.Generator().manual_seed(1)
    cfg = mr.RouterConfig(gating=gating, top_k=K, load_balance=0.5, z_loss=0.1)
    z, w, replay = randn(N, E, gen=gen), randn(N, K, gen=gen), _experts()
    a = z.clone().requires_grad_(True)
    res = mr.route(a, cfg, replay_indices=replay)
    ((res.gates * w).sum() + 3 * res.aux_loss).backward()
    z64 = z.double().requires_grad_(True)
    idx = replay.long()
    gates = ref.gate_weights(gating, ref.gate_inputs(gating, ref.sanitize(z64)).gather(1, idx),
                             ref.normalizes_by_default(gating), 1.0)
    penalties = ref.penalties(z64, idx, **fields(cfg))
    assert torch.equal(res.indices, replay)
    assert_close(res.gates, gates, **GATE_TOL)
    assert_close(res.penalty_values, penalties, **VALUE_TOL)
    ((gates * w.double()).sum() + 3 * penalties.sum()).backward()
    assert_grad(a.grad, z64.grad)
    assert torch.equal(res.tokens_per_expert.long(), torch.bincount(idx.reshape(-1), minlength=E))


@pytest.mark.parametrize("preset", ["deepseek_v3", "mixtral", "qwen3"])
def test_replaying_the_routers_own_choice_is_the_normal_call(preset):
    gen = torch.Generator().manual_seed(2)
    cfg = mr.RouterConfig.preset(preset, load_balance=0.1, z_loss=0.01)
    e = mr.RouterConfig.preset_experts(preset)
    z = randn(64, e, gen=gen)
    bias = torch.randn(e, generator=gen) * 0.1 if cfg.uses_expert_bias else None
    admission = mr.Admission.capacity_probs(1.0)
    a, b = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    normal = mr.route(a, cfg, expert_bias=bias, admission=admission)
    replayed = mr.route(b, cfg, expert_bias=bias, admission=admission, replay_indices=normal.routed_indices)
    w = randn(64, cfg.top_k, gen=gen)
    ((normal.gates * w).sum() + normal.aux_loss).backward()
    ((replayed.gates * w).sum() + replayed.aux_loss).backward()
    for name in ("indices", "gates", "routed_indices", "routed_gates", "status", "penalty_values"):
        assert torch.equal(getattr(replayed, name), getattr(normal, name)), name
    assert torch.equal(a.grad, b.grad)


def test_replay_with_a_token_mask_and_admission():
    gen = torch.Generator().manual_seed(3)
    cfg = mr.RouterConfig(top_k=K, load_balance=0.5)
    z, replay = randn(N, E, gen=gen), _experts(seed=3)
    mask = torch.arange(N) % 3 != 0
    replay[~mask] = -5  # padding rows are not read
    res = mr.route(z, cfg, replay_indices=replay, token_mask=mask, admission=mr.Admission.capacity_position(0.7))
    want = mr.route(z[mask], cfg, replay_indices=replay[mask], admission=mr.Admission.capacity_position(0.7))
    assert torch.equal(res.indices[mask], want.indices) and bool((res.indices[~mask] == -1).all())
    assert torch.equal(res.gates[mask], want.gates)
    torch.testing.assert_close(res.penalty_values, want.penalty_values, rtol=1e-6, atol=0.0)


def test_a_bad_replay_is_refused_by_name():
    z, cfg = randn(N, E, gen=torch.Generator().manual_seed(4)), mr.RouterConfig(top_k=K)
    replay = _experts()
    bad = replay.clone()
    bad[4, 1] = E
    with pytest.raises(ValueError, match=r"replay_indices\[13\] \(= 12\) is not an expert"):
        mr.route(z, cfg, replay_indices=bad)
    bad = replay.clone()
    bad[4, 2] = bad[4, 0]
    with pytest.raises(ValueError, match="token 4 replays expert .* twice"):
        mr.route(z, cfg, replay_indices=bad)
    with pytest.raises(ValueError, match="replay_indices"):
        mr.route(z, cfg, replay_indices=replay[:, :2])
    with pytest.raises(TypeError, match="replay_indices must be torch.int32"):
        mr.route(z, cfg, replay_indices=replay.float())


def test_megatron_router_replay_is_a_second_oracle():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import_engine("megatron.core")
        from megatron.core import parallel_state
        from megatron.core.transformer.moe import moe_utils
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplayAction
        from megatron.core.transformer.transformer_config import TransformerConfig
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        for fields_ in (dict(moe_router_topk=2), dict(moe_router_topk=4, moe_router_pre_softmax=True),
                        dict(moe_router_topk=4, moe_router_score_function="sigmoid",
                             moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=16,
                                           use_cpu_initialization=True, add_bias_linear=False,
                                           moe_enable_routing_replay=True, **fields_)
            with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
                router = TopKRouter(config, pg_collection=moe_utils.get_default_pg_collection())
            k = fields_["moe_router_topk"]
            bias = torch.randn(16, generator=torch.Generator().manual_seed(5)) * 0.3
            if router.expert_bias is not None:
                router.expert_bias.copy_(bias)
            logits = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(6)) * 2
            upstream = torch.randn(16, 16, generator=torch.Generator().manual_seed(7))
            replay = _experts(16, 16, k, seed=8)
            router.router_replay.set_target_indices(replay.long())
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            z = logits.clone().requires_grad_(True)
            probs, routing_map = router.routing(z)
            (probs * upstream).sum().backward()
            cfg = mr.RouterConfig.from_megatron(**fields_)
            y = logits.reshape(16, 16).clone().requires_grad_(True)
            res = mr.route(y, cfg, replay_indices=replay,
                           expert_bias=bias if cfg.uses_expert_bias else None)
            got = torch.zeros(16, 16).scatter(1, res.indices.long(), res.gates)
            (got * upstream).sum().backward()
            assert torch.equal(routing_map, got != 0)
            torch.testing.assert_close(got, probs.detach(), rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(y.grad, z.grad.reshape(16, 16), rtol=1e-5, atol=1e-6)
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
