"""The registered operators (torch.ops.moe_route.*): torch.library.opcheck for each
(schema, fake implementation, autograd registration, AOT dispatch with static and
dynamic shapes), and a small MoE block under torch.compile(fullgraph=True) and
torch.export against eager (docs/python.md)."""

import pytest
import torch

import moe_route as mr
from moe_route._ops import ops

N, E, K = 24, 12, 3


def _logits(n=N, e=E, requires_grad=False):
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, e, generator=g).requires_grad_(requires_grad)


def _route_args(z, cfg, admission="", *, expert_bias=None, prior=(None, None, None), hidden_norms=None,
                weight_norms=None):
    return (z, cfg.to_text(), expert_bias, *prior, None, 0, None, None, 0, True, admission, hidden_norms,
            weight_norms, None, 1, None, 1)


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


@pytest.mark.parametrize("name", sorted(ROUTE_CASES))
def test_opcheck_route(name):
    cfg, admission = ROUTE_CASES[name]
    z = _logits(requires_grad=True)
    bias = torch.linspace(-0.1, 0.1, E) if cfg.uses_expert_bias else None
    norms = (torch.rand(N) + 0.5, torch.rand(E) + 0.5) if admission is not None and admission.needs_norms else (None,
                                                                                                              None)
    prior = _prior() if cfg.prior != "none" else (None, None, None)
    args = _route_args(z, cfg, admission.to_text() if admission else "", expert_bias=bias, prior=prior,
                       hidden_norms=norms[0], weight_norms=norms[1])
    torch.library.opcheck(ops.route.default, args)


def test_opcheck_route_backward_admit_dispatch():
    cfg = mr.RouterConfig(top_k=K, load_balance=1e-2, z_loss=1e-3)
    z = _logits()
    out = ops.route(*_route_args(z, cfg))
    routed, routed_gates, workspace = out[3], out[4], out[6]
    grad_gates, grad_values = torch.randn(N, K), torch.randn(5)
    torch.library.opcheck(ops.route_backward.default,
                          (grad_gates, grad_values, z, cfg.to_text(), None, None, None, None, None, 0, None, None, 0,
                           True, routed, workspace, None, False, 1))
    admission = mr.Admission.capacity_position(1.0).to_text()
    torch.library.opcheck(ops.admit.default,
                          (z, cfg.to_text(), admission, routed, routed_gates, None, None, None, 1, None, 1))
    for align in (1, 4):
        torch.library.opcheck(ops.dispatch.default, (routed, E, align, 2, None))


def test_opcheck_expert_choice_router_l2_prior_and_bias():
    z = _logits(requires_grad=True)
    torch.library.opcheck(ops.expert_choice.default, (z, 2, 1.0, 0, None, 1, None, 1))
    indices = ops.expert_choice(z.detach(), 2, 1.0, 0, None, 1, None, 1)[1]
    torch.library.opcheck(ops.expert_choice_backward.default, (torch.randn(N, E), z.detach(), indices, 1))
    weights = [torch.randn(E, 8, requires_grad=True), torch.randn(E, 8, requires_grad=True)]
    base = [w.detach() + 0.1 * torch.randn(E, 8) for w in weights]
    torch.library.opcheck(ops.router_l2.default, (weights, base, 1e2))
    rows = torch.arange(N, dtype=torch.int32) % 3
    torch.library.opcheck(ops.prior_build.default, (z.detach(), rows, 4, "softmax"))
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
        res = mr.route(self.router(x), self.cfg, admission=self.admission, num_ranks=1, threads=1)
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
    compiled = _grads(block, x, torch.compile(block, fullgraph=True, backend="aot_eager"))
    for a, b in zip([eager[0], eager[1]] + eager[2], [compiled[0], compiled[1]] + compiled[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_export_moe_block():
    block, x = _block_and_input()
    program = torch.export.export(block, (x.detach(),))
    out, aux = program.module()(x.detach())
    want, want_aux = block(x.detach())
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux, want_aux)
