"""Hugging Face transformers' own router modules as the oracle (issue 16): for
every family RouterConfig.from_hf_config has a rule for, the library's route on
the router's logits gives the family's experts and gates, its
load_balancing_loss_func where the model adds one, and the gradient of the
router weight. Tiny random configurations on the CPU, nothing downloaded."""

import importlib
from operator import attrgetter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import moe_route as mr
from helpers import import_engine

import_engine("transformers")

N, H = 48, 32


def _dense(indices, gates, e):
    return torch.zeros(indices.shape[0], e, dtype=gates.dtype).scatter_add(1, indices.long(), gates)


# How each router is built and called, and what it returns as (logits, dense gates [N, E]).
def _build(router_class, config):
    return router_class(config)


def _build_jetmoe(router_class, config):
    return router_class(config.hidden_size, config.num_local_experts, config.num_experts_per_tok)


def _build_layer_0(router_class, config):  # HunYuan reads its per-layer moe_topk at layer_idx
    return router_class(config, layer_idx=0)


def _call(router, hidden, bias):
    logits, gates, indices = router(hidden)
    return logits, _dense(indices, gates, logits.shape[1])


def _call_with_bias(router, hidden, bias):  # the MoE block passes its bias in (MiniMax-M2, LFM2-MoE)
    logits, gates, indices = router(hidden, bias)
    return logits, _dense(indices, gates, logits.shape[1])


def _call_afmoe(router, hidden, bias):  # AFMoE's router takes [batch, seq, hidden] and the block's bias
    logits, gates, indices = router(hidden.unsqueeze(0), bias)
    return logits, _dense(indices, gates, logits.shape[1])


def _call_llama4(router, hidden, bias):
    scores, logits = router(hidden)
    return logits, scores


def _call_jetmoe(router, hidden, bias):  # the token-expert pairs sorted by expert
    _, batch_index, batch_gates, expert_size, logits = router(hidden)
    experts = torch.repeat_interleave(torch.arange(logits.shape[1]), torch.tensor(expert_size))
    return logits, torch.zeros_like(logits).index_put((batch_index, experts), batch_gates)


def _call_dbrx(ffn, hidden, bias):  # DbrxRouter gives the logits, the FFN block routes them
    logits = ffn.router(hidden)
    gates, indices = ffn.route_tokens_to_experts(logits)
    return logits, _dense(indices, gates, logits.shape[1])


def _family(module, config_class, router_class, *, build=_build, call=_call, linear="", **fields):
    """linear: the path of the submodule holding the router weight ("" for the router)."""
    m = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    c = importlib.import_module(f"transformers.models.{module}.configuration_{module}")
    return dict(config_class=getattr(c, config_class), router_class=getattr(m, router_class), modeling=m,
                fields=fields, build=build, call=call, linear=linear)


