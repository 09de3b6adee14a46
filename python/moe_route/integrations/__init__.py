"""Drop-in replacements of the routers of the engines users come from
(docs/integration.md): transformers.patch(model) for a Hugging Face
transformers MoE model, megatron.MoERouteTopKRouter for Megatron-Core,
torchtitan.MoERouteTokenChoiceTopKRouter (and patch, patch_config) for
torchtitan, and vllm.routing_function(config) for vLLM's and SGLang's custom
routing function."""
