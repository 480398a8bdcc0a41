"""The Hugging Face architectures we map, one declarative entry each, read by both directions.

    arch = arch.get("Qwen3ForCausalLM")       # or arch.choose(values) for export: the entry a config fits
    arch.keys                                 # config.json key <-> our config key ("section.key")
    arch.fixed                                # our keys the architecture fixes (import sets them, export requires)
    arch.experts                              # the MoE block's tensor names (None: a dense architecture)

Import (`config_map.from_hf`) reads every `Key` of the entry from config.json and sets the `fixed` values; export
(`export.hf_config`) chooses the entry a config fits (`choose`), refuses by name what its `fixed` values do not
allow, and writes every `Key` back. The tensors (`weights.layout`) are the shared per-layer table below (`LAYER`,
`DENSE_MLP`, the embedding, final norm and head) and the entry's `experts` names. Adding an architecture is adding
an entry to `ARCHITECTURES`; export prefers a later entry where a config fits two.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from core.config import TransformerConfig

__all__ = [
    "ARCHITECTURES",
    "COMMON_FIXED",
    "DENSE_MLP",
    "EXPECTED",
    "LAYER",
    "MLP_EXPERTS",
    "MOE_FIXED",
    "REQUIRED",
    "TOP",
    "Architecture",
    "ExpertNames",
    "Fixed",
    "Key",
    "Tensor",
    "choose",
    "get",
    "rope_from_hf",
    "rope_to_hf",
]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()
"""A `Key`'s default when config.json must hold the key."""


@dataclasses.dataclass(frozen=True)
class Key:
    """config.json key `hf` <-> our config key `ours` ("section.key"). Import reads `hf` (or the first of `aliases`
    present; a key absent or null takes `default`, a value or a function of the whole config.json; no default:
    required) through `read`, and sets `ours` and every key of `also` to it. Export writes `write(ours's value)`
    under `hf` (unless not `written`: a key of ours the architecture does not use, set on import only), and refuses
    a config whose `also` keys differ from `ours` (one config.json key cannot hold two values)."""

    hf: str
    ours: str
    default: Any = REQUIRED
    aliases: tuple[str, ...] = ()
    also: tuple[str, ...] = ()
    read: Callable[[Any], Any] = lambda v: v
    write: Callable[[Any], Any] = lambda v: v
    written: bool = True


@dataclasses.dataclass(frozen=True)
class Fixed:
    """Our key `ours` ("section.key") holds `value` in every checkpoint of the architecture: import sets it, export
    refuses any other value, saying `why`."""

    ours: str
    value: Any
    why: str


