"""On-chip memory budgets of the kernels' tiles, per device family, and the check a kernel makes before it runs.

A kernel whose tiles do not fit the on-chip memory of a program fails to compile (Triton: "out of resource: shared
memory, Required: 65792, Hardware limit: 65536"), or worse, on some stacks, at launch. The kernels here compute their
static need from their tile shapes and call `check` first: a configuration that does not fit raises
NotImplementedError with the numbers, which `kvcache.attention` treats as a refusal (the next implementation runs).
`fit_tile` halves a default query tile until it fits: the Triton kernel against shared memory / LDS
(`triton_attention_bytes`), the TPU kernel against the scoped VMEM default (`tpu_attention.vmem_bytes`), past which
the TPU kernel compiles with the chip's physical VMEM as its `vmem_limit_bytes`, if that holds it.

`BUDGETS[family]` (bytes a program may use):
  TPU VMEM per TensorCore (Mosaic): the scoped default a kernel gets without `vmem_limit_bytes` (16 MiB on v4, v5e
    and v5p, 32 MiB on v6e; JAX's Pallas TPU documentation, "Pipelining" and `pltpu.CompilerParams.vmem_limit_bytes`)
    and the physical size a kernel may raise it to (16 MiB v4, 128 MiB v5e, 64 MiB v5p, 128 MiB v6e; JAX's
    `jax._src.pallas.mosaic.tpu_info` table of chips).
  NVIDIA shared memory per thread block, the opt-in maximum Triton requests (CUDA C++ Programming Guide, "Compute
    Capabilities" table): 227 KB = 232,448 B on H100 and H200 (compute capability 9.0) and on B200 (10.0).
  AMD LDS per workgroup: 64 KB = 65,536 B on MI300X (CDNA3, 64 KB per CU), 160 KB = 163,840 B on MI355X (CDNA4);
    64 KB on RDNA3 and RDNA4 per workgroup (AMD's ISA guides). vLLM's unified attention on RDNA4 asked for 65,792 B
    of the 65,536 B there: 256 B over is enough to fail.

Family names: "tpu_v4", "tpu_v5e", "tpu_v5p", "tpu_v6e", "h100", "h200", "b200", "mi300x", "mi355x", "rdna3", "rdna4".
`family_of(device_kind)` maps a `jax.Device.device_kind` to one (None when unknown: then no check is made).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax

from kvcache.formats import GROUP

__all__ = [
    "BUDGETS",
    "Budget",
    "check",
    "detect",
    "family_of",
    "fit_tile",
    "resolve",
    "triton_attention_bytes",
]

_KIB = 1024
_MIB = 1024 * 1024


class Budget(NamedTuple):
    """One device family's on-chip memory for a program: `bytes` the kernel may use by default, `physical` the
    hardware's size (equal except TPU VMEM, whose scoped default a kernel may raise), `memory` its name."""

    memory: str
    bytes: int
    physical: int


BUDGETS: dict[str, Budget] = {
    "tpu_v4": Budget("VMEM", 16 * _MIB, 16 * _MIB),
    "tpu_v5e": Budget("VMEM", 16 * _MIB, 128 * _MIB),
    "tpu_v5p": Budget("VMEM", 16 * _MIB, 64 * _MIB),
    "tpu_v6e": Budget("VMEM", 32 * _MIB, 128 * _MIB),
    "h100": Budget("shared memory", 227 * _KIB, 227 * _KIB),
    "h200": Budget("shared memory", 227 * _KIB, 227 * _KIB),
    "b200": Budget("shared memory", 227 * _KIB, 227 * _KIB),
    "mi300x": Budget("LDS", 64 * _KIB, 64 * _KIB),
    "mi355x": Budget("LDS", 160 * _KIB, 160 * _KIB),
    "rdna3": Budget("LDS", 64 * _KIB, 64 * _KIB),
    "rdna4": Budget("LDS", 64 * _KIB, 64 * _KIB),
}

# Substrings of a lower-cased `device_kind` (or its gfx target) -> family; the first match wins.
_KINDS: tuple[tuple[str, str], ...] = (
    ("tpu v4 lite", ""),  # v4i: not in the table
    ("tpu v4", "tpu_v4"),
    ("tpu v5 lite", "tpu_v5e"),
    ("tpu v5e", "tpu_v5e"),
    ("tpu v5p", "tpu_v5p"),
    ("tpu v5", "tpu_v5p"),
    ("tpu v6 lite", "tpu_v6e"),
    ("tpu v6e", "tpu_v6e"),
    ("h100", "h100"),
    ("h200", "h200"),
    ("b200", "b200"),
    ("mi300x", "mi300x"),
    ("gfx942", "mi300x"),
    ("mi355x", "mi355x"),
    ("mi350x", "mi355x"),
    ("gfx950", "mi355x"),
    ("gfx110", "rdna3"),
    ("radeon rx 7", "rdna3"),
    ("radeon pro w7", "rdna3"),
    ("gfx120", "rdna4"),
    ("radeon rx 90", "rdna4"),
    ("radeon ai pro r9", "rdna4"),
)


