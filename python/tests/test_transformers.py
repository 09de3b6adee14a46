"""Hugging Face transformers' own router modules as the oracle (issue 16): for
every family RouterConfig.from_hf_config has a rule for, the library's route on
the router's logits gives the family's experts and gates, its
load_balancing_loss_func where the model adds one, and the gradient of the
router weight. Tiny random configurations on the CPU, nothing downloaded."""

import importlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import moe_route as mr
from helpers import import_engine

import_engine("transformers")

N, H = 48, 32


def _family(module, config_class, router_class, **fields):
    m = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    c = importlib.import_module(f"transformers.models.{module}.configuration_{module}")
    return getattr(c, config_class), getattr(m, router_class), m, fields


COMMON = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64)
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
    "llama4": _family("llama4", "Llama4TextConfig", "Llama4Router", num_local_experts=16, num_experts_per_tok=1),
    "ernie4_5_moe": _family("ernie4_5_moe", "Ernie4_5_MoeConfig", "Ernie4_5_MoeTopKRouter", moe_num_experts=16,
                            moe_k=4),
    "minimax": _family("minimax", "MiniMaxConfig", "MiniMaxTopKRouter", num_local_experts=12, num_experts_per_tok=2,
                       output_router_logits=True, router_aux_loss_coef=1e-2),
    "qwen3_next": _family("qwen3_next", "Qwen3NextConfig", "Qwen3NextTopKRouter", num_experts=20,
                          num_experts_per_tok=4, norm_topk_prob=True, output_router_logits=True,
                          router_aux_loss_coef=1e-2),
    "qwen3_5_moe": _family("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeTopKRouter", num_experts=16,
                           num_experts_per_tok=4),
    "flex_olmo": _family("flex_olmo", "FlexOlmoConfig", "FlexOlmoTopKRouter", num_experts=8, num_experts_per_tok=2,
                         norm_topk_prob=False, output_router_logits=True, router_aux_loss_coef=1e-2),
    "jamba": _family("jamba", "JambaConfig", "JambaTopKRouter", num_experts=16, num_experts_per_tok=2,
                     output_router_logits=True, router_aux_loss_coef=1e-2),
    "granitemoe": _family("granitemoe", "GraniteMoeConfig", "GraniteMoeTopKRouter", num_local_experts=16,
                          num_experts_per_tok=4, output_router_logits=True, router_aux_loss_coef=1e-2),
    "dots1": _family("dots1", "Dots1Config", "Dots1TopkRouter", n_routed_experts=32, num_experts_per_tok=4,
                     n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.0),
    "exaone_moe": _family("exaone_moe", "ExaoneMoeConfig", "ExaoneMoeTopkRouter", num_experts=16,
                          num_experts_per_tok=4, n_group=2, topk_group=1, norm_topk_prob=False,
                          routed_scaling_factor=2.5),
}


def _router(name, seed):
    config_class, router_class, _, fields = FAMILIES[name]
    config = config_class(**COMMON, **fields)
    router = router_class(config)
    g = torch.Generator().manual_seed(seed)
    bias = None
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.5)
        if hasattr(router, "bias") and router.bias is not None:  # gpt-oss: part of its logits
            router.bias.copy_(torch.randn(router.bias.shape, generator=g))
        for owner in (router, getattr(router, "moe_statics", None)):
            if owner is not None and hasattr(owner, "e_score_correction_bias"):
                owner.e_score_correction_bias.copy_(torch.rand(owner.e_score_correction_bias.shape, generator=g) * 0.1)
                bias = owner.e_score_correction_bias.reshape(-1).clone()
    return config, router, bias


def _dense(indices, gates, e):
    return torch.zeros(indices.shape[0], e, dtype=gates.dtype).scatter_add(1, indices.long(), gates)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_route_equals_the_transformers_router(name, seed):
    config, router, bias = _router(name, seed)
    _, _, modeling, _ = FAMILIES[name]
    cfg = mr.RouterConfig.from_hf_config(config)
    e = router.weight.shape[0]
    hidden = torch.randn(N, H, generator=torch.Generator().manual_seed(seed + 10))
    upstream = torch.randn(N, e, generator=torch.Generator().manual_seed(seed + 20))

    out = router(hidden)
    if name == "llama4":  # (dense scores, logits)
        want, logits = out
    else:
        logits, scores, indices = out
        want = _dense(indices, scores, e)
    want_loss = (want * upstream).sum()
    if cfg.load_balance:
        aux = modeling.load_balancing_loss_func((logits,), e, config.num_experts_per_tok)
        want_loss = want_loss + config.router_aux_loss_coef * aux
    want_loss.backward()

    weight = router.weight.detach().clone().requires_grad_()
    z = F.linear(hidden, weight, None if getattr(router, "bias", None) is None else router.bias.detach())
    res = mr.route(z, cfg, expert_bias=bias)
    got = _dense(res.indices, res.gates, e)
    ((got * upstream).sum() + res.aux_loss).backward()

    assert torch.equal(got.detach() != 0, want.detach() != 0)
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-7)
    if cfg.load_balance:
        torch.testing.assert_close(res.penalties["load_balance"].detach(), config.router_aux_loss_coef * aux.detach(),
                                   rtol=1e-5, atol=0.0)
    torch.testing.assert_close(weight.grad, router.weight.grad, rtol=1e-5,
                               atol=1e-5 * float(router.weight.grad.abs().max()))


def test_families_and_settings_without_a_rule_are_refused_by_name():
    from transformers import DbrxConfig, MixtralConfig
    from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config
    from transformers.models.ernie4_5_moe.configuration_ernie4_5_moe import Ernie4_5_MoeConfig

    with pytest.raises(ValueError, match="transformers' model_type='dbrx' is not reproduced"):
        mr.RouterConfig.from_hf_config(DbrxConfig())
    with pytest.raises(ValueError, match="router_jitter_noise=0.1"):
        mr.RouterConfig.from_hf_config(MixtralConfig(router_jitter_noise=0.1))
    with pytest.raises(ValueError, match="topk_method='noaux_tc'"):
        mr.RouterConfig.from_hf_config(DeepseekV2Config(topk_method="noaux_tc", num_experts_per_tok=6))
    with pytest.raises(ValueError, match="num_experts_per_tok=None"):
        mr.RouterConfig.from_hf_config(DeepseekV2Config())
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.01"):
        mr.RouterConfig.from_hf_config(Ernie4_5_MoeConfig(output_router_logits=True, router_aux_loss_coef=0.01))
    with pytest.raises(ValueError, match="moe_norm_min=0.5"):
        mr.RouterConfig.from_hf_config(Ernie4_5_MoeConfig(moe_norm_min=0.5))


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
