"""Megatron-Core's router arguments (the moe_* fields of its TransformerConfig)
as the library's configuration: RouterConfig.from_megatron and
Admission.from_megatron (docs/integration.md). A configuration the library
reproduces exactly becomes fields; any other raises ValueError naming the
Megatron field at fault, so nothing routes differently without saying so.
python/tests/test_megatron.py checks each accepted configuration against
Megatron's own TopKRouter."""

from __future__ import annotations

from typing import Any, Dict

# Megatron-Core's defaults (megatron/core/transformer/transformer_config.py) of
# the fields that decide routing.
DEFAULTS: Dict[str, Any] = {
    "moe_router_topk": 2,
    "moe_router_score_function": "softmax",
    "moe_router_pre_softmax": False,
    "moe_router_topk_scaling_factor": None,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_router_enable_expert_bias": False,
    "moe_router_bias_update_rate": 1e-3,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.0,
    "moe_z_loss_coeff": None,
    "moe_expert_capacity_factor": None,
    "moe_token_drop_policy": "probs",
    "moe_pad_expert_input_to_capacity": False,
    "moe_router_dtype": None,
    "moe_input_jitter_eps": None,
    "moe_router_force_load_balancing": False,
    "moe_router_padding_for_quantization": False,
    "moe_router_padding_for_fp8": False,
    "moe_router_topk_limited_devices": None,
}

# Fields that change what Megatron routes and that the library does not do, with why.
_NOT_REPRODUCED = {
    "moe_input_jitter_eps": "the jitter multiplies the router's input, before the logits the library takes",
    "moe_router_force_load_balancing": "it replaces the logits with random ones (a benchmarking mode)",
    "moe_router_padding_for_quantization": "padding the routing map is not done by the library",
    "moe_router_padding_for_fp8": "padding the routing map is not done by the library",
    "moe_router_topk_limited_devices": "use moe_router_num_groups and moe_router_group_topk",
}


def fields_of(config, fields: Dict[str, Any]) -> Dict[str, Any]:
    """The routing fields of a Megatron TransformerConfig (any object with those
    attributes) or of keyword arguments named as Megatron names them."""
    if config is not None and fields:
        raise TypeError("moe_route: from_megatron takes a TransformerConfig or keyword arguments, not both")
    if config is not None:
        return {name: getattr(config, name, default) for name, default in DEFAULTS.items()}
    unknown = sorted(set(fields) - set(DEFAULTS))
    if unknown:
        raise TypeError(f"moe_route: from_megatron got unknown Megatron router arguments {unknown}; "
                        f"it reads {sorted(DEFAULTS)}")
    return {**DEFAULTS, **fields}


def _refuse(field: str, value, why: str):
    raise ValueError(f"moe_route: Megatron's {field}={value!r} is not reproduced: {why}")


