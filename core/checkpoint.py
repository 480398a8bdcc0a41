"""Checkpoints with orbax: save, find the latest, restore exactly and verified, refuse what does not fit.

A checkpoint of step s holds the whole training state as a flat {path: array} dict (parameters, optimizer
state, step, PRNG key) and a JSON record: a manifest of every array's shape, dtype and content checksum
(`digest`), the loop's own state (e.g. the running train-loss window), `compat` facts (model config, optimizer,
data fingerprint) that must match for a resume to be meaningful, the caller's `provenance` (how the state was
trained), and a SHA-256 of the record itself. Restoring first checks the record's own hash and compares the
manifest and the compat facts with the running program, before any array is read; then it reads the arrays and
recomputes their checksums. Anything damaged or different raises `CheckpointError` (`DamagedCheckpointError`
when the bytes on disk are not what was saved) naming the checkpoint and what differs. Nothing on disk is
modified by a failed restore.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from core import orbax_compat

with orbax_compat.root_logging_as_it_was():  # absl's basicConfig on orbax's import-time logs
    import orbax.checkpoint as ocp

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "DamagedCheckpointError",
    "Digest",
    "digest",
    "flatten",
    "load_numpy",
    "unflatten",
]


class CheckpointError(RuntimeError):
    """A checkpoint is corrupt or does not fit the running program. The message says which and what to do."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's files cannot be read, or what they hold is not what was saved (a checksum differs)."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (the disk is full, the folder not writable): the message names the folder,
    the cause and the checkpoints kept, from which a rerun resumes."""


def _key_name(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def flatten(tree) -> dict[str, Any]:
    """{"a/b/0/c": leaf} for every leaf of `tree` (dict keys, attribute names and indices joined by '/')."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    flat = {"/".join(_key_name(e) for e in path): leaf for path, leaf in leaves}
    if len(flat) != len(leaves):
        raise ValueError("two leaves of the state flatten to the same checkpoint key")
    return flat


