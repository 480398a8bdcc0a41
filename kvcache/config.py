"""The `kvcache` config section (merged by experiments/build.py): the KV-cache format of cached generation."""

from __future__ import annotations

from core.config import ConfigError, Field
from kvcache import formats
from kvcache.attention import IMPLEMENTATIONS

__all__ = ["check", "make_format", "section"]


def section() -> dict[str, Field]:
    return {
        "format": Field(
            "bf16",
            (str,),
            "KV-cache format of cached generation: bf16 (dense cache), fp8 (E4M3, "
            "per-token scale) or fp4 (UltraQuant: E2M1 + UE8M0 per 32, rotated K); fp8/fp4 use the "
            "paged cache",
            choices=formats.NAMES,
        ),
        "scale_rule": Field(
            "mse",
            (str,),
            "fp4 scale rule: mse = 2^round(log2(0.156 absmax)), mx = OCP 2^(floor(log2 absmax) - 2)",
            choices=formats.SCALE_RULES,
        ),
        "rotate_k": Field(True, (bool,), "fp4: Hadamard-rotate K (and the query) over the head dim"),
        "fp8_query": Field(True, (bool,), "fp4: round the rotated query to FP8 E4M3 before the score product"),
        "paged": Field(False, (bool,), "use the paged cache for bf16 as well (fp8 and fp4 always page)"),
        "block_size": Field(16, (int,), "tokens per paged-cache block", low=1),
        "implementation": Field(
            "xla",
            (str,),
            "paged attention: xla (reference), xla_split (split-KV decode as an "
            "XLA loop: the fast CPU path) or pallas (kernels; interpreted on CPU)",
            choices=IMPLEMENTATIONS,
        ),
    }


def make_format(kv) -> formats.Format:
    """The format a `kvcache` config section describes."""
    if kv.format != "fp4":
        return formats.get(kv.format)
    return formats.get("fp4", scale_rule=kv.scale_rule, rotate_k=kv.rotate_k, fp8_query=kv.fp8_query)


def check(kv, head_dim: int) -> None:
    """Raises ConfigError if the format cannot store this model's heads."""
    try:
        make_format(kv).check_head_dim(head_dim)
    except ValueError as e:
        raise ConfigError(
            f"config key 'kvcache.format' = {kv.format!r} cannot cache this model: {e} (head_dim = "
            f"model.d_model / model.num_heads)"
        ) from None
