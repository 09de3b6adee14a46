"""Megatron-Core's own TopKRouter as the oracle (issue 16): for every router
configuration RouterConfig.from_megatron / Admission.from_megatron accept, the
library's route gives Megatron's routing map, its probabilities, its load-balance
and z-loss values, the gradient of the logits (through Megatron's aux-loss
scaler) and its expert-bias update; the configurations it does not reproduce
raise ValueError naming the field. Megatron runs its pure-PyTorch path on the CPU
in one gloo process, on random logits (TopKRouter.routing: the router after its
gating linear)."""

import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch

import moe_route as mr
from helpers import import_engine

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Megatron warns that Transformer Engine and Apex are absent
    import_engine("megatron.core")
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

# Megatron's configuration warns about fields a router alone does not use.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SEQ, BATCH, E = 8, 4, 16
N = SEQ * BATCH


@pytest.fixture(scope="module", autouse=True)
def megatron_state():
    """One gloo process: Megatron's router asks parallel_state for its groups."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def _logits(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SEQ, BATCH, E, generator=g) * 2.0


def _bias(seed):
    return torch.randn(E, generator=torch.Generator().manual_seed(seed + 100)) * 0.5


def megatron_route(fields, logits, expert_bias=None, upstream=None, router_class=TopKRouter, padding_mask=None,
                   prepare=None):
    """Megatron's probs, routing map, loss values (coefficient included), logits
    gradient of sum(upstream * probs) (aux losses through their scaler) and its
    tokens_per_expert for the expert-bias update."""
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=E,
                               use_cpu_initialization=True, add_bias_linear=False, **fields)
    # Megatron puts the expert-bias buffers on torch.cuda.current_device(); here they live on the CPU.
    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
        router = router_class(config, pg_collection=moe_utils.get_default_pg_collection())
    router.set_layer_number(1)
    if expert_bias is not None:
        router.expert_bias.copy_(expert_bias)
    if prepare is not None:
        prepare(router)
    moe_utils.clear_aux_losses_tracker()
    z = logits.clone().requires_grad_()
    probs, routing_map = router.routing(z, padding_mask=padding_mask)
    (probs * upstream).sum().backward()
    tracked = moe_utils.get_moe_layer_wise_logging_tracker()
    coeffs = {"load_balancing_loss": router.get_aux_loss_coeff("aux_loss"),
              "seq_load_balancing_loss": router.get_aux_loss_coeff("seq_aux_loss"),
              "z_loss": config.moe_z_loss_coeff or 0.0}
    values = {name: float(tracked[name]["values"][0]) * coeffs[name] for name in coeffs if name in tracked}
    moe_utils.clear_aux_losses_tracker()
    loads = router.local_tokens_per_expert.clone() if expert_bias is not None else None
    return probs.detach(), routing_map, values, z.grad.reshape(N, E), loads


def library_route(fields, logits, expert_bias=None, upstream=None):
    cfg = mr.RouterConfig.from_megatron(**fields)
    admission = mr.Admission.from_megatron(**fields)
    z = logits.reshape(N, E).clone().requires_grad_()
    sequences = {}
    if cfg.load_balance_scope == "sequence":  # Megatron's tokens are [seq_length, batch]
        sequences = dict(sequence_ids=torch.arange(N) % BATCH, num_sequences=BATCH)
    res = mr.route(z, cfg, expert_bias=expert_bias, admission=None if admission.is_dropless else admission,
                   **sequences)
    kept = res.indices >= 0
    slot = res.indices.clamp(min=0).long()
    probs = torch.zeros(N, E).scatter_add(1, slot, torch.where(kept, res.gates, torch.zeros_like(res.gates)))
    routing_map = torch.zeros(N, E, dtype=torch.bool).scatter_add(1, slot, kept)
    ((probs * upstream).sum() + res.aux_loss).backward()
    return probs.detach(), routing_map, res, z.grad


CASES = {
    # Mixtral-like: Megatron's defaults (softmax over the K selected logits), aux loss and z-loss
    "softmax_after_topk": dict(moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3),
    # DeepSeek-V2-Lite-like: softmax over all experts, top-6, scaled
    "pre_softmax_scaled": dict(moe_router_topk=6, moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.0,
                               moe_aux_loss_coeff=1e-2),
    "softmax_grouped": dict(moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2,
                            moe_z_loss_coeff=1e-3),
    # groups scored by their top probabilities (DeepSeek-V2 in Megatron) and by sigmoid scores
    "pre_softmax_grouped": dict(moe_router_topk=6, moe_router_pre_softmax=True, moe_router_num_groups=8,
                                moe_router_group_topk=3, moe_router_topk_scaling_factor=1.5),
    "sigmoid_grouped": dict(moe_router_topk=4, moe_router_score_function="sigmoid", moe_router_num_groups=4,
                            moe_router_group_topk=2, moe_z_loss_coeff=1e-3),
    "sigmoid": dict(moe_router_topk=4, moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5,
                    moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3),
    "sigmoid_single_gate": dict(moe_router_topk=1, moe_router_score_function="sigmoid", moe_aux_loss_coeff=1e-2),
    # Moonlight-like: sigmoid with the aux-loss-free expert bias
    "sigmoid_bias": dict(moe_router_topk=4, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                         moe_router_topk_scaling_factor=2.5, moe_z_loss_coeff=1e-3),
    # DeepSeek-V3-like: biased sigmoid, 2 of 4 groups
    "sigmoid_bias_grouped": dict(moe_router_topk=4, moe_router_score_function="sigmoid",
                                 moe_router_enable_expert_bias=True, moe_router_num_groups=4,
                                 moe_router_group_topk=2),
    "seq_aux_loss": dict(moe_router_topk=2, moe_router_pre_softmax=True, moe_router_load_balancing_type="seq_aux_loss",
                         moe_aux_loss_coeff=1e-2),
    # aux losses whose loads Megatron counts on a plain top-k while the router selects with
    # a bias or groups (load_balance_counts="top_k"): DeepSeek-V3's sequence-wise loss,
    # a biased sigmoid with the batch loss, grouped softmax routers
    "sigmoid_bias_grouped_seq_aux_loss": dict(moe_router_topk=4, moe_router_score_function="sigmoid",
                                              moe_router_enable_expert_bias=True, moe_router_num_groups=4,
                                              moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                                              moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2),
    "sigmoid_bias_aux_loss": dict(moe_router_topk=4, moe_router_score_function="sigmoid",
                                  moe_router_enable_expert_bias=True, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3),
    "softmax_grouped_aux_loss": dict(moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2,
                                     moe_aux_loss_coeff=1e-2),
    "pre_softmax_grouped_aux_loss": dict(moe_router_topk=6, moe_router_pre_softmax=True, moe_router_num_groups=8,
                                         moe_router_group_topk=3, moe_aux_loss_coeff=1e-2),
    "listed_types": dict(moe_router_topk=2, moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                         moe_aux_loss_coeff=[1e-2, 0.0]),
    "drop_probs": dict(moe_router_topk=2, moe_router_pre_softmax=True, moe_expert_capacity_factor=1.0,
                       moe_aux_loss_coeff=1e-2),
    "drop_probs_single_sigmoid": dict(moe_router_topk=1, moe_router_score_function="sigmoid",
                                      moe_expert_capacity_factor=0.75),
    # Megatron's default router ranks the tokens of an expert by its normalised top-k gate
    "drop_probs_default_router": dict(moe_router_topk=2, moe_expert_capacity_factor=1.0, moe_aux_loss_coeff=1e-2,
                                      moe_z_loss_coeff=1e-3),
    "drop_probs_sigmoid": dict(moe_router_topk=4, moe_router_score_function="sigmoid",
                               moe_router_topk_scaling_factor=2.5, moe_expert_capacity_factor=0.8),
    "drop_probs_biased_grouped": dict(moe_router_topk=4, moe_router_score_function="sigmoid",
                                      moe_router_enable_expert_bias=True, moe_router_num_groups=4,
                                      moe_router_group_topk=2, moe_expert_capacity_factor=1.0),
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(CASES))
def test_route_equals_megatron(name, seed):
    fields = CASES[name]
    logits = _logits(seed)
    bias = _bias(seed) if fields.get("moe_router_enable_expert_bias") else None
    upstream = torch.randn(N, E, generator=torch.Generator().manual_seed(seed + 7))
    want_probs, want_map, want_values, want_grad, want_loads = megatron_route(fields, logits, bias, upstream)
    probs, routing_map, res, grad = library_route(fields, logits, bias, upstream)

    assert torch.equal(routing_map, want_map)
    torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-5 * float(want_grad.abs().max()))
    penalties = {name: float(value.detach()) for name, value in res.penalties.items()}
    lb = want_values.get("load_balancing_loss", 0.0) + want_values.get("seq_load_balancing_loss", 0.0)
    torch.testing.assert_close(penalties["load_balance"], lb, rtol=1e-5, atol=0.0)
    torch.testing.assert_close(penalties["z_loss"], want_values.get("z_loss", 0.0), rtol=1e-5, atol=0.0)
    if bias is not None:  # the aux-loss-free update Megatron applies after the step
        rate = mr.RouterConfig.from_megatron(**fields).bias_update_rate
        want_bias = moe_utils.get_updated_expert_bias(want_loads.clone(), bias.clone(), rate)
        updated = bias.clone()
        mr.update_expert_bias(updated, res.tokens_per_expert, rate)
        assert torch.equal(res.tokens_per_expert.to(want_loads.dtype), want_loads)
        assert torch.equal(updated, want_bias)


def _assert_same_step(got, want):
    """Two megatron_route results: the same probs, tracked losses, logits gradient and
    expert-bias loads (the routing maps are the caller's to compare)."""
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
    assert got[2].keys() == want[2].keys()
    for key in want[2]:
        torch.testing.assert_close(got[2][key], want[2][key], rtol=1e-5, atol=0.0)
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=1e-5 * float(want[3].abs().max()))
    if want[4] is not None:
        assert torch.equal(got[4], want[4])


