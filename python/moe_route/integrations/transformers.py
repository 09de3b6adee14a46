"""Routes a Hugging Face transformers MoE model through the library:
patch(model) makes each router module of the model call the library's
operators, keeping its weights, its state dict and its outputs (router
logits, gates, expert indices), so the rest of the model and its
load-balancing loss run unchanged (docs/integration.md)."""

from __future__ import annotations

from operator import attrgetter
from typing import Callable, Dict, NamedTuple, Optional

import torch
import torch.nn.functional as F

from .. import _hf
from ..config import RouterConfig
from ..functional import route, select_experts


def _logits_gates_indices(logits, gates, indices):
    return logits, gates, indices


def _dense_scores(logits, gates, indices):
    """Llama 4's (scores [N, E], logits)."""
    return torch.zeros_like(logits).scatter(1, indices, gates), logits


def _gates_indices(logits, gates, indices):
    """DBRX's route_tokens_to_experts."""
    return gates, indices


def _sorted_by_expert(logits, gates, indices):
    """JetMoE's (index_sorted_experts, batch_index, batch_gates, expert_size,
    logits): the token-expert pairs sorted by expert, as its experts take them."""
    _, index_sorted_experts = indices.flatten().sort(0)
    batch_index = index_sorted_experts.div(indices.shape[1], rounding_mode="trunc")
    expert_size = torch.bincount(indices.flatten(), minlength=logits.shape[1]).tolist()
    return index_sorted_experts, batch_index, gates.flatten()[index_sorted_experts], expert_size, logits


class _Family(NamedTuple):
    router_class: str  # the class name, in the family's modeling code, of the module that routes
    logits: Callable  # (linear, the method's input) -> router logits, as the module computes them
    bias: Callable  # (module, the method's other arguments) -> the selection bias (expert_bias) or None
    gate_dtype: Callable  # (logits, input) -> the dtype the module returns its gates in
    outputs: Callable = _logits_gates_indices  # (logits, gates, indices) -> what the method returns
    linear: str = ""  # the path of the submodule holding the router weight; "" for the module itself
    method: str = "forward"  # the method that routes


def linear_of(module, family: _Family):
    """The module (the router or a submodule of it) whose weight gives the logits."""
    return attrgetter(family.linear)(module) if family.linear else module


def _linear(linear, hidden):
    return F.linear(hidden.reshape(-1, linear.weight.shape[1]), linear.weight)


def _linear_fp32(linear, hidden):
    return F.linear(hidden.reshape(-1, linear.weight.shape[1]).float(), linear.weight.float())


def _linear_then_fp32(linear, hidden):
    return F.linear(hidden.reshape(-1, linear.weight.shape[1]), linear.weight).float()


def _linear_in_weight_dtype(linear, hidden):
    return F.linear(hidden.reshape(-1, linear.weight.shape[1]).to(linear.weight.dtype), linear.weight)


def _linear_with_bias(linear, hidden):
    return F.linear(hidden.reshape(-1, linear.weight.shape[1]), linear.weight, linear.bias)


def _given_logits(linear, logits):
    """DBRX routes the logits its router module computed."""
    return logits


def _no_bias(module, args):
    return None


def _correction_bias(module, args):
    return module.e_score_correction_bias.reshape(-1).float()


def _ernie_bias(module, args):
    return module.moe_statics.e_score_correction_bias.reshape(-1).float()


def _bias_argument(module, args):
    """MiniMax-M2, LFM2-MoE, AFMoE: the MoE block holds the bias and passes it in
    (LFM2-MoE passes None without use_expert_bias)."""
    return None if args[0] is None else args[0].reshape(-1).float()


def _float32(logits, hidden):
    return torch.float32


def _logits_dtype(logits, hidden):
    return logits.dtype


def _hidden_dtype(logits, hidden):
    return hidden.dtype


