"""KV-cache formats: how one token's keys and values are stored, and how queries meet them (docs/kvcache.md).

A format turns keys and values `k, v: [..., K, D]` (K key/value heads, D head dim) into a dict of arrays (its
*fields*), each `[..., K, *trailing]`, and back. Storing fields as separate arrays (structure of arrays) lets a
kernel load each one contiguously; `pack_slots` / `unpack_slots` convert to and from the spec's byte layout per
(token, KV head), which has exactly the same size. Bytes per token and head at D = 128 in brackets.

  "bf16":  k, v as bfloat16                                                                      4 D      (512)
  "fp8":   E4M3 codes with one float32 scale absmax / 448 per token and head                     2 D + 8  (264)
  "fp4":   UltraQuant (arXiv 2606.20474): 4-bit codes, two per byte, one UE8M0 scale byte per    D + D/16 (136)
           32 head-dim elements; E2M1 by default, or the uniform E1M2 / INT4 grid (`grid`: UFP4's shrinkage-bias
           argument, arXiv 2606.20381, applied to the cache); K rotated by the normalised Sylvester Hadamard
           matrix over the whole head dim (V not rotated); the query rotated by the same matrix and cast to FP8
           E4M3, so q.k is unchanged up to quantisation.
  "nvfp4": NVFP4 KV (vLLM, FlashInfer): E2M1 codes and one E4M3 scale per 16 elements,          D + D/8  (144)
           "max" or "4 over 6" selection (`select`); nothing rotated; the query in FP8 E4M3.
  "k8v4":  keys as fp8's (E4M3, a float32 scale per token and head, float32 query), values as    3 D / 2 + D / 32
           fp4's (unrotated, UE8M0 per 32)                                                                 + 4 (200)

Head dims 80 and 96 (Phi-2's and Phi-3's heads) are stored padded with zeros to Dp (`Format.padded_head_dim`), the
smallest size >= D that every codec takes (a multiple of 32 for bf16 / fp8 codes, the columns a kernel decodes at a
time; of 64 for 4-bit sides, two 32-element groups per split-half packed chunk), and a power of two when the format
rotates (the Hadamard matrix): bf16 and fp8 store 96 columns for both, fp4, nvfp4 and k8v4 store 128 (k8v4's two
sides share one Dp). `quantize` pads K and V, `prepare_query` pads the query, `finish_output(out, D)` slices the
output back; zero columns add q_pad . k_pad = 0 to every score (rotated: (q_pad H) . (k_pad H) = q_pad . k_pad = q . k),
so attention is that of the unpadded heads. `fields` and `bytes_per_token` state the padded (stored) sizes, e.g.
fp4 at D = 96: 128 + 8 = 136 bytes per token and head, as at D = 128. Any other head dim the codecs or the rotation
do not take is refused.

The element codecs (grids, scale rules and selections, split-half packing, their kernel hooks) are kvcache.codecs';
the numerics under them (4-bit codes, exact powers of two and floor(log2), E4M3 rounding, the Hadamard matrix)
core.lowbit's.

The registry: each format is one `Format` subclass registered under its name (`@register`); it says which codec
stores K and which V, what is rotated and how the query is prepared; the base class derives the fields, sizes,
numerics and what the Pallas kernels need (`kernel_groups`, `kernel_token_scale`, `kernel_write`: how one block row
of K or V is decoded, and one token row encoded, inside a kernel) from the codecs. Adding a format is one subclass
here with its registration; `get(name, **options)` builds one (its options are its dataclass fields).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import ClassVar

import chex
import jax
import jax.numpy as jnp
import numpy as np

from core import lowbit
from core.lowbit import E2M1_LEVELS, E4M3_MAX, decode_e2m1, encode_e2m1, pow2
from kvcache.codecs import (
    E4M3_SELECTIONS,
    GRIDS,
    GROUP,
    MSE_FACTOR,
    SCALE_RULES,
    Block4,
    Codec,
    Fields,
    KernelGroup,
    PerToken8,
    Plain,
    scale_value,
    ue8m0_exponent,
)

__all__ = [
    "BF16",
    "E2M1_LEVELS",
    "E4M3_MAX",
    "E4M3_SELECTIONS",
    "FP4",
    "FP8",
    "GRIDS",
    "GROUP",
    "K8V4",
    "MSE_FACTOR",
    "NAMES",
    "NVFP4",
    "PADDED_HEAD_DIMS",
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


PADDED_HEAD_DIMS = (80, 96)  # head dims stored padded with zeros to `Format.padded_head_dim` (Phi-2, Phi-3)


def hadamard(d: int) -> np.ndarray:
    """The normalised Sylvester Hadamard matrix H_d / sqrt(d) (float32 [d, d], symmetric and orthogonal; d a power
    of two): `core.lowbit.hadamard(d, normalized=True)` in float32."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"head_dim = {d}: the Hadamard rotation needs a power of two (64, 128, 256)")
    return lowbit.hadamard(d, normalized=True).astype(np.float32)


