"""torchtitan's router (torchtitan.models.common.moe.TokenChoiceTopKRouter and
the MoE layer around it, torchtitan 0.3.0) as the library's configuration:
RouterConfig.from_torchtitan (docs/integration.md). A configuration the
library reproduces exactly becomes fields; any other raises ValueError naming
the torchtitan field at fault. python/tests/test_torchtitan.py checks each
accepted configuration against torchtitan's own router and MoE layer.

torchtitan's router: scores s = softmax or sigmoid of the gate's logits; the
choice is a top-k of s + expert_bias_E (the MoE layer passes its bias when
load_balance_coeff is set: aux-loss-free balancing, the bias chooses only),
after node-limited routing when num_expert_groups is set (groups scored by
their two largest s + b, the best num_limited_groups kept); the gates are the
chosen s, divided by their sum + 1e-20 under route_norm, times route_scale.
It has no auxiliary loss."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

# The attributes of a TokenChoiceTopKRouter (its Config and the built module
# carry the same names) that decide routing, with torchtitan 0.3.0's defaults.
DEFAULTS: Dict[str, Any] = {
    "num_experts": None,
    "num_expert_groups": None,
    "num_limited_groups": None,
    "top_k": 1,
    "score_func": "sigmoid",
    "route_norm": False,
    "route_scale": 1.0,
    "_debug_force_load_balance": False,
}

_UNSET = object()


def _refuse(field: str, value, why: str):
    raise ValueError(f"moe_route: torchtitan's {field}={value!r} is not reproduced: {why}")


def router_and_coeff(config, load_balance_coeff=_UNSET) -> Tuple[Any, Optional[float]]:
    """(the router's Config or module, the MoE layer's load_balance_coeff) of a
    torchtitan MoE.Config or MoE module (they hold .router), or of a
    TokenChoiceTopKRouter.Config or module with load_balance_coeff given (None:
    no expert bias, as when the layer passes none)."""
    if hasattr(config, "router"):
        if load_balance_coeff is not _UNSET:
            raise TypeError("moe_route: from_torchtitan takes load_balance_coeff from the MoE layer's "
                            "configuration; pass it only with a router's")
        return config.router, getattr(config, "load_balance_coeff", None)
    if not hasattr(config, "top_k") or not hasattr(config, "score_func"):
        raise TypeError(f"moe_route: from_torchtitan takes a torchtitan MoE or TokenChoiceTopKRouter (their Config "
                        f"or the built module), got {type(config).__name__}")
    return config, None if load_balance_coeff is _UNSET else load_balance_coeff


def router_fields(router, load_balance_coeff: Optional[float]) -> Dict[str, Any]:
    """RouterConfig fields of a TokenChoiceTopKRouter (Config or module) called
    with an expert bias when load_balance_coeff is not None."""
    m = {name: getattr(router, name, default) for name, default in DEFAULTS.items()}
    e, k = m["num_experts"], int(m["top_k"])
    biased = load_balance_coeff is not None
    if biased and not float(load_balance_coeff) > 0.0:
        _refuse("load_balance_coeff", load_balance_coeff, "torchtitan requires it > 0 (None turns the bias off)")
    if e is not None and not 1 <= k <= int(e):
        _refuse("top_k", k, f"it must be in [1, num_experts = {e}]")
    score = m["score_func"]
    if score not in ("softmax", "sigmoid"):
        _refuse("score_func", score, "torchtitan's score functions are 'softmax' and 'sigmoid'")
    f: Dict[str, Any] = {"gating": score, "top_k": k, "normalize": bool(m["route_norm"]),
                         "scaling_factor": float(m["route_scale"])}
    groups = m["num_expert_groups"]
    if groups is not None:  # torchtitan checks these on every call, the round-robin's included
        limited = m["num_limited_groups"]
        if limited is None:
            _refuse("num_limited_groups", None, "torchtitan raises when num_expert_groups is set without it")
        groups, limited = int(groups), int(limited)
        if e is None or groups < 1 or int(e) % groups:
            _refuse("num_expert_groups", groups, f"it must divide num_experts (= {e})")
        size = int(e) // groups
        if size < 2:
            _refuse("num_expert_groups", groups, f"torchtitan scores a group by its two largest scores and "
                                                 f"requires at least 2 experts a group (here {size})")
        if not 1 <= limited <= groups:
            _refuse("num_limited_groups", limited, f"it must be in [1, num_expert_groups = {groups}]")
    if m["_debug_force_load_balance"]:
        # Its round-robin: token t's slot j goes to expert (t*K + j) % E, whatever
        # the scores, the bias or the groups; the gates are those experts' scores.
        f["selection"] = "fixed"
    elif groups is not None:
        if k > limited * size:
            _refuse("top_k", k, f"the {limited} kept groups hold {limited * size} experts; torchtitan would "
                                f"choose among the masked (-inf) ones")
        # torchtitan keys the groups on s + b (s without the bias): the two largest, summed.
        f.update(selection="group_limited_bias" if biased else "group_limited_score", groups=groups,
                 top_groups=limited, per_group_k=2)
    elif biased:
        f["selection"] = "expert_bias"
    if biased:
        f["bias_update_rate"] = float(load_balance_coeff)
    return f
