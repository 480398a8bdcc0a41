"""Hugging Face checkpoints in and out: their layout (config.json + safetensors) mapped to ours.

`arch` holds one declarative entry per architecture (config.json keys <-> our config keys, the values it fixes, its
tensor names), read by both directions; `config_map` turns a checkpoint's config.json into our config sections
(refusing, by name, every field we cannot honour); `weights` reads its safetensors with the `safetensors` NumPy API
(no torch) and maps every tensor to our parameter paths, checking names, shapes and dtypes; `load` resolves
`checkpoint.init_from = "hf:DIR"` (the sections DIR implies, its parameters in their shardings); `export` writes ours
as a checkpoint of the architecture it fits (import(export(model)) is the model). The model or a run at step 0 built
from a checkpoint: experiments.pretrained. Supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
MixtralForCausalLM, Qwen3MoeForCausalLM.
"""