@dataclasses.dataclass(frozen=True)
class ExpertNames:
    """How a MoE layer's tensors are named under `model.layers.{i}.{block}`: the router `{router}.weight` [E, d] and
    expert j's projections `experts.{j}.{gate|up|down}.weight` (PyTorch's [out, in])."""

    block: str
    router: str
    gate: str
    up: str
    down: str


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One Hugging Face architecture (`architectures[0]` of its config.json, and its `model_type`).

    `moe`: a MoE architecture (our moe.every > 0) or a dense one (moe.every = 0). `chosen_by`: the `fixed` keys
    that make export pick this entry (the last of its kind in `ARCHITECTURES` they fit; none: the kind's fallback);
    its other `fixed` values are then required, in order. `keys`: beyond `COMMON_KEYS`; `experts`: the MoE block's
    tensor names; `exported`: False for an entry only imported (Mistral, whose every checkpoint is also a Llama
    one: export writes Llama)."""

    name: str
    model_type: str
    moe: bool
    keys: tuple[Key, ...]
    fixed: tuple[Fixed, ...]
    chosen_by: tuple[str, ...] = ()
    experts: ExpertNames | None = None
    exported: bool = True  # False: import only (export writes an equivalent entry's architecture instead)

    def all_keys(self) -> tuple[Key, ...]:
        return (*COMMON_KEYS, *self.keys)


def _tuple(v: Any) -> tuple:
    return tuple(sorted(v or ()))


COMMON_KEYS = (
    Key("vocab_size", "model.vocab_size"),
    Key("hidden_size", "model.d_model"),
    Key("num_hidden_layers", "model.num_layers"),
    Key("num_attention_heads", "model.num_heads"),
    Key("num_key_value_heads", "model.num_kv_heads", default=lambda hf: hf["num_attention_heads"]),
    Key("head_dim", "model.head_dim", default=lambda hf: hf["hidden_size"] // hf["num_attention_heads"]),
    Key("rms_norm_eps", "model.norm_eps"),
    Key("tie_word_embeddings", "model.tie_embeddings", default=False, read=bool),
)
"""The config.json keys every architecture here shares."""

COMMON_FIXED = (
    Fixed("model.norm", "rmsnorm", "only RMSNorm maps"),
    Fixed("model.peri_ln", False, "Peri-LN output norms do not map"),
)
"""What every architecture here fixes (the MLP form: `DENSE_FIXED`, the experts' form: `MOE_FIXED`)."""

DENSE_FIXED = Fixed("model.mlp", "swiglu", "only SwiGLU MLPs map")
"""Every architecture's dense MLP; required by export where a layer is dense (moe.every != 1 or dense_layers)."""

MOE_FIXED = (
    Fixed("moe.router", "softmax", "only a softmax router maps"),
    Fixed("moe.expert_mlp", "swiglu", "only SwiGLU experts map"),
)
"""What every MoE architecture here fixes (checked by export before the architecture is chosen)."""

MOE_KNOBS = {"moe.z_loss_weight": 0.0}
"""Training knobs a MoE checkpoint does not carry: import sets them (the config may override); export ignores them."""

EXPECTED: Mapping[str, tuple[Callable[[Any, Mapping[str, Any]], bool], str]] = {
    "hidden_act": (lambda v, hf: v == "silu", "only 'silu' (SwiGLU) is implemented"),
    "attention_dropout": (lambda v, hf: not v, "dropout is not implemented; use 0.0"),
    "mlp_bias": (lambda v, hf: not v, "MLP biases are not implemented"),
    "sliding_window": (lambda v, hf: v is None or not hf.get("use_sliding_window", True), "no sliding window"),
    "use_sliding_window": (lambda v, hf: not v, "sliding-window attention is not implemented"),
    "router_jitter_noise": (lambda v, hf: not v, "router jitter is not implemented; use 0.0"),
    "clip_qkv": (lambda v, hf: v is None, "clipping q/k/v is not implemented; use null"),
}
"""config.json keys that must hold the one value we implement: (check(value, config.json), why not)."""

WRITTEN = {"hidden_act": "silu", "attention_dropout": 0.0}
"""What export writes for the `EXPECTED` keys transformers' configs carry."""

IRRELEVANT = frozenset(
    {
        "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "bos_token_id",
        "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "max_position_embeddings",
        "output_router_logits", "router_aux_loss_coef", "pretraining_tp", "max_window_layers",
        "tokenizer_class", "return_dict", "output_hidden_states", "output_attentions", "layer_types",
    }
)  # fmt: skip
"""config.json keys that change nothing in the forward pass (token ids, bookkeeping, initialisation, training-only
knobs): import ignores them."""

ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")
"""The config.json keys `rope_from_hf` reads and `rope_to_hf` writes (as `rope_parameters`)."""

_BIAS = Key("attention_bias", "model.qkv_bias", default=False, also=("model.out_bias",), read=bool)
_D_FF = Key("intermediate_size", "model.d_ff")
_AUX = Key("router_aux_loss_coef", "moe.load_balance_weight", default=0.0, read=float)
_PER_HEAD = Fixed("model.qk_norm_over", "head", "Qwen3's q/k norm is per head (over the projections: OLMoE)")
_NO_SHARED = (
    Fixed("moe.shared_expert_size", 0, "a shared expert maps only to Qwen2-MoE (with its sigmoid gate)"),
    Fixed("moe.shared_expert_gate", False, "a shared expert's gate maps only to Qwen2-MoE"),
)
SHARED_EXPERT = "shared_expert"
"""The shared expert's module under the MoE block (Qwen2-MoE's; its sigmoid gate is `shared_expert_gate`), named
like the dense MLP inside."""
MLP_EXPERTS = ExpertNames(block="mlp", router="gate", gate="gate_proj", up="up_proj", down="down_proj")
"""Experts named like the dense MLP (Qwen3-MoE's): the default where a checkpoint's tensor names do not say."""

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        "LlamaForCausalLM",
        "llama",
        moe=False,
        keys=(_D_FF, _BIAS),
        fixed=(Fixed("model.qk_norm", False, "LlamaForCausalLM has no q/k norm"),),
    ),
    Architecture(
        "Qwen2ForCausalLM",
        "qwen2",
        moe=False,
        keys=(_D_FF,),
        fixed=(
            Fixed("model.qkv_bias", True, "Qwen2 has q/k/v biases"),
            Fixed("model.out_bias", False, "Qwen2 has no output bias"),
            Fixed("model.qk_norm", False, "Qwen2ForCausalLM has no q/k norm"),
        ),
        chosen_by=("model.qkv_bias", "model.out_bias"),
    ),
    Architecture(
        "Qwen3ForCausalLM",
        "qwen3",
        moe=False,
        keys=(_D_FF, _BIAS),
        fixed=(Fixed("model.qk_norm", True, "Qwen3 has q/k norm"), _PER_HEAD),
        chosen_by=("model.qk_norm",),
    ),
    Architecture(
        "MistralForCausalLM",
        "mistral",
        moe=False,
        keys=(_D_FF,),
        fixed=(
            Fixed("model.qk_norm", False, "MistralForCausalLM has no q/k norm"),
            Fixed("model.qkv_bias", False, "MistralForCausalLM has no attention biases"),
            Fixed("model.out_bias", False, "MistralForCausalLM has no attention biases"),
        ),
        exported=False,
    ),
    Architecture(
        "MixtralForCausalLM",
        "mixtral",
        moe=True,
        keys=(
            _AUX,
            Key("num_local_experts", "moe.num_experts"),
            Key("num_experts_per_tok", "moe.top_k"),
            Key("intermediate_size", "moe.expert_size"),
            Key("intermediate_size", "model.d_ff", written=False),  # no Mixtral layer is dense
        ),
        fixed=(
            Fixed("moe.every", 1, "Mixtral has experts in every layer"),
            Fixed("moe.dense_layers", (), "Mixtral has no dense layers"),
            Fixed("moe.normalize_gates", True, "Mixtral renormalises the gates"),
            Fixed("model.qk_norm", False, "MixtralForCausalLM has no q/k norm"),
            Fixed("model.qkv_bias", False, "MixtralForCausalLM has no attention biases"),
            Fixed("model.out_bias", False, "MixtralForCausalLM has no attention biases"),
            *_NO_SHARED,
        ),
        experts=ExpertNames(block="block_sparse_moe", router="gate", gate="w1", up="w3", down="w2"),
    ),
    Architecture(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        moe=True,
        keys=(
            _D_FF,
            _BIAS,
            _AUX,
            Key("num_experts", "moe.num_experts", aliases=("num_local_experts",)),
            Key("num_experts_per_tok", "moe.top_k"),
            Key("moe_intermediate_size", "moe.expert_size"),
            Key("norm_topk_prob", "moe.normalize_gates", default=False, read=bool),
            Key("decoder_sparse_step", "moe.every", default=1),
            Key("mlp_only_layers", "moe.dense_layers", default=(), read=_tuple, write=list),
        ),
        fixed=(Fixed("model.qk_norm", True, "Qwen3-MoE has q/k norm"), _PER_HEAD, *_NO_SHARED),
        chosen_by=("model.qk_norm",),
        experts=MLP_EXPERTS,
    ),
    Architecture(
        "Qwen2MoeForCausalLM",
        "qwen2_moe",
        moe=True,
        keys=(
            _D_FF,
            _AUX,
            Key("qkv_bias", "model.qkv_bias", default=True, read=bool),
            Key("num_experts", "moe.num_experts"),
            Key("num_experts_per_tok", "moe.top_k"),
            Key("moe_intermediate_size", "moe.expert_size"),
            Key("shared_expert_intermediate_size", "moe.shared_expert_size"),
            Key("norm_topk_prob", "moe.normalize_gates", default=False, read=bool),
            Key("decoder_sparse_step", "moe.every", default=1),
            Key("mlp_only_layers", "moe.dense_layers", default=(), read=_tuple, write=list),
        ),
        fixed=(
            Fixed("moe.shared_expert_gate", True, "Qwen2-MoE gates its shared expert"),
            Fixed("model.out_bias", False, "Qwen2-MoE has no output bias"),
            Fixed("model.qk_norm", False, "Qwen2-MoE has no q/k norm"),
        ),
        chosen_by=("moe.shared_expert_gate",),
        experts=MLP_EXPERTS,
    ),
    Architecture(
        "OlmoeForCausalLM",
        "olmoe",
        moe=True,
        keys=(
            _BIAS,
            _AUX,
            Key("num_experts", "moe.num_experts"),
            Key("num_experts_per_tok", "moe.top_k"),
            Key("intermediate_size", "moe.expert_size"),
            Key("intermediate_size", "model.d_ff", written=False),  # no OLMoE layer is dense
            Key("norm_topk_prob", "moe.normalize_gates", default=False, read=bool),
        ),
        fixed=(
            Fixed("model.qk_norm", True, "OLMoE has q/k norm"),
            Fixed("model.qk_norm_over", "projection", "OLMoE's q/k norm is over the whole projections"),
            Fixed("moe.every", 1, "OLMoE has experts in every layer"),
            Fixed("moe.dense_layers", (), "OLMoE has no dense layers"),
            *_NO_SHARED,
        ),
        chosen_by=("model.qk_norm_over",),
        experts=MLP_EXPERTS,
    ),
)
"""Every architecture import and export support. Export prefers the later of two entries a config fits (the more
specific: Qwen3 over Llama, Qwen3-MoE over Mixtral)."""