def family_of(device_kind: str) -> str | None:
    """The family of a `jax.Device.device_kind` ("NVIDIA H100 80GB HBM3" -> "h100", "TPU v5 lite" -> "tpu_v5e",
    "AMD Radeon RX 9070 XT" -> "rdna4"), or None for a device not in `BUDGETS` (a CPU, an A100, ...)."""
    kind = device_kind.lower()
    for pattern, family in _KINDS:
        if pattern in kind:
            return family or None
    return None


def detect() -> str | None:
    """The family of the default device (`jax.devices()[0]`), None when unknown."""
    return family_of(jax.devices()[0].device_kind)


def resolve(device: str | None) -> str | None:
    """`device` (a family name of `BUDGETS`) as given, or the detected family when None. ValueError naming the
    value and the allowed names for any other string."""
    if device is None:
        return detect()
    if device not in BUDGETS:
        raise ValueError(f"device = {device!r}; allowed: None (detect) or one of {list(BUDGETS)}")
    return device


def check(need_bytes: int, device_family: str, *, what: str = "the kernel") -> None:
    """Refuse a tile configuration that does not fit: NotImplementedError "needs 65,792 B of LDS; rdna4 has
    65,536 B" when need_bytes > BUDGETS[device_family].bytes; nothing otherwise. ValueError for an unknown family."""
    if device_family not in BUDGETS:
        raise ValueError(f"device_family = {device_family!r}; allowed: {list(BUDGETS)}")
    budget = BUDGETS[device_family]
    if need_bytes > budget.bytes:
        raise NotImplementedError(
            f"{what} needs {need_bytes:,} B of {budget.memory}; {device_family} has {budget.bytes:,} B"
        )


def fit_tile(
    need: Callable[[int], int],
    *,
    tile: int,
    device_family: str,
    shrink: bool = True,
    what: Callable[[int], str],
    raisable: bool = False,
) -> int:
    """The largest query tile <= `tile` (halving; only `tile` itself when shrink=False) whose `need(tile)` bytes fit
    `BUDGETS[device_family].bytes`. When none does: with `raisable` (TPU VMEM, whose scoped default a kernel may
    raise) the smallest tile tried is returned if it fits the physical size (the caller raises its limit);
    otherwise NotImplementedError with the numbers of the smallest tile tried, naming it by `what(tile)`."""
    budget = BUDGETS[device_family]
    while need(tile) > budget.bytes and shrink and tile > 1:
        tile = max(1, tile // 2)
    if not raisable:
        check(need(tile), device_family, what=what(tile))
    elif need(tile) > budget.physical:
        raise NotImplementedError(
            f"{what(tile)} needs {need(tile):,} B of {budget.memory}; {device_family} has {budget.physical:,} B"
        )
    return tile


def triton_attention_bytes(
    *, rows: int, head_dim: int, block_size: int, kv_bytes_per_token: int, q_bytes: int = 4, acc_bytes: int = 4
) -> int:
    """Static on-chip bytes of one program of the Triton paged-attention kernel (`kvcache.kernels.attention`).

    The tiles live at once in the block loop, with R = query tile rows (tile tokens x padded query heads), D the
    head dim, bs the block size, kv = bytes of one token's K, V and scales for one KV head as stored:
        query tile      R * D * q_bytes          (the prepared query, float32)
        accumulators    R * D * acc_bytes + 2 * R * acc_bytes   (output accumulator, running max m and sum l)
        scores          R * bs * 4               (scores, then probabilities, float32)
        one KV block    bs * kv                  (K, V and their scales as stored)
        decoded groups  2 * bs * GROUP * 4       (one decoded 32-column K group and V group, float32)
    e.g. R = 16, D = 128, bs = 16, bf16 (kv = 512): 8,192 + 8,320 + 1,024 + 8,192 + 4,096 = 29,824 B.
    This is a model of what the compiler must hold, not its exact allocation; it is monotone in every tile size, so
    a smaller tile never needs more.
    """
    for name, value in (("rows", rows), ("head_dim", head_dim), ("block_size", block_size)):
        if value < 1:
            raise ValueError(f"{name} = {value}; must be >= 1")
    query = rows * head_dim * q_bytes
    acc = rows * head_dim * acc_bytes + 2 * rows * acc_bytes
    scores = rows * block_size * 4
    block = block_size * kv_bytes_per_token
    decoded = 2 * block_size * GROUP * 4
    return query + acc + scores + block + decoded
