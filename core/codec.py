"""Block codecs for values that cross a slow link: what a federated round sends, quantised on the wire only
(docs/fomoe.md, "Low-bit synchronisation"; INTELLECT-1 arXiv 2412.01152, Streaming DiLoCo arXiv 2501.18512).

A `WireFormat` encodes float32 rows [n, C] (C a multiple of the block size G) into the arrays that travel and
decodes them back to float32:

  float32   the values themselves                                   4 bytes per value
  bf16      bfloat16 (round to nearest even, or stochastic)         2
  int8      codes -127..127 with one scale per block of G           1 + s / G
  fp4       OCP FP4 E2M1 codes (levels 0 .. 6), two per byte        0.5 + s / G
  int4      the uniform 4-bit grid 0 .. 7 (UFP4's E1M2 / INT4: the same grid up to a power of two), two per byte
  topk2     the `keep` largest magnitudes of each block of G (chunk), each a 16-bit word: its     (2 keep + 8) / G
            index in the chunk (14 bits, G <= 16384), its sign and one magnitude bit choosing
            between the chunk's two float32 levels lo (the keep-th largest magnitude) and hi
            (the largest); the other values are dropped (SparseLoCo arXiv 2508.15706's top-k
            with 2-bit values: error feedback carries what is dropped)

s is the scale's size: "fp32" (4 bytes, amax / q_max, so the block's largest magnitude maps to the grid's top level)
or "ue8m0" (1 byte, a power of two 2^e, the smallest with amax <= q_max 2^e: nothing saturates, and dividing by it is
exact). Rounding is "nearest" (ties to even) or "stochastic" (unbiased inside the grid's range: E[decode] = x; the
uniform draws are core.lowbit.uniform's, keyed). The grid arithmetic is core.lowbit's; with fp32 scales the
quotient x / s is rounded by comparing x with products of s (core.lowbit.round_ratio), never by a division.

topk2 is a sparse format: it is never re-encoded after averaging (`gathered`: each site's message goes to the whole
group), needs "fp32" scales (its two levels) and rounds the magnitude to lo or hi, nearest or stochastically
(unbiased between them: E[decode] = x for a kept value).

A block whose largest magnitude is not finite decodes to NaN everywhere (fp32 scale inf or nan; UE8M0 byte 255): a
diverged value is never hidden behind a finite code.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from core import lowbit

__all__ = ["FORMATS", "ROUNDINGS", "SCALES", "WireFormat"]

FORMATS = ("float32", "bf16", "int8", "fp4", "int4", "topk2")
SCALES = ("fp32", "ue8m0")
ROUNDINGS = ("nearest", "stochastic")
_BITS = {"float32": 32, "bf16": 16, "int8": 8, "fp4": 4, "int4": 4, "topk2": 2}
TOPK_MAX_BLOCK = 1 << 14  # a topk2 word holds a 14-bit index
_GRID = {"fp4": "e2m1", "int4": "int4"}  # the 4-bit formats' core.lowbit grids
_QMAX = {"int8": 127.0, "fp4": 6.0, "int4": 7.0}
_QMAX_LOG2 = {"int8": 6, "fp4": 2, "int4": 2}  # floor(log2 q_max)


@dataclasses.dataclass(frozen=True)
class WireFormat:
    """How values travel: `name` one of FORMATS; `block` G values share one scale (int8, fp4, int4; a 4-bit block
    is even) or are one chunk (topk2); `scale` one of SCALES; `rounding` one of ROUNDINGS; `keep` the values topk2
    sends per chunk (1..G; 0 for the other formats). Raises ValueError naming a bad field."""

    name: str = "float32"
    block: int = 32
    scale: str = "ue8m0"
    rounding: str = "nearest"
    keep: int = 0

    def __post_init__(self):
        for field, allowed in (("name", FORMATS), ("scale", SCALES), ("rounding", ROUNDINGS)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"wire format {field} = {getattr(self, field)!r}; allowed: {list(allowed)}.")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"wire format block = {self.block!r}; allowed: a positive integer.")
        if self.bits == 4 and self.block % 2:
            raise ValueError(
                f"wire format block = {self.block} for {self.name!r}: two 4-bit codes share a byte, so "
                "a block holds an even number of values."
            )
        if self.name == "topk2":
            if self.block > TOPK_MAX_BLOCK:
                raise ValueError(f"wire format block = {self.block} for 'topk2'; allowed: 1..{TOPK_MAX_BLOCK}.")
            if isinstance(self.keep, bool) or not isinstance(self.keep, int) or not 1 <= self.keep <= self.block:
                raise ValueError(f"wire format keep = {self.keep!r} for 'topk2'; allowed: 1..block ({self.block}).")
            if self.scale != "fp32":
                raise ValueError(f"wire format scale = {self.scale!r} for 'topk2'; allowed: 'fp32' (its two levels).")
        elif self.keep != 0:
            raise ValueError(f"wire format keep = {self.keep!r} for {self.name!r}; allowed: 0 (only 'topk2' keeps).")

    @property
    def bits(self) -> int:
        return _BITS[self.name]

    @property
    def scaled(self) -> bool:
        """Values share a scale per block (int8, fp4, int4, topk2)."""
        return self.name in _QMAX or self.name == "topk2"

    @property
    def gathered(self) -> bool:
        """Sparse (topk2): each site's message goes whole to its group and the mean is never re-encoded."""
        return self.name == "topk2"

    @property
    def unit(self) -> int:
        """Values per encoding unit: rows are encoded in whole units (G for scaled formats, else 1)."""
        return self.block if self.scaled else 1

    @property
    def scale_bytes(self) -> int:
        return (4 if self.scale == "fp32" else 1) if self.scaled else 0

    @property
    def bytes_per_value(self) -> float:
        """Wire bytes per value: bits / 8 + scale bytes / G (e.g. fp4 with UE8M0 scales per 32: 0.53125); topk2
        (2 keep + 8) / G."""
        if self.name == "topk2":
            return (2 * self.keep + 8) / self.block
        return self.bits / 8 + (self.scale_bytes / self.block if self.scaled else 0.0)

    @property
    def exact(self) -> bool:
        """float32: nothing is dropped (no error feedback to keep)."""
        return self.name == "float32"

    def encode(self, x: jax.Array, key: jax.Array | None = None) -> tuple[jax.Array, ...]:
        """float32 [n, C] (C a multiple of `unit`) -> the arrays that travel, each with leading dimension n:
        float32: (values,); bf16: (its bits, uint16,); scaled formats: (codes, scales) with codes int8 [n, C] or
        uint8 [n, C / 2] (two 4-bit codes a byte, the first in the low nibble) and scales float32 or uint8 [n, C / G].
        `key` (a PRNG key) is required by stochastic rounding and ignored by nearest."""
        x = jnp.asarray(x, jnp.float32)
        n, c = x.shape
        if c % self.unit:
            raise ValueError(f"encode: rows of {c} values; a multiple of the block {self.unit} is required.")
        if self.rounding == "stochastic" and key is None and not self.exact:
            raise ValueError("encode: stochastic rounding needs a PRNG key.")
        u = None
        if self.rounding == "stochastic" and not self.exact:
            assert key is not None  # checked above
            u = lowbit.uniform(key, x.shape)
        if self.name == "float32":
            return (x,)
        if self.name == "bf16":  # sent as its bits: XLA:CPU would move a bfloat16 collective in float32
            if u is not None:
                bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
                noise = (u * 65536.0).astype(jnp.uint32)  # 16 uniform bits below bfloat16's mantissa
                up = jax.lax.bitcast_convert_type((bits + noise) & jnp.uint32(0xFFFF0000), jnp.float32)
                x = jnp.where(jnp.isfinite(x), up, x)
            return (jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16),)
        if self.name == "topk2":
            return self._encode_topk(x, u)
        blocks = x.reshape(n, c // self.block, self.block)
        amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
        finite = jnp.isfinite(amax)
        ub = None if u is None else u.reshape(blocks.shape)
        if self.scale == "fp32":
            scale = amax / _QMAX[self.name]
            den = jnp.where(finite & (scale > 0), scale, 1.0)
            levels = self._round(blocks, den, ub)
            scales = jnp.where(finite, scale, jnp.nan)[..., 0]
        else:
            e = lowbit.floor_log2(amax) - _QMAX_LOG2[self.name]
            e = jnp.where(amax > lowbit.ldexp(jnp.float32(_QMAX[self.name]), e), e + 1, e)
            e = jnp.clip(e, lowbit.UE8M0_MIN_EXPONENT, lowbit.UE8M0_MAX_EXPONENT)
            levels = self._round(lowbit.ldexp(blocks, -e), None, ub)
            scales = jnp.where(finite, e + lowbit.UE8M0_BIAS, 255)[..., 0].astype(jnp.uint8)
        levels = jnp.where(finite, levels, 0.0).reshape(n, c)
        if self.name == "int8":
            return levels.astype(jnp.int8), scales
        codes = lowbit.encode_code(levels, _GRID[self.name])
        pairs = codes.reshape(n, c // 2, 2)
        return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8), scales

    def decode(self, arrays: tuple[jax.Array, ...]) -> jax.Array:
        """`encode`'s arrays -> float32 [n, C]."""
        if self.name == "float32":
            return arrays[0]
        if self.name == "bf16":
            return jax.lax.bitcast_convert_type(arrays[0], jnp.bfloat16).astype(jnp.float32)
        if self.name == "topk2":
            return self._decode_topk(arrays)
        codes, scales = arrays
        n = codes.shape[0]
        if self.name == "int8":
            levels = codes.astype(jnp.float32)
        else:
            packed = codes.astype(jnp.int32)
            nibbles = jnp.stack([packed & 15, packed >> 4], axis=-1).reshape(n, -1)
            levels = lowbit.decode_code(nibbles, _GRID[self.name])
        blocks = levels.reshape(n, -1, self.block)
        if self.scale == "fp32":
            out = blocks * scales[..., None]
        else:
            e = scales.astype(jnp.int32)[..., None]
            out = jnp.where(e == 255, jnp.nan, lowbit.ldexp(blocks, e - lowbit.UE8M0_BIAS))
        return out.reshape(n, -1)

    def _encode_topk(self, x: jax.Array, u: jax.Array | None) -> tuple[jax.Array, ...]:
        """topk2's (words uint16 [n, C / G x keep], levels float32 [n, C / G, 2] = (lo, hi), NaN for a chunk holding
        a non-finite value). A word: index << 2 | negative << 1 | (magnitude rounds to hi)."""
        n, c = x.shape
        chunks = x.reshape(n, c // self.block, self.block)
        top, index = jax.lax.top_k(jnp.abs(chunks), self.keep)  # descending magnitudes
        lo, hi = top[..., -1:], top[..., :1]
        kept = jnp.take_along_axis(chunks, index, axis=-1)
        if u is None:  # nearest (ties to lo), without a division: |v| - lo against hi - |v|
            up = top - lo > hi - top
        else:  # P(hi) = (|v| - lo) / (hi - lo): unbiased between the two levels
            draws = jnp.take_along_axis(u.reshape(chunks.shape), index, axis=-1)
            up = draws * (hi - lo) < top - lo
        words = (index.astype(jnp.uint32) << 2) | ((kept < 0).astype(jnp.uint32) << 1) | up.astype(jnp.uint32)
        finite = jnp.all(jnp.isfinite(chunks), axis=-1, keepdims=True)
        levels = jnp.where(finite, jnp.concatenate([lo, hi], axis=-1), jnp.nan)
        return words.astype(jnp.uint16).reshape(n, -1), levels

    def _decode_topk(self, arrays: tuple[jax.Array, ...]) -> jax.Array:
        words, levels = arrays
        n, chunks = levels.shape[:2]
        w = words.astype(jnp.int32).reshape(n, chunks, self.keep)
        magnitude = jnp.where((w & 1) == 1, levels[..., 1:], levels[..., :1])
        values = jnp.where((w & 2) == 2, -magnitude, magnitude)
        rows, cols = jnp.arange(n)[:, None, None], jnp.arange(chunks)[None, :, None]
        out = jnp.zeros((n, chunks, self.block), jnp.float32).at[rows, cols, w >> 2].set(values)
        return jnp.where(jnp.isnan(levels[..., :1]), jnp.nan, out).reshape(n, -1)

    def _round(self, num: jax.Array, den: jax.Array | None, u: jax.Array | None) -> jax.Array:
        """Signed grid levels of num / den (den None: num is already scaled), as float32."""
        if self.name == "int8":
            y = num if den is None else num / den  # (an int8 step is 1: the quotient's last-ulp error is harmless)
            r = jnp.round(y) if u is None else jnp.floor(y + u)
            return jnp.clip(r, -127.0, 127.0)
        grid = _GRID[self.name]
        if den is not None:
            return lowbit.round_ratio(num, den, grid, u=u)
        return lowbit.round_nearest(num, grid) if u is None else lowbit.round_stochastic(num, grid, u)
