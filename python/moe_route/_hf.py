"""Hugging Face transformers' MoE routers as the library's configuration:
RouterConfig.from_hf_config (docs/integration.md). Each family's rule, read
from its router module in transformers' modeling code, becomes fields; a family
or setting without a rule here raises ValueError naming it.
python/tests/test_transformers.py checks each family against transformers'
own router module."""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple


def _refuse(what: str, why: str):
    raise ValueError(f"moe_route: transformers' {what} is not reproduced: {why}")


def _one_per_model(name: str, value):
    """A per-layer list (HunYuan's moe_topk) is one router only if its entries agree."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            _refuse(f"{name}={value!r}", "the layers differ, and from_hf_config gives one router for all of them")
        value = value[0]
    return value


def _top_k(config) -> int:
    k = getattr(config, "num_experts_per_tok", None)
    if k is None:
        _refuse("num_experts_per_tok=None", "the configuration does not say how many experts a token takes")
    return int(_one_per_model("num_experts_per_tok", k))


def _no_jitter(config):
    if getattr(config, "router_jitter_noise", 0.0):
        _refuse(f"router_jitter_noise={config.router_jitter_noise!r}",
                "the jitter multiplies the router's input, before the logits the library takes")


def _switch_load_balance(enabled, coefficient, k: int) -> Dict[str, Any]:
    """load_balancing_loss_func, which the model adds times its coefficient when
    output_router_logits is set: for one layer it is top_k times the Switch loss
    over the softmax."""
    coefficient = float(coefficient or 0.0)
    if not enabled or coefficient == 0.0:
        return {}
    return {"load_balance": coefficient * k}


def _load_balance(config, k: int) -> Dict[str, Any]:
    return _switch_load_balance(getattr(config, "output_router_logits", False),
                                getattr(config, "router_aux_loss_coef", 0.0), k)


def _jetmoe_load_balance(config, k: int) -> Dict[str, Any]:
    """JetMoE names its coefficient aux_loss_coef."""
    return _switch_load_balance(config.output_router_logits, config.aux_loss_coef, k)


def _dbrx_load_balance(config, k: int) -> Dict[str, Any]:
    """DBRX's coefficient is its ffn_config's moe_loss_weight."""
    return _switch_load_balance(config.output_router_logits, config.ffn_config.moe_loss_weight, k)


def _unbiased_load_balance(config, k: int) -> Dict[str, Any]:
    """Ernie 4.5's: load_balancing_loss_func counts a plain top-k of the
    probabilities while the router chooses with the correction bias."""
    f = _load_balance(config, k)
    if f:
        f["load_balance_counts"] = "top_k"
    return f


def _softmax_load_balance_of_a_sigmoid_router(config, k: int) -> Dict[str, Any]:
    """MiniMax-M2's: load_balancing_loss_func takes the softmax of a sigmoid
    router's logits."""
    if _load_balance(config, k):
        _refuse(f"router_aux_loss_coef={config.router_aux_loss_coef!r}",
                "its load-balancing loss balances the softmax of the logits, the library's a sigmoid router's "
                "s / sum(s)")
    return {}


def _no_load_balance(config, k: int) -> Dict[str, Any]:
    return {}


def _softmax_top_k(normalize: str) -> Callable[[Any], Dict[str, Any]]:
    """Top-k of the softmax; renormalised "always", "never" or when the
    configuration's norm_topk_prob says so ("flag")."""
    def rule(config) -> Dict[str, Any]:
        _no_jitter(config)
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
    """DeepSeek-V3 and its kin (FAMILIES): sigmoid, the e_score_correction_bias in the choice
    only (pass it as expert_bias), groups scored by their two largest s + b."""
    return {"gating": "sigmoid", "selection": "group_limited_bias", "top_k": _top_k(config),
            "normalize": bool(config.norm_topk_prob), "scaling_factor": float(config.routed_scaling_factor),
            "groups": int(config.n_group), "top_groups": int(config.topk_group), "per_group_k": 2}


def _mistral4(config) -> Dict[str, Any]:
    """Mistral 4: DeepSeek-V3's groups without a bias, over the softmax: groups
    scored by their two largest probabilities."""
    return {"gating": "softmax", "selection": "group_limited_score", "top_k": _top_k(config),
            "normalize": bool(config.norm_topk_prob), "scaling_factor": float(config.routed_scaling_factor),
            "groups": int(config.n_group), "top_groups": int(config.topk_group), "per_group_k": 2}


def _softmax_after_top_k(config) -> Dict[str, Any]:
    """gpt-oss, Granite-MoE, JetMoE: top-k of the logits (gpt-oss's router's linear bias
    included), softmax over them."""
    return {"gating": "softmax_after_topk", "top_k": _top_k(config), "normalize": False}


def _llama4(config) -> Dict[str, Any]:
    """Llama 4: top-k of the logits, each gate the sigmoid of its logit, unnormalised."""
    return {"gating": "sigmoid", "top_k": _top_k(config), "normalize": False}


def _cohere2_moe(config) -> Dict[str, Any]:
    """Cohere2-MoE: top-k of the logits; expert_selection_fn "softmax" over them, or
    "sigmoid" of each, renormalised if norm_topk_prob."""
    if config.expert_selection_fn == "softmax":
        return _softmax_after_top_k(config)
    if config.expert_selection_fn != "sigmoid":
        _refuse(f"expert_selection_fn={config.expert_selection_fn!r}", "Cohere2-MoE's are 'softmax' and 'sigmoid'")
    return dict(_llama4(config), normalize=bool(config.norm_topk_prob))


def _minimax_m2(config) -> Dict[str, Any]:
    """MiniMax-M2: sigmoid, the choice by s + the e_score_correction_bias its MoE
    block passes to the router (pass it as expert_bias), renormalised."""
    _no_jitter(config)
    return {"gating": "sigmoid", "selection": "expert_bias", "top_k": _top_k(config), "normalize": True}


