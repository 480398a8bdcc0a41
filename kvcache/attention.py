"""Paged attention over a quantised KV cache: the public entry points, dispatching through `IMPLEMENTATIONS`.

`IMPLEMENTATIONS` maps a name to its `Implementation` (the functions behind `unified_attention`,
`decode_attention` and `write`, None where it offers no such op), as tokamax's ops map backends:
  "pallas_tpu":    `kvcache.kernels.tpu_attention` and `tpu_write` (Mosaic TPU; imported when first called, so the
                   registry works without them); decode and unified attention, quantise-on-write;
  "pallas_triton": `kvcache.kernels` (Triton, for NVIDIA and AMD GPUs: split-KV with a log-sum-exp reduce, formats
                   decoded in the kernel); "pallas" is its alias (older configs and flags);
  "xla_split":     decode only: `kvcache.split`, the split-KV algorithm as an XLA loop (the CPU fast path); its
                   writes are the reference's;
  "xla":           `kvcache.reference` (gathers each sequence's blocks, dequantises, one softmax); never refuses;
  "auto":          by `jax.default_backend()` (`BACKEND_ORDER`): tpu -> pallas_tpu, xla; gpu -> pallas_triton,
                   xla_split (decode), xla; cpu -> xla_split (decode), xla.
A Pallas kernel on a CPU backend runs in Pallas' interpreter (`interpret=None` picks that automatically; pass False
to insist on a compiled kernel); the Triton kernels refuse a TPU backend unless told to interpret.

`implementation=` takes one name or a sequence of names (auto expands in place): the first implementation that
accepts the call runs. An implementation refuses a configuration by raising NotImplementedError (its tiles do not fit
the device's on-chip memory: `kvcache.kernels.budgets`; a shape it does not handle; its kernel module missing); the
dispatcher then logs ONE warning line on the logger "kvcache.attention" (which implementation refused, why, which one
runs next) and runs the next. A single explicitly named implementation that refuses raises its NotImplementedError;
so does a sequence whose every member refused. Under `jax.jit` the choice is made, and logged, once per trace.
`partitions` tunes the split-KV implementations (pallas_triton, pallas_tpu, xla_split); in a sequence, the others
ignore it; naming only implementations that do not take it is a ValueError.

Input refusals (`_check`, before any implementation runs): shapes and dtypes always; and when the arrays are
concrete (not traced: under `jax.jit` their values are unknown, so only shapes are checked there), seq_lens in
0 .. block_tables.shape[1] * block_size, block-table entries in 0 .. the pool's blocks - 1, write slots below the
pool's slots (negative = skip). Each a one-line ValueError naming the argument, the value and what is allowed.
Shapes and semantics: `kvcache.reference`. Adding an implementation is one entry of the dict.

All of them exclude the positions a query may not see by selection (`jnp.where` on scores, values and scales), not
by multiplying them with a zero probability: slots past a sequence's length (the tail of its last block, the blocks
behind padding columns of its block table) may hold NaN or Inf left by another request or never written, and
0 * NaN is NaN. Whatever those slots hold, the output is the same bit for bit.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import chex
import jax
import numpy as np

from kvcache import reference, split
from kvcache.formats import Format
from kvcache.kernels import attention as attention_kernel
from kvcache.kernels import write as write_kernel

__all__ = [
    "ALIASES",
    "BACKEND_ORDER",
    "IMPLEMENTATIONS",
    "Implementation",
    "check_implementation",
    "decode_attention",
    "resolve",
    "unified_attention",
    "write",
]

logger = logging.getLogger("kvcache.attention")

_OPS = {"unified": "unified_attention", "decode": "decode_attention", "write": "write"}


def _interpret(interpret: bool | None) -> bool:
    """Triton kernels: compiled on a GPU backend, interpreted on a CPU one unless told; refused elsewhere."""
    backend = jax.default_backend()
    if interpret is None and backend not in ("gpu", "cpu"):
        raise NotImplementedError(f"the Triton kernels compile for a GPU backend; this one is {backend}")
    return backend == "cpu" if interpret is None else interpret


# Each op of an implementation takes the public function's arguments (`partitions`, `interpret`, `device`).


def _xla_unified(
    q, fields, block_tables, seq_lens, query_start_loc, *, fmt, max_query_len, sm_scale, partitions, interpret, device
):
    return reference.unified_attention(
        q, fields, block_tables, seq_lens, query_start_loc, fmt=fmt, max_query_len=max_query_len, sm_scale=sm_scale
    )


def _triton_unified(q, fields, block_tables, seq_lens, query_start_loc, *, interpret, **kw):
    return attention_kernel.unified_attention(
        q, fields, block_tables, seq_lens, query_start_loc, interpret=_interpret(interpret), **kw
    )


def _tpu_module(module: str) -> Any:
    try:
        return importlib.import_module(f"kvcache.kernels.{module}")
    except ImportError as e:
        raise NotImplementedError(f"the Mosaic TPU kernels are not available ({e})") from e


def _tpu_op(name: str, module: str = "tpu_attention") -> Callable[..., Any]:
    op = getattr(_tpu_module(module), name, None)
    if op is None:
        raise NotImplementedError(f"kvcache.kernels.{module} has no {name}")
    return op


def _tpu_unified(q, fields, block_tables, seq_lens, query_start_loc, *, interpret, **kw):
    op = _tpu_op("unified_attention")  # (its own `interpret`: None compiles on a TPU, interprets elsewhere)
    return op(q, fields, block_tables, seq_lens, query_start_loc, interpret=interpret, **kw)


def _xla_decode(q, fields, block_tables, seq_lens, *, fmt, sm_scale, partitions, interpret, device):
    return reference.decode_attention(q, fields, block_tables, seq_lens, fmt=fmt, sm_scale=sm_scale)


def _split_decode(q, fields, block_tables, seq_lens, *, fmt, sm_scale, partitions, interpret, device):
    per = None if partitions is None else -(-block_tables.shape[1] // partitions)  # None: split.partition_blocks
    return split.decode_attention(
        q, fields, block_tables, seq_lens, fmt=fmt, sm_scale=sm_scale, blocks_per_partition=per
    )


def _triton_decode(q, fields, block_tables, seq_lens, *, interpret, **kw):
    return attention_kernel.decode_attention(q, fields, block_tables, seq_lens, interpret=_interpret(interpret), **kw)


def _tpu_decode(q, fields, block_tables, seq_lens, *, interpret, **kw):
    op = _tpu_op("decode_attention")
    return op(q, fields, block_tables, seq_lens, interpret=interpret, **kw)


def _xla_write(fields, k, v, slot_mapping, *, fmt, interpret):
    return reference.write(fields, k, v, slot_mapping, fmt=fmt)


def _triton_write(fields, k, v, slot_mapping, *, fmt, interpret):
    return write_kernel.write(fields, k, v, slot_mapping, fmt=fmt, interpret=_interpret(interpret))


def _tpu_write(fields, k, v, slot_mapping, *, fmt, interpret):
    op = _tpu_op("write", "tpu_write")  # (its own `interpret`, as the TPU attention kernel's)
    return op(fields, k, v, slot_mapping, fmt=fmt, interpret=interpret)


class Implementation(NamedTuple):
    """The functions of one attention implementation (signatures of the public functions; None: not offered), and
    whether it takes `partitions` (split-KV)."""

    unified: Callable[..., jax.Array] | None
    decode: Callable[..., jax.Array] | None
    write: Callable[..., dict[str, jax.Array]] | None
    partitions: bool = False


# tpu / gpu / cpu -> op -> the implementations "auto" tries, in order (any other backend: cpu's).
BACKEND_ORDER: dict[str, dict[str, tuple[str, ...]]] = {
    "tpu": {"unified": ("pallas_tpu", "xla"), "decode": ("pallas_tpu", "xla"), "write": ("pallas_tpu", "xla")},
    "gpu": {
        "unified": ("pallas_triton", "xla"),
        "decode": ("pallas_triton", "xla_split", "xla"),
        "write": ("pallas_triton", "xla"),
    },
    "cpu": {"unified": ("xla",), "decode": ("xla_split", "xla"), "write": ("xla",)},
}
ALIASES = {"pallas": "pallas_triton"}


def _auto(op: str) -> Callable[..., Any]:
    def run(*args, **kw):
        return _dispatch(op, "auto", *args, **kw)

    run.__name__ = f"auto_{op}"
    return run


_TRITON = Implementation(_triton_unified, _triton_decode, _triton_write, partitions=True)
IMPLEMENTATIONS: dict[str, Implementation] = {
    "pallas_tpu": Implementation(_tpu_unified, _tpu_decode, _tpu_write, partitions=True),
    "pallas_triton": _TRITON,
    "xla_split": Implementation(None, _split_decode, _xla_write, partitions=True),
    "xla": Implementation(_xla_unified, _xla_decode, _xla_write),
    "pallas": _TRITON,  # alias of pallas_triton
    "auto": Implementation(_auto("unified"), _auto("decode"), _auto("write"), partitions=True),
}


def check_implementation(implementation: str) -> Implementation:
    """The implementation called `implementation`; ValueError naming it and the allowed names otherwise."""
    if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation = {implementation!r}; allowed: {list(IMPLEMENTATIONS)} or a sequence of them")
    return IMPLEMENTATIONS[implementation]


def resolve(implementation: str | Sequence[str] | None, op: str, backend: str | None = None) -> tuple[str, ...]:
    """The implementations `implementation` tries for `op` ("unified", "decode" or "write"), in order: "auto" (or
    None) expanded by `backend` (default `jax.default_backend()`) leaving out those that do not offer the op, aliases
    replaced by their names, repeats dropped. ValueError for an unknown name or an empty sequence."""
    if implementation is None or isinstance(implementation, str):
        names = ["auto" if implementation is None else implementation]
    else:
        names = list(implementation)
    if not names:
        raise ValueError(
            f"implementation = {implementation!r}; allowed: a name of {list(IMPLEMENTATIONS)} or a sequence"
        )
    out: list[str] = []
    for name in names:
        check_implementation(name)
        if name == "auto":
            order = BACKEND_ORDER.get(backend or jax.default_backend(), BACKEND_ORDER["cpu"])[op]
            expanded = [n for n in order if getattr(IMPLEMENTATIONS[n], op) is not None]
        else:
            expanded = [ALIASES.get(name, name)]
        out += [n for n in expanded if n not in out]
    return tuple(out)


def _dispatch(op: str, implementation: str | Sequence[str] | None, *args, **kw):
    """Run `op` on the first implementation of `resolve(implementation, op)` that accepts the call (see the module
    docstring for refusals, the log line and `partitions`)."""
    names = resolve(implementation, op)
    asked = [implementation] if isinstance(implementation, str) or implementation is None else list(implementation)
    single = len(asked) == 1 and asked[0] not in (None, "auto")
    public = _OPS[op]
    named = not any(a in (None, "auto") for a in asked)  # "auto" takes partitions as a hint
    if named and kw.get("partitions") is not None and not any(IMPLEMENTATIONS[n].partitions for n in names):
        raise ValueError(
            f"partitions applies to implementation={[n for n, i in IMPLEMENTATIONS.items() if i.partitions]} only; "
            f"got {implementation!r}"
        )
    refusals = []
    for i, name in enumerate(names):
        impl = IMPLEMENTATIONS[name]
        fn = getattr(impl, op)
        if fn is None:
            if single:
                offering = [n for n, x in IMPLEMENTATIONS.items() if getattr(x, op) is not None]
                raise ValueError(f"implementation = {implementation!r} offers no {public}; use one of {offering}")
            reason = f"offers no {public}"
        else:
            try:
                return fn(*args, **(kw if impl.partitions or "partitions" not in kw else {**kw, "partitions": None}))
            except NotImplementedError as e:
                if single:
                    raise
                reason = str(e)
        refusals.append(f"{name!r}: {reason}")
        if i + 1 < len(names):
            logger.warning("%s: implementation %r refused (%s); running %r", public, name, reason, names[i + 1])
    raise NotImplementedError(f"{public}: every implementation of {implementation!r} refused: {'; '.join(refusals)}")


def _concrete(x) -> np.ndarray | None:
    """x's values, or None under tracing (jit), where they are unknown."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _first_outside(name: str, values: np.ndarray, low: int, high: int, allowed: str) -> None:
    bad = np.argwhere((values < low) | (values > high))
    if len(bad):
        at = tuple(int(i) for i in bad[0])
        index = ", ".join(map(str, at))
        raise ValueError(f"{name}[{index}] = {int(values[at])}; allowed: {allowed}")


