"""Checkpoints with orbax: save, find the latest, restore exactly, refuse what does not fit.

A checkpoint of step s holds the whole training state as a flat {path: array} dict (parameters, optimizer
state, step, PRNG key) and a JSON record: a manifest of every array's shape and dtype, the loop's own state
(e.g. the running train-loss window), and `compat` facts (model config, optimizer, data fingerprint) that must
match for a resume to be meaningful. Restoring first compares the manifest and the compat facts with the
running program and raises `CheckpointError` naming what differs, before any array is read; a checkpoint that
orbax cannot read also raises `CheckpointError`. Nothing on disk is modified by a failed restore.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["CheckpointError", "Checkpointer", "flatten", "unflatten"]


class CheckpointError(RuntimeError):
    """A checkpoint is corrupt or does not fit the running program. The message says which and what to do."""


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
    return {k: [list(v.shape), str(np.dtype(v.dtype))] for k, v in flat.items()}


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

    def latest_step(self) -> int | None:
        """The newest fully written checkpoint's step (partial writes of a crashed run are ignored)."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state, *, loop: Mapping[str, Any], compat: Mapping[str, Any]) -> None:
        """Saves `state` (any pytree of arrays) at `step` with JSON-serialisable `loop` and `compat` records."""
        flat = flatten(state)
        meta = {"manifest": _manifest(flat), "loop": dict(loop), "compat": dict(compat)}
        self._manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(flat), meta=ocp.args.JsonSave(meta))
        )

    def restore(self, step: int, like, *, compat: Mapping[str, Any]):
        """Restores the state saved at `step` into the structure, shapes, dtypes and shardings of `like`.

        Args:
          like: a pytree of arrays or `jax.ShapeDtypeStruct`s (with `.sharding`) of the running program.
          compat: the running program's compat facts; every key must equal the saved value.
        Returns:
          (state, loop record).
        Raises:
          CheckpointError naming the checkpoint path and what differs or could not be read.
        """
        path = os.path.join(self.directory, str(step))
        where = f"checkpoint of step {step} at {path}"
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # orbax raises many types for missing/corrupt files
            raise CheckpointError(
                f"the {where} cannot be read ({type(e).__name__}: {e}). Nothing was changed. "
                "Move that directory away to resume from an earlier checkpoint, or use a new "
                "--workdir."
            ) from e
        if not isinstance(meta, dict) or not {"manifest", "loop", "compat"} <= set(meta):
            raise CheckpointError(
                f"the {where} has no valid metadata record; it was not written by this program "
                "or is damaged. Nothing was changed; use a new --workdir."
            )
        for key, value in compat.items():
            saved = meta["compat"].get(key)
            if saved != _jsonable(value):
                raise CheckpointError(_compat_message(where, key, saved, _jsonable(value)))
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
            if expected[key] != saved[key]:
                raise CheckpointError(
                    f"the {where} holds '{key}' with shape/dtype {saved[key]} but the running "
                    f"program needs {expected[key]}; use a new --workdir. Nothing was changed."
                )
        target = {
            k: jax.ShapeDtypeStruct(np.shape(v), v.dtype, sharding=getattr(v, "sharding", None))
            for k, v in flat_like.items()
        }
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))[
                "state"
            ]
        except Exception as e:
            raise CheckpointError(
                f"the arrays of the {where} cannot be read ({type(e).__name__}: {e}). Nothing "
                "was changed. Move that directory away to resume from an earlier checkpoint, or "
                "use a new --workdir."
            ) from e
        logging.info("restored %s", where)
        return unflatten(like, restored), meta["loop"]

    def wait(self) -> None:
        """Blocks until background writes finish."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def _jsonable(value):
    """The value as JSON would give it back (tuples -> lists), so saved and current facts compare equal."""
    import json

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