def _megatron_expert_bias_loads(router, routing_map, padding_mask=None):
    """TopKRouter._apply_expert_bias. Megatron-Core 0.16.1 masks the [tokens, E] map with
    the [tokens] padding mask, which does not broadcast; this is its count with the
    mask's expert dimension added."""
    if router.enable_expert_bias and torch.is_grad_enabled():
        valid = True if padding_mask is None else ~padding_mask.unsqueeze(-1)
        router.local_tokens_per_expert += (routing_map & valid).sum(dim=0)


def _integration_and_topkrouter(fields, seed, logits=None, padding=None):
    """megatron_route of MoERouteTopKRouter and of Megatron's TopKRouter on the same
    inputs (Megatron reads 0 where the integration's padding logits are NaN)."""
    from moe_route.integrations.megatron import MoERouteTopKRouter

    logits = _logits(seed) if logits is None else logits
    bias = _bias(seed) if fields.get("moe_router_enable_expert_bias") else None
    upstream = torch.randn(N, E, generator=torch.Generator().manual_seed(seed + 7))
    with mock.patch.object(TopKRouter, "_apply_expert_bias", _megatron_expert_bias_loads):
        want = megatron_route(fields, logits.nan_to_num(0.0), bias, upstream, padding_mask=padding)
    got = megatron_route(fields, logits, bias, upstream, router_class=MoERouteTopKRouter, padding_mask=padding)
    return got, want


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_megatron_integration_router_equals_topkrouter(name):
    # MoERouteTopKRouter is Megatron's TopKRouter with routing() on the library: the
    # same probs, map, tracked losses, logits gradient and expert-bias loads.
    got, want = _integration_and_topkrouter(CASES[name], 4)
    assert torch.equal(got[1], want[1])
    _assert_same_step(got, want)


