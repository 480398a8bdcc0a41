"""How one side (K or V) of a KV-cache format stores its rows, and how a Pallas kernel reads and writes them
(kvcache.formats builds each format from a K codec and a V codec; docs/kvcache.md).

A codec turns rows x [..., K, D] (float32, already rotated when the format rotates that side) into fields named
after the side's prefix ("k" or "v"), each [..., K, *trailing], and back:

  Plain       the values as bfloat16                                                       2 D bytes
  PerToken8   E4M3 codes and one float32 scale absmax / 448 per token and head             D + 4
  Block4      4-bit codes on a grid (core.lowbit.GRIDS: e2m1, e1m2, int4), two per byte in split-half packing
              (byte j of a row holds element j in its low and element j + D/2 in its high nibble; a code is the
              sign, bit 3, and the magnitude index, bits 0-2), with block scales:
                "ue8m0": one byte 2^(s - 127) per 32 elements (UltraQuant)                  D/2 + D/32
                "e4m3":  one E4M3 value per 16 elements (NVFP4)                             D/2 + D/16

UE8M0 scale rules, per 32-element group with absmax a, on a grid whose max is G:
  "mse" (the open UltraQuant backend, written for E2M1): e = round(log2(0.156 (6 / G) a)), halves up; the largest
        values may clip at +-G 2^e. For E2M1 (G = 6) this is the backend's rule; other grids keep its ratio of the
        group's max to the grid's max.
  "mx"  (OCP microscaling): e = floor(log2 a) - floor(log2 G), so a / 2^e lies in [2^floor(log2 G), 2^(floor(log2 G)
        + 1)) and values above G saturate to +-G (E2M1: [4, 8) against 6; E1M2: [1, 2) against 1.75; INT4: [4, 8)
        against 7).
  Exponents are clipped to +-126, so scales and their inverses are normal floats; an all-zero group has e = 0.
  E1M2 and INT4 are one grid scaled by 4 and both rules move with the grid's max: they store the same codes and
  values, with scale bytes 2 apart.
E4M3 scale selection, per 16-element block with absmax a (no tensor scale: vLLM's uncalibrated scale of 1):
  "max":    s = e4m3(a / G), the block's max mapped to the grid's max (a rounded-down s may saturate it slightly)
  "4over6": E2M1 only (arXiv 2512.02010): the block is encoded with s = e4m3(a / 6) and with s = e4m3(a / 4) and
            keeps the one with the smaller squared error (a / 6 on ties)
  The code of x is the grid level nearest to x / s, decided by comparing x with products of s
  (core.lowbit.round_ratio), never by dividing; a block whose scale rounds to 0 stores zeros. Without a tensor
  scale, a block max below about 6 2^-10 stores zeros and one above 6 x 448 = 2688 saturates.
A block holding inf or nan stores a nan scale (UE8M0 byte 255, E4M3 nan), so it decodes as nan, as
core.lowbit's quantisers do: a non-finite key or value is never stored as a finite one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from core import lowbit
from core.lowbit import E4M3_MAX, cast_e4m3, pow2

__all__ = [
    "E4M3_BLOCK",
    "E4M3_SELECTIONS",
    "GRIDS",
    "GROUP",
    "MSE_FACTOR",
    "SCALES",
    "SCALE_RULES",
    "Block4",
    "Codec",
    "PerToken8",
    "Plain",
    "scale_value",
    "ue8m0_exponent",
]

GROUP = 32  # head-dim columns a kernel decodes at a time; elements per UE8M0 scale
E4M3_BLOCK = 16  # elements per E4M3 scale
GRIDS = tuple(lowbit.GRIDS)
SCALES = ("ue8m0", "e4m3")
SCALE_RULES = ("mse", "mx")  # UE8M0 scales
E4M3_SELECTIONS = ("max", "4over6")  # E4M3 scales
MSE_FACTOR = 0.156  # the open backend's absmax multiplier for E2M1: s = 2^round(log2(0.156 absmax))
_MIN_EXPONENT, _MAX_EXPONENT = -126, 126

Fields = dict[str, tuple[tuple[int, ...], Any]]  # name -> (shape per token, dtype)
KernelGroup = tuple[int, jax.Array, jax.Array | None]  # (group index, values [bs, 32] float32, scale [bs] or None)


def scale_value(scale: jax.Array) -> jax.Array:
    """The float32 value 2^(s - 127) of UE8M0 scale bytes s (any shape; the formats store s in [1, 253]):
    `core.lowbit.ue8m0_value`."""
    return lowbit.ue8m0_value(scale)


def ue8m0_exponent(absmax: jax.Array, rule: str, grid: str = "e2m1") -> jax.Array:
    """Unbiased scale exponent e (int32, absmax's shape) of each group's float32 absmax by the rule for `grid` (the
    module docstring); 0 for an all-zero group; clipped to [-126, 126]. Kernels use it too."""
    if rule not in SCALE_RULES:
        raise ValueError(f"scale_rule = {rule!r} unknown; allowed: {list(SCALE_RULES)}")
    top = lowbit.GRIDS[grid][-1]
    safe = jnp.where(absmax > 0, absmax, 1.0)
    if rule == "mx":
        e = lowbit.floor_log2(safe) - (math.frexp(top)[1] - 1)  # floor(log2 G): 2, 0, 2
    else:
        e = jnp.floor(jnp.log2(MSE_FACTOR * (6.0 / top) * safe) + 0.5).astype(jnp.int32)
    return jnp.clip(jnp.where(absmax > 0, e, 0), _MIN_EXPONENT, _MAX_EXPONENT)


def _ue8m0_scale(absmax: jax.Array, rule: str, grid: str) -> tuple[jax.Array, jax.Array]:
    """(exponent e, scale byte e + 127, or 255 (nan) where absmax is not finite) of groups with absmax."""
    e = ue8m0_exponent(absmax, rule, grid)
    return e, jnp.where(jnp.isfinite(absmax), e + 127, 255).astype(jnp.uint8)


def _e4m3_candidate(x: jax.Array, absmax: jax.Array, grid: str, top: float) -> tuple[jax.Array, jax.Array]:
    """(levels of x, E4M3 scale s = e4m3(absmax / top)) for blocks x [..., n] with absmax [..., 1]."""
    s = lowbit.round_e4m3_ratio(absmax, jnp.float32(top))
    den = jnp.where(s > 0, s, jnp.inf)  # a zero scale: every comparison fails, every level is 0
    return lowbit.round_ratio(x, den, grid), s


def _e4m3_levels(x: jax.Array, absmax: jax.Array, grid: str, select: str) -> tuple[jax.Array, jax.Array]:
    """(levels [..., n], scales [..., 1]) of blocks x [..., n] (absmax [..., 1]) by the selection rule."""
    first = _e4m3_candidate(x, absmax, grid, lowbit.GRIDS[grid][-1] if select == "max" else 6.0)
    if select == "4over6":
        second = _e4m3_candidate(x, absmax, grid, 4.0)
        err = [jnp.sum(jnp.square(q * s - x), axis=-1, keepdims=True) for q, s in (first, second)]
        take = err[1] < err[0]
        first = jnp.where(take, second[0], first[0]), jnp.where(take, second[1], first[1])
    return first[0], jnp.where(jnp.isfinite(absmax), first[1], jnp.nan)


def _row_parts(row, head_dim: int) -> list[tuple[Any, jax.Array]]:
    """A token row as (columns, values [1, n]) parts for a kernel to store: 32-column groups when head_dim is a
    multiple of 32 (Triton takes only power-of-two arrays, and a padded head dim of 96 is not one), else the row."""
    if head_dim % GROUP:
        return [(slice(None), row())]
    return [(pl.ds(g * GROUP, GROUP), row(g * GROUP, GROUP)) for g in range(head_dim // GROUP)]


def _pack(codes: jax.Array) -> jax.Array:
    half = codes.shape[-1] // 2
    return (codes[..., :half] | (codes[..., half:] << 4)).astype(jnp.uint8)


class Codec:
    """One side's storage: `fields`, `encode`, `decode` in XLA, and the kernel hooks (kvcache.formats.Format
    documents them: `kernel_groups`, `kernel_token_scale`, `kernel_write`). `pad_multiple`: a head dim the format
    pads (kvcache.formats.PADDED_HEAD_DIMS) is padded to a multiple of it (the columns a kernel decodes at a time)."""

    pad_multiple: ClassVar[int] = GROUP

    def check_head_dim(self, head_dim: int) -> None:
        """Raises ValueError naming `head_dim` if this codec cannot store rows of that size (any, by default)."""

    def fields(self, prefix: str, num_kv_heads: int, head_dim: int) -> Fields:
        raise NotImplementedError

    def main_field(self, prefix: str) -> str:
        """The field whose shape is [..., K, bs, ...] in a pool and [..., K, *] per token."""
        return prefix

    def head_dim_of(self, field: jax.Array) -> int:
        """D of the main field (any leading dims)."""
        return field.shape[-1]

    def encode(self, prefix: str, x: jax.Array) -> dict[str, jax.Array]:
        raise NotImplementedError

    def decode(self, fields: dict[str, jax.Array], prefix: str) -> jax.Array:
        raise NotImplementedError

    def kernel_groups(self, refs: dict, prefix: str, blk, h, head_dim: int) -> Iterator[KernelGroup]:
        """The stored columns as values, 32 at a time, without a group scale."""
        for g in range(head_dim // GROUP):
            yield g, refs[prefix][blk, h, :, pl.ds(g * GROUP, GROUP)].astype(jnp.float32), None

    def kernel_token_scale(self, refs: dict, prefix: str, blk, h) -> jax.Array | None:
        return None

    def kernel_write(self, outs: dict, prefix: str, row, blk, h, off, head_dim: int) -> None:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Plain(Codec):
    """The values as bfloat16."""

    def fields(self, prefix, num_kv_heads, head_dim):
        return {prefix: ((num_kv_heads, head_dim), jnp.bfloat16)}

    def encode(self, prefix, x):
        return {prefix: x.astype(jnp.bfloat16)}

    def decode(self, fields, prefix):
        return fields[prefix].astype(jnp.float32)

    def kernel_write(self, outs, prefix, row, blk, h, off, head_dim):
        for columns, values in _row_parts(row, head_dim):
            outs[prefix][blk, h, pl.ds(off, 1), columns] = values.astype(jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class PerToken8(Codec):
    """E4M3 codes with one float32 scale absmax / 448 per token and head (the largest entry maps to E4M3's largest
    finite value)."""

    def fields(self, prefix, num_kv_heads, head_dim):
        return {
            prefix: ((num_kv_heads, head_dim), jnp.float8_e4m3fn),
            prefix + "_scale": ((num_kv_heads,), jnp.float32),
        }

    def encode(self, prefix, x):
        absmax = jnp.max(jnp.abs(x), axis=-1)
        scale = jnp.where(absmax > 0, absmax / E4M3_MAX, 1.0)
        return {prefix: cast_e4m3(x / scale[..., None]), prefix + "_scale": scale}

    def decode(self, fields, prefix):
        return fields[prefix].astype(jnp.float32) * fields[prefix + "_scale"][..., None]

    def kernel_token_scale(self, refs, prefix, blk, h):
        return refs[prefix + "_scale"][blk, h, :]

    def kernel_write(self, outs, prefix, row, blk, h, off, head_dim):
        parts = _row_parts(row, head_dim)
        absmax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(values)) for _, values in parts])
        scale = jnp.where(absmax > 0, absmax / E4M3_MAX, 1.0)
        for columns, values in parts:
            outs[prefix][blk, h, pl.ds(off, 1), columns] = cast_e4m3(values / scale)
        outs[prefix + "_scale"][blk, h, pl.ds(off, 1)] = jnp.reshape(scale, (1,))


@dataclasses.dataclass(frozen=True)
class Block4(Codec):
    """4-bit codes on `grid` with block scales `scale` chosen by `rule` (the module docstring: "mse" / "mx" for
    ue8m0, "max" / "4over6" for e4m3). Raises ValueError naming a bad field."""

    grid: str = "e2m1"
    scale: str = "ue8m0"
    rule: str = "mse"
    pad_multiple: ClassVar[int] = 2 * GROUP  # two 32-element groups per split-half packed chunk

    def __post_init__(self):
        rules = SCALE_RULES if self.scale == "ue8m0" else E4M3_SELECTIONS
        for name, value, allowed in (("grid", self.grid, GRIDS), ("scale", self.scale, SCALES)):
            if value not in allowed:
                raise ValueError(f"{name} = {value!r} unknown; allowed: {list(allowed)}")
        if self.rule not in rules:
            what = "scale_rule" if self.scale == "ue8m0" else "select"
            raise ValueError(f"{what} = {self.rule!r} unknown for {self.scale} scales; allowed: {list(rules)}")
        if self.rule == "4over6" and self.grid != "e2m1":
            raise ValueError(
                f"select = '4over6' chooses between E2M1's levels 4 and 6; grid = {self.grid!r} (allowed: 'e2m1')"
            )

    @property
    def block(self) -> int:
        """Elements per scale: 32 (UE8M0) or 16 (E4M3)."""
        return GROUP if self.scale == "ue8m0" else E4M3_BLOCK

    def check_head_dim(self, head_dim):
        """A multiple of 64: two 32-element groups per packed 32-byte chunk."""
        if head_dim % (2 * GROUP):
            raise ValueError(
                f"head_dim = {head_dim}: a 4-bit KV side needs a multiple of {2 * GROUP} "
                f"(two 32-element groups per packed 32-byte chunk)"
            )

    def fields(self, prefix, num_kv_heads, head_dim):
        dtype = jnp.uint8 if self.scale == "ue8m0" else jnp.float8_e4m3fn
        return {
            prefix + "_codes": ((num_kv_heads, head_dim // 2), jnp.uint8),
            prefix + "_scales": ((num_kv_heads, head_dim // self.block), dtype),
        }

    def main_field(self, prefix):
        return prefix + "_codes"

    def head_dim_of(self, field):
        return 2 * field.shape[-1]  # two codes per byte

    def encode(self, prefix, x):
        blocks = x.reshape(*x.shape[:-1], x.shape[-1] // self.block, self.block)
        absmax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
        if self.scale == "ue8m0":
            e, scales = _ue8m0_scale(absmax[..., 0], self.rule, self.grid)
            codes = lowbit.encode_code(blocks * pow2(-e)[..., None], self.grid)
        else:
            levels, s = _e4m3_levels(blocks, absmax, self.grid, self.rule)
            codes, scales = lowbit.encode_code(levels, self.grid), s[..., 0].astype(jnp.float8_e4m3fn)
        return {prefix + "_codes": _pack(codes.reshape(x.shape)), prefix + "_scales": scales}

    def decode(self, fields, prefix):
        codes = fields[prefix + "_codes"]
        levels = jnp.concatenate(
            [lowbit.decode_code(codes & 15, self.grid), lowbit.decode_code(codes >> 4, self.grid)], axis=-1
        )
        scales = fields[prefix + "_scales"]
        scales = scale_value(scales) if self.scale == "ue8m0" else scales.astype(jnp.float32)
        return levels * jnp.repeat(scales, self.block, axis=-1)

    def kernel_groups(self, refs, prefix, blk, h, head_dim):
        """A 32-byte chunk c of codes gives groups c (low nibbles) and c + D/64 (high), decoded arithmetically.
        UE8M0: the group's scale [bs] multiplies its partial scores (K) or its values (V). E4M3: the two per-16
        scales are applied to the group's values (selected by column), which come without a group scale."""
        half = head_dim // (2 * GROUP)
        codes_ref, scales_ref = refs[prefix + "_codes"], refs[prefix + "_scales"]
        first_half = jax.lax.broadcasted_iota(jnp.int32, (1, GROUP), 1) < E4M3_BLOCK
        for c in range(half):
            chunk = codes_ref[blk, h, :, pl.ds(c * GROUP, GROUP)]
            for g, nibbles in ((c, chunk & 15), (c + half, chunk >> 4)):
                values = lowbit.decode_code(nibbles, self.grid)
                if self.scale == "ue8m0":
                    yield g, values, scale_value(scales_ref[blk, h, :, g])
                else:
                    lo = scales_ref[blk, h, :, 2 * g].astype(jnp.float32)[:, None]
                    hi = scales_ref[blk, h, :, 2 * g + 1].astype(jnp.float32)[:, None]
                    yield g, values * jnp.where(first_half, lo, hi), None

    def kernel_write(self, outs, prefix, row, blk, h, off, head_dim):
        """Per 32-column group: its scale(s) by the rule, codes (ties to the even code), then split-half packing of
        chunk c from groups c and c + D/64."""
        num_groups, codes = head_dim // GROUP, []
        first_half = jax.lax.broadcasted_iota(jnp.int32, (1, GROUP), 1) < E4M3_BLOCK
        scales_ref = outs[prefix + "_scales"]
        for g in range(num_groups):
            group = row(g * GROUP, GROUP)
            if self.scale == "ue8m0":
                e, byte = _ue8m0_scale(jnp.max(jnp.abs(group)), self.rule, self.grid)
                codes.append(lowbit.encode_code(group * pow2(-e), self.grid))
                scales_ref[blk, h, pl.ds(off, 1), pl.ds(g, 1)] = jnp.reshape(byte, (1, 1))
                continue
            halves = []
            for part in (first_half, ~first_half):
                x = jnp.where(part, group, 0.0)
                halves.append(_e4m3_levels(x, jnp.max(jnp.abs(x), axis=-1, keepdims=True), self.grid, self.rule))
            (q_lo, s_lo), (q_hi, s_hi) = halves
            codes.append(lowbit.encode_code(jnp.where(first_half, q_lo, q_hi), self.grid))
            for i, s in ((2 * g, s_lo), (2 * g + 1, s_hi)):
                scales_ref[blk, h, pl.ds(off, 1), pl.ds(i, 1)] = jnp.reshape(s, (1, 1)).astype(jnp.float8_e4m3fn)
        half = num_groups // 2
        for c in range(half):
            packed = (codes[c] | (codes[c + half] << 4)).astype(jnp.uint8)
            outs[prefix + "_codes"][blk, h, pl.ds(off, 1), pl.ds(c * GROUP, GROUP)] = packed