def _check(q, fields, block_tables, seq_lens, fmt: Format, q_rank: int) -> None:
    chex.assert_rank(q, q_rank, custom_message="q: [tokens or sequences, heads, head_dim]")
    chex.assert_type(q, float, custom_message="q: a floating-point query")
    chex.assert_type([block_tables, seq_lens], int, custom_message="block_tables and seq_lens: integer arrays")
    names = set(fmt.fields(1, q.shape[-1]))  # (checks the head dim)
    if set(fields) != names:
        raise ValueError(f"cache fields {sorted(fields)} do not match format {fmt.label}: expected {sorted(names)}")
    num_blocks, num_kv, block_size = fields[fmt.key_field].shape[:3]
    if q.shape[-2] % num_kv:
        raise ValueError(f"q has {q.shape[-2]} heads; must be a multiple of the cache's {num_kv} KV heads")
    if block_tables.ndim != 2 or seq_lens.shape != block_tables.shape[:1]:
        raise ValueError(f"block_tables {block_tables.shape} must be [B, max_blocks] and seq_lens {seq_lens.shape} [B]")
    capacity = block_tables.shape[1] * block_size
    lens, tables = _concrete(seq_lens), _concrete(block_tables)
    if lens is not None:
        allowed = f"0 .. {capacity} (block_tables' {block_tables.shape[1]} columns x block size {block_size})"
        _first_outside("seq_lens", lens, 0, capacity, allowed)
    if tables is not None:
        _first_outside(
            "block_tables", tables, 0, num_blocks - 1, f"0 .. {num_blocks - 1} (the pool's {num_blocks} blocks)"
        )