PADDED_CASES = sorted(name for name, fields in CASES.items() if "moe_expert_capacity_factor" not in fields)


@pytest.mark.parametrize("name", PADDED_CASES)
def test_the_megatron_integration_router_with_a_padding_mask_equals_topkrouter_on_the_valid_tokens(name):
    # Dropless, Megatron leaves padding out of its losses and expert-bias loads but still
    # routes it; the library routes it nowhere. Valid tokens: the same map, probs, losses and gradient.
    logits = _logits(5)
    padding = torch.zeros(SEQ, BATCH, dtype=torch.bool)
    padding[5:, 0] = True  # right padding of unequal lengths (seq_aux_loss: each sequence by the mean length)
    padding[2:, 3] = True
    padding[:, 2] = name.endswith("seq_aux_loss")  # a sequence of padding alone still counts in that mean
    logits[padding] = float("nan")  # never read
    valid = ~padding.reshape(-1)
    got, want = _integration_and_topkrouter(CASES[name], 5, logits, padding)
    assert torch.equal(got[1][valid], want[1][valid]) and not got[1][~valid].any()
    assert torch.equal(got[0][~valid], torch.zeros_like(got[0][~valid]))
    assert torch.equal(got[3][~valid], torch.zeros_like(got[3][~valid]))
    _assert_same_step([x[valid] if i in (0, 3) else x for i, x in enumerate(got)],
                      [x[valid] if i in (0, 3) else x for i, x in enumerate(want)])