def _rotate(x: jax.Array, rot: np.ndarray) -> jax.Array:
    return jnp.einsum("...d,de->...e", x.astype(jnp.float32), jnp.asarray(rot), precision=jax.lax.Precision.HIGHEST)


# ------------------------------------------------------------------------------------------ the format protocol


@dataclasses.dataclass(frozen=True)
class Format:
    """A KV-cache format: pure functions of arrays; hashable, so it can be a static argument of jit.

    A subclass sets `name` (its registry key) and defines `codecs` (which kvcache.codecs codec stores K and which
    V); it may rotate K (`rotate_k`) or V (`rotate_v`) by the Hadamard matrix, and prepare the query (`fp8_query`).
    Its dataclass fields are its options (`get(name, **options)`).
    """

    name: ClassVar[str]
    rotate_k: ClassVar[bool] = False  # a dataclass field in formats that make it an option
    rotate_v: ClassVar[bool] = False
    fp8_query: ClassVar[bool] = False

    def codecs(self) -> tuple[Codec, Codec]:
        """(the K codec, the V codec)."""
        raise NotImplementedError

    def codec(self, prefix: str) -> Codec:
        """The codec of side `prefix` ("k" or "v")."""
        return self.codecs()["kv".index(prefix)]

    @property
    def label(self) -> str:
        """The name shown in tables and errors (with the options that differ from the defaults)."""
        return self.name

    @property
    def key_field(self) -> str:
        """The field whose shape is [..., K, bs, ...] in a pool and [..., K, *] per token: where callers read the KV
        head count and block size."""
        return self.codec("k").main_field("k")

    def check_head_dim(self, head_dim: int) -> None:
        """Raises ValueError naming `head_dim`, its value and what is allowed if this format cannot store heads of
        that size: one every codec (and the rotation, if any) takes as it is, or one of `PADDED_HEAD_DIMS`."""
        if head_dim in PADDED_HEAD_DIMS:
            return
        try:
            for codec in self.codecs():
                codec.check_head_dim(head_dim)
            if self.rotate_k or self.rotate_v:
                hadamard(head_dim)
        except ValueError as e:
            raise ValueError(f"{e}; or one of {list(PADDED_HEAD_DIMS)}, stored padded with zeros") from None

    def padded_head_dim(self, head_dim: int) -> int:
        """Dp, the head dim the fields store for model heads of `head_dim` (checked: `check_head_dim`): `head_dim`
        itself, or for one of `PADDED_HEAD_DIMS` the smallest size >= it that is a multiple of every codec's
        `pad_multiple` (32 or 64) and, if the format rotates, a power of two (80, 96 -> 96 for bf16 / fp8, 128 for
        the 4-bit formats)."""
        self.check_head_dim(head_dim)
        if head_dim not in PADDED_HEAD_DIMS:
            return head_dim
        multiple = max(codec.pad_multiple for codec in self.codecs())  # 32 or 64: the larger is their lcm
        dp = -(-head_dim // multiple) * multiple
        return 1 << (dp - 1).bit_length() if self.rotate_k or self.rotate_v else dp

    def fields(self, num_kv_heads: int, head_dim: int) -> Fields:
        """name -> (shape per token [K, *trailing], dtype) of each stored array, in the slot's byte order, for model
        heads of `head_dim` (stored as `padded_head_dim(head_dim)` columns)."""
        dp = self.padded_head_dim(head_dim)
        k, v = self.codecs()
        return {**k.fields("k", num_kv_heads, dp), **v.fields("v", num_kv_heads, dp)}

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one token occupies in one layer (keys, values and their scales): the sum of its fields' sizes, at
        the padded (stored) head dim."""
        return sum(
            int(np.prod(shape)) * np.dtype(dtype).itemsize
            for shape, dtype in self.fields(num_kv_heads, head_dim).values()
        )

    def head_dim_of(self, fields: dict[str, jax.Array]) -> int:
        """The stored head dim Dp of fields (any leading dims): `padded_head_dim` of the model's D."""
        return self.codec("k").head_dim_of(fields[self.key_field])

    def rotation(self, head_dim: int) -> np.ndarray | None:
        """The matrix [Dp, Dp] that padded K (and the query) is rotated by before storing, or None."""
        return hadamard(self.padded_head_dim(head_dim)) if self.rotate_k else None

    def value_rotation(self, head_dim: int) -> np.ndarray | None:
        """The matrix [Dp, Dp] that padded V is rotated by before storing, or None."""
        return hadamard(self.padded_head_dim(head_dim)) if self.rotate_v else None

    def pad(self, x: jax.Array) -> jax.Array:
        """x [..., D] -> float32 [..., Dp], zero columns appended (`padded_head_dim`; nothing when Dp = D)."""
        dp = self.padded_head_dim(x.shape[-1])
        x = x.astype(jnp.float32)
        return x if dp == x.shape[-1] else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, dp - x.shape[-1])])

    def finish_output(self, out: jax.Array, head_dim: int | None = None) -> jax.Array:
        """Attention output [..., Dp] computed from stored (possibly rotated) V -> output in the model's basis,
        [..., head_dim] (its first `head_dim` columns: the others are the padding's zeros; default Dp, none cut)."""
        rot = self.value_rotation(out.shape[-1])
        out = out if rot is None else _rotate(out, rot)
        return out if head_dim is None else out[..., :head_dim]

    def prepare_query(self, q: jax.Array) -> jax.Array:
        """q [..., D] -> float32 query [..., Dp] in the basis (and precision) the score product with the stored K
        uses: padded with zeros to Dp, rotated like K, and with `fp8_query` rounded to FP8 E4M3 values (scale 1,
        saturating at +-448; zeros stay zeros)."""
        q = self.pad(q)
        rot = self.rotation(q.shape[-1])
        if rot is not None:
            q = _rotate(q, rot)
        return lowbit.round_e4m3(q) if self.fp8_query else q

    def stored_rows(self, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        """k, v [..., K, D] -> float32 [..., K, Dp]: padded with zeros and rotated as the format stores them (what
        the codecs encode; the write kernel's input)."""
        k, v = self.pad(k), self.pad(v)
        rot, vrot = self.rotation(k.shape[-1]), self.value_rotation(k.shape[-1])
        return (k if rot is None else _rotate(k, rot)), (v if vrot is None else _rotate(v, vrot))

    def quantize(self, k: jax.Array, v: jax.Array) -> dict[str, jax.Array]:
        """k, v [..., K, D] (any float dtype, equal shapes) -> the stored fields, each [..., K, *trailing] (at the
        padded head dim Dp)."""
        if k.shape != v.shape:
            raise ValueError(f"k {k.shape} and v {v.shape} must have the same shape [..., K, D]")
        chex.assert_type([k, v], float, custom_message=f"{self.label}: k and v are quantised from floating point")
        k, v = self.stored_rows(k, v)
        kc, vc = self.codecs()
        return {**kc.encode("k", k), **vc.encode("v", v)}

    def dequantize(
        self, fields: dict[str, jax.Array], *, rotated: bool = False, head_dim: int | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """The stored fields -> (k, v) float32 [..., K, Dp]. With `rotated=True`, rotated K (and V) stay in the
        stored basis (what attention uses, with `prepare_query` and `finish_output`); otherwise they are rotated
        back (H is its own inverse: one more product with it), and `head_dim` (the model's D) cuts the padding off:
        [..., K, D]. A `head_dim` other than Dp with `rotated=True` on a rotating format is a ValueError (padding is
        not a set of columns in the rotated basis)."""
        kc, vc = self.codecs()
        k, v = kc.decode(fields, "k"), vc.decode(fields, "v")
        dp = k.shape[-1]
        rot, vrot = self.rotation(dp), self.value_rotation(dp)
        if not rotated:
            k = k if rot is None else _rotate(k, rot)
            v = v if vrot is None else _rotate(v, vrot)
        if head_dim is None or head_dim == dp:
            return k, v
        if (rotated and (rot is not None or vrot is not None)) or self.padded_head_dim(head_dim) != dp:
            raise ValueError(
                f"head_dim = {head_dim}; allowed: the stored {dp}, or a head dim stored as {dp} "
                f"(with rotated=False where {self.label} rotates)"
            )
        return k[..., :head_dim], v[..., :head_dim]

    # --- what the Pallas kernels need (refs of a layer's pool fields [NB, K, bs, ...], indexed per block and head)

    def kernel_groups(self, refs: dict, prefix: str, blk, h, head_dim: int) -> Iterator[KernelGroup]:
        """Yields (g, values [bs, 32] float32, group scale [bs] or None) for each 32-column group g of the K
        (prefix "k") or V ("v") of block `blk`, KV head `h`. Values without a group scale may be NaN or Inf in the
        block's tail past the sequence (the kernel selects them away); with one, they are finite. `head_dim` is the
        stored (padded) Dp."""
        return self.codec(prefix).kernel_groups(refs, prefix, blk, h, head_dim)

    def kernel_token_scale(self, refs: dict, prefix: str, blk, h) -> jax.Array | None:
        """A per-token scale [bs] of the block's K (multiplies the scores) or V (multiplies the probabilities),
        or None."""
        return self.codec(prefix).kernel_token_scale(refs, prefix, blk, h)

    def kernel_write(self, outs: dict, prefix: str, row, blk, h, off, head_dim: int) -> None:
        """Stores one token's K or V (prefix "k" / "v") into slot `off` of block `blk`, KV head `h` of the output
        refs. `row()` loads the token's (already rotated) row as float32 [1, D]; `row(start, size)` its columns
        [start, start + size) as [1, size]."""
        self.codec(prefix).kernel_write(outs, prefix, row, blk, h, off, head_dim)


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
    """The format called `name` (a key of `REGISTRY`) with its options: fp4 takes grid, scale_rule, rotate_k,
    rotate_v, fp8_query; nvfp4 select, fp8_query; k8v4 grid, scale_rule. Unknown names, options and option values
    are a ValueError."""
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

    def codecs(self):
        return Plain(), Plain()


@register
@dataclasses.dataclass(frozen=True)
class FP8(Format):
    """E4M3 codes with one float32 scale absmax / 448 per token and head: 2 D + 8 bytes per token and head."""

    name: ClassVar[str] = "fp8"

    def codecs(self):
        return PerToken8(), PerToken8()


@register
@dataclasses.dataclass(frozen=True)
class FP4(Format):
    """UltraQuant (arXiv 2606.20474): 4-bit codes (split-half packed) and UE8M0 scales per 32: D + D / 16 bytes.

    Attributes:
      grid: "e2m1" (UltraQuant), "e1m2" or "int4" (the uniform grid; the same values under power-of-two scales).
      scale_rule: "mse" or "mx" (kvcache.codecs).
      rotate_k: rotate K (and the query) by the Hadamard matrix.
      rotate_v: rotate V as well (the "symmetric" treatment UltraQuant rejects; for measurements): attention then
        yields P (V H), and `finish_output` multiplies the output by H.
      fp8_query: cast the (rotated) query to FP8 E4M3 (scale 1) before the score product.
    """

    name: ClassVar[str] = "fp4"
    grid: str = "e2m1"
    scale_rule: str = "mse"
    rotate_k: bool = True  # type: ignore[misc]
    rotate_v: bool = False  # type: ignore[misc]
    fp8_query: bool = True  # type: ignore[misc]

    def __post_init__(self):
        self.codecs()  # a bad grid or rule is an error here

    def codecs(self):
        side = Block4(self.grid, "ue8m0", self.scale_rule)
        return side, side

    @property
    def label(self) -> str:
        extras = (
            ([] if self.grid == "e2m1" else [self.grid])
            + [self.scale_rule]
            + ([] if self.rotate_k else ["K unrotated"])
            + (["V rotated"] if self.rotate_v else [])
            + ([] if self.fp8_query else ["fp32 query"])
        )
        return "fp4 (" + ", ".join(extras) + ")"


@register
@dataclasses.dataclass(frozen=True)
class NVFP4(Format):
    """NVFP4 KV (vLLM, FlashInfer, TensorRT-LLM): E2M1 codes and one E4M3 scale per 16: D + D / 8 bytes.

    Attributes:
      select: "max" (scale = e4m3(absmax / 6)) or "4over6" (per block the better of absmax / 6 and absmax / 4).
      fp8_query: cast the query to FP8 E4M3 (scale 1) before the score product (NVFP4 KV's FP8 attention math).
    """

    name: ClassVar[str] = "nvfp4"
    select: str = "max"
    fp8_query: bool = True  # type: ignore[misc]

    def __post_init__(self):
        self.codecs()

    def codecs(self):
        side = Block4("e2m1", "e4m3", self.select)
        return side, side

    @property
    def label(self) -> str:
        return "nvfp4 (" + ", ".join([self.select] + ([] if self.fp8_query else ["fp32 query"])) + ")"


@register
@dataclasses.dataclass(frozen=True)
class K8V4(Format):
    """Asymmetric K8V4: keys as fp8's, values as fp4's (unrotated): 3 D / 2 + D / 32 + 4 bytes.

    Attributes:
      grid, scale_rule: the values' 4-bit grid and UE8M0 scale rule (as fp4's).
    """

    name: ClassVar[str] = "k8v4"
    grid: str = "e2m1"
    scale_rule: str = "mse"

    def __post_init__(self):
        self.codecs()

    def codecs(self):
        return PerToken8(), Block4(self.grid, "ue8m0", self.scale_rule)

    @property
    def label(self) -> str:
        return "k8v4 (" + ", ".join(([] if self.grid == "e2m1" else [self.grid]) + [self.scale_rule]) + ")"


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
