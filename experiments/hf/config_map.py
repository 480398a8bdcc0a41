"""A Hugging Face config.json -> our `model` and `moe` config sections, refusing what we cannot honour.

    sections = config_map.from_hf(json.load(open("config.json")), source="ckpt/config.json")
    # {"model": {...}, "moe": {...}}: set these on a default config (experiments.build.default_config())

Every key of the file is accounted for: mapped to one of ours, checked to hold the only value we implement (e.g.
`hidden_act` "silu", `attention_dropout` 0), or known to describe nothing the forward pass depends on (token ids,
initialiser, dtype, cache flags). Any other key, or a value we do not implement, raises `HFConfigError` naming the
file, the key and its value, before any weight is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ARCHITECTURES", "HFConfigError", "from_hf"]

ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)

# Keys that change nothing in the forward pass (token ids, bookkeeping, initialisation, training-only knobs).
_IRRELEVANT = frozenset(
    {
        "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "bos_token_id",
        "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "max_position_embeddings",
        "output_router_logits", "router_aux_loss_coef", "pretraining_tp", "max_window_layers",
        "tokenizer_class", "return_dict", "output_hidden_states", "output_attentions", "layer_types",
    }
)  # fmt: skip


class HFConfigError(ValueError):
    """A config.json field we cannot honour; the message names the file, the field and its value."""


def from_hf(hf: Mapping[str, Any], *, source: str) -> dict[str, dict[str, Any]]:
    """Our `model` and `moe` sections for the checkpoint whose config.json is `hf` (`source` names the file in
    errors). Raises HFConfigError for an unsupported architecture, an unknown field or an unsupported value."""

    def fail(key: str, why: str) -> HFConfigError:
        return HFConfigError(f"{source}: {key} = {hf.get(key)!r}: {why}")

    arch = (hf.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise fail("architectures", f"supported: {', '.join(ARCHITECTURES)}")
    heads = hf["num_attention_heads"]
    model: dict[str, Any] = {
        "vocab_size": hf["vocab_size"],
        "d_model": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "d_ff": hf["intermediate_size"],
        "mlp": "swiglu",
        "norm": "rmsnorm",
        "norm_eps": hf["rms_norm_eps"],
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
        "out_bias": arch != "Qwen2ForCausalLM" and bool(hf.get("attention_bias", False)),
        "qk_norm": arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
    }
    used = {
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
        "rope_theta", "rope_scaling", "rope_parameters",  # read by _rope
    }  # fmt: skip
    checks: dict[str, tuple[Callable[[Any], bool], str]] = {
        "hidden_act": (lambda v: v == "silu", "only 'silu' (SwiGLU) is implemented"),
        "attention_dropout": (lambda v: not v, "dropout is not implemented; use 0.0"),
        "mlp_bias": (lambda v: not v, "MLP biases are not implemented"),
        "sliding_window": (lambda v: v is None or not hf.get("use_sliding_window", True), "no sliding window"),
        "use_sliding_window": (lambda v: not v, "sliding-window attention is not implemented"),
        "router_jitter_noise": (lambda v: not v, "router jitter is not implemented; use 0.0"),
    }
    moe: dict[str, Any] = {"every": 0}
    if arch == "MixtralForCausalLM":
        moe = {
            "every": 1,
            "num_experts": hf["num_local_experts"],
            "top_k": hf["num_experts_per_tok"],
            "expert_size": hf["intermediate_size"],
            "router": "softmax",
            "normalize_gates": True,
            "expert_mlp": "swiglu",
        }
        used |= {"num_local_experts", "num_experts_per_tok"}
    elif arch == "Qwen3MoeForCausalLM":
        step, dense = hf.get("decoder_sparse_step", 1), sorted(hf.get("mlp_only_layers") or [])
        moe = {
            "every": step,
            "num_experts": hf.get("num_experts") or hf["num_local_experts"],  # transformers 5 writes the latter
            "top_k": hf["num_experts_per_tok"],
            "expert_size": hf["moe_intermediate_size"],
            "router": "softmax",
            "normalize_gates": bool(hf.get("norm_topk_prob", False)),
            "expert_mlp": "swiglu",
            "dense_layers": tuple(dense),
        }
        used |= {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"}
        used |= {"decoder_sparse_step", "mlp_only_layers"}
    if moe["every"]:
        moe.update(load_balance_weight=float(hf.get("router_aux_loss_coef", 0.0)), z_loss_weight=0.0)
    model.update(_rope(hf, fail))
    for key, value in hf.items():
        if key in used or key in _IRRELEVANT:
            continue
        if key not in checks:
            raise fail(key, "a field this importer does not know; it may change the model, so it is refused")
        ok, why = checks[key]
        if not ok(value):
            raise fail(key, why)
    return {"model": model, "moe": moe}


def _rope(hf: Mapping[str, Any], fail: Callable[[str, str], HFConfigError]) -> dict[str, Any]:
    """rope_theta and the scaling, from transformers 5's `rope_parameters` or the older `rope_theta` +
    `rope_scaling`."""
    key = "rope_parameters" if "rope_parameters" in hf else "rope_scaling"
    params = dict(hf.get(key) or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10_000.0))
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind == "default":
        if params:
            raise fail(key, f"unexpected entries {sorted(params)} for rope_type 'default'")
        return {"rope_theta": float(theta), "rope_scaling": "none"}
    if kind != "llama3":
        raise fail(key, f"rope_type {kind!r} is not implemented; supported: 'default', 'llama3'")
    expected = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    if set(params) != expected:
        raise fail(key, f"rope_type 'llama3' needs exactly {sorted(expected)}")
    return {
        "rope_theta": float(theta),
        "rope_scaling": "llama3",
        "rope_factor": float(params["factor"]),
        "rope_low_freq_factor": float(params["low_freq_factor"]),
        "rope_high_freq_factor": float(params["high_freq_factor"]),
        "rope_original_max_len": int(params["original_max_position_embeddings"]),
    }