def unflatten(like, flat: Mapping[str, Any]):
    """Inverse of `flatten` given a tree `like` of the same structure."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(treedef, [flat["/".join(_key_name(e) for e in p)] for p, _ in leaves])


def _manifest(flat: Mapping[str, Any]) -> dict[str, list]:
    return {k: [list(np.shape(v)), str(np.dtype(v.dtype))] for k, v in flat.items()}


def _record_hash(meta: Mapping[str, Any]) -> str:
    body = {k: v for k, v in meta.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class Checkpointer:
    """Saves and restores training states under `directory` (one subdirectory per step).

    Args:
      directory: where checkpoints live (created on the first save).
      keep: how many of the most recent checkpoints to keep.
      async_save: write in a background thread (call `wait` before reading or exiting).
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 2, async_save: bool = False):
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._failed = False  # a write failed (close then stays quiet)
        self._closed = False

    def latest_step(self) -> int | None:
        """The newest fully written checkpoint's step (partial writes of a crashed run are ignored)."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(
        self,
        step: int,
        state,
        *,
        loop: Mapping[str, Any],
        compat: Mapping[str, Any],
        provenance: Mapping[str, Any] | None = None,
        checked: Digest | None = None,
    ) -> None:
        """Saves `state` (any pytree of arrays) at `step` with JSON-serialisable `loop`, `compat` and `provenance`
        records and every array's checksum (`checked`: the state's `digest`, when the caller already took it)."""
        flat = flatten(state)
        sums = (checked or digest(state)).checksums
        manifest = {k: [*entry, sums[k]] for k, entry in _manifest(flat).items()}
        meta = {
            "manifest": manifest,
            "loop": dict(loop),
            "compat": _jsonable(dict(compat)),
            "provenance": _jsonable(dict(provenance or {})),
        }
        meta["sha256"] = _record_hash(meta)
        self._check_space(step, sum(v.nbytes for v in flat.values()))
        with self._writing(step):
            self._manager.save(
                step, args=ocp.args.Composite(state=ocp.args.StandardSave(flat), meta=ocp.args.JsonSave(meta))
            )

    def _check_space(self, step: int, nbytes: int) -> None:
        """Raises CheckpointWriteError, before anything is written, if the disk holding the checkpoints has less
        free space than twice the state's bytes (uncompressed) and 1 MiB of records: a bound, with a margin for
        the many small files of orbax's layout, of what a checkpoint takes. A write that fails halfway leaves
        orbax's worker threads failing on their own; this refuses the common case, a full disk, cleanly."""
        need = 2 * nbytes + 2**20
        free = shutil.disk_usage(_existing(self.directory)).free
        if need > free:
            raise CheckpointWriteError(
                f"the checkpoint of step {step} needs up to {need / 2**20:,.1f} MiB and {self.directory} has "
                f"{free / 2**20:,.1f} MiB free (No space left on device): nothing was written, and {self._kept()}"
            )

    def _kept(self) -> str:
        kept = self.all_steps()
        if not kept:
            return "no checkpoint was kept (a rerun starts over)"
        return f"the checkpoints kept are steps {kept} (free space, then rerun: it resumes from {kept[-1]})"

    @contextlib.contextmanager
    def _writing(self, step: int | None):
        """Turns a failed write (orbax's many exception types, TensorStore's RESOURCE_EXHAUSTED for a full disk) into
        one CheckpointWriteError naming the cause and what was kept; the partial write is removed. orbax's worker
        threads log the same failure as absl errors: those are silenced while it writes (the exception reports
        it)."""
        try:
            with self._silenced():
                yield
        except Exception as e:
            self._failed = True
            for partial in glob.glob(os.path.join(glob.escape(self.directory), "*.orbax-checkpoint-tmp*")):
                shutil.rmtree(partial, ignore_errors=True)
            what = f"the checkpoint of step {step}" if step is not None else "a checkpoint"
            raise CheckpointWriteError(
                f"{what} could not be written to {self.directory}: {_cause(e)}; the partial write was removed and "
                f"{self._kept()}"
            ) from None

    def read_record(self, step: int) -> dict[str, Any]:
        """The JSON record of the checkpoint of `step` (manifest, loop, compat, provenance), its hash verified.
        Raises DamagedCheckpointError if it cannot be read or was changed since it was written."""
        where = self._where(step)
        try:
            with orbax_compat.draining_event_loops():
                meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # orbax raises many types for missing/corrupt files
            raise DamagedCheckpointError(f"the {where} cannot be read ({_short(e)}). {_AFTER}") from e
        if not isinstance(meta, dict) or not {"manifest", "loop", "compat"} <= set(meta):
            raise DamagedCheckpointError(
                f"the {where} has no valid metadata record; it was not written by this program or is damaged. {_AFTER}"
            )
        if "sha256" in meta and meta["sha256"] != _record_hash(meta):
            raise DamagedCheckpointError(
                f"the {where} is damaged: its metadata record does not match its hash. {_AFTER}"
            )
        return meta

    def check_compat(self, step: int, compat: Mapping[str, Any], record: Mapping[str, Any]) -> None:
        """Raises CheckpointError naming the first compat fact (`record`: the checkpoint's `read_record`) that
        differs from the running program's `compat`: a checkpoint of another program, whatever else differs."""
        for key, value in compat.items():
            saved = record["compat"].get(key)
            if saved != _jsonable(value):
                raise CheckpointError(_compat_message(self._where(step), key, saved, _jsonable(value)))

    def restore(self, step: int, like, *, compat: Mapping[str, Any], record: Mapping[str, Any] | None = None):
        """Restores the state saved at `step` into the structure, shapes, dtypes and shardings of `like`, and
        verifies every array's checksum.

        Args:
          like: a pytree of arrays or `jax.ShapeDtypeStruct`s (with `.sharding`) of the running program.
          compat: the running program's compat facts; every key must equal the saved value.
          record: the checkpoint's `read_record`, when the caller has already read it.
        Returns:
          (state, loop record).
        Raises:
          CheckpointError naming the checkpoint path and what differs; DamagedCheckpointError if it cannot be read
          or an array's bytes differ from those saved. Collective across processes (the checksums).
        """
        where = self._where(step)
        meta = self.read_record(step) if record is None else record
        self.check_compat(step, compat, meta)
        flat_like = flatten(like)
        expected = _manifest(flat_like)
        saved = meta["manifest"]
        missing, extra = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
        if missing or extra:
            raise CheckpointError(
                f"the {where} does not fit the running program: arrays missing from it "
                f"{missing[:5]}, arrays it has that the program lacks {extra[:5]}. It was written "
                "by a different model or optimizer; use a new --workdir. Nothing was changed."
            )
        for key in expected:
            if expected[key] != saved[key][:2]:
                raise CheckpointError(
                    f"the {where} holds '{key}' with shape/dtype {saved[key][:2]} but the running "
                    f"program needs {expected[key]}; use a new --workdir. Nothing was changed."
                )
        target = {
            k: jax.ShapeDtypeStruct(np.shape(v), v.dtype, sharding=getattr(v, "sharding", None))
            for k, v in flat_like.items()
        }
        try:
            with orbax_compat.draining_event_loops():  # a failed read leaves no other read calling a closed loop
                restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))[
                    "state"
                ]
        except Exception as e:
            raise DamagedCheckpointError(f"the arrays of the {where} cannot be read ({_short(e)}). {_AFTER}") from e
        recorded = {k: entry[2] for k, entry in saved.items() if len(entry) > 2}
        if len(recorded) < len(saved):  # a record without a checksum for every array
            print(f"warning: the {where} records no checksums; it is restored unverified", file=sys.stderr)
        else:
            found = digest(restored).checksums
            differ = sorted(k for k in recorded if found[k] != recorded[k])
            if differ:
                raise DamagedCheckpointError(
                    f"the {where} is damaged: {len(differ)} of its {len(saved)} arrays differ from what was saved "
                    f"(checksums of {differ[:4]}{' ...' if len(differ) > 4 else ''}). {_AFTER}"
                )
        return unflatten(like, restored), meta["loop"]

    def _where(self, step: int) -> str:
        return f"checkpoint of step {step} at {os.path.join(self.directory, str(step))}"

    def wait(self) -> None:
        """Blocks until background writes finish. Raises CheckpointWriteError if one failed."""
        with self._writing(None):
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for background writes and closes (once: a second call does nothing); after a failed write (already
        raised) nothing more is raised."""
        if self._closed:
            return
        self._closed = True
        if self._failed:
            with contextlib.suppress(Exception), self._silenced():
                self._manager.close()
            return
        with self._writing(None):
            self._manager.close()

    @contextlib.contextmanager
    def _silenced(self):
        absl = logging.getLogger("absl")
        level = absl.level
        absl.setLevel(logging.CRITICAL)
        try:
            yield
        finally:
            absl.setLevel(level)


_AFTER = "Nothing was changed."


def _existing(path: str) -> str:
    """`path` or its nearest existing parent (the checkpoints folder is created on the first save)."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _cause(e: Exception) -> str:
    """What stopped a write, in one line: "No space left on device" for a full disk (TensorStore's
    RESOURCE_EXHAUSTED quotes the OS error), else the exception, shortened."""
    if "No space left on device" in str(e) or getattr(e, "errno", None) == errno.ENOSPC:
        return "No space left on device"
    return _short(e)