def get(name: Any) -> Architecture | None:
    """The entry of `architectures[0]` = `name`, or None."""
    return next((a for a in ARCHITECTURES if a.name == name), None)


def choose(values: Mapping[str, Any]) -> Architecture:
    """The last entry of its kind (MoE when values["moe.every"] > 0) whose `chosen_by` keys hold its fixed values in
    `values` ({"section.key": value}); the first entry of each kind has no `chosen_by` and takes the rest."""
    kind = [a for a in ARCHITECTURES if a.moe == bool(values["moe.every"]) and a.exported]
    for a in reversed(kind):
        fixed = {f.ours: f.value for f in a.fixed}
        if all(values[key] == fixed[key] for key in a.chosen_by):
            return a
    raise AssertionError("unreachable: the first entry of each kind has no chosen_by")


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A checkpoint tensor `hf` (under its prefix) <-> our parameter path `ours`: its shape in the checkpoint as a
    function of the `model` section, whether ours is its transpose (PyTorch's Linear stores [out, in]), and whether
    the model has it."""

    hf: str
    ours: str
    shape: Callable[[TransformerConfig], tuple[int, ...]]
    transpose: bool = False
    present: Callable[[TransformerConfig], bool] = lambda m: True


def _qkv(name: str, heads: str) -> tuple[Tensor, Tensor]:
    """The `name` projection (q, k or v) of `heads` heads: its kernel and its bias (with `model.qkv_bias`)."""

    def width(m: TransformerConfig) -> int:
        return getattr(m, heads) * m.head_dim

    return (
        Tensor(f"self_attn.{name}_proj.weight", f"attn.{name}.kernel", lambda m: (width(m), m.d_model), True),
        Tensor(f"self_attn.{name}_proj.bias", f"attn.{name}.bias", lambda m: (width(m),), present=lambda m: m.qkv_bias),
    )


def _has_qk_norm(m: TransformerConfig) -> bool:
    return m.qk_norm


def _qk_norm(m: TransformerConfig, heads: int) -> tuple[int]:
    """A q/k norm's scale: one per head dimension (Qwen3), or per channel of the `heads` heads' projection (OLMoE)."""
    return (heads * m.head_dim,) if m.qk_norm_over == "projection" else (m.head_dim,)


TOP = (
    Tensor("model.embed_tokens.weight", "embedding", lambda m: (m.vocab_size, m.d_model)),
    Tensor("model.norm.weight", "final_norm.scale", lambda m: (m.d_model,)),
    Tensor("lm_head.weight", "head.kernel", lambda m: (m.vocab_size, m.d_model), True, lambda m: not m.tie_embeddings),
)
"""The tensors outside the layers."""

LAYER = (
    Tensor("input_layernorm.weight", "attn_norm.scale", lambda m: (m.d_model,)),
    Tensor("post_attention_layernorm.weight", "ffn_norm.scale", lambda m: (m.d_model,)),
    *(
        t
        for name, heads in (("q", "num_heads"), ("k", "num_kv_heads"), ("v", "num_kv_heads"))
        for t in _qkv(name, heads)
    ),
    Tensor("self_attn.o_proj.weight", "attn.o.kernel", lambda m: (m.d_model, m.num_heads * m.head_dim), True),
    Tensor("self_attn.o_proj.bias", "attn.o.bias", lambda m: (m.d_model,), present=lambda m: m.out_bias),
    Tensor("self_attn.q_norm.weight", "attn.q_norm.scale", lambda m: _qk_norm(m, m.num_heads), present=_has_qk_norm),
    Tensor("self_attn.k_norm.weight", "attn.k_norm.scale", lambda m: _qk_norm(m, m.num_kv_heads), present=_has_qk_norm),
)
"""Every layer's tensors under `model.layers.{i}` <-> ours under `blocks.{i}`, but the FFN's."""

DENSE_MLP = (
    Tensor("mlp.gate_proj.weight", "ffn.gate.kernel", lambda m: (m.d_ff, m.d_model), True),
    Tensor("mlp.up_proj.weight", "ffn.up.kernel", lambda m: (m.d_ff, m.d_model), True),
    Tensor("mlp.down_proj.weight", "ffn.down.kernel", lambda m: (m.d_model, m.d_ff), True),
)
"""A dense layer's FFN (SwiGLU) under `model.layers.{i}` <-> ours under `blocks.{i}`."""


def rope_from_hf(hf: Mapping[str, Any], fail: Callable[[str, str], Exception]) -> dict[str, Any]:
    """Our `model.rope_*` keys from transformers 5's `rope_parameters` or the older `rope_theta` + `rope_scaling`
    (`rope_type` 'default' or 'llama3'); raises `fail(key, why)` for anything else."""
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


def rope_to_hf(model: Mapping[str, Any]) -> dict[str, Any]:
    """transformers 5's `rope_parameters` of our `model` section (the inverse of `rope_from_hf`)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": model["rope_theta"]}
    if model["rope_scaling"] == "llama3":
        rope.update(
            rope_type="llama3",
            factor=model["rope_factor"],
            low_freq_factor=model["rope_low_freq_factor"],
            high_freq_factor=model["rope_high_freq_factor"],
            original_max_position_embeddings=model["rope_original_max_len"],
        )
    return rope
