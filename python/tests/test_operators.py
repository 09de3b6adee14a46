"""The registered operators (torch.ops.moe_route.*): torch.library.opcheck for each
(schema, fake implementation, autograd registration, AOT dispatch with static and
dynamic shapes), and a small MoE block under torch.compile(fullgraph=True) and
torch.export against eager (docs/python.md)."""

import pytest
import torch

import moe_route as mr
from moe_route._ops import ops

N, E, K = 24, 12, 3
TOKENS = (N, 0, 1)  # and the integer edges: no tokens, one token (docs/reliability.md)


def _logits(n=N, e=E, requires_grad=False):
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, e, generator=g).requires_grad_(requires_grad)


def _route_args(z, cfg, admission="", *, expert_bias=None, prior=(None, None, None), hidden_norms=None,
                weight_norms=None):
    return (z, cfg.to_text(), expert_bias, *prior, None, 0, None, None, 0, True, admission, hidden_norms,
            weight_norms, None, 1, None, None, None, 1)


def _prior(n=N, e=E, rows=3):
    pi = torch.softmax(torch.randn(rows, e, generator=torch.Generator().manual_seed(5)), dim=1)
    prepared = mr.prior.prepare(pi)
    return prepared.bias, prepared.probs, (torch.arange(n, dtype=torch.int32) % (rows + 1)) - 1


ROUTE_CASES = {
    "softmax": (mr.RouterConfig(top_k=K), None),
    "softmax_penalties": (mr.RouterConfig(top_k=K, load_balance=1e-2, z_loss=1e-3), None),
    "rpb": (mr.RouterConfig(top_k=K, prior="log_prior_bias", kl_to_base=1e-1, logit_l2=1e-3, load_balance=1e-2),
            None),
    "sigmoid_bias": (mr.RouterConfig(gating="sigmoid", selection="expert_bias", top_k=K, load_balance=1e-2), None),
    "grouped": (mr.RouterConfig(gating="sigmoid", selection="group_limited", top_k=4, groups=4, top_groups=2),
                None),
    "capacity_probs": (mr.RouterConfig(top_k=K, z_loss=1e-3), mr.Admission.capacity_probs(1.0)),
    "cipher_reroute": (mr.RouterConfig(top_k=K), mr.Admission.cipher_reroute(0.05, capacity_factor=1.0)),
}


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not (mr.with_cuda and torch.cuda.is_available()), reason="needs the CUDA branch and a CUDA device"))]


@pytest.mark.parametrize("n", TOKENS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(ROUTE_CASES))
def test_opcheck_route(name, device, n):
    cfg, admission = ROUTE_CASES[name]
    z = _logits(n).to(device).requires_grad_(True)
    bias = torch.linspace(-0.1, 0.1, E) if cfg.uses_expert_bias else None
    norms = (torch.rand(n) + 0.5, torch.rand(E) + 0.5) if admission is not None and admission.needs_norms else (None,
                                                                                                              None)
    prior = _prior(n) if cfg.prior != "none" else (None, None, None)
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    args = _route_args(z, cfg, admission.to_text() if admission else "", expert_bias=on(bias),
                       prior=tuple(on(t) for t in prior), hidden_norms=on(norms[0]), weight_norms=on(norms[1]))
    torch.library.opcheck(ops.route.default, args)


def test_only_gates_and_penalty_values_are_differentiable():
    cfg, admission = ROUTE_CASES["capacity_probs"]
    z = _logits(requires_grad=True)
    out = ops.route(*_route_args(z, cfg, admission.to_text()))
    assert [t.requires_grad for t in out] == [True, True] + [False] * 7  # routed_gates too: it has no gradient
    assert out[0].grad_fn is out[1].grad_fn is not None
    with torch.no_grad():
        assert not any(t.requires_grad for t in ops.route(*_route_args(z, cfg, admission.to_text())))
    gates, indices, per_token, report = ops.expert_choice(z, 2, 1.0, 0, None, 1, None, None, 1)
    assert gates.grad_fn is not None and not (indices.requires_grad or per_token.requires_grad or report.requires_grad)
    (g,) = torch.autograd.grad(gates.sum(), z, create_graph=True)
    with pytest.raises(RuntimeError, match="the router's backward is not differentiable"):
        g.sum().backward()


