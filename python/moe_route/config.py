"""Router and admission configurations: plain dataclasses whose fields are the
library's run-time parameters (include/moe_route/runtime/config.hpp)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from . import _C, _hf, _megatron, _torchtitan

GATINGS = ("softmax", "sigmoid", "sqrt_softplus", "softmax_after_topk")
SELECTIONS = ("top_k", "expert_bias", "group_limited", "group_limited_bias", "group_limited_score", "fixed")
PRIORS = ("none", "log_prior_bias", "prior_override")
PENALTIES = tuple(_C.penalty_names)


def _text_of(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return repr(value)  # the shortest text that reads back to the same double
    return str(value)


class _Fields:
    """Rejects attributes that are not fields, so a misspelt option (cfg.topk = 4)
    raises instead of being silently ignored; keeps the text form the operators
    take ("field=value;...", include/moe_route/adapters/detail/config_text.hpp),
    made again after any change."""

    def __setattr__(self, name, value):
        if name not in self.__dataclass_fields__:
            raise AttributeError(f"moe_route: {type(self).__name__} has no field '{name}'")
        object.__setattr__(self, name, value)
        object.__setattr__(self, "_text", None)

    def to_text(self) -> str:
        text = getattr(self, "_text", None)
        if text is None:
            text = ";".join(f"{f}={_text_of(getattr(self, f))}" for f in self.__dataclass_fields__
                            if getattr(self, f) is not None)
            object.__setattr__(self, "_text", text)
        return text

    @classmethod
    def _from_text(cls, text: str, **overrides):
        fields = {}
        for item in filter(None, text.split(";")):
            name, value = item.split("=", 1)
            default = cls.__dataclass_fields__[name].default
            if isinstance(default, bool) or default is None:
                fields[name] = value == "1"
            elif isinstance(default, (int, float)) and not isinstance(default, str):
                fields[name] = type(default)(value)
            else:
                fields[name] = value
        fields.update(overrides)
        return cls(**fields)


@dataclass
class RouterConfig(_Fields):
    """One router: gating, selection, prior policy and penalty coefficients.

    A penalty with coefficient 0 is off (value 0, no gradient). ``normalize``
    None takes the gating's default (sigmoid and sqrt_softplus normalise).
    """

    gating: str = "softmax"
    selection: str = "top_k"
    top_k: int = 2
    normalize: Optional[bool] = None
    scaling_factor: float = 1.0
    # group_limited (groups keyed on logits) / group_limited_score (on scores s) / group_limited_bias (on s + b)
    groups: int = 1
    top_groups: int = 1
    per_group_k: int = 2
    # expert_bias / group_limited_bias: b_e += rate * sign(mean load - load_e)
    bias_update_rate: float = 1e-3
    # prior policy (RPB): log_prior_bias adds beta * b[r(t)] in training;
    # prior_override takes the prior's top-K in training
    prior: str = "none"
    prior_beta: float = 1.0
    bias_gates: bool = True
    # penalties
    load_balance: float = 0.0
    load_balance_scope: str = "batch"
    # the experts the load-balance loads f count: "selected" (those routed) or
    # "top_k" (each token's K largest unbiased logits, as Megatron-Core counts)
    load_balance_counts: str = "selected"
    # under load_balance_scope="sequence", the length that normalises each
    # sequence: "own" (its valid tokens) or "batch_mean" (the batch's mean valid
    # length, as Megatron-Core's seq_aux_loss does under a padding mask)
    load_balance_sequence_length: str = "own"
    z_loss: float = 0.0
    kl_to_base: float = 0.0
    logit_l2: float = 0.0
    locality: float = 0.0
    locality_epsilon: float = 1e-3

    @classmethod
    def preset(cls, name: str, **overrides) -> "RouterConfig":
        """A published model's router (deepseek_v2_lite, moonlight, deepseek_v3,
        qwen3, mixtral, deepseek_v4), with any field overridden."""
        return cls._from_text(_C.preset(name)["config"], **overrides)

    @classmethod
    def from_megatron(cls, config=None, **fields) -> "RouterConfig":
        """Megatron-Core's router: its TransformerConfig, or its moe_* fields as
        keyword arguments (moe_router_topk=..., moe_router_score_function=...).
        Raises ValueError naming the field when Megatron would route differently
        (docs/integration.md). Under seq_aux_loss pass route() the sequence of
        each token in Megatron's [seq_length, batch] order: sequence_ids =
        arange(seq_length * batch) % batch, num_sequences = batch. Under
        global_aux_loss pass load_fractions from a moe_route.GlobalLoadBalance."""
        return cls(**_megatron.router_fields(_megatron.fields_of(config, fields)))

    @classmethod
    def from_hf_config(cls, config) -> "RouterConfig":
        """The router of a Hugging Face transformers MoE model, from its
        configuration: Mixtral, MiniMax, Qwen2-MoE, Qwen3-MoE, Qwen3-Next,
        Qwen3.5-MoE, OLMoE, FlexOlmo, Jamba, DeepSeek-V2, DeepSeek-V3,
        GLM-4.5-MoE, dots.llm1, EXAONE-MoE, gpt-oss, Granite-MoE, Llama 4 and
        Ernie 4.5. Under the sigmoid families with a correction bias
        (DeepSeek-V3 and its kin) and Ernie 4.5 pass the router's
        e_score_correction_bias as expert_bias. Raises ValueError naming the
        model type or setting it does not reproduce (docs/integration.md)."""
        return cls(**_hf.router_fields(config))

    @classmethod
    def from_torchtitan(cls, config, load_balance_coeff=_torchtitan._UNSET) -> "RouterConfig":
        """torchtitan's router (torchtitan.models.common.moe, 0.3.0): a MoE
        layer's Config or module (its router, and its load_balance_coeff: the
        expert bias is on when that is set), or a TokenChoiceTopKRouter's
        Config or module with load_balance_coeff given (default: no bias).
        With the bias on pass the layer's expert_bias_E as expert_bias, and
        update it with moe_route.integrations.torchtitan.update_expert_bias
        (torchtitan centres the step). Raises ValueError naming the torchtitan
        field it does not reproduce (docs/integration.md)."""
        router, coeff = _torchtitan.router_and_coeff(config, load_balance_coeff)
        return cls(**_torchtitan.router_fields(router, coeff))

    @staticmethod
    def preset_experts(name: str) -> int:
        """E of the preset's model."""
        return int(_C.preset(name)["num_experts"])

    @property
    def normalizes(self) -> bool:
        """Whether the gates are normalised: ``normalize``, or the gating's default when it is None."""
        return _C.normalizes(self.to_text())

    @property
    def uses_expert_bias(self) -> bool:
        return self.selection in ("expert_bias", "group_limited_bias")