def _listed(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _load_balance(m: Dict[str, Any], biased_or_grouped: bool) -> Dict[str, Any]:
    """The load-balance penalty: Megatron's aux_loss (batch) or seq_aux_loss (sequence)."""
    types = _listed(m["moe_router_load_balancing_type"])
    coeffs = _listed(m["moe_aux_loss_coeff"])
    if len(coeffs) == 1 and len(types) > 1:
        coeffs = coeffs * len(types)
    if len(coeffs) != len(types):
        _refuse("moe_aux_loss_coeff", m["moe_aux_loss_coeff"],
                f"it has {len(coeffs)} coefficients for {len(types)} load-balancing types")
    for t in types:
        if t not in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none"):
            _refuse("moe_router_load_balancing_type", t,
                    "only aux_loss, seq_aux_loss, global_aux_loss and none are reproduced (sinkhorn routes "
                    "differently)")
    active = [(t, float(c)) for t, c in zip(types, coeffs) if t != "none" and float(c) != 0.0]
    if not active:
        return {}
    if len(active) > 1:
        _refuse("moe_router_load_balancing_type", m["moe_router_load_balancing_type"],
                "the library has one load-balance penalty; give one type a non-zero coefficient")
    kind, coeff = active[0]
    if kind == "global_aux_loss":  # the loads come from GlobalLoadBalance, a plain top-k as Megatron's
        return {"load_balance": coeff, "load_balance_scope": "global_batch"}
    f = {"load_balance": coeff, "load_balance_scope": "batch" if kind == "aux_loss" else "sequence"}
    if kind == "seq_aux_loss":  # under a padding mask Megatron divides every sequence by the mean valid length
        f["load_balance_sequence_length"] = "batch_mean"
    if biased_or_grouped:  # Megatron counts the loads on a plain top-k of the unbiased scores
        f["load_balance_counts"] = "top_k"
    return f


def router_fields(m: Dict[str, Any]) -> Dict[str, Any]:
    """RouterConfig fields of Megatron's routing fields `m` (fields_of)."""
    for field, why in _NOT_REPRODUCED.items():
        if m[field] not in (None, False, 0.0):
            _refuse(field, m[field], why)
    if m["moe_router_dtype"] == "fp64":
        _refuse("moe_router_dtype", "fp64", "the library routes in float32")
    k = int(m["moe_router_topk"])
    score = m["moe_router_score_function"]
    biased = bool(m["moe_router_enable_expert_bias"])
    group_topk = m["moe_router_group_topk"]
    grouped = bool(group_topk)  # Megatron's own test: a group_topk of None or 0 routes ungrouped
    scale = m["moe_router_topk_scaling_factor"]
    f: Dict[str, Any] = {"top_k": k, "scaling_factor": float(scale) if scale else 1.0}
    if score == "softmax":
        if biased:
            _refuse("moe_router_enable_expert_bias", True, "Megatron applies the expert bias only to sigmoid scores")
        pre = bool(m["moe_router_pre_softmax"])
        f.update(gating="softmax" if pre else "softmax_after_topk", normalize=False)
        group_key = "group_limited_score" if pre else "group_limited"  # Megatron's groups: probabilities or logits
    elif score == "sigmoid":
        f.update(gating="sigmoid", normalize=k > 1)  # Megatron leaves a single sigmoid gate unnormalised
        group_key = "group_limited_bias" if biased else "group_limited_score"
    else:
        _refuse("moe_router_score_function", score, "Megatron's score functions are 'softmax' and 'sigmoid'")
    if grouped:
        groups, top_groups = m["moe_router_num_groups"], int(group_topk)
        if not groups:
            _refuse("moe_router_num_groups", groups, "group-limited routing needs the number of groups")
        if k < top_groups:
            _refuse("moe_router_group_topk", group_topk,
                    f"Megatron scores each group by its top moe_router_topk // group_topk = {k // top_groups} scores")
        f.update(selection=group_key, groups=int(groups), top_groups=top_groups, per_group_k=k // top_groups)
    elif biased:
        f["selection"] = "expert_bias"
    if biased:
        f["bias_update_rate"] = float(m["moe_router_bias_update_rate"])
    f.update(_load_balance(m, biased or grouped))
    if m["moe_z_loss_coeff"]:
        f["z_loss"] = float(m["moe_z_loss_coeff"])
    return f


def admission_preset(m: Dict[str, Any]):
    """(preset name, capacity factor) of Megatron's token dropping, or None when it drops nothing."""
    factor = m["moe_expert_capacity_factor"]
    if factor is None:
        return None
    policy = m["moe_token_drop_policy"]
    if policy == "position":
        # Megatron documents it as dropping the tokens at the end of the batch, which
        # capacity_position does; its code keeps whichever of the equal entries of the
        # routing map its topk returns, so only the counts kept per expert agree exactly.
        return "capacity_position", float(factor)
    if policy != "probs":
        _refuse("moe_token_drop_policy", policy, "Megatron's drop policies are 'probs' and 'position'")
    # Megatron ranks an expert's tokens by the gate its router returns (after its
    # normalisation and scaling), which is capacity_gate's affinity.
    return "capacity_gate", float(factor)
