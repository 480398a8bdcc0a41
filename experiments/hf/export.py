"""Our model -> a Hugging Face checkpoint directory (config.json + safetensors), where it fits an architecture.

    export.save(config, model, "out/")   # config.json, model.safetensors (or shards + index past `max_shard_bytes`)

The architecture is chosen from the config: a dense model is Qwen3 with q/k norm, Qwen2 with q/k/v biases but no
output bias, else Llama; a MoE model is Qwen3-MoE with q/k norm, else Mixtral. What no architecture can express (a
sigmoid router, LayerNorm, Peri-LN, SiLU-only MLPs or experts, a shared expert, ...) raises `HFExportError` naming
the config key and its value, before anything is written. Tensors are mapped by `weights.layout`, the table the
importer reads, so import(export(model)) is the model.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import ml_collections
import numpy as np
from flax import nnx

from core import config as config_lib
from core import workdir as workdir_lib
from experiments import build
from experiments.hf import weights
from moe.config import MoEConfig

__all__ = ["HFExportError", "hf_config", "save"]


class HFExportError(ValueError):
    """The model has a feature no supported Hugging Face architecture expresses; the message names the key."""


def hf_config(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The config.json of `config`'s model (transformers 5's layout; `rope_parameters` holds theta and scaling)."""
    m, moe = config.model, config.moe

    def refuse(key: str, value: Any, why: str) -> HFExportError:
        return HFExportError(f"config key '{key}' = {value!r}: {why}; no supported Hugging Face architecture has it")

    for key, value, ok, why in (
        ("model.norm", m.norm, m.norm == "rmsnorm", "only RMSNorm maps"),
        ("model.mlp", m.mlp, m.mlp == "swiglu" or moe.every == 1, "only SwiGLU MLPs map"),
        ("model.peri_ln", m.peri_ln, not m.peri_ln, "Peri-LN output norms do not map"),
        (
            "fomoe.routing",
            config.fomoe.routing,
            not (config.mesh.site > 1 and moe.every and config.fomoe.routing == "skip_token"),
            "a skip-token site routes over experts it does not hold",
        ),
    ):
        if not ok:
            raise refuse(key, value, why)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "llama3":
        rope.update(
            rope_type="llama3",
            factor=m.rope_factor,
            low_freq_factor=m.rope_low_freq_factor,
            high_freq_factor=m.rope_high_freq_factor,
            original_max_position_embeddings=m.rope_original_max_len,
        )
    out: dict[str, Any] = {
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": build.model_config(config).head_dim,  # resolved: 0 in the config means d_model / num_heads
        "intermediate_size": m.d_ff,
        "hidden_act": "silu",
        "rms_norm_eps": m.norm_eps,
        "rope_parameters": rope,
        "tie_word_embeddings": m.tie_embeddings,
        "attention_dropout": 0.0,
        "dtype": m.param_dtype,
    }
    if moe.every:
        for key, value, ok, why in (
            ("moe.router", moe.router, moe.router == "softmax", "only a softmax router maps"),
            ("moe.expert_mlp", moe.expert_mlp, moe.expert_mlp == "swiglu", "only SwiGLU experts map"),
            ("moe.shared_expert_size", moe.shared_expert_size, moe.shared_expert_size == 0, "no shared expert maps"),
        ):
            if not ok:
                raise refuse(key, value, why)
        out["router_aux_loss_coef"] = moe.load_balance_weight
        if m.qk_norm:
            arch = "Qwen3MoeForCausalLM"
            out.update(
                num_experts=moe.num_experts,
                num_experts_per_tok=moe.top_k,
                moe_intermediate_size=moe.expert_size,
                norm_topk_prob=moe.normalize_gates,
                decoder_sparse_step=moe.every,
                mlp_only_layers=list(moe.dense_layers),
                attention_bias=m.qkv_bias,
            )
        else:
            arch = "MixtralForCausalLM"
            for key, value, ok, why in (
                ("moe.every", moe.every, moe.every == 1, "Mixtral has experts in every layer"),
                ("moe.dense_layers", moe.dense_layers, not moe.dense_layers, "Mixtral has no dense layers"),
                ("moe.normalize_gates", moe.normalize_gates, moe.normalize_gates, "Mixtral renormalises the gates"),
            ):
                if not ok:
                    raise refuse(key, value, why)
            out.update(
                num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k, intermediate_size=moe.expert_size
            )
    elif m.qk_norm:
        arch = "Qwen3ForCausalLM"
        out["attention_bias"] = m.qkv_bias
    elif m.qkv_bias and not m.out_bias:
        arch = "Qwen2ForCausalLM"
    else:
        arch = "LlamaForCausalLM"
        out["attention_bias"] = m.qkv_bias
    if arch != "Qwen2ForCausalLM" and m.qkv_bias != m.out_bias:
        raise refuse(
            "model.out_bias", m.out_bias, f"{arch} has biases on all of q, k, v, o or none (qkv_bias = {m.qkv_bias})"
        )
    if arch in ("Qwen2ForCausalLM", "MixtralForCausalLM") and m.qk_norm:
        raise refuse("model.qk_norm", m.qk_norm, f"{arch} has no q/k norm")
    return {"architectures": [arch], "model_type": _MODEL_TYPES[arch], **out}


_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def save(
    config: ml_collections.ConfigDict, model: nnx.Module, out_dir: str, *, max_shard_bytes: int = 5 * 2**30
) -> list[str]:
    """Writes `model` (a core.model.Transformer built from `config`) to `out_dir` as a Hugging Face checkpoint:
    config.json and model.safetensors, or shards model-0000i-of-0000n.safetensors with model.safetensors.index.json
    when the tensors exceed `max_shard_bytes`, and the run's tokenizer (`data.tokenizer`, the byte tokenizer
    included) as tokenizer.json + tokenizer_config.json (core.tokenizer: transformers' AutoTokenizer loads them).
    config.json carries the tokenizer's BOS / EOS / PAD ids, so that transformers' generate stops at our EOS.
    Returns the files written. Raises HFExportError first if the model maps to no supported architecture, and
    core.tokenizer.TokenizerError if the run's tokenizer cannot be loaded (both before anything is written)."""
    from safetensors.numpy import save_file

    from core import tokenizer as tokenizer_lib

    tok = build.build_tokenizer(config)
    hf = {**hf_config(config), "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    params = {
        ".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    moe = config_lib.from_config(MoEConfig, config.moe)
    mixtral = hf["architectures"][0] == "MixtralForCausalLM"
    tensors = weights.from_ours(params, build.model_config(config), moe, mixtral=mixtral)
    os.makedirs(out_dir, exist_ok=True)
    shards = _shards(tensors, max_shard_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
    written = [os.path.join(out_dir, n) for n in names]
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(x.nbytes for x in tensors.values())},
            "weight_map": {t: n for n, shard in zip(names, shards) for t in shard},
        }
        written.append(os.path.join(out_dir, "model.safetensors.index.json"))
        workdir_lib.write_json(written[-1], index)
    written.append(os.path.join(out_dir, "config.json"))
    workdir_lib.write_json(written[-1], hf)
    tok.save(out_dir)
    written += [os.path.join(out_dir, name) for name in (tokenizer_lib.TOKENIZER_FILE, tokenizer_lib.CONFIG_FILE)]
    return written


def _shards(tensors: Mapping[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
    """The tensors in order, cut into groups of at most `max_bytes` (a larger tensor gets a group of its own)."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, x in tensors.items():
        if shards[-1] and size + x.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = x
        size += x.nbytes
    return shards
