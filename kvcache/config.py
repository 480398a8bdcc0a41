"""The `kvcache` config section (merged by experiments/build.py): the KV-cache format of cached generation."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from core.config import Compat, ConfigError, field
from kvcache import formats
from kvcache.attention import IMPLEMENTATIONS

__all__ = ["KVCacheConfig", "check", "make_format"]


@dataclasses.dataclass(frozen=True)
class KVCacheConfig:
    """The section `kvcache`: the KV-cache format of cached generation (inference only: not part of resume
    compatibility, a trained model may be sampled through any format)."""

    compat: ClassVar[Compat] = False

    format: str = field(
        "bf16",
        "KV-cache format of cached generation: bf16 (dense cache), fp8 (E4M3, per-token scale) or fp4 "
        "(UltraQuant: E2M1 + UE8M0 per 32, rotated K); fp8/fp4 use the paged cache",
        choices=formats.NAMES,
    )
    scale_rule: str = field(
        "mse",
        "fp4 scale rule: mse = 2^round(log2(0.156 absmax)), mx = OCP 2^(floor(log2 absmax) - 2)",
        choices=formats.SCALE_RULES,
    )
    rotate_k: bool = field(True, "fp4: Hadamard-rotate K (and the query) over the head dim")
    fp8_query: bool = field(True, "fp4: round the rotated query to FP8 E4M3 before the score product")
    paged: bool = field(False, "use the paged cache for bf16 as well (fp8 and fp4 always page)")
    block_size: int = field(16, "tokens per paged-cache block", low=1)
    implementation: str = field(
        "xla",
        "paged attention: xla (reference), xla_split (split-KV decode as an XLA loop: the fast CPU path) or "
        "pallas (kernels; interpreted on CPU)",
        choices=tuple(IMPLEMENTATIONS),
    )


def make_format(kv: KVCacheConfig) -> formats.Format:
    """The format a `kvcache` section describes: `formats.get(kv.format)` with the section's keys that are options
    of that format (`formats.options`; scale_rule, rotate_k and fp8_query for fp4)."""
    taken = {name: getattr(kv, name) for name in formats.options(kv.format) if hasattr(kv, name)}
    return formats.get(kv.format, **taken)


def check(kv: KVCacheConfig, head_dim: int) -> None:
    """Raises ConfigError if the format cannot store this model's heads."""
    try:
        make_format(kv).check_head_dim(head_dim)
    except ValueError as e:
        raise ConfigError(
            f"config key 'kvcache.format' = {kv.format!r} cannot cache this model: {e} (head_dim = "
            f"model.d_model / model.num_heads)"
        ) from None