COMMON = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64)
DEEPSEEK = dict(n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2)
FAMILIES = {
    "mixtral": _family("mixtral", "MixtralConfig", "MixtralTopKRouter", num_local_experts=8, num_experts_per_tok=2,
                       output_router_logits=True, router_aux_loss_coef=0.02),
    "qwen2_moe": _family("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeTopKRouter", num_experts=24, num_experts_per_tok=4,
                         norm_topk_prob=False, output_router_logits=True, router_aux_loss_coef=1e-2),
    "qwen3_moe": _family("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeTopKRouter", num_experts=33, num_experts_per_tok=4,
                         norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=1e-2),
    "olmoe": _family("olmoe", "OlmoeConfig", "OlmoeTopKRouter", num_experts=16, num_experts_per_tok=8,
                     norm_topk_prob=False),
    "deepseek_v2": _family("deepseek_v2", "DeepseekV2Config", "DeepseekV2TopkRouter", n_routed_experts=32,
                           num_experts_per_tok=6, routed_scaling_factor=2.0, topk_method="greedy"),
    "deepseek_v2_grouped": _family("deepseek_v2", "DeepseekV2Config", "DeepseekV2TopkRouter", n_routed_experts=32,
                                   num_experts_per_tok=6, routed_scaling_factor=1.5,
                                   topk_method="group_limited_greedy", n_group=8, topk_group=3),
    "deepseek_v3": _family("deepseek_v3", "DeepseekV3Config", "DeepseekV3TopkRouter", n_routed_experts=32,
                           num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
                           routed_scaling_factor=2.5),
    "glm4_moe": _family("glm4_moe", "Glm4MoeConfig", "Glm4MoeTopkRouter", n_routed_experts=16, num_experts_per_tok=4,
                        n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0),
    "gpt_oss": _family("gpt_oss", "GptOssConfig", "GptOssTopKRouter", num_local_experts=16, num_experts_per_tok=4,
                       output_router_logits=True, router_aux_loss_coef=0.9),
    "llama4": _family("llama4", "Llama4TextConfig", "Llama4Router", num_local_experts=16, num_experts_per_tok=1,
                      call=_call_llama4),
    "ernie4_5_moe": _family("ernie4_5_moe", "Ernie4_5_MoeConfig", "Ernie4_5_MoeTopKRouter", moe_num_experts=16,
                            moe_k=4),
    # its loss counts a plain top-k while the router chooses with the bias: load_balance_counts="top_k"
    "ernie4_5_moe_aux_loss": _family("ernie4_5_moe", "Ernie4_5_MoeConfig", "Ernie4_5_MoeTopKRouter",
                                     moe_num_experts=16, moe_k=4, output_router_logits=True,
                                     router_aux_loss_coef=1e-2),
    "minimax": _family("minimax", "MiniMaxConfig", "MiniMaxTopKRouter", num_local_experts=12, num_experts_per_tok=2,
                       output_router_logits=True, router_aux_loss_coef=1e-2),
    "qwen3_next": _family("qwen3_next", "Qwen3NextConfig", "Qwen3NextTopKRouter", num_experts=20,
                          num_experts_per_tok=4, norm_topk_prob=True, output_router_logits=True,
                          router_aux_loss_coef=1e-2),
    "qwen3_5_moe": _family("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeTopKRouter", num_experts=16,
                           num_experts_per_tok=4),
    "qwen3_vl_moe": _family("qwen3_vl_moe", "Qwen3VLMoeTextConfig", "Qwen3VLMoeTextTopKRouter", num_experts=16,
                            num_experts_per_tok=4, output_router_logits=True, router_aux_loss_coef=1e-2),
    "qwen3_omni_moe": _family("qwen3_omni_moe", "Qwen3OmniMoeTextConfig", "Qwen3OmniMoeThinkerTextTopKRouter",
                              num_experts=16, num_experts_per_tok=4, norm_topk_prob=False, output_router_logits=True,
                              router_aux_loss_coef=1e-2),
    "qwen3_omni_moe_talker": _family("qwen3_omni_moe", "Qwen3OmniMoeTalkerTextConfig",
                                     "Qwen3OmniMoeTalkerTextTopKRouter", num_experts=16, num_experts_per_tok=4,
                                     norm_topk_prob=True),
    "flex_olmo": _family("flex_olmo", "FlexOlmoConfig", "FlexOlmoTopKRouter", num_experts=8, num_experts_per_tok=2,
                         norm_topk_prob=False, output_router_logits=True, router_aux_loss_coef=1e-2),
    "jamba": _family("jamba", "JambaConfig", "JambaTopKRouter", num_experts=16, num_experts_per_tok=2,
                     output_router_logits=True, router_aux_loss_coef=1e-2),
    "granitemoe": _family("granitemoe", "GraniteMoeConfig", "GraniteMoeTopKRouter", num_local_experts=16,
                          num_experts_per_tok=4, output_router_logits=True, router_aux_loss_coef=1e-2),
    "granitemoeshared": _family("granitemoeshared", "GraniteMoeSharedConfig", "GraniteMoeSharedTopKRouter",
                                num_local_experts=16, num_experts_per_tok=4, output_router_logits=True,
                                router_aux_loss_coef=1e-2),
    "granitemoehybrid": _family("granitemoehybrid", "GraniteMoeHybridConfig", "GraniteMoeHybridTopKRouter",
                                num_local_experts=8, num_experts_per_tok=2, output_router_logits=True,
                                router_aux_loss_coef=3e-2, mamba_n_heads=8, mamba_d_head=8),
    "jetmoe": _family("jetmoe", "JetMoeConfig", "JetMoeTopKGating", build=_build_jetmoe, call=_call_jetmoe,
                      linear="layer", num_local_experts=16, num_experts_per_tok=4, output_router_logits=True,
                      aux_loss_coef=2e-2),
    # d_model: DBRX copies it into ffn_config before it reads hidden_size
    "dbrx": _family("dbrx", "DbrxConfig", "DbrxFFN", call=_call_dbrx, linear="router.layer", d_model=H,
                    ffn_config=dict(moe_num_experts=16, moe_top_k=4, ffn_hidden_size=16, moe_loss_weight=0.05),
                    output_router_logits=True),
    "dbrx_unnormalised": _family("dbrx", "DbrxConfig", "DbrxFFN", call=_call_dbrx, linear="router.layer",
                                 d_model=H, ffn_config=dict(moe_num_experts=16, moe_top_k=4, ffn_hidden_size=16,
                                                 moe_normalize_expert_weights=None)),
    "hunyuan_v1_moe": _family("hunyuan_v1_moe", "HunYuanMoEV1Config", "HunYuanMoEV1Gate", build=_build_layer_0,
                              linear="wg", num_experts=16, moe_topk=[4, 4]),
    "cohere2_moe": _family("cohere2_moe", "Cohere2MoeConfig", "Cohere2MoeTopKRouter", num_experts=16,
                           num_experts_per_tok=4, expert_selection_fn="softmax"),
    "cohere2_moe_sigmoid": _family("cohere2_moe", "Cohere2MoeConfig", "Cohere2MoeTopKRouter", num_experts=16,
                                   num_experts_per_tok=4, expert_selection_fn="sigmoid", norm_topk_prob=True),
    "cohere2_moe_sigmoid_unnormalised": _family("cohere2_moe", "Cohere2MoeConfig", "Cohere2MoeTopKRouter",
                                                num_experts=16, num_experts_per_tok=4, expert_selection_fn="sigmoid",
                                                norm_topk_prob=False),
    "dots1": _family("dots1", "Dots1Config", "Dots1TopkRouter", n_routed_experts=32, num_experts_per_tok=4,
                     n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.0),
    "exaone_moe": _family("exaone_moe", "ExaoneMoeConfig", "ExaoneMoeTopkRouter", num_experts=16,
                          num_experts_per_tok=4, n_group=2, topk_group=1, norm_topk_prob=False,
                          routed_scaling_factor=2.5),
    "deepseek_v32": _family("deepseek_v32", "DeepseekV32Config", "DeepseekV32TopkRouter", **DEEPSEEK,
                            norm_topk_prob=False, routed_scaling_factor=1.5),
    "glm4_moe_lite": _family("glm4_moe_lite", "Glm4MoeLiteConfig", "Glm4MoeLiteTopkRouter", n_routed_experts=16,
                             num_experts_per_tok=4, n_group=2, topk_group=1, norm_topk_prob=True,
                             routed_scaling_factor=1.8),
    "kimi_linear": _family("kimi_linear", "KimiLinearConfig", "KimiLinearTopkRouter", num_experts=16,
                           num_experts_per_token=4, num_expert_group=4, topk_group=2, moe_renormalize=True,
                           routed_scaling_factor=2.446),
    "bailing_hybrid": _family("bailing_hybrid", "BailingHybridConfig", "BailingHybridTopkRouter", num_experts=32,
                              num_experts_per_token=4, num_expert_group=8, topk_group=4, moe_renormalize=False,
                              routed_scaling_factor=2.5),
    "solar_open": _family("solar_open", "SolarOpenConfig", "SolarOpenTopkRouter", n_routed_experts=16,
                          num_experts_per_tok=4, norm_topk_prob=False, routed_scaling_factor=2.0),
    "mistral4": _family("mistral4", "Mistral4Config", "Mistral4TopkRouter", **DEEPSEEK, norm_topk_prob=True,
                        routed_scaling_factor=1.5),
    "mistral4_one_group": _family("mistral4", "Mistral4Config", "Mistral4TopkRouter", n_routed_experts=16,
                                  num_experts_per_tok=4, norm_topk_prob=False),
    "longcat_flash": _family("longcat_flash", "LongcatFlashConfig", "LongcatFlashTopkRouter", linear="classifier",
                             n_routed_experts=12, zero_expert_num=4, moe_topk=4, routed_scaling_factor=6.0),
    "minimax_m2": _family("minimax_m2", "MiniMaxM2Config", "MiniMaxM2TopKRouter", call=_call_with_bias,
                          num_local_experts=16, num_experts_per_tok=4),
    "lfm2_moe": _family("lfm2_moe", "Lfm2MoeConfig", "Lfm2MoeTopKRouter", call=_call_with_bias, num_experts=16,
                        num_experts_per_tok=4, use_expert_bias=True, norm_topk_prob=True, routed_scaling_factor=2.0),
    # without use_expert_bias LFM2-MoE ignores the bias the test passes, and so must the library
    "lfm2_moe_unbiased": _family("lfm2_moe", "Lfm2MoeConfig", "Lfm2MoeTopKRouter", call=_call_with_bias,
                                 num_experts=16, num_experts_per_tok=4, use_expert_bias=False, norm_topk_prob=False),
    "afmoe": _family("afmoe", "AfmoeConfig", "AfmoeTokenChoiceRouter", call=_call_afmoe, linear="gate",
                     num_experts=16, num_experts_per_tok=4, route_scale=2.5),
}


