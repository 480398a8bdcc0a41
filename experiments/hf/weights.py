"""A Hugging Face checkpoint's safetensors -> our parameters, by name, with every shape and dtype checked.

    tensors = weights.read(hf_dir)                    # {hf name: np.ndarray}, one file or an index of shards
    params = weights.to_ours(tensors, sections, source=hf_dir)   # {our path ("blocks.0.attn.q.kernel"): array}

Layout differences the mapping undoes: PyTorch's Linear stores [out, in] (ours [in, out]); experts are one tensor
per expert and projection (ours one [E, in, out] stack per projection); the router is `gate` / `block_sparse_moe.gate`
[E, d] (ours [d, E]). Every tensor of the checkpoint must be used and every parameter of ours found: anything else
raises `HFWeightsError` naming the file and the tensor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from moe.config import MoEConfig

__all__ = ["HFWeightsError", "read", "to_ours"]

_FLOATS = ("float32", "float16", "bfloat16")


class HFWeightsError(ValueError):
    """A checkpoint's tensors do not fit: a missing shard or tensor, an unused tensor, a shape or dtype we cannot
    hold. The message names the file and the tensor."""


def read(hf_dir: str) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint in `hf_dir`: `model.safetensors`, or the shards `model.safetensors.index.json`
    lists (each tensor from the file the index names). Read with the safetensors NumPy API (bfloat16 as ml_dtypes')."""
    from safetensors import safe_open

    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
    else:
        single = os.path.join(hf_dir, "model.safetensors")
        if not os.path.exists(single):
            raise HFWeightsError(f"{hf_dir}: neither model.safetensors nor model.safetensors.index.json is there")
        with safe_open(single, framework="np") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    tensors: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        path = os.path.join(hf_dir, shard)
        if not os.path.exists(path):
            names = [n for n, s in weight_map.items() if s == shard]
            raise HFWeightsError(
                f"{path}: the shard is missing (the index puts {len(names)} tensors there, e.g. {names[0]!r})"
            )
        with safe_open(path, framework="np") as f:
            present = set(f.keys())
            for name in (n for n, s in weight_map.items() if s == shard):
                if name not in present:
                    raise HFWeightsError(f"{path}: tensor {name!r} listed in the index is not in the file")
                tensors[name] = f.get_tensor(name)
    return tensors


def to_ours(tensors: Mapping[str, np.ndarray], sections: Mapping[str, Mapping[str, Any]], *, source: str) -> dict:
    """{our parameter path: array} of a model with the config `sections` (config_map.from_hf's), from the
    checkpoint's `tensors`. Raises HFWeightsError for a missing or unused tensor, a wrong shape or dtype."""
    m, moe = sections["model"], sections["moe"]
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...], *, transpose: bool = False) -> np.ndarray:
        if name not in tensors:
            raise HFWeightsError(f"{source}: tensor {name!r} is missing (expected shape {shape})")
        x = tensors[name]
        if str(x.dtype) not in _FLOATS:
            raise HFWeightsError(f"{source}: tensor {name!r} has dtype {x.dtype}; supported: {', '.join(_FLOATS)}")
        if tuple(x.shape) != shape:
            raise HFWeightsError(f"{source}: tensor {name!r} has shape {tuple(x.shape)}, expected {shape}")
        used.add(name)
        return np.ascontiguousarray(x.T) if transpose else x

    d, v, hd = m["d_model"], m["vocab_size"], m["head_dim"]
    h, kv = m["num_heads"], m["num_kv_heads"]
    out = {"embedding": take("model.embed_tokens.weight", (v, d)), "final_norm.scale": take("model.norm.weight", (d,))}
    if not m["tie_embeddings"]:
        out["head.kernel"] = take("lm_head.weight", (v, d), transpose=True)
    for i in range(m["num_layers"]):
        hf, ours = f"model.layers.{i}", f"blocks.{i}"
        out[f"{ours}.attn_norm.scale"] = take(f"{hf}.input_layernorm.weight", (d,))
        out[f"{ours}.ffn_norm.scale"] = take(f"{hf}.post_attention_layernorm.weight", (d,))
        for name, width in (("q", h * hd), ("k", kv * hd), ("v", kv * hd)):
            out[f"{ours}.attn.{name}.kernel"] = take(f"{hf}.self_attn.{name}_proj.weight", (width, d), transpose=True)
            if m["qkv_bias"]:
                out[f"{ours}.attn.{name}.bias"] = take(f"{hf}.self_attn.{name}_proj.bias", (width,))
        out[f"{ours}.attn.o.kernel"] = take(f"{hf}.self_attn.o_proj.weight", (d, h * hd), transpose=True)
        if m["out_bias"]:
            out[f"{ours}.attn.o.bias"] = take(f"{hf}.self_attn.o_proj.bias", (d,))
        if m["qk_norm"]:
            out[f"{ours}.attn.q_norm.scale"] = take(f"{hf}.self_attn.q_norm.weight", (hd,))
            out[f"{ours}.attn.k_norm.scale"] = take(f"{hf}.self_attn.k_norm.weight", (hd,))
        if MoEConfig(**moe).is_moe_layer(i):
            mixtral = f"{hf}.block_sparse_moe.gate.weight" in tensors
            out.update(_experts(take, hf, f"{ours}.ffn", d, moe, mixtral=mixtral))
        else:
            for name in ("gate", "up"):
                out[f"{ours}.ffn.{name}.kernel"] = take(f"{hf}.mlp.{name}_proj.weight", (m["d_ff"], d), transpose=True)
            out[f"{ours}.ffn.down.kernel"] = take(f"{hf}.mlp.down_proj.weight", (d, m["d_ff"]), transpose=True)
    unused = sorted(set(tensors) - used)
    if unused:
        raise HFWeightsError(
            f"{source}: {len(unused)} tensors map to no parameter of the model its config.json describes, e.g. "
            f"{unused[:3]}"
        )
    return out


def _experts(take, hf: str, ours: str, d: int, moe: Mapping[str, Any], *, mixtral: bool) -> dict[str, np.ndarray]:
    """A MoE layer's router and stacked SwiGLU experts (Mixtral: block_sparse_moe, w1 gate / w3 up / w2 down;
    Qwen3-MoE: mlp, gate_proj / up_proj / down_proj)."""
    e, size = moe["num_experts"], moe["expert_size"]
    prefix, names = (
        (f"{hf}.block_sparse_moe", ("w1", "w3", "w2"))
        if mixtral
        else (f"{hf}.mlp", ("gate_proj", "up_proj", "down_proj"))
    )
    gate, up, down = names
    return {
        f"{ours}.router": take(f"{prefix}.gate.weight", (e, d), transpose=True),
        f"{ours}.gate": np.stack([take(f"{prefix}.experts.{j}.{gate}.weight", (size, d)).T for j in range(e)]),
        f"{ours}.up": np.stack([take(f"{prefix}.experts.{j}.{up}.weight", (size, d)).T for j in range(e)]),
        f"{ours}.down": np.stack([take(f"{prefix}.experts.{j}.{down}.weight", (d, size)).T for j in range(e)]),
    }
