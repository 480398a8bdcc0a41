"""The `kvcache` section of an experiment config: the KV-cache format of cached generation, mapped onto the library's
`kvcache.formats.Format` (`make_format`, `with_format`) and checked against the model's heads (`check`), every
error naming the config key. The kvcache package itself takes a `Format` and reads no config."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from core.fields import Compat, ConfigError, field
from kvcache import formats
from kvcache.attention import IMPLEMENTATIONS

__all__ = ["KVCacheConfig", "check", "make_format", "with_format"]


@dataclasses.dataclass(frozen=True)
class KVCacheConfig:
    """The section `kvcache`: the KV-cache format of cached generation (inference only: not part of resume
    compatibility, a trained model may be sampled through any format)."""

    compat: ClassVar[Compat] = False

    format: str = field(
        "bf16",
        "KV-cache format of cached generation: bf16 (dense cache), fp8 (E4M3, per-token scale), fp4 "
        "(UltraQuant: 4-bit codes + UE8M0 per 32, rotated K), nvfp4 (E2M1 + E4M3 per 16) or k8v4 (fp8 keys, fp4 "
        "values); all but bf16 use the paged cache",
        choices=formats.NAMES,
    )
    grid: str = field("e2m1", "fp4, k8v4: the 4-bit grid (e2m1, or the uniform e1m2 / int4)", choices=formats.GRIDS)
    scale_rule: str = field(
        "mse",
        "fp4, k8v4: UE8M0 scale rule: mse = 2^round(log2(0.156 absmax)) for E2M1, mx = OCP "
        "2^(floor(log2 absmax) - floor(log2 grid max))",
        choices=formats.SCALE_RULES,
    )
    select: str = field(
        "max", "nvfp4: E4M3 scale selection: max (absmax / 6) or 4over6", choices=formats.E4M3_SELECTIONS
    )
    rotate_k: bool = field(True, "fp4: Hadamard-rotate K (and the query) over the head dim")
    fp8_query: bool = field(True, "fp4, nvfp4: round the (rotated) query to FP8 E4M3 before the score product")
    paged: bool = field(False, "use the paged cache for bf16 as well (the other formats always page)")
    block_size: int = field(16, "tokens per paged-cache block", low=1)
    implementation: str = field(
        "xla",
        "paged attention: xla (reference), xla_split (split-KV decode as an XLA loop: the fast CPU path), "
        "pallas_triton (alias pallas: the Triton kernels for GPUs), pallas_tpu (the Mosaic TPU kernels; both "
        "interpreted on CPU) or auto (by backend, falling back with a logged line when a kernel refuses)",
        choices=tuple(IMPLEMENTATIONS),
    )


_OPTION_KEYS = ("grid", "scale_rule", "select", "rotate_k", "fp8_query")


def make_format(kv: KVCacheConfig) -> formats.Format:
    """The format a `kvcache` section describes: `formats.get(kv.format)` with the section's keys that are options
    of that format (`formats.options`: grid, scale_rule, rotate_k and fp8_query for fp4; select and fp8_query for
    nvfp4; grid and scale_rule for k8v4). A key set away from its default for a format that does not take it is a
    ConfigError naming it (it would change nothing)."""
    allowed = formats.options(kv.format)
    defaults = KVCacheConfig()
    for name in _OPTION_KEYS:
        value = getattr(kv, name)
        if name not in allowed and value != getattr(defaults, name):
            takes = [f for f in formats.NAMES if name in formats.options(f)]
            raise ConfigError(
                f"config key 'kvcache.{name}' = {value!r} has no effect on kvcache.format = {kv.format!r}; "
                f"it applies to {takes}"
            )
    return formats.get(kv.format, **{name: getattr(kv, name) for name in allowed if hasattr(kv, name)})


def with_format(kv: KVCacheConfig, name: str) -> KVCacheConfig:
    """The section with format `name` and, of its option keys, those `name` does not take back at their defaults
    (a run's fp4 options do not stop it from being served through fp8)."""
    defaults, allowed = KVCacheConfig(), formats.options(name)
    reset = {key: getattr(defaults, key) for key in _OPTION_KEYS if key not in allowed}
    return dataclasses.replace(kv, format=name, **reset)


def check(kv: KVCacheConfig, head_dim: int) -> None:
    """Raises ConfigError if the format cannot store this model's heads."""
    try:
        make_format(kv).check_head_dim(head_dim)
    except ValueError as e:
        raise ConfigError(
            f"config key 'kvcache.format' = {kv.format!r} cannot cache this model: {e} (head_dim = "
            f"model.d_model / model.num_heads)"
        ) from None
