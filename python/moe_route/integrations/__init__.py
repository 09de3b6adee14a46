"""Drop-in replacements of the routers of the engines users come from
(docs/integration.md): transformers.patch(model)."""
