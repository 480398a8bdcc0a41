"""KV capacity planner: how many tokens of KV cache a memory budget holds, per format, and the concurrency it gives.

Only full-attention layers keep keys and values for every token of the context (sliding-window and linear-attention
layers do not grow with it), so a model with L such layers, K KV heads and head dim D costs, per token,

    b = L * fmt.bytes_per_token(K, D)  bytes        bf16: 4 L K D;  fp8: L K (2 D + 8);  fp4: L K (D + D / 16)

A paged pool of M bytes with blocks of B tokens holds whole blocks only, and n tokens need whole blocks:

    block_bytes    = B b                             bytes of one block over all layers (the one place this is
                                                     computed: kvcache.paged and kvcache.serving.simulate call it)
    num_blocks(M)  = floor(M / (B b))                blocks
    pool_tokens(M) = num_blocks(M) * B               tokens
    memory_for(n)  = ceil(n / B) * B b               bytes, so pool_tokens(memory_for(n)) >= n

vLLM reports concurrency = pool_tokens / max_model_len: how many requests of the full context length fit at once.

The spec's check (kvcache.md, the RDNA4 long-context report): 10 full-attention layers, 2 KV heads, head dim 256 give
20 KiB of bf16 KV per token, and 262,144 tokens x ~2.9 concurrency ~ 14.5 GiB of KV (`SPEC_MODEL`,
`SPEC_BUDGET_BYTES`). fp4 (UltraQuant) stores 136 B per token, head and layer at D = 128 against bf16's 512 B: 3.76x
the tokens in the same memory.

    from kvcache import capacity
    rows = capacity.plan(capacity.SPEC_BUDGET_BYTES, capacity.SPEC_MODEL)   # every registered format
    print(capacity.markdown(rows, title="KV capacity", memory_bytes=capacity.SPEC_BUDGET_BYTES,
                            shape=capacity.SPEC_MODEL, max_model_len=capacity.SPEC_MAX_MODEL_LEN))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from kvcache import formats as kv_formats

__all__ = [
    "SPEC_BUDGET_BYTES",
    "SPEC_MAX_MODEL_LEN",
    "SPEC_MODEL",
    "ModelShape",
    "block_bytes",
    "concurrency",
    "kv_bytes_per_token",
    "markdown",
    "memory_for",
    "num_blocks",
    "plan",
    "pool_tokens",
]

GIB = 2**30


def _int(name: str, value, *, low: int) -> int:
    """value as an int >= low, or a ValueError naming the argument, the value and the rule."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} = {value!r}; must be an int >= {low}")
    return int(value)


def _format(fmt: kv_formats.Format | str) -> kv_formats.Format:
    if isinstance(fmt, kv_formats.Format):
        return fmt
    if not isinstance(fmt, str) or fmt not in kv_formats.REGISTRY:
        raise ValueError(
            f"fmt = {fmt!r} unknown; allowed: a kvcache.formats.Format or one of {list(kv_formats.REGISTRY)}"
        )
    return kv_formats.get(fmt)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the KV cache of a model depends on.

    Attributes:
      full_attention_layers: layers that keep K and V for every token of the context.
      num_kv_heads: key/value heads per layer (K).
      head_dim: dimension of one head (D).
    """

    full_attention_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self):
        for field in dataclasses.fields(self):
            _int(field.name, getattr(self, field.name), low=1)


SPEC_MODEL = ModelShape(full_attention_layers=10, num_kv_heads=2, head_dim=256)
"""The spec's model (Qwen3.6-35B-A3B in the RDNA4 report): 10 full-attention layers, 2 KV heads, head dim 256."""

SPEC_MAX_MODEL_LEN = 262_144
"""The spec's max_model_len: the model's native 262K context, in tokens."""

SPEC_BUDGET_BYTES = SPEC_MAX_MODEL_LEN * 20 * 1024 * 29 // 10
"""The spec's KV budget in bytes: 262,144 tokens (max_model_len) x 2.9 (the concurrency vLLM reported) x 20 KiB
(20,480 B, the bf16 KV of one token of `SPEC_MODEL`), computed in integers and rounded down:
262,144 x 20,480 x 29 // 10 = 15,569,256,448 B = 14.5 GiB exactly."""


def kv_bytes_per_token(shape: ModelShape, fmt: kv_formats.Format | str) -> int:
    """Bytes of KV cache one token occupies over all full-attention layers (keys, values and their scales):
    L * fmt.bytes_per_token(K, D). fmt is a `formats.Format` or a name ("bf16", "fp8", "fp4")."""
    return shape.full_attention_layers * _format(fmt).bytes_per_token(shape.num_kv_heads, shape.head_dim)


