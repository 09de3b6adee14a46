"""moe_route.integrations.transformers.patch on tiny random models of every
family it knows (issue 16 item 3): the patched model's logits equal the
original's, and so do the loss and every parameter's gradient of one
training step with the model's own load-balancing loss. CPU, nothing
downloaded."""

import copy
import importlib
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
MLA_Q_LORA = dict(MLA, q_lora_rank=16)
HYBRID = ["linear_attention", "full_attention"]
NO_SPECIAL_TOKENS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
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
    "dbrx": ("DbrxConfig", "DbrxForCausalLM", dict(d_model=32, n_heads=4, n_layers=2, attn_config=dict(kv_n_heads=2, rope_theta=1e4, clip_qkv=8.0),
                                                    ffn_config=dict(moe_num_experts=8, moe_top_k=2, ffn_hidden_size=16,
                                                                    moe_loss_weight=0.05))),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(num_experts=8, moe_topk=[2, 2], head_dim=8)),
    "jetmoe": ("JetMoeConfig", "JetMoeForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2, kv_channels=8,
                                                         aux_loss_coef=0.05)),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(
        num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=16)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=16, mamba_n_heads=8, mamba_d_head=8,
        layer_types=["mamba", "attention"])),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2,
                                                                  head_dim=8)),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, index_topk=4, index_head_dim=8, index_n_heads=2, num_key_value_heads=4, **MLA_Q_LORA)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, mlp_layer_types=["sparse"] * 2, **MLA)),
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, num_dense_layers=0,
                                                             moe_intermediate_size=16, routed_scaling_factor=2.0,
                                                             layer_types=["conv", "full_attention"])),
    "longcat_flash": ("LongcatFlashConfig", "LongcatFlashForCausalLM", dict(
        num_hidden_layers=4, head_dim=4, n_routed_experts=6, zero_expert_num=2, moe_topk=2, expert_ffn_hidden_size=16, routed_scaling_factor=2.0,
        **{k: v for k, v in MLA_Q_LORA.items() if k not in ("first_k_dense_replace", "n_shared_experts",
                                                             "moe_intermediate_size")})),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(
        num_experts=8, num_experts_per_token=2, num_expert_group=4, topk_group=2, layer_types=HYBRID,
        mlp_layer_types=["sparse"] * 2, linear_head_dim=8, linear_num_heads=4, **NO_SPECIAL_TOKENS, **MLA)),
    "afmoe": ("AfmoeConfig", "AfmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, num_dense_layers=0,
                                                      num_shared_experts=1, moe_intermediate_size=16, route_scale=2.0,
                                                      head_dim=8)),
    "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2,
                                                                      expert_selection_fn="sigmoid")),
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM", dict(
        num_experts=8, num_experts_per_token=2, num_expert_group=4, topk_group=2, layer_types=HYBRID,
        mlp_layer_types=["sparse"] * 2, num_mtp_layers=0, head_dim=8, **NO_SPECIAL_TOKENS, **MLA)),
    "solar_open": ("SolarOpenConfig", "SolarOpenForCausalLM", dict(n_routed_experts=8, num_experts_per_tok=2,
                                                                  n_shared_experts=1, moe_intermediate_size=16,
                                                                  head_dim=8)),
    "mistral4": ("Mistral4Config", "Mistral4ForCausalLM", dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                                               topk_group=2, **MLA)),
    # multimodal families: their text models, which hold the routers and give hidden states, not logits
    "qwen3_vl_moe_text": ("Qwen3VLMoeTextConfig", "Qwen3VLMoeTextModel", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8)),
    "qwen3_omni_moe_text": ("Qwen3OmniMoeTextConfig", "Qwen3OmniMoeThinkerTextModel", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8)),
    "qwen3_omni_moe_talker_text": ("Qwen3OmniMoeTalkerTextConfig", "Qwen3OmniMoeTalkerModel", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        head_dim=8)),
}


ROUTERS_PER_LAYER = {"jetmoe": 2}  # its attention is a mixture of experts too
TALKER = "qwen3_omni_moe_talker_text"  # it takes embeddings, not token ids


def _config_class(name):
    if name.startswith("qwen3_omni_moe"):  # its sub-configurations are not exported at the top level
        return getattr(importlib.import_module("transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe"),
                       MODELS[name][0])
    return getattr(tf, MODELS[name][0])


def _outputs(name, model, ids):
    """The model's logits, or a text model's last hidden states."""
    if MODELS[name][1].endswith("ForCausalLM"):
        return model(ids).logits
    if name == TALKER:
        table = torch.randn(VOCAB, BASE["hidden_size"], generator=torch.Generator().manual_seed(3))
        return model(inputs_embeds=table[ids]).last_hidden_state
    return model(ids).last_hidden_state


def _loss(name, model, ids):
    """The model's own loss (with its load-balancing loss), or for a text model
    the mean square of its hidden states."""
    if MODELS[name][1].endswith("ForCausalLM"):
        return model(ids, labels=ids).loss
    return _outputs(name, model, ids).square().mean()


def _model_type(name):
    return "llama4_text" if name == "llama4" else name


def _models(name):
    _, model_class, fields = MODELS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        original = getattr(tf, model_class)(_config_class(name)(**{**BASE, **fields}))
    family = integration.FAMILIES[_model_type(name)]
    with torch.no_grad():  # random routers with a spread of logits (the default init is nearly uniform)
        g = torch.Generator().manual_seed(1)
        for module in original.modules():
            if type(module).__name__ == family.router_class:
                integration.linear_of(module, family).weight.normal_(0.0, 0.3, generator=g)
            for bias in ("e_score_correction_bias", "expert_bias"):  # the router's, or its MoE block's
                if isinstance(getattr(module, bias, None), torch.Tensor):
                    getattr(module, bias).uniform_(0.0, 0.2, generator=g)
            if type(module).__name__ == "Qwen3OmniMoeTalkerTextExperts":  # its _init_weights leaves them torch.empty
                for weight in module.parameters(recurse=False):
                    weight.normal_(0.0, 0.02, generator=g)
    patched = copy.deepcopy(original)
    assert integration.patch(patched) == 2 * ROUTERS_PER_LAYER.get(name, 1)
    return original, patched


@pytest.mark.parametrize("name", sorted(MODELS))
def test_patched_model_equals_the_original(name):
    original, patched = _models(name)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    assert original.state_dict().keys() == patched.state_dict().keys()
    original.eval(), patched.eval()
    with torch.no_grad():
        torch.testing.assert_close(_outputs(name, patched, ids), _outputs(name, original, ids), rtol=1e-5, atol=1e-5)

    original.train(), patched.train()
    losses = []
    for model in (original, patched):
        loss = _loss(name, model, ids)
        loss.backward()
        losses.append(loss.detach())
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
