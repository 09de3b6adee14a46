"""moe_route.integrations.vllm.routing_function, the custom routing function of
vLLM's FusedMoE and SGLang's select_experts: the signature those engines call,
and against vLLM's own rule for its default router (fused_topk: softmax, top-k,
renormalised when asked), written out here."""

from pathlib import Path

import pytest
import torch

import moe_route as mr
from moe_route.integrations import vllm as integration


def fused_topk(gating_output, topk, renormalize):
    """vLLM's fused_topk on the CPU: softmax in float32, top-k, optional renormalisation."""
    weights, ids = torch.topk(torch.softmax(gating_output.float(), dim=-1), topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_function_equals_vllms_fused_topk(renormalize, dtype):
    logits = torch.randn(37, 24, generator=torch.Generator().manual_seed(1)).to(dtype)
    f = integration.routing_function(mr.RouterConfig(top_k=4, normalize=renormalize))
    with torch.inference_mode():
        weights, ids = f(hidden_states=torch.zeros(37, 8), gating_output=logits, topk=4, renormalize=renormalize)
    want_weights, want_ids = fused_topk(logits, 4, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-7)


def test_routing_function_takes_a_deepseek_v3_router_and_refuses_a_mismatch():
    cfg = mr.RouterConfig.preset("deepseek_v3", groups=4, top_groups=2)
    bias = torch.linspace(-0.1, 0.1, 64)
    logits = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
    f = integration.routing_function(cfg, expert_bias=bias)
    with torch.no_grad():
        got = f(hidden_states=None, gating_output=logits, topk=cfg.top_k, renormalize=True)
        want = mr.route(logits, cfg, training=False, expert_bias=bias)
    assert torch.equal(got[1], want.indices) and torch.equal(got[0], want.gates)
    with pytest.raises(ValueError, match="topk=2, the RouterConfig has top_k=8"):
        f(hidden_states=None, gating_output=logits, topk=2, renormalize=True)
    with pytest.raises(ValueError, match="renormalize=False, the RouterConfig normalizes=True"):
        f(hidden_states=None, gating_output=logits, topk=8, renormalize=False)
    with pytest.raises(TypeError, match="config must be a RouterConfig"):
        integration.routing_function("deepseek_v3")


def test_the_snippet_of_docs_integration_md_runs():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "integration.md").read_text()
    snippet = doc.split("## vLLM and SGLang", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    names = {"router_logits": torch.randn(5, 8, generator=torch.Generator().manual_seed(3))}
    exec(snippet, names)  # noqa: S102  (the documentation's own code)
    weights, ids = names["topk_weights"], names["topk_ids"]
    want = fused_topk(names["router_logits"], 2, True)
    assert torch.equal(ids, want[1])
    torch.testing.assert_close(weights, want[0], rtol=1e-5, atol=1e-7)