def _afmoe(config) -> Dict[str, Any]:
    """AFMoE: MiniMax-M2's rule (the block's expert_bias), scaled by route_scale."""
    return dict(_minimax_m2(config), scaling_factor=float(config.route_scale))


def _lfm2_moe(config) -> Dict[str, Any]:
    """LFM2-MoE: sigmoid; with use_expert_bias the choice by s + the block's
    expert_bias (pass it as expert_bias); renormalised if norm_topk_prob, scaled.
    It adds 1e-6 to the sum it divides by, the library 1e-20."""
    return {"gating": "sigmoid", "selection": "expert_bias" if config.use_expert_bias else "top_k",
            "top_k": _top_k(config), "normalize": bool(config.norm_topk_prob),
            "scaling_factor": float(config.routed_scaling_factor)}


def _longcat_flash(config) -> Dict[str, Any]:
    """LongCat-Flash: softmax over the routed and zero-computation experts, the
    choice by probability + e_score_correction_bias (pass it as expert_bias),
    unnormalised, scaled."""
    return {"gating": "softmax", "selection": "expert_bias", "top_k": _top_k(config), "normalize": False,
            "scaling_factor": float(config.routed_scaling_factor)}


def _dbrx(config) -> Dict[str, Any]:
    """DBRX (its ffn_config): softmax top-k, divided by their
    moe_normalize_expert_weights-norm; the 1-norm is the library's
    renormalisation, None none."""
    ffn = config.ffn_config
    if ffn.moe_jitter_eps is not None:
        _refuse(f"moe_jitter_eps={ffn.moe_jitter_eps!r}",
                "the jitter multiplies the router's input, before the logits the library takes")
    p = ffn.moe_normalize_expert_weights
    if p not in (None, 1):
        _refuse(f"moe_normalize_expert_weights={p!r}",
                "the library renormalises by the sum of the gates (the 1-norm), not by another p-norm")
    return {"gating": "softmax", "top_k": int(ffn.moe_top_k), "normalize": p is not None}


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
    "qwen3_vl_moe_text": (_softmax_top_k("always"), _load_balance),
    "hunyuan_v1_moe": (_softmax_top_k("always"), _no_load_balance),
    "dbrx": (_dbrx, _dbrx_load_balance),
    "qwen2_moe": (_softmax_top_k("flag"), _load_balance),
    "qwen3_moe": (_softmax_top_k("flag"), _load_balance),
    "qwen3_next": (_softmax_top_k("flag"), _load_balance),
    "qwen3_omni_moe_text": (_softmax_top_k("flag"), _load_balance),
    "qwen3_omni_moe_talker_text": (_softmax_top_k("flag"), _load_balance),
    "olmoe": (_softmax_top_k("flag"), _load_balance),
    "flex_olmo": (_softmax_top_k("flag"), _load_balance),
    "jamba": (_softmax_top_k("never"), _load_balance),
    "deepseek_v2": (_deepseek_v2, _no_load_balance),
    "deepseek_v3": (_deepseek_v3, _no_load_balance),
    "deepseek_v32": (_deepseek_v3, _no_load_balance),
    "glm4_moe": (_deepseek_v3, _no_load_balance),
    "glm4_moe_lite": (_deepseek_v3, _no_load_balance),
    "dots1": (_deepseek_v3, _no_load_balance),
    "exaone_moe": (_deepseek_v3, _no_load_balance),
    "kimi_linear": (_deepseek_v3, _no_load_balance),
    "bailing_hybrid": (_deepseek_v3, _no_load_balance),
    "solar_open": (_deepseek_v3, _no_load_balance),
    "mistral4": (_mistral4, _no_load_balance),
    "gpt_oss": (_softmax_after_top_k, _load_balance),
    "granitemoe": (_softmax_after_top_k, _load_balance),
    "granitemoeshared": (_softmax_after_top_k, _load_balance),
    "granitemoehybrid": (_softmax_after_top_k, _load_balance),
    "jetmoe": (_softmax_after_top_k, _jetmoe_load_balance),
    "cohere2_moe": (_cohere2_moe, _no_load_balance),
    "llama4_text": (_llama4, _no_load_balance),
    "minimax_m2": (_minimax_m2, _softmax_load_balance_of_a_sigmoid_router),
    "afmoe": (_afmoe, _no_load_balance),
    "lfm2_moe": (_lfm2_moe, _no_load_balance),
    "longcat_flash": (_longcat_flash, _no_load_balance),
    "ernie4_5_moe": (_ernie4_5_moe, _unbiased_load_balance),
}

# model_type: why its router has no rule.
REFUSED: Dict[str, str] = {
    "phimoe": "its sparsemixer masks the softmax to the experts within a jitter threshold of the best, one at a "
              "time, and samples them (Gumbel) in training",
}


def router_fields(config, with_load_balance: bool = True) -> Dict[str, Any]:
    """RouterConfig fields of a transformers model configuration (a
    PretrainedConfig); without the load-balancing loss when the model keeps
    computing its own (integrations.transformers.patch)."""
    if hasattr(config, "get_text_config"):  # a multimodal configuration holds the text model's (Llama 4, Qwen3.5)
        config = config.get_text_config()
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED:
        _refuse(f"model_type={model_type!r}", REFUSED[model_type])
    if model_type not in FAMILIES:
        _refuse(f"model_type={model_type!r}", f"the families with a rule are {sorted(FAMILIES)}")
    rule, load_balance = FAMILIES[model_type]
    fields = rule(config)
    if with_load_balance:
        fields.update(load_balance(config, fields["top_k"]))
    return fields