DROPPING_CASES = {name: fields for name, fields in CASES.items() if "moe_expert_capacity_factor" in fields}
DROPPING_CASES["drop_probs_seq_aux_loss"] = dict(CASES["drop_probs"], moe_router_load_balancing_type="seq_aux_loss",
                                                 moe_z_loss_coeff=1e-3)


@pytest.mark.parametrize("name", sorted(DROPPING_CASES))
def test_the_megatron_integration_router_with_a_padding_mask_and_token_dropping_equals_topkrouter(name):
    # With a capacity factor Megatron's padding is routed and competes for capacity; only the
    # losses and the expert-bias loads leave it out. The integration does the same: every row equal.
    padding = torch.zeros(SEQ, BATCH, dtype=torch.bool)
    padding[3:, 1] = True
    padding[6:, 2] = True
    got, want = _integration_and_topkrouter(DROPPING_CASES[name], 8, padding=padding)
    assert torch.equal(got[1], want[1]) and bool(got[1][padding.reshape(-1)].any())
    _assert_same_step(got, want)


@pytest.mark.parametrize("name", ["softmax_after_topk", "pre_softmax_scaled", "sigmoid_bias", "drop_probs", "seq_aux_loss",
                                  "sigmoid_bias_grouped_seq_aux_loss"])
def test_the_megatron_integration_router_records_and_replays_as_topkrouter(name):
    # Megatron's RouterReplay (moe_enable_routing_replay): RECORD keeps the chosen experts,
    # REPLAY_FORWARD routes to given ones; MoERouteTopKRouter does both through route().
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    from moe_route.integrations.megatron import MoERouteTopKRouter

    fields = dict(CASES[name], moe_enable_routing_replay=True)
    logits = _logits(6)
    bias = _bias(6) if fields.get("moe_router_enable_expert_bias") else None
    upstream = torch.randn(N, E, generator=torch.Generator().manual_seed(13))
    k = fields["moe_router_topk"]
    target = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:k] for t in range(N)])
    outputs, recorded = {}, {}
    try:
        for action in (RouterReplayAction.RECORD, RouterReplayAction.REPLAY_FORWARD):
            for router_class in (TopKRouter, MoERouteTopKRouter):
                RouterReplay.clear_global_router_replay_instances()
                routers = []

                def prepare(router):
                    router.router_replay.set_target_indices(target)
                    router.router_replay.set_router_replay_action(action)
                    routers.append(router)

                outputs[action, router_class] = megatron_route(fields, logits, bias, upstream,
                                                               router_class=router_class, prepare=prepare)
                recorded[action, router_class] = routers[0].router_replay.get_recorded_indices()
    finally:
        RouterReplay.clear_global_router_replay_instances()
    for action in (RouterReplayAction.RECORD, RouterReplayAction.REPLAY_FORWARD):
        want, got = outputs[action, TopKRouter], outputs[action, MoERouteTopKRouter]
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
        for key in want[2]:
            torch.testing.assert_close(got[2][key], want[2][key], rtol=1e-5, atol=0.0)
        torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=1e-5 * float(want[3].abs().max()))
    mine, theirs = recorded[RouterReplayAction.RECORD, MoERouteTopKRouter], recorded[RouterReplayAction.RECORD, TopKRouter]
    assert torch.equal(mine.sort(dim=1).values, theirs.sort(dim=1).values)