def unified_attention(
    q: jax.Array,
    fields: dict[str, jax.Array],
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    fmt: Format,
    implementation: str | Sequence[str] | None = "auto",
    max_query_len: int | None = None,
    sm_scale: float | None = None,
    partitions: int | None = None,
    interpret: bool | None = None,
    device: str | None = None,
) -> jax.Array:
    """A ragged batch of prefill chunks and decode tokens over the paged cache (q [T, H, D] -> [T, H, D] float32).

    See `kvcache.reference.unified_attention`. implementation: a name of `IMPLEMENTATIONS` or a sequence of them
    (the first that accepts the call runs; see the module docstring). partitions: the split-KV partition count of the
    Pallas kernels. device: the device family whose on-chip memory the kernel's tiles must fit (Triton: shared
    memory / LDS; TPU: VMEM; `kvcache.kernels.budgets.BUDGETS`; None: detected from the default device, unknown
    -> not checked; the TPU kernel refuses a family that is not a TPU).
    Raises: ValueError for bad input (the argument, its value, what is allowed); NotImplementedError when the named
    implementation (or every one of a sequence) refuses the call.
    """
    resolve(implementation, "unified")
    _check(q, fields, block_tables, seq_lens, fmt, 3)
    return _dispatch(
        "unified",
        implementation,
        q,
        fields,
        block_tables,
        seq_lens,
        query_start_loc,
        fmt=fmt,
        max_query_len=max_query_len,
        sm_scale=sm_scale,
        partitions=partitions,
        interpret=interpret,
        device=device,
    )