def load_numpy(directory: str | os.PathLike, step: int | None = None, *, verify: bool = True) -> dict[str, np.ndarray]:
    """The arrays of a checkpoint as NumPy arrays on the host, by key, in any program on any devices.

    Args:
      directory: a checkpoints directory (`<workdir>/checkpoints`) or a workdir holding one.
      step: which checkpoint (default the latest complete one).
      verify: recompute every array's checksum and compare it with the record's.
    Returns:
      {"params/blocks/0/attn/q/kernel": array, "opt_state/...": ..., "step": ..., "key": ...}: the flat keys of
      `flatten` (a federated run's arrays carry a leading site axis [M, ...]), each with its saved shape and dtype.
    Raises:
      CheckpointError when there is no such checkpoint; DamagedCheckpointError when it cannot be read or an array's
      checksum differs from the one saved.

    It is plain orbax (docs/design.md shows the same lines): restoring to `np.ndarray` instead of a sharded
    `jax.Array` needs no target tree and no sharding, so it works whatever devices wrote the checkpoint (where
    `ocp.StandardCheckpointer().restore(path)` refuses a checkpoint written on another topology).
    """
    directory = os.path.abspath(os.fspath(directory))
    if os.path.isdir(os.path.join(directory, "checkpoints")):
        directory = os.path.join(directory, "checkpoints")
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory} does not exist: no checkpoints to load")
    checkpointer = Checkpointer(directory)
    try:
        steps = checkpointer.all_steps()
        step = steps[-1] if step is None and steps else step
        if step is None or step not in steps:
            raise CheckpointError(f"{directory} holds no complete checkpoint of step {step} (it holds {steps})")
        record = checkpointer.read_record(step) if verify else None
    finally:
        checkpointer.close()
    path = os.path.join(directory, str(step), "state")
    try:
        with orbax_compat.draining_event_loops():
            arrays = _restore_numpy(path)
    except Exception as e:
        raise DamagedCheckpointError(f"the arrays of {path} cannot be read ({_short(e)})") from e
    if record is not None:
        recorded = {k: entry[2] for k, entry in record["manifest"].items() if len(entry) > 2}
        found = digest(arrays).checksums
        differ = sorted(k for k in recorded if found.get(k) != recorded[k])
        if differ:
            raise DamagedCheckpointError(
                f"{path} is damaged: {len(differ)} of its {len(recorded)} arrays differ from what was saved "
                f"(checksums of {differ[:4]}{' ...' if len(differ) > 4 else ''})"
            )
    return arrays