def test_the_megatron_integration_router_refuses_what_from_megatron_refuses():
    from moe_route.integrations.megatron import MoERouteTopKRouter

    def build(**fields):
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=E,
                                   use_cpu_initialization=True, add_bias_linear=False, **fields)
        return MoERouteTopKRouter(config, pg_collection=moe_utils.get_default_pg_collection())

    padding = torch.zeros(SEQ, BATCH, dtype=torch.bool)
    with pytest.raises(ValueError, match="padding_mask must be"):
        build().routing(_logits(0), padding_mask=padding[:, :2])


PAD_CASES = {
    "drop_probs": dict(CASES["drop_probs"], moe_pad_expert_input_to_capacity=True),
    "drop_probs_default_router": dict(CASES["drop_probs_default_router"], moe_pad_expert_input_to_capacity=True),
    "drop_probs_biased_grouped": dict(CASES["drop_probs_biased_grouped"], moe_pad_expert_input_to_capacity=True),
    "drop_probs_sigmoid_aux_loss": dict(CASES["drop_probs_sigmoid"], moe_aux_loss_coeff=1e-2,
                                        moe_pad_expert_input_to_capacity=True),
    # a capacity above the tokens: Megatron maps every token to every expert
    "capacity_above_tokens": dict(moe_router_topk=2, moe_expert_capacity_factor=10.0,
                                  moe_pad_expert_input_to_capacity=True),
}


@pytest.mark.parametrize("name", sorted(PAD_CASES))
def test_the_megatron_integration_router_pads_to_capacity_as_topkrouter(name):
    # moe_pad_expert_input_to_capacity: every expert's column of the map holds exactly
    # min(C, tokens) entries, its admitted tokens and fillers of prob 0. Equal to
    # Megatron: probs, the admitted entries, the counts, losses, gradient, expert-bias
    # loads. Megatron's fillers are its topk's pick among equal zeros; the library's
    # are the lowest-index tokens, the order Megatron's dispatcher fills in.
    from moe_route.integrations.megatron import MoERouteTopKRouter

    fields = PAD_CASES[name]
    logits = _logits(8)
    bias = _bias(8) if fields.get("moe_router_enable_expert_bias") else None
    upstream = torch.randn(N, E, generator=torch.Generator().manual_seed(14))
    want = megatron_route(fields, logits, bias, upstream)
    got = megatron_route(fields, logits, bias, upstream, router_class=MoERouteTopKRouter)
    admission = mr.Admission.from_megatron(**fields)
    capacity = admission.capacity(N, fields["moe_router_topk"], E)
    assert torch.equal(got[1].sum(dim=0), torch.full((E,), min(capacity, N)))
    assert torch.equal(want[1].sum(dim=0), got[1].sum(dim=0))
    assert torch.equal(got[1] & (got[0] != 0), want[1] & (want[0] != 0))
    _assert_same_step(got, want)
    # The fillers: per expert, the lowest-index tokens it did not admit.
    for e in range(E):
        fillers = (got[1][:, e] & (got[0][:, e] == 0)).nonzero().flatten()
        free = ((got[0][:, e] == 0)).nonzero().flatten()
        assert torch.equal(fillers, free[:fillers.numel()])