@pytest.mark.parametrize("n", TOKENS)
def test_opcheck_route_backward_admit_dispatch(n):
    cfg = mr.RouterConfig(top_k=K, load_balance=1e-2, z_loss=1e-3)
    z = _logits(n)
    out = ops.route(*_route_args(z, cfg))
    routed, routed_gates, workspace = out[2], out[0].detach(), out[6]  # dropless: indices, gates are the routed ones
    assert out[3].shape == (0, K) and out[4].shape == (0, K) and out[5].shape == (0, K)
    grad_gates, grad_values = torch.randn(n, K), torch.randn(5)
    torch.library.opcheck(ops.select_experts.default, (_logits(n), cfg.to_text(), None, None, 1))
    torch.library.opcheck(ops.route_backward.default,
                          (grad_gates, grad_values, z, cfg.to_text(), None, None, None, None, None, 0, None, None, 0,
                           True, routed, workspace, None, False, None, 1))
    admission = mr.Admission.capacity_position(1.0).to_text()
    torch.library.opcheck(ops.admit.default,
                          (z, cfg.to_text(), admission, routed, routed_gates, None, None, None, 1, None, None, 1))
    for align in (1, 4):
        torch.library.opcheck(ops.dispatch.default, (routed, E, align, 2, None))
        torch.library.opcheck(ops.dispatch.default, (routed, E, align, 2, None, max(n, 1) * K))  # the fixed layout


def test_opcheck_with_token_mask():
    cfg = mr.RouterConfig(top_k=K, load_balance=1e-2, z_loss=1e-3)
    mask = torch.arange(N) % 3 != 1
    z = _logits(requires_grad=True)
    args = list(_route_args(z, cfg, mr.Admission.capacity_probs(1.0).to_text()))
    args[-3] = mask
    torch.library.opcheck(ops.route.default, tuple(args))
    args[-2] = ops.route(*_route_args(z.detach(), cfg))[2].flip(1).contiguous()  # replay: a routing of its own
    torch.library.opcheck(ops.route.default, tuple(args))
    out = ops.route(*_route_args(z.detach(), cfg))
    routed, workspace = out[2], out[6]
    torch.library.opcheck(ops.route_backward.default,
                          (torch.randn(N, K), torch.randn(5), z.detach(), cfg.to_text(), None, None, None, None, None,
                           0, None, None, 0, True, routed, workspace, None, False, mask, 1))
    torch.library.opcheck(ops.admit.default, (z.detach(), cfg.to_text(), mr.Admission.capacity_position(1.0).to_text(),
                                              routed, out[0].detach(), None, None, None, 1, None, mask, 1))
    torch.library.opcheck(ops.expert_choice.default, (z, 2, 1.0, 0, None, 1, None, mask, 1))
    torch.library.opcheck(ops.select_experts.default, (z.detach(), cfg.to_text(), None, mask, 1))


@pytest.mark.parametrize("n", TOKENS)
def test_opcheck_expert_choice_router_l2_prior_and_bias(n):
    z = _logits(n, requires_grad=True)
    torch.library.opcheck(ops.expert_choice.default, (z, 2, 1.0, 0, None, 1, None, None, 1))
    indices = ops.expert_choice(z.detach(), 2, 1.0, 0, None, 1, None, None, 1)[1]
    torch.library.opcheck(ops.expert_choice_backward.default, (torch.randn(n, E), z.detach(), indices, None, 1))
    weights = [torch.randn(E, 8, requires_grad=True), torch.randn(E, 8, requires_grad=True)]
    base = [w.detach() + 0.1 * torch.randn(E, 8) for w in weights]
    torch.library.opcheck(ops.router_l2.default, (weights, base, 1e2))
    rows = torch.arange(n, dtype=torch.int32) % 3
    torch.library.opcheck(ops.prior_build.default, (z.detach(), rows, 4, "softmax", 1))
    pi = torch.softmax(torch.randn(3, E), dim=1)
    torch.library.opcheck(ops.prior_prepare.default, (pi, 0.05, 5.0))
    torch.library.opcheck(ops.expert_bias_update.default, (torch.zeros(E), torch.arange(E, dtype=torch.float64), 1e-3))


