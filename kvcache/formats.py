"""KV-cache formats: how one token's keys and values are stored, and how queries meet them (docs/kvcache.md).

A format turns keys and values `k, v: [..., K, D]` (K key/value heads, D head dim) into a dict of arrays (its
*fields*), each `[..., K, *trailing]`, and back. Storing fields as separate arrays (structure of arrays) lets a
kernel load each one contiguously; `pack_slots` / `unpack_slots` convert to and from the spec's byte layout per
(token, KV head), which has exactly the same size.

  "bf16": k, v as bfloat16                                           4 D bytes per token and head
  "fp8":  E4M3 codes with one float32 scale per token and head        2 D + 8
          (scale = absmax / 448, so the largest entry maps to E4M3's largest finite value)
  "fp4":  UltraQuant (arXiv 2606.20474): E2M1 codes, two per byte;    D + D / 16   (136 B at D = 128)
          one UE8M0 scale byte 2^(e - 127) per 32 head-dim elements per token and head (exponents clipped to
          +-126, so scales and their inverses are normal floats); K rotated by the
          normalised Sylvester Hadamard matrix over the whole head dim (V not rotated); the query is rotated by
          the same matrix and cast to FP8 E4M3, so q.k is unchanged up to quantisation.

fp4 scale rules (per 32-element group with absmax a):
  "mse" (the open vLLM backend): s = 2^round(log2(0.156 a)) (halves round up); the largest values may clip
        at +-6 s.
  "mx"  (OCP microscaling):      s = 2^(floor(log2 a) - 2), so a / s lies in [4, 8): values above 6 s saturate
        to +-6 s, as the OCP spec prescribes.

fp4 packing: byte j of a row holds element j in its low nibble and element j + D/2 in its high nibble
("split halves"), so a kernel unpacks a 32-byte chunk into two 32-element groups without any interleaving. A code
is sign (bit 3) and magnitude index m (bits 0-2) into E2M1's levels 0, 0.5, 1, 1.5, 2, 3, 4, 6.

The registry: each format is one `Format` subclass registered under its name (`@register`); it owns its fields,
sizes, numerics and what the Pallas kernels need of it (`kernel_groups`, `kernel_token_scale`, `kernel_write`:
how one block row of K or V is decoded, and one token row encoded, inside a kernel). Adding a format is one
subclass here with its registration; `get(name, **options)` builds one (its options are its dataclass fields).

The numerics (E2M1 codes, exact powers of two and floor(log2), E4M3 rounding, the Hadamard matrix) are
core.lowbit's; the names below that kernels import (encode_e2m1, decode_e2m1, pow2, scale_value) are those
functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, ClassVar

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from core import lowbit
from core.lowbit import E2M1_LEVELS, E4M3_MAX, cast_e4m3, decode_e2m1, encode_e2m1, pow2

__all__ = [
    "BF16",
    "E2M1_LEVELS",
    "E4M3_MAX",
    "FP4",
    "FP8",
    "GROUP",
    "MSE_FACTOR",
    "NAMES",
    "REGISTRY",
    "SCALE_RULES",
    "Format",
    "decode_e2m1",
    "encode_e2m1",
    "get",
    "hadamard",
    "options",
    "pack_slots",
    "pow2",
    "register",
    "scale_value",
    "ue8m0_exponent",
    "unpack_slots",
]

SCALE_RULES = ("mse", "mx")
GROUP = 32  # head-dim columns a kernel decodes at a time; fp4 elements per UE8M0 scale
MSE_FACTOR = 0.156  # the open backend's absmax multiplier: s = 2^round(log2(0.156 absmax))
_MIN_EXPONENT, _MAX_EXPONENT = -126, 126  # fp4 scale exponents: scales and their inverses are normal floats

Fields = dict[str, tuple[tuple[int, ...], Any]]  # name -> (shape per token, dtype)
KernelGroup = tuple[int, jax.Array, jax.Array | None]  # (group index, values [bs, 32] float32, scale [bs] or None)


def hadamard(d: int) -> np.ndarray:
    """The normalised Sylvester Hadamard matrix H_d / sqrt(d) (float32 [d, d], symmetric and orthogonal; d a power
    of two): `core.lowbit.hadamard(d, normalized=True)` in float32."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"head_dim = {d}: the Hadamard rotation needs a power of two (64, 128, 256)")
    return lowbit.hadamard(d, normalized=True).astype(np.float32)