def decode_attention(
    q: jax.Array,
    fields: dict[str, jax.Array],
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    fmt: Format,
    implementation: str | Sequence[str] | None = "auto",
    sm_scale: float | None = None,
    partitions: int | None = None,
    interpret: bool | None = None,
    device: str | None = None,
) -> jax.Array:
    """One new token per sequence (q [B, H, D] -> [B, H, D] float32), split-KV in the Pallas kernels and in
    "xla_split" (`partitions` = the partition count there). implementation, device, errors: as unified_attention."""
    resolve(implementation, "decode")
    _check(q, fields, block_tables, seq_lens, fmt, 3)
    return _dispatch(
        "decode",
        implementation,
        q,
        fields,
        block_tables,
        seq_lens,
        fmt=fmt,
        sm_scale=sm_scale,
        partitions=partitions,
        interpret=interpret,
        device=device,
    )


def write(
    fields: dict[str, jax.Array],
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    fmt: Format,
    implementation: str | Sequence[str] | None = "auto",
    interpret: bool | None = None,
) -> dict[str, jax.Array]:
    """Quantise-on-write of k, v [T, K, D] into flat slots [T] (negative = skip); returns the updated fields.

    Concrete slots must be below the pool's NB * bs slots (ValueError naming the first that is not)."""
    resolve(implementation, "write")
    chex.assert_rank([k, v, slot_mapping], [3, 3, 1], custom_message="k, v: [T, K, D]; slot_mapping: [T]")
    chex.assert_type(slot_mapping, int, custom_message="slot_mapping: integer slots")
    num_blocks, _, block_size = next(iter(fields.values())).shape[:3]
    slots = _concrete(slot_mapping)
    if slots is not None:
        top = num_blocks * block_size - 1
        allowed = f"negative (skip) or 0 .. {top} (the pool's {num_blocks} blocks x {block_size} slots)"
        _first_outside("slot_mapping", slots, np.iinfo(slots.dtype).min, top, allowed)
    return _dispatch("write", implementation, fields, k, v, slot_mapping, fmt=fmt, interpret=interpret)