def _restore_numpy(path: str) -> dict[str, np.ndarray]:
    """docs/design.md's plain-orbax recipe: the arrays of `<checkpoint>/state` as NumPy arrays."""
    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(path).item_metadata.tree  # {key: ArrayMetadata}: the saved layout
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))


def _short(error: BaseException, limit: int = 400) -> str:
    """What went wrong, in one line of at most `limit` characters: "<type>: <message>" of the most telling exception
    of `error`'s chain (TensorStore's status, e.g. "OUT_OF_RANGE: Error reading <array> in OCDBT database at <path>:
    ...", which orbax wraps in a message quoting the array's whole TensorStore spec), without any spec."""
    chain: list[BaseException] = []
    seen: BaseException | None = error
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    status = [e for e in chain if _STATUS.match(str(e))]
    chosen = status[-1] if status else error
    text = " ".join(_SPEC.sub("", str(chosen)).split())
    text = f"{type(chosen).__name__}: {text}"
    return text if len(text) <= limit else text[:limit] + " ..."


_STATUS = re.compile(r"^[A-Z][A-Z_]+: ")  # a TensorStore / absl status: "NOT_FOUND: ...", "OUT_OF_RANGE: ..."
_SPEC = re.compile(r"\s*(?:\[tensorstore_spec.*|See full TensorStore details:.*)$", re.DOTALL)


def _jsonable(value):
    """The value as JSON would give it back (tuples -> lists), so saved and current facts compare equal."""
    return json.loads(json.dumps(value))


def _compat_message(where: str, key: str, saved, current) -> str:
    if isinstance(saved, dict) and isinstance(current, dict):
        diffs = [
            f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}"
            for k in sorted(set(saved) | set(current))
            if saved.get(k) != current.get(k)
        ]
        detail = "; ".join(diffs)
    else:
        detail = f"checkpoint {saved!r}, now {current!r}"
    return (
        f"the {where} was written with a different {key} ({detail}). Resuming would mix two experiments; "
        "use a new --workdir (or restore the original config). Nothing was changed."
    )