def test_fake_shapes_follow_symbolic_tokens():
    """The fakes size every output from N alone, workspace included, for any N."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    cfg = mr.RouterConfig(top_k=K, load_balance=1e-2, z_loss=1e-3, kl_to_base=0.0)
    for n in (1, 1023, 1024, 1025, 3000):
        real = ops.route(*_route_args(_logits(n), cfg))
        with FakeTensorMode(shape_env=ShapeEnv()) as mode:
            fake = ops.route(*_route_args(mode.from_tensor(_logits(n), static_shapes=False), cfg))
        for r, f in zip(real, fake):
            assert tuple(r.shape) == tuple(int(d) for d in f.shape) and r.dtype == f.dtype


class _MoEBlock(torch.nn.Module):
    """Router linear -> route (load balance, z-loss) -> capacity admission -> dispatch ->
    experts on the expert-major buffer -> combine."""

    def __init__(self, d=16, e=8, k=2):
        super().__init__()
        self.e = e
        self.router = torch.nn.Linear(d, e, bias=False)
        self.w = torch.nn.Parameter(torch.randn(e, d, d) * 0.1)
        self.cfg = mr.RouterConfig(top_k=k, load_balance=1e-2, z_loss=1e-3)
        self.admission = mr.Admission.capacity_probs(1.25)

    def forward(self, x):
        n, d = x.shape
        res = mr.route(self.router(x), self.cfg, admission=self.admission, num_ranks=1)
        meta = res.dispatch
        k = res.indices.shape[1]
        rows = meta.permutation.clamp(min=0)  # padding rows gather token 0 and are never combined
        token_of_row = torch.div(rows, k, rounding_mode="floor")
        expert_of_row = torch.bucketize(torch.arange(rows.shape[0]), meta.offsets[1:], right=True).clamp(max=self.e - 1)
        hidden = torch.bmm(x[token_of_row].unsqueeze(1), self.w[expert_of_row]).squeeze(1)
        slot_rows = meta.inverse.clamp(min=0)
        executed = (meta.inverse >= 0).to(x.dtype).unsqueeze(1)
        per_slot = hidden[slot_rows] * executed * res.gates.reshape(-1, 1)
        return per_slot.reshape(n, k, d).sum(1), res.aux_loss


def _block_and_input():
    torch.manual_seed(3)
    block = _MoEBlock()
    x = torch.randn(40, 16, requires_grad=True)
    return block, x


def _grads(block, x, fn):
    out, aux = fn(x)
    (out.square().sum() + aux).backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
    x.grad = None
    block.zero_grad()
    return out.detach(), aux.detach(), grads


def test_compiled_moe_block_has_no_graph_breaks_and_matches_eager():
    block, x = _block_and_input()
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    eager = _grads(block, x, block)
    compiled = _grads(block, x, torch.compile(block, fullgraph=True))
    for a, b in zip([eager[0], eager[1]] + eager[2], [compiled[0], compiled[1]] + compiled[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_export_moe_block():
    block, x = _block_and_input()
    program = torch.export.export(block, (x.detach(),))
    out, aux = program.module()(x.detach())
    want, want_aux = block(x.detach())
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux, want_aux)


# ---------------------------------------------------------------------------
# Bad input: every operator checks before it writes, and names the argument.

def _bad_route(**changes):
    cfg = changes.pop("cfg", mr.RouterConfig(top_k=K))
    names = [a.name for a in ops.route.default._schema.arguments]
    args = dict(zip(names, _route_args(_logits(), cfg)))
    args.update(changes)
    return lambda: ops.route(*args.values())


BAD_ROUTE = [
    (dict(logits=_logits().double()), TypeError, "logits must be torch.float32, got torch.float64"),
    (dict(logits=torch.randn(N)), ValueError, r"logits must have shape \[\*, \*\], got \[24\]"),
    (dict(logits=torch.randn(4, 0)), ValueError, "logits must have at least one expert column"),
    (dict(logits=torch.randn(2, 4097)), ValueError, r"logits: num_experts \(= 4097\) must be in \[1, 4096\]"),
    (dict(cfg=mr.RouterConfig(top_k=13)), ValueError, r"top_k \(= 13\) exceeds the number of experts \(= 12\)"),
    (dict(config="top_k=3;topk=4"), ValueError, "RouterConfig has no field 'topk'"),
    (dict(config="top_k=three"), ValueError, "top_k = 'three' is not a whole number"),
    (dict(config="gating=softmaxx"), ValueError, "gating = 'softmaxx' is not one of: softmax, sigmoid"),
    (dict(admission="kind=capacity;overflow=sideways"), ValueError, "overflow = 'sideways' is not one of"),
    (dict(cfg=mr.RouterConfig(selection="expert_bias", top_k=K), expert_bias=torch.zeros(E + 1)), ValueError,
     r"expert_bias must have shape \[12\], got \[13\]"),
    (dict(cfg=mr.RouterConfig(selection="expert_bias", top_k=K), expert_bias=torch.zeros(E, dtype=torch.int32)),
     TypeError, "expert_bias must be torch.float32, got torch.int32"),
    (dict(sequence_ids=torch.zeros(N, dtype=torch.int32)), ValueError, "num_sequences must be >= 1"),
    (dict(sequence_ids=torch.zeros(N + 1, dtype=torch.int32), num_sequences=1), ValueError,
     r"sequence_ids must have shape \[24\]"),
    (dict(cfg=mr.RouterConfig(top_k=K, prior="log_prior_bias"), prior_bias=torch.zeros(2, E),
          token_prior_row=torch.full((N,), 5, dtype=torch.int32)), ValueError, r"token_prior_row\[0\] \(= 5\)"),
    (dict(token_prior_row=torch.full((N,), 2**40, dtype=torch.int64)), ValueError,
     "token_prior_row has values outside the int32 range"),
    (dict(admission=mr.Admission.cipher_strict(0.1).to_text(), hidden_norms=torch.ones(N - 1),
          weight_norms=torch.ones(E)), ValueError, r"hidden_norms must have shape \[24\]"),
    (dict(admission=mr.Admission.capacity_probs(1.0).to_text(), num_groups=0), ValueError, "num_groups must be >= 1"),
    (dict(num_sequences=2**31), ValueError, r"num_sequences \(= 2147483648\) is outside the int32 range"),
    # Fits int32, but its per-sequence sums need about 400 GB: refused naming it, not by the allocator.
    (dict(cfg=mr.RouterConfig(top_k=K, load_balance=1e-2, load_balance_scope="sequence"),
          sequence_ids=torch.zeros(N, dtype=torch.int32), num_sequences=2**31 - 1), ValueError,
     r"num_tokens \(= 24\), num_experts \(= 12\) and num_sequences \(= 2147483647\) need a workspace of \d+ bytes,"
     r" which cannot be allocated on cpu"),
    (dict(rank=-2**31 - 1), ValueError, r"rank \(= -2147483649\) is outside the int32 range"),
    (dict(threads=2**40), ValueError, r"threads \(= 1099511627776\) is outside the int32 range"),
    (dict(logits=_logits().to("meta"), expert_bias=torch.zeros(E),
          cfg=mr.RouterConfig(selection="expert_bias", top_k=K)), ValueError, "expert_bias is on cpu, but logits is on meta"),
]


@pytest.mark.parametrize("case", range(len(BAD_ROUTE)))
def test_route_operator_rejects(case):
    changes, error, message = BAD_ROUTE[case]
    with pytest.raises(error, match=message):
        _bad_route(**changes)()


def test_other_operators_reject_bad_input():
    z = _logits()
    cfg = mr.RouterConfig(top_k=K).to_text()
    routed = torch.zeros(N, K, dtype=torch.int32)
    gates = torch.zeros(N, K)
    with pytest.raises(ValueError, match=r"routed_indices must have shape \[24, 3\]"):
        ops.admit(z, cfg, "kind=capacity", routed[:, :2], gates, None, None, None, 1, None, None, 1)
    with pytest.raises(TypeError, match="routed_gates must be torch.float32"):
        ops.admit(z, cfg, "kind=capacity", routed, gates.double(), None, None, None, 1, None, None, 1)
    with pytest.raises(ValueError, match="align must be >= 1"):
        ops.dispatch(routed, E, 0, 1, None)
    with pytest.raises(ValueError, match="num_ranks must be >= 1"):
        ops.dispatch(routed, E, 1, 0, None)
    # Integer arguments that do not fit the library's int are refused, not wrapped (2**32 + 12 would be 12).
    with pytest.raises(ValueError, match=r"num_experts \(= 4294967308\) is outside the int32 range"):
        ops.dispatch(routed, 2**32 + E, 1, 1, None)
    with pytest.raises(ValueError, match=r"align \(= 4294967297\) is outside the int32 range"):
        ops.dispatch(routed, E, 2**32 + 1, 1, None)
    with pytest.raises(ValueError, match=r"num_experts \(= 5000\) must be in \[1, 4096\]"):
        ops.dispatch(routed, 5000, 1, 1, None)
    with pytest.raises(ValueError, match=r"top_k \(= 4294967298\) is outside the int32 range"):
        ops.expert_choice(z, 2**32 + 2, 1.0, 0, None, 1, None, None, 1)
    with pytest.raises(ValueError, match=r"num_groups \(= -4294967295\) is outside the int32 range"):
        ops.admit(z, cfg, "kind=capacity", routed, gates, None, None, None, 1 - 2**32, None, None, 1)
    with pytest.raises(ValueError, match=r"indices\[0\]"):
        ops.dispatch(torch.full((2, 2), E, dtype=torch.int32), E, 1, 1, None)
    with pytest.raises(ValueError, match=r"group_ids must have shape \[24\]"):
        ops.expert_choice(z, 2, 1.0, 0, torch.zeros(3, dtype=torch.int32), 2, None, None, 1)
    with pytest.raises(TypeError, match="capacity must be torch.int64"):
        ops.expert_choice(z, 2, 1.0, 0, None, 1, torch.ones(E, dtype=torch.int32), None, 1)
    with pytest.raises(ValueError, match=r"grad_gates must have shape \[24, 12\]"):
        ops.expert_choice_backward(torch.zeros(N, E - 1), z, torch.zeros(N, E, dtype=torch.int32), None, 1)
    with pytest.raises(ValueError, match="the same number of layers, got 2 and 1"):
        ops.router_l2([torch.zeros(2, 3), torch.zeros(2, 3)], [torch.zeros(2, 3)], 1.0)
    with pytest.raises(ValueError, match=r"layer 0 base must have shape \[2, 3\], got \[3, 2\]"):
        ops.router_l2([torch.zeros(2, 3)], [torch.zeros(3, 2)], 1.0)
    with pytest.raises(ValueError, match="num_rows must be >= 1"):
        ops.prior_build(z, torch.zeros(N, dtype=torch.int32), 0, "softmax", 1)
    with pytest.raises(ValueError, match=r"rows must have shape \[24\]"):
        ops.prior_build(z, torch.zeros(N - 1, dtype=torch.int32), 2, "softmax", 1)
    with pytest.raises(ValueError, match="gating = 'relu' is not one of"):
        ops.prior_build(z, torch.zeros(N, dtype=torch.int32), 2, "relu", 1)
    with pytest.raises(TypeError, match="pi must be torch.float32"):
        ops.prior_prepare(torch.ones(2, E, dtype=torch.float64), 0.05, 5.0)
    bias = torch.linspace(-1, 1, E)
    before = bias.clone()
    with pytest.raises(ValueError, match=r"loads must have shape \[12\]"):
        ops.expert_bias_update(bias, torch.ones(E + 1), 1e-3)
    assert torch.equal(bias, before)  # nothing half-written
    with pytest.raises(ValueError, match="expert_bias must be a contiguous 1-D float32 tensor"):
        ops.expert_bias_update(bias.double(), torch.ones(E), 1e-3)