def _rotate(x: jax.Array, rot: np.ndarray) -> jax.Array:
    return jnp.einsum("...d,de->...e", x.astype(jnp.float32), jnp.asarray(rot), precision=jax.lax.Precision.HIGHEST)


# ------------------------------------------------------------------------------------------------ fp4 scales


def scale_value(scale: jax.Array) -> jax.Array:
    """The float32 value 2^(s - 127) of UE8M0 scale bytes s (any shape; this format stores s in [1, 253]):
    `core.lowbit.ue8m0_value`."""
    return lowbit.ue8m0_value(scale)


def ue8m0_exponent(absmax: jax.Array, rule: str) -> jax.Array:
    """Unbiased scale exponent e (int32, absmax's shape) of each group's float32 absmax by the rule; 0 for an
    all-zero group. Clipped to [-126, 126] so that the scale and its inverse are normal floats. Kernels use it too.
      "mx":  floor(log2 a) - 2, exact (`core.lowbit.mx_exponent`, from a's exponent bits)
      "mse": floor(log2(0.156 a) + 0.5) in float32 arithmetic (the open backend's rule: round, halves up)"""
    if rule not in SCALE_RULES:
        raise ValueError(f"scale_rule = {rule!r} unknown; allowed: {list(SCALE_RULES)}")
    safe = jnp.where(absmax > 0, absmax, 1.0)
    e = lowbit.mx_exponent(safe) if rule == "mx" else jnp.floor(jnp.log2(MSE_FACTOR * safe) + 0.5).astype(jnp.int32)
    return jnp.clip(jnp.where(absmax > 0, e, 0), _MIN_EXPONENT, _MAX_EXPONENT)


def _group_scales(x: jax.Array, rule: str) -> jax.Array:
    """UE8M0 scale bytes [..., D / 32] (biased exponent e + 127) of x [..., D]."""
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    return (ue8m0_exponent(jnp.max(jnp.abs(groups), axis=-1), rule) + 127).astype(jnp.uint8)


def _fp4_encode(x: jax.Array, rule: str) -> tuple[jax.Array, jax.Array]:
    """x [..., D] float -> (codes [..., D/2] uint8 in split-half packing, scales [..., D/32] uint8)."""
    x = x.astype(jnp.float32)
    scales = _group_scales(x, rule)
    inverse = jnp.repeat(pow2(127 - scales.astype(jnp.int32)), GROUP, axis=-1)
    codes = encode_e2m1(x * inverse)
    half = x.shape[-1] // 2
    return (codes[..., :half] | (codes[..., half:] << 4)).astype(jnp.uint8), scales


def _fp4_decode(codes: jax.Array, scales: jax.Array) -> jax.Array:
    values = jnp.concatenate([decode_e2m1(codes & 15), decode_e2m1(codes >> 4)], axis=-1)
    return values * jnp.repeat(scale_value(scales), GROUP, axis=-1)


