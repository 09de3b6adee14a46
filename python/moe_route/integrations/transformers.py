"""Routes a Hugging Face transformers MoE model through the library:
patch(model) makes each router module of the model call the library's
operators, keeping its weights, its state dict and its outputs (router
logits, gates, expert indices), so the rest of the model and its
load-balancing loss run unchanged (docs/integration.md)."""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional

import torch
import torch.nn.functional as F

from .. import _hf
from ..config import RouterConfig
from ..functional import route, select_experts


class _Family(NamedTuple):
    router_class: str  # the router module's class name in the family's modeling code
    logits: Callable  # (module, hidden_states) -> router logits, as the module computes them
    bias: Callable  # module -> the selection bias (expert_bias) or None
    gate_dtype: Callable  # (logits, hidden_states) -> the dtype the module returns its gates in
    dense_scores: bool = False  # Llama 4 returns (scores [N, E], logits)


def _linear(module, hidden):
    return F.linear(hidden.reshape(-1, module.weight.shape[1]), module.weight)


def _linear_fp32(module, hidden):
    return F.linear(hidden.reshape(-1, module.weight.shape[1]).float(), module.weight.float())


def _linear_then_fp32(module, hidden):
    return F.linear(hidden.reshape(-1, module.weight.shape[1]), module.weight).float()


def _linear_with_bias(module, hidden):
    return F.linear(hidden.reshape(-1, module.weight.shape[1]), module.weight, module.bias)


def _no_bias(module):
    return None


def _correction_bias(module):
    return module.e_score_correction_bias.reshape(-1).float()


def _ernie_bias(module):
    return module.moe_statics.e_score_correction_bias.reshape(-1).float()


def _float32(logits, hidden):
    return torch.float32


def _logits_dtype(logits, hidden):
    return logits.dtype


def _hidden_dtype(logits, hidden):
    return hidden.dtype


_STANDARD = dict(logits=_linear, bias=_no_bias, gate_dtype=_logits_dtype)
FAMILIES: Dict[str, _Family] = {
    "mixtral": _Family("MixtralTopKRouter", _linear, _no_bias, _float32),
    "minimax": _Family("MiniMaxTopKRouter", _linear, _no_bias, _float32),
    "qwen2_moe": _Family("Qwen2MoeTopKRouter", **_STANDARD),
    "qwen3_moe": _Family("Qwen3MoeTopKRouter", **_STANDARD),
    "qwen3_next": _Family("Qwen3NextTopKRouter", **_STANDARD),
    "qwen3_5_moe_text": _Family("Qwen3_5MoeTopKRouter", **_STANDARD),
    "olmoe": _Family("OlmoeTopKRouter", **_STANDARD),
    "flex_olmo": _Family("FlexOlmoTopKRouter", **_STANDARD),
    "jamba": _Family("JambaTopKRouter", _linear, _no_bias, _hidden_dtype),
    "deepseek_v2": _Family("DeepseekV2TopkRouter", _linear_fp32, _no_bias, _float32),
    "deepseek_v3": _Family("DeepseekV3TopkRouter", _linear_fp32, _correction_bias, _float32),
    "glm4_moe": _Family("Glm4MoeTopkRouter", _linear_fp32, _correction_bias, _float32),
    "dots1": _Family("Dots1TopkRouter", _linear_fp32, _correction_bias, _float32),
    "exaone_moe": _Family("ExaoneMoeTopkRouter", _linear_fp32, _correction_bias, _float32),
    "gpt_oss": _Family("GptOssTopKRouter", _linear_with_bias, _no_bias, _logits_dtype),
    "granitemoe": _Family("GraniteMoeTopKRouter", _linear_then_fp32, _no_bias, _hidden_dtype),
    "llama4_text": _Family("Llama4Router", _linear, _no_bias, _logits_dtype, dense_scores=True),
    "ernie4_5_moe": _Family("Ernie4_5_MoeTopKRouter", _linear_fp32, _ernie_bias, _hidden_dtype),
}


def _forward(self, hidden_states):
    family: _Family = self._moe_route_family
    logits = family.logits(self, hidden_states)
    bias = family.bias(self)
    if torch.is_grad_enabled() and logits.requires_grad:
        res = route(logits, self._moe_route_config, expert_bias=bias, threads=self._moe_route_threads)
        gates, indices = res.gates, res.indices
    else:
        gates, indices = select_experts(logits, self._moe_route_config, expert_bias=bias,
                                        threads=self._moe_route_threads)
    gates, indices = gates.to(family.gate_dtype(logits, hidden_states)), indices.long()
    if family.dense_scores:
        return torch.zeros_like(logits).scatter(1, indices, gates), logits
    return logits, gates, indices


_patched_classes: Dict[type, type] = {}


def _patched_class(cls: type) -> type:
    if cls not in _patched_classes:
        _patched_classes[cls] = type(cls.__name__, (cls,), {"forward": _forward, "_moe_route_patched": True,
                                                            "__module__": cls.__module__})
    return _patched_classes[cls]


def patch(model: torch.nn.Module, *, threads: Optional[int] = None) -> int:
    """Makes every router of `model` (a transformers MoE model of a family
    RouterConfig.from_hf_config knows, all eighteen) route with the library; returns how
    many were patched. The module keeps its class name, parameters and
    buffers; only its forward changes. The model's own load-balancing loss
    still comes from the router logits, so the library adds no penalty of its
    own. Raises ValueError for a model of another family or without routers."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError("moe_route: patch needs a transformers model (a module with a .config)")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = text.model_type
    router_config = RouterConfig(**_hf.router_fields(text, with_load_balance=False))
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"moe_route: patch has no router rule for model_type={model_type!r}; "
                         f"it knows {sorted(FAMILIES)}")
    patched = 0
    for module in model.modules():
        if type(module).__name__ != family.router_class:
            continue
        if not getattr(module, "_moe_route_patched", False):
            module.__class__ = _patched_class(type(module))
        module._moe_route_family = family
        module._moe_route_config = router_config
        module._moe_route_threads = threads
        patched += 1
    if patched == 0:
        raise ValueError(f"moe_route: the model has no {family.router_class} module to patch")
    return patched
