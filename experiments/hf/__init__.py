"""Hugging Face checkpoints in and out: their layout (config.json + safetensors) mapped to ours.

`config_map` turns a checkpoint's config.json into our config sections (refusing, by name, every field we cannot
honour); `weights` reads its safetensors with the `safetensors` NumPy API (no torch) and maps every tensor to our
parameter paths, checking names, shapes and dtypes; `load` builds our model from a checkpoint directory; `export`
writes ours as a checkpoint of the architecture it fits (import(export(model)) is the model). Supported:
LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM.
"""