@pytest.mark.parametrize("name", ["drop_probs", "drop_probs_default_router", "drop_probs_biased_grouped"])
def test_the_fixed_dispatch_layout_holds_the_tokens_megatrons_padded_permute_puts_first(name):
    # route(..., dispatch_capacity=C) lays the dispatch out in E blocks of C rows, the
    # static shapes of Megatron's drop-and-pad dispatcher: each block starts with the
    # expert's admitted tokens in token order, as Megatron's permute(drop_and_pad=True)
    # orders them; the rest are empty rows (-1) where Megatron repeats zero-prob tokens.
    fields = dict(CASES[name], moe_pad_expert_input_to_capacity=True)
    logits = _logits(9).reshape(N, E)
    bias = _bias(9) if fields.get("moe_router_enable_expert_bias") else None
    cfg, admission = mr.RouterConfig.from_megatron(**fields), mr.Admission.from_megatron(**fields)
    k = cfg.top_k
    capacity = admission.capacity(N, k, E)
    res = mr.route(logits, cfg, expert_bias=bias, admission=admission, dispatch_capacity=capacity)
    layout = res.dispatch
    assert layout.permutation.shape == (E * capacity,) and int(layout.rows) == E * capacity
    routing_map = torch.zeros(N, E, dtype=torch.bool).scatter_add(1, res.indices.clamp(min=0).long(),
                                                                 res.indices >= 0)
    hidden = torch.arange(N, dtype=torch.float32).unsqueeze(1)
    _, _, megatron_rows = moe_utils.permute(hidden, routing_map, num_out_tokens=E * capacity, drop_and_pad=True)
    rows = layout.permutation.view(E, capacity)
    for e in range(E):
        count = int(layout.tokens_per_expert[e])
        assert count == int(routing_map[:, e].sum()) <= capacity
        assert torch.equal(rows[e, :count] // k, megatron_rows.view(E, capacity)[e, :count])
        assert bool((rows[e, count:] == -1).all())
    with pytest.raises(ValueError, match=r"more than capacity \(= 1\) slots"):
        mr.dispatch(res.indices, E, capacity=1)


def test_drop_position_keeps_as_many_tokens_as_megatron_and_the_earliest_as_it_documents():
    # Megatron documents "position" as dropping the tokens at the end of the batch, but
    # implements it as a topk of the 0/1 routing map down each expert's column: which
    # of the equal ones it keeps is the topk's choice (on this CPU, not the earliest,
    # so the two maps differ).
    # The library keeps the earliest. Equal: the routed experts, the number kept per
    # expert, the gates of the kept slots.
    fields = dict(moe_router_topk=2, moe_router_pre_softmax=True, moe_expert_capacity_factor=1.0,
                  moe_token_drop_policy="position")
    upstream = torch.ones(N, E)
    logits = _logits(3)
    want_probs, want_map, _, _, _ = megatron_route(fields, logits, None, upstream)
    probs, routing_map, res, _ = library_route(fields, logits, None, upstream)
    routed = torch.zeros(N, E, dtype=torch.bool).scatter(1, res.routed_indices.long(), True)
    capacity = -(-N * 2 // E)  # ceil(N K / E * 1.0)
    assert torch.equal(routing_map.sum(0), want_map.sum(0))
    assert torch.equal(routing_map.sum(0), routed.sum(0).clamp(max=capacity))
    assert not (want_map & ~routed).any() and not (routing_map & ~routed).any()
    for e in range(E):  # the library keeps each expert's earliest routed tokens
        tokens = torch.nonzero(routed[:, e]).flatten()
        assert torch.equal(torch.nonzero(routing_map[:, e]).flatten(), tokens[:capacity])
    torch.testing.assert_close(probs[routing_map], torch.softmax(logits.reshape(N, E), -1)[routing_map])
    torch.testing.assert_close(want_probs[want_map], torch.softmax(logits.reshape(N, E), -1)[want_map])


GLOBAL_CASES = {
    "softmax": dict(moe_router_topk=2, moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=1e-2),
    # the loads of a biased, grouped router are still a plain top-k in Megatron's global aux loss
    "sigmoid_bias_grouped": dict(moe_router_topk=4, moe_router_score_function="sigmoid",
                                 moe_router_enable_expert_bias=True, moe_router_num_groups=4, moe_router_group_topk=2,
                                 moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=1e-2),
}


@pytest.mark.parametrize("name", sorted(GLOBAL_CASES))
def test_global_aux_loss_over_accumulation_steps_equals_megatron(name):
    fields = GLOBAL_CASES[name]
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=E,
                               use_cpu_initialization=True, add_bias_linear=False, **fields)
    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
        router = TopKRouter(config, pg_collection=moe_utils.get_default_pg_collection())
    router.set_layer_number(1)
    bias = _bias(9) if router.expert_bias is not None else None
    if bias is not None:
        router.expert_bias.copy_(bias)
    cfg = mr.RouterConfig.from_megatron(**fields)
    assert cfg.load_balance_scope == "global_batch"
    balance = mr.GlobalLoadBalance(E, cfg.top_k)
    for step in range(3):  # three micro-batches of one optimizer step: Megatron's buffer accumulates
        logits = _logits(20 + step)
        upstream = torch.randn(N, E, generator=torch.Generator().manual_seed(step))
        moe_utils.clear_aux_losses_tracker()
        z_megatron = logits.clone().requires_grad_()
        probs, _ = router.routing(z_megatron)
        (probs * upstream).sum().backward()
        want = float(moe_utils.get_moe_layer_wise_logging_tracker()["global_load_balancing_loss"]["values"][0]) * 1e-2

        z = logits.reshape(N, E).clone().requires_grad_()
        res = mr.route(z, cfg, expert_bias=bias, load_fractions=balance.load_fractions(z.detach()))
        dense = torch.zeros(N, E).scatter_add(1, res.indices.long(), res.gates)
        ((dense * upstream).sum() + res.aux_loss).backward()
        assert balance.steps == step + 1 and float(router.ga_steps) == step + 1
        torch.testing.assert_close(float(res.penalties["load_balance"].detach()), want, rtol=1e-5, atol=0.0)
        torch.testing.assert_close(z.grad, z_megatron.grad.reshape(N, E), rtol=1e-5,
                                   atol=1e-5 * float(z_megatron.grad.abs().max()))
    moe_utils.clear_aux_losses_tracker()
    router.reset_global_aux_loss_tracker()
    balance.reset()
    assert balance.steps == 0 and balance.loads is None


@pytest.mark.parametrize("name", sorted(GLOBAL_CASES))
def test_the_megatron_integration_router_accumulates_the_global_batch_as_topkrouter(name):
    from moe_route.integrations.megatron import MoERouteTopKRouter

    fields = GLOBAL_CASES[name]
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=E,
                               use_cpu_initialization=True, add_bias_linear=False, **fields)
    routers = []
    for router_class in (TopKRouter, MoERouteTopKRouter):
        with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
            routers.append(router_class(config, pg_collection=moe_utils.get_default_pg_collection()))
        routers[-1].set_layer_number(1)
        if routers[-1].expert_bias is not None:
            routers[-1].expert_bias.copy_(_bias(9))
    for optimizer_step in range(2):
        for micro_batch in range(2):
            logits = _logits(40 + 2 * optimizer_step + micro_batch)
            upstream = torch.randn(N, E, generator=torch.Generator().manual_seed(micro_batch))
            results = []
            for router in routers:
                moe_utils.clear_aux_losses_tracker()
                z = logits.clone().requires_grad_()
                probs, routing_map = router.routing(z)
                (probs * upstream).sum().backward()
                tracked = moe_utils.get_moe_layer_wise_logging_tracker()["global_load_balancing_loss"]["values"][0]
                results.append((probs.detach(), routing_map, float(tracked), z.grad))
            (want_probs, want_map, want_loss, want_grad), (probs, routing_map, loss, grad) = results
            assert torch.equal(routing_map, want_map)
            torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0.0)
            torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-5 * float(want_grad.abs().max()))
        for router in routers:  # what finalize_model_grads does after the optimizer step
            router.reset_global_aux_loss_tracker()
    moe_utils.clear_aux_losses_tracker()