def block_bytes(shape: ModelShape, fmt: kv_formats.Format | str, *, block_size: int = 16) -> int:
    """Bytes of one paged-cache block of `block_size` tokens over all full-attention layers:
    block_size * `kv_bytes_per_token(shape, fmt)`."""
    return _int("block_size", block_size, low=1) * kv_bytes_per_token(shape, fmt)


def num_blocks(memory_bytes: int, shape: ModelShape, fmt: kv_formats.Format | str, *, block_size: int = 16) -> int:
    """Whole blocks a paged pool of `memory_bytes` bytes holds: floor(memory_bytes / `block_bytes(...)`)."""
    memory_bytes = _int("memory_bytes", memory_bytes, low=0)
    return memory_bytes // block_bytes(shape, fmt, block_size=block_size)


def pool_tokens(memory_bytes: int, shape: ModelShape, fmt: kv_formats.Format | str, *, block_size: int = 16) -> int:
    """Tokens a paged pool of `memory_bytes` bytes holds in whole blocks of `block_size` tokens:
    `num_blocks(...)` * block_size = floor(memory_bytes / (block_size * b)) * block_size, with
    b = `kv_bytes_per_token(shape, fmt)`."""
    return num_blocks(memory_bytes, shape, fmt, block_size=block_size) * _int("block_size", block_size, low=1)


def memory_for(tokens: int, shape: ModelShape, fmt: kv_formats.Format | str, *, block_size: int = 16) -> int:
    """Bytes a paged pool needs to hold `tokens` tokens in whole blocks of `block_size` tokens:
    ceil(tokens / block_size) * block_size * b, with b = `kv_bytes_per_token(shape, fmt)`."""
    tokens = _int("tokens", tokens, low=0)
    block_size = _int("block_size", block_size, low=1)
    return -(-tokens // block_size) * block_bytes(shape, fmt, block_size=block_size)


def concurrency(pool_tokens: int, max_model_len: int) -> float:
    """Requests of `max_model_len` tokens the pool holds at once, as vLLM reports it: pool_tokens / max_model_len
    (a ratio, not rounded down)."""
    pool_tokens = _int("pool_tokens", pool_tokens, low=0)
    return pool_tokens / _int("max_model_len", max_model_len, low=1)


def plan(
    memory_bytes: int,
    shape: ModelShape,
    formats: Sequence[kv_formats.Format | str] | None = None,
    *,
    max_model_len: int = SPEC_MAX_MODEL_LEN,
    block_size: int = 16,
) -> list[dict]:
    """One row per format (default: every registered format, `kvcache.formats.REGISTRY`) of what `memory_bytes`
    bytes of KV cache hold for a model of this shape.

    Each row: "format" (its label), "bytes_per_token" (B, all full-attention layers), "pool_tokens" (tokens in whole
    blocks), "concurrency" (pool_tokens / max_model_len) and "vs_bf16" (pool_tokens / bf16's pool tokens; nan if the
    budget holds no bf16 block).
    """
    formats = tuple(kv_formats.REGISTRY) if formats is None else formats
    if isinstance(formats, (str, kv_formats.Format)) or not formats:
        raise ValueError(
            f"formats = {formats!r}; must be a non-empty sequence of formats or names {list(kv_formats.REGISTRY)}"
        )
    _int("max_model_len", max_model_len, low=1)
    bf16_tokens = pool_tokens(memory_bytes, shape, "bf16", block_size=block_size)
    rows = []
    for fmt in map(_format, formats):
        tokens = pool_tokens(memory_bytes, shape, fmt, block_size=block_size)
        rows.append(
            {
                "format": fmt.label,
                "bytes_per_token": kv_bytes_per_token(shape, fmt),
                "pool_tokens": tokens,
                "concurrency": concurrency(tokens, max_model_len),
                "vs_bf16": tokens / bf16_tokens if bf16_tokens else math.nan,
            }
        )
    return rows


def markdown(rows: Sequence[dict], *, title: str, memory_bytes: int, shape: ModelShape, max_model_len: int) -> str:
    """`plan`'s rows as a markdown section: a heading, one line stating the budget and the model, then the table."""
    lines = [
        f"### {title}",
        "",
        f"KV budget {memory_bytes / GIB:.2f} GiB ({memory_bytes:,} B); {shape.full_attention_layers} "
        f"full-attention layers, {shape.num_kv_heads} KV heads, head dim {shape.head_dim}; "
        f"max_model_len {max_model_len:,} tokens.",
        "",
        "| format | KV bytes / token | pool tokens | concurrency | tokens vs bf16 |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['format']} | {r['bytes_per_token']:,} | {r['pool_tokens']:,} | {r['concurrency']:.2f}x "
        f"| {r['vs_bf16']:.2f}x |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"
