"""moe_route.integrations.transformers.patch on tiny random models of every
family it knows (issue 16 item 3): the patched model's logits equal the
original's, and so do the loss and every parameter's gradient of one
training step with the model's own load-balancing loss. CPU, nothing
downloaded."""

import copy
import warnings

import pytest
import torch

from helpers import import_engine

tf = import_engine("transformers")
from moe_route.integrations import transformers as integration  # noqa: E402

VOCAB = 64
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.05)
MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
           first_k_dense_replace=0, n_shared_experts=1, moe_intermediate_size=16)
MODELS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2,
                                                                 moe_intermediate_size=16,
                                                                 shared_expert_intermediate_size=16)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2,
                                                                 moe_intermediate_size=16, norm_topk_prob=True,
                                                                 head_dim=8)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, eos_token_id=None,
                                                      pad_token_id=None)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        n_routed_experts=8, num_experts_per_tok=2, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=1.5, **MLA)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, **MLA)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(n_routed_experts=8, num_experts_per_tok=2,
                                                             moe_intermediate_size=16, first_k_dense_replace=0,
                                                             n_group=1, topk_group=1, head_dim=8)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2, head_dim=8,
                                                          layer_types=["sliding_attention", "full_attention"],
                                                          sliding_window=16)),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(num_local_experts=8, num_experts_per_tok=1,
                                                             intermediate_size_mlp=48, head_dim=8,
                                                             interleave_moe_layer_step=1)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(moe_num_experts=8, moe_k=2,
                                                                           moe_intermediate_size=16,
                                                                           moe_layer_start_index=0, head_dim=8)),
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2, head_dim=8,
                                                            layer_types=["full_attention"] * 2)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        head_dim=8, norm_topk_prob=True, layer_types=["full_attention"] * 2)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        head_dim=8, layer_types=["full_attention"] * 2)),
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", dict(num_experts=8, num_experts_per_tok=2,
                                                                pad_token_id=None, eos_token_id=None)),
    "jamba": ("JambaConfig", "JambaForCausalLM", dict(num_experts=8, num_experts_per_tok=2, attn_layer_period=1,
                                                      attn_layer_offset=0, expert_layer_period=1,
                                                      expert_layer_offset=0, use_mamba_kernels=False)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2)),
    "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
                                                      moe_intermediate_size=16, first_k_dense_replace=0, n_group=4,
                                                      topk_group=2, head_dim=8)),
    "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2,
                                                                   moe_intermediate_size=16, first_k_dense_replace=0,
                                                                   head_dim=8)),
}


def _model_type(name):
    return "llama4_text" if name == "llama4" else name


def _models(name):
    config_class, model_class, fields = MODELS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        original = getattr(tf, model_class)(getattr(tf, config_class)(**BASE, **fields))
    with torch.no_grad():  # random routers with a spread of logits (the default init is nearly uniform)
        g = torch.Generator().manual_seed(1)
        for module in original.modules():
            if type(module).__name__ == integration.FAMILIES[_model_type(name)].router_class:
                module.weight.normal_(0.0, 0.3, generator=g)
                for owner in (module, getattr(module, "moe_statics", None)):
                    if owner is not None and hasattr(owner, "e_score_correction_bias"):
                        owner.e_score_correction_bias.uniform_(0.0, 0.2, generator=g)
    patched = copy.deepcopy(original)
    assert integration.patch(patched) == 2  # one router per layer
    return original, patched


@pytest.mark.parametrize("name", sorted(MODELS))
def test_patched_model_equals_the_original(name):
    original, patched = _models(name)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    assert original.state_dict().keys() == patched.state_dict().keys()
    original.eval(), patched.eval()
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-5)

    original.train(), patched.train()
    losses = []
    for model in (original, patched):
        out = model(ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    grads = dict(original.named_parameters())
    for key, p in patched.named_parameters():
        want = grads[key].grad
        if want is None:
            assert p.grad is None, key
            continue
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-5 * max(1.0, float(want.abs().max())),
                                   msg=lambda m, key=key: f"{key}: {m}")


def test_patch_refuses_models_it_has_no_rule_for():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16,
                                                   num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="transformers' model_type='llama' is not reproduced"):
        integration.patch(dense)
    with pytest.raises(ValueError, match="needs a transformers model"):
        integration.patch(torch.nn.Linear(2, 2))


def test_the_snippet_of_docs_integration_md_patches_a_model():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "integration.md").read_text()
    snippet = doc.split("### Patching a model", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    names = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(snippet, names)  # noqa: S102  (the documentation's own code)
    assert names["routers"] == 2
    with torch.no_grad():
        assert names["model"](torch.zeros(1, 4, dtype=torch.long)).logits.shape == (1, 4, 64)


def test_patch_knows_exactly_the_families_from_hf_config_has_rules_for():
    from moe_route import _hf

    assert set(integration.FAMILIES) == set(_hf.FAMILIES)
    assert {_model_type(name) for name in MODELS} == set(integration.FAMILIES)  # each has a model test