def test_global_load_balance_sums_over_ranks_through_the_callers_all_reduce():
    # Two "ranks" whose all_reduce adds the other's loads and tokens: the fractions
    # are those of the concatenated batch, scaled by this rank's share n / T.
    a, b = _logits(30).reshape(N, E), _logits(31).reshape(N, E)
    other = {}

    def all_reduce(t):
        t += other[t.dim()]

    other[1] = torch.zeros(E).index_add_(0, torch.topk(b, 2, dim=1).indices.reshape(-1), torch.ones(2 * N))
    other[0] = torch.tensor(float(N))
    f = mr.GlobalLoadBalance(E, 2, all_reduce).load_fractions(a)
    both = torch.cat([a, b])
    loads = torch.zeros(E).index_add_(0, torch.topk(both, 2, dim=1).indices.reshape(-1), torch.ones(4 * N))
    torch.testing.assert_close(f, loads * N / (2 * (2 * N) ** 2))
    with pytest.raises(ValueError, match=r"expects logits \[tokens, 16\]"):
        mr.GlobalLoadBalance(E, 2).load_fractions(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="1 <= top_k"):
        mr.GlobalLoadBalance(E, 17)


REFUSED = [
    (dict(moe_router_load_balancing_type="sinkhorn"), "moe_router_load_balancing_type='sinkhorn'"),
    (dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[1e-2, 1e-3]),
     "moe_router_load_balancing_type"),
    (dict(moe_router_enable_expert_bias=True), "moe_router_enable_expert_bias=True"),
    (dict(moe_router_topk=4, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
          moe_router_num_groups=4, moe_router_group_topk=8), "moe_router_group_topk=8"),
    (dict(moe_router_dtype="fp64"), "moe_router_dtype='fp64'"),
    (dict(moe_input_jitter_eps=1e-2), "moe_input_jitter_eps=0.01"),
    (dict(moe_router_score_function="tanh"), "moe_router_score_function='tanh'"),
]

