"""Hugging Face checkpoints in and out: their layout (config.json + safetensors) mapped to ours.

`config_map` turns a checkpoint's config.json into our config sections (refusing, by name, every field we cannot
honour); `weights` reads its safetensors with the `safetensors` NumPy API (no torch) and maps every tensor to our
parameter paths, checking names, shapes and dtypes. Supported: LlamaForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM.
"""
