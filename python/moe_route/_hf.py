"""Hugging Face transformers' MoE routers as the library's configuration:
RouterConfig.from_hf_config (docs/integration.md). Each family's rule, read
from its TopKRouter in transformers' modeling code, becomes fields; a family
or setting without a rule here raises ValueError naming it.
python/tests/test_transformers.py checks each family against transformers'
own router module."""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple


def _refuse(what: str, why: str):
    raise ValueError(f"moe_route: transformers' {what} is not reproduced: {why}")


def _top_k(config) -> int:
    k = getattr(config, "num_experts_per_tok", None)
    if k is None:
        _refuse("num_experts_per_tok=None", "the configuration does not say how many experts a token takes")
    return int(k)


def _load_balance(config, k: int) -> Dict[str, Any]:
    """load_balancing_loss_func, which the model adds when output_router_logits is
    set: for one layer it is top_k times the Switch loss over the softmax."""
    coefficient = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    if not getattr(config, "output_router_logits", False) or coefficient == 0.0:
        return {}
    return {"load_balance": coefficient * k}


def _unbiased_load_balance(config, k: int) -> Dict[str, Any]:
    """Ernie 4.5's load_balancing_loss_func counts an unbiased top-k."""
    if _load_balance(config, k):
        _refuse(f"router_aux_loss_coef={config.router_aux_loss_coef!r}",
                "its load-balancing loss counts a top-k of the unbiased probabilities, the library the experts "
                "it selects")
    return {}


def _no_load_balance(config, k: int) -> Dict[str, Any]:
    return {}


def _softmax_top_k(normalize: str) -> Callable[[Any], Dict[str, Any]]:
    """Top-k of the softmax; renormalised "always", "never" or when the
    configuration's norm_topk_prob says so ("flag")."""
    def rule(config) -> Dict[str, Any]:
        if getattr(config, "router_jitter_noise", 0.0):
            _refuse(f"router_jitter_noise={config.router_jitter_noise!r}",
                    "the jitter multiplies the router's input, before the logits the library takes")
        renormalised = normalize == "always" or (normalize == "flag" and bool(getattr(config, "norm_topk_prob", False)))
        return {"gating": "softmax", "top_k": _top_k(config), "normalize": renormalised}
    return rule


def _deepseek_v2(config) -> Dict[str, Any]:
    """DeepSeek-V2: softmax top-k, scaled; group_limited_greedy keeps the groups
    with the largest probability, which are those with the largest logit."""
    f = {"gating": "softmax", "top_k": _top_k(config), "normalize": False, "scaling_factor": float(config.routed_scaling_factor)}
    if config.topk_method == "group_limited_greedy":
        f.update(selection="group_limited", groups=int(config.n_group), top_groups=int(config.topk_group),
                 per_group_k=1)
    elif config.topk_method != "greedy":
        _refuse(f"topk_method={config.topk_method!r}", "DeepSeek-V2's methods are 'greedy' and 'group_limited_greedy'")
    return f


def _deepseek_v3(config) -> Dict[str, Any]:
    """DeepSeek-V3, GLM-4.5-MoE, dots.llm1, EXAONE-MoE: sigmoid, the e_score_correction_bias in the choice
    only (pass it as expert_bias), groups scored by their two largest s + b."""
    return {"gating": "sigmoid", "selection": "group_limited_bias", "top_k": _top_k(config),
            "normalize": bool(config.norm_topk_prob), "scaling_factor": float(config.routed_scaling_factor),
            "groups": int(config.n_group), "top_groups": int(config.topk_group), "per_group_k": 2}


def _softmax_after_top_k(config) -> Dict[str, Any]:
    """gpt-oss, Granite-MoE: top-k of the logits (gpt-oss's router's linear bias
    included), softmax over them."""
    return {"gating": "softmax_after_topk", "top_k": _top_k(config), "normalize": False}


def _llama4(config) -> Dict[str, Any]:
    """Llama 4: top-k of the logits, each gate the sigmoid of its logit, unnormalised."""
    return {"gating": "sigmoid", "top_k": _top_k(config), "normalize": False}


def _ernie4_5_moe(config) -> Dict[str, Any]:
    """Ernie 4.5: the choice by softmax probability plus e_score_correction_bias
    (pass it as expert_bias), the chosen probabilities renormalised."""
    k, e = _top_k(config), int(config.num_experts)
    # Ernie divides by max(sum, moe_norm_min); a top-k sum of a softmax is at least K/E.
    if float(config.moe_norm_min) >= k / e:
        _refuse(f"moe_norm_min={config.moe_norm_min!r}", "it can exceed the sum of the chosen probabilities")
    return {"gating": "softmax", "selection": "expert_bias", "top_k": k, "normalize": True}


# model_type: (the router rule, the rule of the load-balancing loss the model adds).
FAMILIES: Dict[str, Tuple[Callable[[Any], Dict[str, Any]], Callable[[Any, int], Dict[str, Any]]]] = {
    "mixtral": (_softmax_top_k("always"), _load_balance),
    "minimax": (_softmax_top_k("always"), _load_balance),
    "qwen3_5_moe_text": (_softmax_top_k("always"), _load_balance),
    "qwen2_moe": (_softmax_top_k("flag"), _load_balance),
    "qwen3_moe": (_softmax_top_k("flag"), _load_balance),
    "qwen3_next": (_softmax_top_k("flag"), _load_balance),
    "olmoe": (_softmax_top_k("flag"), _load_balance),
    "flex_olmo": (_softmax_top_k("flag"), _load_balance),
    "jamba": (_softmax_top_k("never"), _load_balance),
    "deepseek_v2": (_deepseek_v2, _no_load_balance),
    "deepseek_v3": (_deepseek_v3, _no_load_balance),
    "glm4_moe": (_deepseek_v3, _no_load_balance),
    "dots1": (_deepseek_v3, _no_load_balance),
    "exaone_moe": (_deepseek_v3, _no_load_balance),
    "gpt_oss": (_softmax_after_top_k, _load_balance),
    "granitemoe": (_softmax_after_top_k, _load_balance),
    "llama4_text": (_llama4, _no_load_balance),
    "ernie4_5_moe": (_ernie4_5_moe, _unbiased_load_balance),
}


def router_fields(config, with_load_balance: bool = True) -> Dict[str, Any]:
    """RouterConfig fields of a transformers model configuration (a
    PretrainedConfig); without the load-balancing loss when the model keeps
    computing its own (integrations.transformers.patch)."""
    if hasattr(config, "get_text_config"):  # a multimodal configuration holds the text model's (Llama 4, Qwen3.5)
        config = config.get_text_config()
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        _refuse(f"model_type={model_type!r}", f"the families with a rule are {sorted(FAMILIES)}")
    rule, load_balance = FAMILIES[model_type]
    fields = rule(config)
    if with_load_balance:
        fields.update(load_balance(config, fields["top_k"]))
    return fields