# --------------------------------------------------------------------------- content digest

_MIX = (np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35))
_LANES = (np.uint32(0x9E3779B9), np.uint32(0x7FEB352D))  # per-lane position multipliers (odd)


class Digest(NamedTuple):
    """What `digest` found in a state: `checksums` {key: 16 hex digits} of every array's bytes, and `nonfinite`
    {key: count} of the floating arrays that hold NaN or Inf (empty when all are finite)."""

    checksums: dict[str, str]
    nonfinite: dict[str, int]


def digest(state) -> Digest:
    """The content checksum of every array of `state` (a pytree of jax / NumPy arrays) and its non-finite counts.

    The checksum of an array of n words w_i (its bytes as uint32 words: one per element of 1, 2 or 4 bytes, two per
    8-byte element) is two 32-bit lanes, lane_l = sum_i fmix32(w_i + c_l * i) mod 2^32 with MurmurHash3's
    finaliser fmix32 and odd constants c_l. For a fixed position the term is a bijection of the word, so any change
    of any one word changes the checksum, and independent changes cancel with probability about 2^-64. It is a sum
    over positions, so every process hashes only the shards it holds (replica 0 of each), with their global
    positions, and the processes add their partial sums: no array is gathered, whatever the sharding, and the
    result does not depend on it. Collective across processes: every process must call it.
    """
    flat = flatten(state)
    sums = np.zeros((len(flat), 2), np.uint32)
    bad = np.zeros(len(flat), np.int64)
    for row, value in enumerate(flat.values()):
        for data, index in _local_shards(value):
            sums[row] += _lane_sums(data, index, np.shape(value))
            if jnp.issubdtype(data.dtype, jnp.inexact):
                bad[row] += int(np.size(data) - np.count_nonzero(np.isfinite(data)))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        sums = np.sum(multihost_utils.process_allgather(sums), axis=0, dtype=np.uint32)
        bad = np.sum(multihost_utils.process_allgather(bad), axis=0)
    checksums = {k: f"{int(a):08x}{int(b):08x}" for k, (a, b) in zip(flat, sums)}
    return Digest(checksums, {k: int(n) for k, n in zip(flat, bad) if n})


def _local_shards(value) -> list[tuple[np.ndarray, tuple[slice, ...]]]:
    """(host data, global index) of each shard of `value` this process holds that is replica 0 of its block."""
    if isinstance(value, jax.Array):
        return [(np.asarray(s.data), s.index) for s in value.addressable_shards if s.replica_id == 0]
    data = np.asarray(value)
    return [(data, (slice(None),) * data.ndim)]


def _fmix(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * _MIX[0]
    h = h ^ (h >> np.uint32(13))
    h = h * _MIX[1]
    return h ^ (h >> np.uint32(16))


def _lane_sums(data: np.ndarray, index: tuple[slice, ...], shape: tuple[int, ...]) -> np.ndarray:
    """The two lane sums of one shard `data` = global[index] of an array of `shape`."""
    data = np.ascontiguousarray(data)
    size = data.dtype.itemsize
    if size == 8:
        words = data.view(np.uint32).reshape(-1)
    else:
        words = data.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size]).astype(np.uint32).reshape(-1)
    per = 2 if size == 8 else 1
    positions: np.ndarray = np.zeros((), np.uint64)  # the shard's elements' flat positions in the global array
    for dim, (extent, part) in enumerate(zip(shape, index)):
        start, stop, step = part.indices(extent)
        stride = int(np.prod(shape[dim + 1 :], dtype=np.int64))
        positions = positions[..., None] + np.arange(start, stop, step, dtype=np.uint64) * np.uint64(stride)
    positions = (positions.reshape(-1, 1) * np.uint64(per) + np.arange(per, dtype=np.uint64)).reshape(-1)
    positions = positions.astype(np.uint32)  # mod 2^32
    return np.array([np.sum(_fmix(words + c * positions), dtype=np.uint32) for c in _LANES], np.uint32)