def _fp8_encode(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    x = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(absmax > 0, absmax / E4M3_MAX, 1.0)
    return lowbit.cast_e4m3(x / scale[..., None]), scale


# ------------------------------------------------------------------------------------------ the format protocol


@dataclasses.dataclass(frozen=True)
class Format:
    """A KV-cache format: pure functions of arrays; hashable, so it can be a static argument of jit.

    A subclass sets `name` (its registry key) and `key_field` (the field whose shape is [..., K, bs, ...] in a pool
    and [..., K, *] per token: where callers read the KV head count and block size), and defines `fields`,
    `_encode`, `dequantize` and `kernel_write`; the rest has defaults for unrotated formats that store K and V
    as D columns of values (bf16, fp8). Its dataclass fields are its options (`get(name, **options)`).
    """

    name: ClassVar[str]
    key_field: ClassVar[str]

    @property
    def label(self) -> str:
        """The name shown in tables and errors (with the options that differ from the defaults)."""
        return self.name

    def check_head_dim(self, head_dim: int) -> None:
        """Raises ValueError naming `head_dim` if this format cannot store heads of that size (any, by default)."""

    def fields(self, num_kv_heads: int, head_dim: int) -> Fields:
        """name -> (shape per token [K, *trailing], dtype) of each stored array, in the slot's byte order."""
        raise NotImplementedError

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one token occupies in one layer (keys, values and their scales): the sum of its fields' sizes."""
        return sum(
            int(np.prod(shape)) * np.dtype(dtype).itemsize
            for shape, dtype in self.fields(num_kv_heads, head_dim).values()
        )

    def head_dim_of(self, fields: dict[str, jax.Array]) -> int:
        """D of stored fields (any leading dims): the key field's last dim."""
        return fields[self.key_field].shape[-1]

    def rotation(self, head_dim: int) -> np.ndarray | None:
        """The matrix K (and the query) is rotated by before storing, or None."""
        return None

    def value_rotation(self, head_dim: int) -> np.ndarray | None:
        """The matrix V is rotated by before storing, or None."""
        return None

    def finish_output(self, out: jax.Array) -> jax.Array:
        """Attention output [..., D] computed from stored (possibly rotated) V -> output in the model's basis."""
        rot = self.value_rotation(out.shape[-1])
        return out if rot is None else _rotate(out, rot)

    def prepare_query(self, q: jax.Array) -> jax.Array:
        """q [..., D] -> float32 query in the basis (and precision) the score product with the stored K uses."""
        return q.astype(jnp.float32)

    def quantize(self, k: jax.Array, v: jax.Array) -> dict[str, jax.Array]:
        """k, v [..., K, D] (any float dtype, equal shapes) -> the stored fields, each [..., K, *trailing]."""
        if k.shape != v.shape:
            raise ValueError(f"k {k.shape} and v {v.shape} must have the same shape [..., K, D]")
        chex.assert_type([k, v], float, custom_message=f"{self.label}: k and v are quantised from floating point")
        self.check_head_dim(k.shape[-1])
        return self._encode(k, v)

    def _encode(self, k: jax.Array, v: jax.Array) -> dict[str, jax.Array]:
        raise NotImplementedError

    def dequantize(self, fields: dict[str, jax.Array], *, rotated: bool = False) -> tuple[jax.Array, jax.Array]:
        """The stored fields -> (k, v) float32 [..., K, D]. With `rotated=True`, rotated K (and V) stay in the stored
        basis (what attention uses, with `prepare_query` and `finish_output`); otherwise they are rotated back."""
        raise NotImplementedError

    # --- what the Pallas kernels need (refs of a layer's pool fields [NB, K, bs, ...], indexed per block and head)

    def kernel_groups(self, refs: dict, prefix: str, blk, h, head_dim: int) -> Iterator[KernelGroup]:
        """Yields (g, values [bs, 32] float32, group scale [bs] or None) for each 32-column group g of the K
        (prefix "k") or V ("v") of block `blk`, KV head `h`: the stored columns as values (bf16, fp8)."""
        for g in range(head_dim // GROUP):
            yield g, refs[prefix][blk, h, :, pl.ds(g * GROUP, GROUP)].astype(jnp.float32), None

    def kernel_token_scale(self, refs: dict, prefix: str, blk, h) -> jax.Array | None:
        """A per-token scale [bs] of the block's K (multiplies the scores) or V (multiplies the probabilities),
        or None."""
        return None

    def kernel_write(self, outs: dict, prefix: str, row, blk, h, off, head_dim: int) -> None:
        """Stores one token's K or V (prefix "k" / "v") into slot `off` of block `blk`, KV head `h` of the output
        refs. `row()` loads the token's (already rotated) row as float32 [1, D]; `row(start, size)` its columns
        [start, start + size) as [1, size]."""
        raise NotImplementedError


REGISTRY: dict[str, type[Format]] = {}


def register(cls: type[Format]) -> type[Format]:
    """Class decorator: adds a `Format` subclass to the registry under `cls.name` (a name may be taken once)."""
    if cls.name in REGISTRY:
        raise ValueError(f"KV format {cls.name!r} is registered already (by {REGISTRY[cls.name].__name__})")
    REGISTRY[cls.name] = cls
    return cls


def options(name: str) -> tuple[str, ...]:
    """The options (keyword arguments of `get`) the format called `name` takes."""
    return tuple(f.name for f in dataclasses.fields(_registered(name)))


def _registered(name: str) -> type[Format]:
    if name not in REGISTRY:
        raise ValueError(f"KV format {name!r} unknown; allowed: {list(REGISTRY)}")
    return REGISTRY[name]


def get(name: str, **kwargs) -> Format:
    """The format called `name` (a key of `REGISTRY`: "bf16", "fp8", "fp4") with its options; fp4 takes
    scale_rule="mse" | "mx", rotate_k, rotate_v, fp8_query. Unknown names and options are a ValueError."""
    cls, allowed = _registered(name), options(name)
    if kwargs and not allowed:
        with_options = [n for n in REGISTRY if options(n)]
        raise ValueError(f"KV format {name!r} takes no options (got {sorted(kwargs)}); only {with_options} do")
    if set(kwargs) - set(allowed):
        raise ValueError(f"unknown {name} options {sorted(set(kwargs) - set(allowed))}; allowed: {sorted(allowed)}")
    return cls(**kwargs)


# --------------------------------------------------------------------------------------------------- formats


@register
@dataclasses.dataclass(frozen=True)
class BF16(Format):
    """K and V as bfloat16: 4 D bytes per token and head."""

    name: ClassVar[str] = "bf16"
    key_field: ClassVar[str] = "k"

    def fields(self, num_kv_heads: int, head_dim: int) -> Fields:
        self.check_head_dim(head_dim)
        kd = (num_kv_heads, head_dim)
        return {"k": (kd, jnp.bfloat16), "v": (kd, jnp.bfloat16)}

    def _encode(self, k, v):
        return {"k": k.astype(jnp.bfloat16), "v": v.astype(jnp.bfloat16)}

    def dequantize(self, fields, *, rotated=False):
        return fields["k"].astype(jnp.float32), fields["v"].astype(jnp.float32)

    def kernel_write(self, outs, prefix, row, blk, h, off, head_dim):
        outs[prefix][blk, h, pl.ds(off, 1), :] = row().astype(jnp.bfloat16)


@register
@dataclasses.dataclass(frozen=True)
class FP8(Format):
    """E4M3 codes with one float32 scale absmax / 448 per token and head: 2 D + 8 bytes per token and head."""

    name: ClassVar[str] = "fp8"
    key_field: ClassVar[str] = "k"

    def fields(self, num_kv_heads: int, head_dim: int) -> Fields:
        self.check_head_dim(head_dim)
        kd = (num_kv_heads, head_dim)
        return {
            "k": (kd, jnp.float8_e4m3fn),
            "k_scale": ((num_kv_heads,), jnp.float32),
            "v": (kd, jnp.float8_e4m3fn),
            "v_scale": ((num_kv_heads,), jnp.float32),
        }

    def _encode(self, k, v):
        (kc, ks), (vc, vs) = _fp8_encode(k), _fp8_encode(v)
        return {"k": kc, "k_scale": ks, "v": vc, "v_scale": vs}

    def dequantize(self, fields, *, rotated=False):
        return (
            fields["k"].astype(jnp.float32) * fields["k_scale"][..., None],
            fields["v"].astype(jnp.float32) * fields["v_scale"][..., None],
        )

    def kernel_token_scale(self, refs, prefix, blk, h):
        return refs[prefix + "_scale"][blk, h, :]

    def kernel_write(self, outs, prefix, row, blk, h, off, head_dim):
        values = row()
        absmax = jnp.max(jnp.abs(values))
        scale = jnp.where(absmax > 0, absmax / E4M3_MAX, 1.0)
        outs[prefix][blk, h, pl.ds(off, 1), :] = cast_e4m3(values / scale)
        outs[prefix + "_scale"][blk, h, pl.ds(off, 1)] = jnp.reshape(scale, (1,))


@register
@dataclasses.dataclass(frozen=True)
class FP4(Format):
    """UltraQuant (arXiv 2606.20474): E2M1 codes (split-half packed) and UE8M0 scales per 32: D + D / 16 bytes.

    Attributes:
      scale_rule: "mse" or "mx" (the module docstring).
      rotate_k: rotate K (and the query) by the Hadamard matrix.
      rotate_v: rotate V as well (the "symmetric" treatment UltraQuant rejects; for measurements): attention then
        yields P (V H), and `finish_output` multiplies the output by H.
      fp8_query: cast the (rotated) query to FP8 E4M3 (scale 1) before the score product.
    """

    name: ClassVar[str] = "fp4"
    key_field: ClassVar[str] = "k_codes"
    scale_rule: str = "mse"
    rotate_k: bool = True
    rotate_v: bool = False
    fp8_query: bool = True

    def __post_init__(self):
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(f"scale_rule = {self.scale_rule!r} unknown; allowed: {list(SCALE_RULES)}")

    @property
    def label(self) -> str:
        extras = (
            [self.scale_rule]
            + ([] if self.rotate_k else ["K unrotated"])
            + (["V rotated"] if self.rotate_v else [])
            + ([] if self.fp8_query else ["fp32 query"])
        )
        return "fp4 (" + ", ".join(extras) + ")"

    def check_head_dim(self, head_dim: int) -> None:
        """A multiple of 64 (two 32-element scale groups per packed 32-byte chunk); a power of two if rotated."""
        if head_dim % (2 * GROUP):
            raise ValueError(
                f"head_dim = {head_dim}: the fp4 KV format needs a multiple of {2 * GROUP} "
                f"(two 32-element scale groups per packed 32-byte chunk)"
            )
        if self.rotate_k or self.rotate_v:
            hadamard(head_dim)

    def fields(self, num_kv_heads: int, head_dim: int) -> Fields:
        self.check_head_dim(head_dim)
        packed, groups = (num_kv_heads, head_dim // 2), (num_kv_heads, head_dim // GROUP)
        return {
            "k_codes": (packed, jnp.uint8),
            "k_scales": (groups, jnp.uint8),
            "v_codes": (packed, jnp.uint8),
            "v_scales": (groups, jnp.uint8),
        }

    def head_dim_of(self, fields):
        return 2 * fields[self.key_field].shape[-1]  # two codes per byte

    def rotation(self, head_dim):
        return hadamard(head_dim) if self.rotate_k else None

    def value_rotation(self, head_dim):
        return hadamard(head_dim) if self.rotate_v else None

    def prepare_query(self, q):
        """Rotated by the same Hadamard matrix as K and, with `fp8_query`, rounded to FP8 E4M3 values (saturating
        at +-448)."""
        q = q.astype(jnp.float32)
        rot = self.rotation(q.shape[-1])
        if rot is not None:
            q = _rotate(q, rot)
        return lowbit.round_e4m3(q) if self.fp8_query else q

    def _encode(self, k, v):
        rot, vrot = self.rotation(k.shape[-1]), self.value_rotation(k.shape[-1])
        k = k.astype(jnp.float32) if rot is None else _rotate(k, rot)
        v = v.astype(jnp.float32) if vrot is None else _rotate(v, vrot)
        (kc, ks), (vc, vs) = _fp4_encode(k, self.scale_rule), _fp4_encode(v, self.scale_rule)
        return {"k_codes": kc, "k_scales": ks, "v_codes": vc, "v_scales": vs}

    def dequantize(self, fields, *, rotated=False):
        """(H is its own inverse: rotating back is one more product with it.)"""
        k = _fp4_decode(fields["k_codes"], fields["k_scales"])
        v = _fp4_decode(fields["v_codes"], fields["v_scales"])
        rot, vrot = self.rotation(k.shape[-1]), self.value_rotation(k.shape[-1])
        if not rotated:
            k = k if rot is None else _rotate(k, rot)
            v = v if vrot is None else _rotate(v, vrot)
        return k, v

    def kernel_groups(self, refs, prefix, blk, h, head_dim):
        """A 32-byte chunk c of codes gives groups c (low nibbles) and c + D/64 (high), decoded arithmetically;
        the group's UE8M0 scale [bs] multiplies its partial scores (K) or its values (V)."""
        half = head_dim // (2 * GROUP)
        codes_ref, scales_ref = refs[prefix + "_codes"], refs[prefix + "_scales"]
        for c in range(half):
            chunk = codes_ref[blk, h, :, pl.ds(c * GROUP, GROUP)]
            for g, nibbles in ((c, chunk & 15), (c + half, chunk >> 4)):
                yield g, decode_e2m1(nibbles), scale_value(scales_ref[blk, h, :, g])

    def kernel_write(self, outs, prefix, row, blk, h, off, head_dim):
        """Per 32-column group: the UE8M0 scale by the rule, E2M1 codes (ties to the even code), then split-half
        packing of chunk c from groups c and c + D/64."""
        num_groups = head_dim // GROUP
        half = num_groups // 2
        codes, scales = [], []
        for g in range(num_groups):
            group = row(g * GROUP, GROUP)
            e = ue8m0_exponent(jnp.max(jnp.abs(group)), self.scale_rule)
            codes.append(encode_e2m1(group * pow2(-e)))
            scales.append(e + 127)
        for c in range(half):
            packed = (codes[c] | (codes[c + half] << 4)).astype(jnp.uint8)
            outs[prefix + "_codes"][blk, h, pl.ds(off, 1), pl.ds(c * GROUP, GROUP)] = packed
        for g, s in enumerate(scales):
            outs[prefix + "_scales"][blk, h, pl.ds(off, 1), pl.ds(g, 1)] = jnp.reshape(s, (1, 1)).astype(jnp.uint8)


NAMES = tuple(REGISTRY)  # the formats defined above, in registration order


# --------------------------------------------------------------------------------------- the spec's byte slot


def pack_slots(fmt: Format, fields: dict[str, jax.Array]) -> jax.Array:
    """The fields -> uint8 [..., K, slot_bytes]: per (token, KV head) the fields in `fields()` order as raw bytes;
    for fp4 this is the spec's slot [K codes D/2][K scales D/32][V codes D/2][V scales D/32] (136 B at D = 128).
    fp8's float32 scales are stored little-endian."""
    key = fields[fmt.key_field]
    parts = []
    for name in fmt.fields(key.shape[-2], fmt.head_dim_of(fields)):
        x = fields[name]
        x = x if x.ndim == key.ndim else x[..., None]  # per-head scalars -> one column
        parts.append(jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(*x.shape[:-1], -1))
    return jnp.concatenate(parts, axis=-1)


def unpack_slots(fmt: Format, slots: jax.Array, head_dim: int) -> dict[str, jax.Array]:
    """Inverse of `pack_slots`: uint8 [..., K, slot_bytes] -> the fields."""
    num_kv_heads = slots.shape[-2]
    out, start = {}, 0
    for name, (shape, dtype) in fmt.fields(num_kv_heads, head_dim).items():
        per_head = shape[1:] or (1,)
        size = int(np.prod(per_head)) * np.dtype(dtype).itemsize
        raw = slots[..., start : start + size]
        start += size
        itemsize = np.dtype(dtype).itemsize
        raw = raw.reshape(*raw.shape[:-1], -1, itemsize) if itemsize > 1 else raw
        x = jax.lax.bitcast_convert_type(raw, dtype)
        out[name] = x.reshape(*slots.shape[:-1], *shape[1:])
    if start != slots.shape[-1]:
        raise ValueError(
            f"slots hold {slots.shape[-1]} bytes per head; format {fmt.label} at head_dim {head_dim} needs {start}"
        )
    return out