_STANDARD = dict(logits=_linear, bias=_no_bias, gate_dtype=_logits_dtype)
_DEEPSEEK_V3 = dict(logits=_linear_fp32, bias=_correction_bias, gate_dtype=_float32)
_GRANITE = dict(logits=_linear_then_fp32, bias=_no_bias, gate_dtype=_hidden_dtype)
FAMILIES: Dict[str, _Family] = {
    "mixtral": _Family("MixtralTopKRouter", _linear, _no_bias, _float32),
    "minimax": _Family("MiniMaxTopKRouter", _linear, _no_bias, _float32),
    "qwen2_moe": _Family("Qwen2MoeTopKRouter", **_STANDARD),
    "qwen3_moe": _Family("Qwen3MoeTopKRouter", **_STANDARD),
    "qwen3_next": _Family("Qwen3NextTopKRouter", **_STANDARD),
    "qwen3_5_moe_text": _Family("Qwen3_5MoeTopKRouter", **_STANDARD),
    "qwen3_vl_moe_text": _Family("Qwen3VLMoeTextTopKRouter", **_STANDARD),
    "qwen3_omni_moe_text": _Family("Qwen3OmniMoeThinkerTextTopKRouter", **_STANDARD),
    "qwen3_omni_moe_talker_text": _Family("Qwen3OmniMoeTalkerTextTopKRouter", **_STANDARD),
    "olmoe": _Family("OlmoeTopKRouter", **_STANDARD),
    "flex_olmo": _Family("FlexOlmoTopKRouter", **_STANDARD),
    "mistral4": _Family("Mistral4TopkRouter", **_STANDARD),
    "hunyuan_v1_moe": _Family("HunYuanMoEV1Gate", _linear_in_weight_dtype, _no_bias, _logits_dtype, linear="wg"),
    "dbrx": _Family("DbrxFFN", _given_logits, _no_bias, _logits_dtype, _gates_indices, linear="router.layer",
                    method="route_tokens_to_experts"),
    "jamba": _Family("JambaTopKRouter", _linear, _no_bias, _hidden_dtype),
    "deepseek_v2": _Family("DeepseekV2TopkRouter", _linear_fp32, _no_bias, _float32),
    "deepseek_v3": _Family("DeepseekV3TopkRouter", **_DEEPSEEK_V3),
    "deepseek_v32": _Family("DeepseekV32TopkRouter", **_DEEPSEEK_V3),
    "glm4_moe": _Family("Glm4MoeTopkRouter", **_DEEPSEEK_V3),
    "glm4_moe_lite": _Family("Glm4MoeLiteTopkRouter", **_DEEPSEEK_V3),
    "dots1": _Family("Dots1TopkRouter", **_DEEPSEEK_V3),
    "exaone_moe": _Family("ExaoneMoeTopkRouter", **_DEEPSEEK_V3),
    "kimi_linear": _Family("KimiLinearTopkRouter", **_DEEPSEEK_V3),
    "bailing_hybrid": _Family("BailingHybridTopkRouter", **_DEEPSEEK_V3),
    "solar_open": _Family("SolarOpenTopkRouter", **_DEEPSEEK_V3),
    "longcat_flash": _Family("LongcatFlashTopkRouter", **_DEEPSEEK_V3, linear="classifier"),
    "gpt_oss": _Family("GptOssTopKRouter", _linear_with_bias, _no_bias, _logits_dtype),
    "granitemoe": _Family("GraniteMoeTopKRouter", **_GRANITE),
    "granitemoeshared": _Family("GraniteMoeSharedTopKRouter", **_GRANITE),
    "granitemoehybrid": _Family("GraniteMoeHybridTopKRouter", **_GRANITE),
    "jetmoe": _Family("JetMoeTopKGating", **_GRANITE, outputs=_sorted_by_expert, linear="layer"),
    "cohere2_moe": _Family("Cohere2MoeTopKRouter", _linear, _no_bias, _hidden_dtype),
    "llama4_text": _Family("Llama4Router", _linear, _no_bias, _logits_dtype, _dense_scores),
    "minimax_m2": _Family("MiniMaxM2TopKRouter", _linear_in_weight_dtype, _bias_argument, _float32),
    "afmoe": _Family("AfmoeTokenChoiceRouter", _linear_then_fp32, _bias_argument, _float32, linear="gate"),
    "lfm2_moe": _Family("Lfm2MoeTopKRouter", _linear, _bias_argument, _logits_dtype),
    "ernie4_5_moe": _Family("Ernie4_5_MoeTopKRouter", _linear_fp32, _ernie_bias, _hidden_dtype),
}


def _route(self, x, *args):
    family: _Family = self._moe_route_family
    logits = family.logits(linear_of(self, family), x)
    bias = family.bias(self, args)
    if torch.is_grad_enabled() and logits.requires_grad:
        res = route(logits, self._moe_route_config, expert_bias=bias, with_dispatch=False,
                    threads=self._moe_route_threads)
        gates, indices = res.gates, res.indices
    else:
        gates, indices = select_experts(logits, self._moe_route_config, expert_bias=bias,
                                        threads=self._moe_route_threads)
    return family.outputs(logits, gates.to(family.gate_dtype(logits, x)), indices.long())


_patched_classes: Dict[type, type] = {}


def _patched_class(cls: type, method: str) -> type:
    if cls not in _patched_classes:
        _patched_classes[cls] = type(cls.__name__, (cls,), {method: _route, "_moe_route_patched": True,
                                                            "__module__": cls.__module__})
    return _patched_classes[cls]


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _find_routers(module, family, router_config, found: Dict, configs: Dict):
    """Adds module and its descendants that are routers to found, each with its
    family and RouterConfig: those of the nearest enclosing module whose
    configuration is of a family with a rule (Qwen3-Omni-MoE's talker has its own)."""
    config = getattr(module, "config", None)
    if hasattr(config, "model_type") and _text_config(config).model_type in FAMILIES:
        family = FAMILIES[_text_config(config).model_type]
        if id(config) not in configs:
            configs[id(config)] = RouterConfig(**_hf.router_fields(config, with_load_balance=False))
        router_config = configs[id(config)]
    if family is not None and type(module).__name__ == family.router_class:
        found[module] = family, router_config
    for child in module.children():
        _find_routers(child, family, router_config, found, configs)


def patch(model: torch.nn.Module, *, threads: Optional[int] = None) -> int:
    """Makes every router of `model` (a transformers MoE model of a family
    RouterConfig.from_hf_config knows) route with the library; returns how many
    were patched. The module keeps its class name, parameters and buffers;
    only its routing method changes. A sub-model with a configuration of its
    own (Qwen3-Omni-MoE's talker) routes by that configuration. The model's
    own load-balancing loss still comes from the router logits, so the library
    adds no penalty of its own. Raises ValueError for a model of another family
    or without routers."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError("moe_route: patch needs a transformers model (a module with a .config)")
    _hf.router_fields(config, with_load_balance=False)  # refuses a family without a rule, by name
    routers: Dict = {}
    _find_routers(model, None, None, routers, {})
    if not routers:
        raise ValueError(f"moe_route: the model has no "
                         f"{FAMILIES[_text_config(config).model_type].router_class} module to patch")
    for module, (family, router_config) in routers.items():
        if not getattr(module, "_moe_route_patched", False):
            module.__class__ = _patched_class(type(module), family.method)
        module._moe_route_family = family
        module._moe_route_config = router_config
        module._moe_route_threads = threads
    return len(routers)