def _aux_loss_coef(config):
    """What the model multiplies load_balancing_loss_func by."""
    if config.model_type == "dbrx":
        return config.ffn_config.moe_loss_weight
    return config.aux_loss_coef if config.model_type == "jetmoe" else config.router_aux_loss_coef


def _router(name, seed):
    """The family's router with random weights, and its selection bias (a
    buffer of the router, or, where the MoE block passes one in, a tensor)."""
    case = FAMILIES[name]
    config = case["config_class"](**COMMON, **case["fields"])
    router = case["build"](case["router_class"], config)
    linear = attrgetter(case["linear"])(router) if case["linear"] else router
    g = torch.Generator().manual_seed(seed)
    bias = None
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=g) * 0.5)
        if hasattr(router, "bias") and router.bias is not None:  # gpt-oss: part of its logits
            router.bias.copy_(torch.randn(router.bias.shape, generator=g))
        for owner in (router, getattr(router, "moe_statics", None)):
            if owner is not None and hasattr(owner, "e_score_correction_bias"):
                owner.e_score_correction_bias.copy_(torch.rand(owner.e_score_correction_bias.shape, generator=g) * 0.1)
                bias = owner.e_score_correction_bias.reshape(-1).clone()
    if case["call"] in (_call_with_bias, _call_afmoe):
        bias = torch.rand(linear.weight.shape[0], generator=g) * 0.1
    return config, router, linear, bias


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_route_equals_the_transformers_router(name, seed):
    config, router, linear, bias = _router(name, seed)
    case = FAMILIES[name]
    cfg = mr.RouterConfig.from_hf_config(config)
    e = linear.weight.shape[0]
    hidden = torch.randn(N, H, generator=torch.Generator().manual_seed(seed + 10))
    upstream = torch.randn(N, e, generator=torch.Generator().manual_seed(seed + 20))

    logits, want = case["call"](router, hidden, bias)
    want_loss = (want * upstream).sum()
    if cfg.load_balance:
        aux = case["modeling"].load_balancing_loss_func((logits,), e, cfg.top_k)
        want_loss = want_loss + _aux_loss_coef(config) * aux
    want_loss.backward()

    weight = linear.weight.detach().clone().requires_grad_()
    z = F.linear(hidden, weight, None if getattr(router, "bias", None) is None else router.bias.detach())
    res = mr.route(z, cfg, expert_bias=bias)
    got = _dense(res.indices, res.gates, e)
    ((got * upstream).sum() + res.aux_loss).backward()

    assert torch.equal(got.detach() != 0, want.detach() != 0)
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-7)
    if cfg.load_balance:
        torch.testing.assert_close(res.penalties["load_balance"].detach(), _aux_loss_coef(config) * aux.detach(),
                                   rtol=1e-5, atol=0.0)
    torch.testing.assert_close(weight.grad, linear.weight.grad, rtol=1e-5,
                               atol=1e-5 * float(linear.weight.grad.abs().max()))