REFUSED_ADMISSION = [
    (dict(moe_router_pre_softmax=True, moe_expert_capacity_factor=1.0, moe_token_drop_policy="random"),
     "moe_token_drop_policy='random'"),
]


@pytest.mark.parametrize("fields, field", REFUSED)
def test_configurations_megatron_routes_differently_are_refused_by_name(fields, field):
    with pytest.raises(ValueError, match=f"Megatron's {field}"):
        mr.RouterConfig.from_megatron(**fields)
    with pytest.raises(ValueError, match=f"Megatron's {field}"):
        mr.Admission.from_megatron(**fields)


@pytest.mark.parametrize("fields, field", REFUSED_ADMISSION)
def test_token_dropping_megatron_does_differently_is_refused_by_name(fields, field):
    mr.RouterConfig.from_megatron(**fields)  # the router itself is reproduced
    with pytest.raises(ValueError, match=f"Megatron's {field}"):
        mr.Admission.from_megatron(**fields)


def test_from_megatron_reads_a_transformer_config_and_refuses_unknown_names():
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=E,
                               moe_router_topk=3, moe_router_score_function="sigmoid", moe_aux_loss_coeff=1e-2,
                               moe_expert_capacity_factor=1.5, moe_token_drop_policy="position")
    cfg = mr.RouterConfig.from_megatron(config)
    assert (cfg.gating, cfg.top_k, cfg.normalizes, cfg.load_balance) == ("sigmoid", 3, True, 1e-2)
    assert mr.Admission.from_megatron(config) == mr.Admission.capacity_position(1.5)
    assert mr.Admission.from_megatron(moe_router_topk=2) == mr.Admission.dropless()
    with pytest.raises(TypeError, match=r"unknown Megatron router arguments \['moe_router_topK'\]"):
        mr.RouterConfig.from_megatron(moe_router_topK=2)
    with pytest.raises(TypeError, match="not both"):
        mr.RouterConfig.from_megatron(config, moe_router_topk=2)


def test_the_snippet_of_docs_integration_md_reproduces_megatron():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "integration.md").read_text()
    snippet = doc.split("## Megatron-Core", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    logits, bias = _logits(5), _bias(5)
    names = {"logits": logits, "num_experts": E, "expert_bias": bias.clone()}
    exec(snippet, names)  # noqa: S102  (the documentation's own code)
    upstream = torch.zeros(N, E)
    want_probs, want_map, _, _, want_loads = megatron_route(names["fields"], logits, bias, upstream)
    res = names["res"]
    assert torch.equal(torch.zeros(N, E, dtype=torch.bool).scatter(1, res.indices.long(), True), want_map)
    torch.testing.assert_close(torch.zeros(N, E).scatter(1, res.indices.long(), res.gates.detach()), want_probs,
                               rtol=1e-5, atol=1e-7)
    rate = names["cfg"].bias_update_rate
    assert torch.equal(names["expert_bias"], moe_utils.get_updated_expert_bias(want_loads, bias.clone(), rate))