@dataclass
class Admission(_Fields):
    """Capacity-bounded admission after routing (docs/admission.md).

    Build one with the presets: dropless(), cipher_strict(tau),
    cipher_reroute(tau), locmoe(capacity_factor), capacity_position(cf),
    capacity_probs(cf), capacity_gate(cf).
    """

    kind: str = "dropless"  # "dropless" or "capacity"
    affinity: str = "probability"  # position | probability | gate | logit | cosine
    overflow: str = "drop"  # drop | reroute
    threshold: float = -math.inf
    capacity_factor: float = 1.0
    min_capacity: int = 0
    renormalize: bool = False
    fill_factor: float = 4.0
    max_rounds: int = -1

    @property
    def is_dropless(self) -> bool:
        return self.kind == "dropless"

    @property
    def needs_norms(self) -> bool:
        return not self.is_dropless and self.affinity == "cosine"

    @property
    def renormalizes(self) -> bool:
        return not self.is_dropless and self.overflow == "drop" and self.renormalize

    def capacity(self, num_tokens: int, top_k: int, num_experts: int) -> int:
        """C = max(min_capacity, ceil(num_tokens * top_k / num_experts * capacity_factor)),
        each expert's capacity for one group of num_tokens tokens: the size of the
        fixed dispatch layout (route(..., dispatch_capacity=C), Megatron's
        moe_pad_expert_input_to_capacity)."""
        return _C.admission_capacity(self.to_text(), int(num_tokens), int(top_k), int(num_experts))

    @classmethod
    def _preset(cls, name: str, capacity_factor: float = 1.0, fill_factor: float = 4.0, tau=None, **fields):
        """A preset of the C++ table (include/moe_route/adapters/detail/config_text.hpp), fields overridden."""
        text = _C.admission_preset(name, float(capacity_factor), float(fill_factor),
                                   None if tau is None else float(tau))
        return cls._from_text(text, **fields)

    @classmethod
    def from_megatron(cls, config=None, **fields) -> "Admission":
        """Megatron-Core's token dropping (moe_expert_capacity_factor,
        moe_token_drop_policy) as an Admission; dropless() when it drops
        nothing. Takes what RouterConfig.from_megatron takes. Under
        moe_pad_expert_input_to_capacity the admission is the same; pass
        route(..., dispatch_capacity=admission.capacity(N, K, E)) for its
        fixed expert shapes (docs/integration.md)."""
        m = _megatron.fields_of(config, fields)
        _megatron.router_fields(m)  # the same refusals as the router's
        preset = _megatron.admission_preset(m)
        if preset is None:
            return cls.dropless()
        name, capacity_factor = preset
        return cls._preset(name, capacity_factor)

    @classmethod
    def dropless(cls) -> "Admission":
        return cls._preset("dropless")

    @classmethod
    def cipher_strict(cls, tau: float, capacity_factor: float = 8.0, renormalize: bool = False) -> "Admission":
        return cls._preset("cipher_strict", capacity_factor, tau=tau, renormalize=renormalize)

    @classmethod
    def cipher_reroute(cls, tau: float, capacity_factor: float = 8.0, fill_factor: float = 4.0) -> "Admission":
        return cls._preset("cipher_reroute", capacity_factor, fill_factor, tau=tau)

    @classmethod
    def locmoe(cls, capacity_factor: float, tau: float = 0.01) -> "Admission":
        return cls._preset("locmoe", capacity_factor, tau=tau)

    @classmethod
    def capacity_position(cls, capacity_factor: float, min_capacity: int = 0) -> "Admission":
        return cls._preset("capacity_position", capacity_factor, min_capacity=min_capacity)

    @classmethod
    def capacity_probs(cls, capacity_factor: float, min_capacity: int = 0) -> "Admission":
        """Each expert keeps its tokens of highest gating score s."""
        return cls._preset("capacity_probs", capacity_factor, min_capacity=min_capacity)

    @classmethod
    def capacity_gate(cls, capacity_factor: float, min_capacity: int = 0) -> "Admission":
        """Each expert keeps its tokens of highest routed gate (after the router's
        normalisation and scaling): Megatron's drop_policy="probs" under any router."""
        return cls._preset("capacity_gate", capacity_factor, min_capacity=min_capacity)