@pytest.mark.parametrize("name", sorted(n for n in FAMILIES if "output_router_logits" in FAMILIES[n]["fields"]
                                         or "output_router_logits" in FAMILIES[n]["fields"].get("ffn_config", {})))
def test_the_load_balance_with_a_token_mask_equals_transformers_with_an_attention_mask(name):
    """The model's loss takes the attention mask (padding excluded from the
    counts, the mean probabilities and the token count); route's token_mask
    is the same statistic."""
    config, router, linear, bias = _router(name, 3)
    cfg = mr.RouterConfig.from_hf_config(config)
    if not cfg.load_balance:
        pytest.skip(f"{name}: no load-balancing loss in this configuration")
    e = linear.weight.shape[0]
    hidden = torch.randn(N, H, generator=torch.Generator().manual_seed(13))
    attention_mask = torch.ones(2, N // 2, dtype=torch.long)
    attention_mask[0, -5:] = 0  # right padding, and left padding in the other sequence
    attention_mask[1, :7] = 0

    weight = linear.weight.detach().clone().requires_grad_()
    z = F.linear(hidden, weight, None if getattr(router, "bias", None) is None else router.bias.detach())
    want_weight = weight.detach().clone().requires_grad_()
    want_z = F.linear(hidden, want_weight, None if getattr(router, "bias", None) is None else router.bias.detach())
    want = _aux_loss_coef(config) * FAMILIES[name]["modeling"].load_balancing_loss_func(
        (want_z,), e, cfg.top_k, attention_mask)
    want.backward()

    res = mr.route(z, cfg, expert_bias=bias, token_mask=attention_mask.reshape(-1).bool())
    res.penalties["load_balance"].backward()
    torch.testing.assert_close(res.penalties["load_balance"].detach(), want.detach(), rtol=1e-5, atol=0.0)
    torch.testing.assert_close(weight.grad, want_weight.grad, rtol=1e-5, atol=1e-5 * float(want_weight.grad.abs().max()))
    assert bool((res.indices[~attention_mask.reshape(-1).bool()] == -1).all())


def test_families_and_settings_without_a_rule_are_refused_by_name():
    from transformers import (Cohere2MoeConfig, DbrxConfig, HunYuanMoEV1Config, MiniMaxM2Config, MixtralConfig,
                              PhimoeConfig)
    from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config
    from transformers.models.ernie4_5_moe.configuration_ernie4_5_moe import Ernie4_5_MoeConfig

    with pytest.raises(ValueError, match="transformers' model_type='phimoe' is not reproduced: its sparsemixer"):
        mr.RouterConfig.from_hf_config(PhimoeConfig())
    with pytest.raises(ValueError, match="router_jitter_noise=0.1"):
        mr.RouterConfig.from_hf_config(MixtralConfig(router_jitter_noise=0.1))
    with pytest.raises(ValueError, match="router_jitter_noise=0.1"):
        mr.RouterConfig.from_hf_config(MiniMaxM2Config(router_jitter_noise=0.1))
    with pytest.raises(ValueError, match="topk_method='noaux_tc'"):
        mr.RouterConfig.from_hf_config(DeepseekV2Config(topk_method="noaux_tc", num_experts_per_tok=6))
    with pytest.raises(ValueError, match="num_experts_per_tok=None"):
        mr.RouterConfig.from_hf_config(DeepseekV2Config())
    with pytest.raises(ValueError, match="moe_norm_min=0.5"):
        mr.RouterConfig.from_hf_config(Ernie4_5_MoeConfig(moe_norm_min=0.5))
    with pytest.raises(ValueError, match="moe_normalize_expert_weights=2.0 is not reproduced"):
        mr.RouterConfig.from_hf_config(DbrxConfig(ffn_config=dict(moe_normalize_expert_weights=2.0)))
    with pytest.raises(ValueError, match="moe_jitter_eps=0.01"):
        mr.RouterConfig.from_hf_config(DbrxConfig(ffn_config=dict(moe_jitter_eps=0.01)))
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.001 is not reproduced: its load-balancing loss"):
        mr.RouterConfig.from_hf_config(MiniMaxM2Config(output_router_logits=True, router_aux_loss_coef=0.001))
    with pytest.raises(ValueError, match=r"num_experts_per_tok=\[2, 4\] is not reproduced: the layers differ"):
        mr.RouterConfig.from_hf_config(HunYuanMoEV1Config(moe_topk=[2, 4]))
    with pytest.raises(ValueError, match="expert_selection_fn='relu'"):
        mr.RouterConfig.from_hf_config(Cohere2MoeConfig(expert_selection_fn="relu"))


def test_the_snippet_of_docs_integration_md_reproduces_transformers():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "integration.md").read_text()
    snippet = doc.split("## Hugging Face transformers", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    names = {}
    exec(snippet.replace("res = mr.route(router_logits, cfg)", ""), names)  # noqa: S102  (the documentation's code)
    router = Qwen3MoeTopKRouter(names["config"])
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(3))
    hidden = torch.randn(N, H, generator=torch.Generator().manual_seed(4))
    names["router_logits"], scores, indices = router(hidden)
    exec("res = mr.route(router_logits, cfg)", names)  # noqa: S102
    res = names["res"]
    assert names["cfg"].load_balance == pytest.approx(4 * 1e-2)
    torch.testing.assert_close(_dense(res.indices, res.gates, 33).detach(), _dense(indices, scores, 33).detach(),
                               rtol=1e-5, atol=1e-7)
