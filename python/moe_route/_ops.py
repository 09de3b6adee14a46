"""The fake (meta) implementations and autograd formulas of the operators that
moe_route._C registers (torch.ops.moe_route.*; schemas in python/src/bindings.cpp).

The fakes give every output its exact shape and dtype from the input shapes and
the configuration alone, so torch.compile, torch.export and FakeTensorMode
trace the operators without running them; N may be symbolic. route,
expert_choice and their backward operators have C++ Autograd kernels (a
double backward raises), and select_experts, whose gates have no gradient,
refuses differentiable logits in its own; router_l2's formula is registered
here with torch.library. The other operators have no differentiable outputs."""

from __future__ import annotations

import torch

from . import _C

ops = torch.ops.moe_route

NUM_PENALTIES = len(_C.penalty_names)
# The counters of admission_report and expert_choice_report (include/moe_route), in order.
ADMISSION_REPORT = ("offered", "kept", "rerouted", "dropped", "below_threshold", "over_capacity",
                    "tokens_without_experts", "invalid")
EXPERT_CHOICE_REPORT = ("assignments", "tokens_without_experts", "max_experts_per_token", "invalid")


def _empty(shape, dtype, like):
    return like.new_empty(shape, dtype=dtype)


def _on_device_of(first, first_name, **tensors):
    """The kernels' device check, for the fakes: every tensor on the device of the first."""
    for name, t in tensors.items():
        if t is not None and t.device != first.device:
            raise ValueError(f"moe_route: {name} is on {t.device}, but {first_name} is on {first.device}")


@torch.library.register_fake("moe_route::route")
def _route_fake(logits, config, expert_bias, prior_bias, prior_probs, token_prior_row, sequence_ids, num_sequences,
                load_fractions, expert_rank, rank, training, admission, hidden_norms, weight_norms, group_ids,
                num_groups, capacity, token_mask, replay_indices, threads):
    _on_device_of(logits, "logits", expert_bias=expert_bias, prior_bias=prior_bias, prior_probs=prior_probs,
                  token_prior_row=token_prior_row, sequence_ids=sequence_ids, load_fractions=load_fractions,
                  expert_rank=expert_rank, hidden_norms=hidden_norms, weight_norms=weight_norms, group_ids=group_ids,
                  capacity=capacity, token_mask=token_mask, replay_indices=replay_indices)
    n, e = logits.shape
    top_k, fixed, per_value, chunk = _C.route_shape(config, int(e), int(num_sequences))
    workspace = fixed + per_value * (n + (n + chunk - 1) // chunk)
    admitted = n if _C.admission_flags(admission)[0] else 0  # the routed_* and status rows: [0, K] if dropless
    pair = lambda rows, dtype: _empty((rows, top_k), dtype, logits)  # noqa: E731
    return (pair(n, torch.float32), _empty((NUM_PENALTIES,), torch.float32, logits), pair(n, torch.int32),
            pair(admitted, torch.int32), pair(admitted, torch.float32), pair(admitted, torch.int8),
            _empty((workspace,), torch.uint8, logits),
            _empty((), torch.int64, logits), _empty((len(ADMISSION_REPORT),), torch.int64, logits))


@torch.library.register_fake("moe_route::select_experts")
def _select_experts_fake(logits, config, expert_bias, token_mask, threads):
    _on_device_of(logits, "logits", expert_bias=expert_bias, token_mask=token_mask)
    top_k = _C.route_shape(config, int(logits.shape[1]), 0)[0]
    return (_empty((logits.shape[0], top_k), torch.float32, logits),
            _empty((logits.shape[0], top_k), torch.int32, logits))


@torch.library.register_fake("moe_route::route_backward")
def _route_backward_fake(grad_gates, grad_penalties, logits, *rest):
    return torch.empty_like(logits, dtype=torch.float32)


@torch.library.register_fake("moe_route::admit")
def _admit_fake(logits, config, admission, routed_indices, routed_gates, hidden_norms, weight_norms, group_ids,
                num_groups, capacity, token_mask, threads):
    _on_device_of(logits, "logits", routed_indices=routed_indices, routed_gates=routed_gates,
                  hidden_norms=hidden_norms, weight_norms=weight_norms, group_ids=group_ids, capacity=capacity,
                  token_mask=token_mask)
    n, k = routed_indices.shape
    return (_empty((n, k), torch.int32, logits), _empty((n, k), torch.float32, logits),
            _empty((n, k), torch.int8, logits), _empty((len(ADMISSION_REPORT),), torch.int64, logits))


def dispatch_rows_bound(num_tokens, slots_per_token, num_experts, align, capacity=0):
    """Rows of the expert-major buffer for any routing of these shapes (admission/dispatch.hpp):
    exactly E blocks of the capacity rounded up to align under a fixed capacity."""
    if capacity > 0:
        return num_experts * ((capacity + align - 1) // align * align)
    return num_tokens * slots_per_token + num_experts * (align - 1)


@torch.library.register_fake("moe_route::dispatch")
def _dispatch_fake(indices, num_experts, align, num_ranks, expert_rank, capacity=0):
    _on_device_of(indices, "indices", expert_rank=expert_rank)
    n, s = indices.shape
    i64 = lambda *shape: _empty(shape, torch.int64, indices)  # noqa: E731
    rows = dispatch_rows_bound(n, s, num_experts, align, capacity)
    return i64(num_experts), i64(num_experts + 1), i64(rows), i64(n * s), i64(num_ranks)


@torch.library.register_fake("moe_route::expert_choice")
def _expert_choice_fake(logits, top_k, capacity_factor, min_capacity, group_ids, num_groups, capacity, token_mask,
                        threads):
    _on_device_of(logits, "logits", group_ids=group_ids, capacity=capacity, token_mask=token_mask)
    n, e = logits.shape
    return (_empty((n, e), torch.float32, logits), _empty((n, e), torch.int32, logits),
            _empty((n,), torch.int32, logits), _empty((len(EXPERT_CHOICE_REPORT),), torch.int64, logits))


@torch.library.register_fake("moe_route::expert_choice_backward")
def _expert_choice_backward_fake(grad_gates, logits, indices, token_mask, threads):
    return torch.empty_like(logits, dtype=torch.float32)


@torch.library.register_fake("moe_route::router_l2")
def _router_l2_fake(weights, base, coefficient):
    return weights[0].new_empty((), dtype=torch.float64), [torch.empty_like(w) for w in weights]


@torch.library.register_fake("moe_route::prior_build")
def _prior_build_fake(logits, rows, num_rows, gating, threads):
    return _empty((num_rows, logits.shape[1]), torch.float32, logits), _empty((num_rows,), torch.int64, logits)


@torch.library.register_fake("moe_route::prior_prepare")
def _prior_prepare_fake(pi, epsilon, cap):
    return torch.empty_like(pi), torch.empty_like(pi), _empty((2,), torch.int64, pi)


@torch.library.register_fake("moe_route::expert_bias_update")
def _expert_bias_update_fake(expert_bias, loads, rate):
    return None


# ---------------------------------------------------------------------------
# Autograd of router_l2 (route, expert_choice and the backward operators have
# C++ Autograd kernels in python/src/bindings.cpp).


def _router_l2_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*output[1])


def _router_l2_backward(ctx, grad_value, grad_grads):
    if grad_value is None:
        return None, [None] * len(ctx.saved_tensors), None
    scale = grad_value.to(torch.float32)
    return [g * scale for g in ctx.saved_tensors], [None] * len(ctx.saved_tensors), None


torch.library.register_autograd("moe_route::router_l2", _router_l2_backward, setup_context=_router_l2_setup_context)
