"""Resuming a run: opening its checkpoints, restoring the latest one that belongs to this program and was trained
as the config says, and recording an accepted change of provenance in the workdir's history."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax

from core import checkpoint as checkpoint_lib
from core import workdir as workdir_lib

if TYPE_CHECKING:  # annotations only: the configuration library is core.schema's, not a dependency here
    import ml_collections

__all__ = ["open_checkpoints", "record_accepted"]


def open_checkpoints(
    config: ml_collections.ConfigDict,
    workdir: str,
    state: Any,
    compat: Mapping[str, Any],
    provenance: dict[str, Any],
    log: workdir_lib.MetricsLog,
) -> tuple[checkpoint_lib.Checkpointer, Any, dict[str, Any], int | None, dict[str, Any] | None]:
    """The run's `<workdir>/checkpoints`: restores the latest checkpoint into `state` when `checkpoint.resume`
    allows (after checking it belongs to this program, was trained as the config says, and is intact), then sets
    metric rows written after it (all of them on a fresh start) aside.

    Returns (checkpointer, state, the checkpoint's loop record ({} on a fresh start), the step resumed from or None,
    the accepted changes as a history.jsonl record or None): the caller records them (`record_accepted`) once a
    checkpoint has been trained under them, never before.
    Raises CheckpointError for a damaged checkpoint (unless `checkpoint.fallback`: then it is moved to
    `checkpoints.damaged/<step>` (`<step>.1`, ... if an earlier one is there) and the next newest is tried; when every
    one is damaged they are all put back and the run is refused rather than started over), one from another program
    (said first: its record is read before its step is compared with train.steps), one beyond train.steps, one
    trained with other hyper-parameters (unless `checkpoint.accept_changes`), or checkpoints present while
    checkpoint.resume is False; WorkdirError for a malformed metrics.jsonl. Nothing on disk changes before
    a restore succeeds.
    """
    cc, steps = config.checkpoint, config.train.steps
    log.check()  # a malformed metrics.jsonl is refused before anything else
    directory = os.path.join(workdir, "checkpoints")
    checkpointer = checkpoint_lib.Checkpointer(directory, keep=cc.keep, async_save=cc.async_save)
    latest = checkpointer.latest_step()
    if latest is not None and not cc.resume:
        raise checkpoint_lib.CheckpointError(
            f"{checkpointer.directory} already holds checkpoints and checkpoint.resume is False; use a new "
            "--workdir so they are not overwritten."
        )
    changes: dict[str, list] = {}
    loop: dict[str, Any] = {}
    moved: list[tuple[str, str]] = []  # (checkpoint, where fallback moved it) of the damaged ones
    try:
        while latest is not None:
            try:
                record = checkpointer.read_record(latest)
                checkpointer.check_compat(latest, compat, record)  # another program's checkpoint: said first
                if latest > steps:  # (only now: raising train.steps cannot make another program's checkpoint resume)
                    raise checkpoint_lib.CheckpointError(
                        f"the latest checkpoint in {checkpointer.directory} is at step {latest}, beyond train.steps "
                        f"= {steps}; raise train.steps (with checkpoint.accept_changes) or use a new --workdir. "
                        "Nothing was changed."
                    )
                changes = _changes(record, provenance)
                if changes and not cc.accept_changes:
                    raise checkpoint_lib.CheckpointError(_changes_message(checkpointer, latest, changes))
                state, loop = checkpointer.restore(latest, state, compat=compat, record=record)
                break
            except checkpoint_lib.DamagedCheckpointError as e:
                if not cc.fallback:
                    raise checkpoint_lib.DamagedCheckpointError(
                        f"{e} Rerun with --config.checkpoint.fallback=True to resume from the newest intact "
                        "checkpoint (the damaged one is moved to checkpoints.damaged/), or use a new --workdir."
                    ) from e
                checkpointer.close()
                aside = workdir_lib.free_name(os.path.join(workdir, "checkpoints.damaged", str(latest)))
                if jax.process_index() == 0:
                    os.makedirs(os.path.dirname(aside), exist_ok=True)
                    os.replace(os.path.join(directory, str(latest)), aside)
                    why = str(e).removesuffix(" Nothing was changed.")  # (it is moved aside now)
                    print(f"checkpoint.fallback: {why}\nmoved it to {aside}; trying the next newest", flush=True)
                moved.append((os.path.join(directory, str(latest)), aside))
                _sync("checkpoint fallback")
                checkpointer = checkpoint_lib.Checkpointer(directory, keep=cc.keep, async_save=cc.async_save)
                latest = checkpointer.latest_step()
        if latest is None and moved:  # every checkpoint was damaged: refuse to start over silently
            steps_seen = ", ".join(os.path.basename(original) for original, _ in moved)
            raise checkpoint_lib.DamagedCheckpointError(
                f"checkpoint.fallback: every checkpoint in {directory} is damaged (steps {steps_seen}); none was "
                "moved and nothing was changed. To start over from step 0, move the checkpoints folder aside or use "
                "a new --workdir."
            )
    except BaseException:  # refused: the checkpointer closed, the damaged checkpoints moved aside put back
        checkpointer.close()
        _put_back(workdir, moved)
        raise
    log.truncate_after(-1 if latest is None else latest)  # a fresh start keeps no row, a step-0 one included
    if latest is None:
        return checkpointer, state, {}, None, None
    if changes and jax.process_index() == 0:
        print(
            f"checkpoint.accept_changes: {_describe_changes(changes)} (recorded in history.jsonl with the first "
            "checkpoint trained under them)",
            flush=True,
        )
    if jax.process_index() == 0:
        print(f"resuming from the checkpoint of step {latest} in {checkpointer.directory}", flush=True)
    return checkpointer, state, loop, latest, {"resumed_from": latest, "changes": changes} if changes else None


def record_accepted(workdir: str, accepted: Mapping[str, Any]) -> None:
    """Appends the changes a resume accepted (`open_checkpoints`' last value) to `<workdir>/history.jsonl`
    (process 0): called with the first checkpoint trained under them."""
    if jax.process_index() == 0:
        workdir_lib.append_history(workdir, dict(accepted))


def _put_back(workdir: str, moved: list[tuple[str, str]]) -> None:
    """Moves the checkpoints fallback set aside back where they were (process 0), and removes the folder it made if
    nothing else is in it: a refused resume leaves the workdir as it found it."""
    if moved and jax.process_index() == 0:
        for original, aside in reversed(moved):
            os.replace(aside, original)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(workdir, "checkpoints.damaged"))
    if moved:
        _sync("checkpoint fallback undone")


def _sync(name: str) -> None:
    """A barrier of every process (a no-op in one), so that all see what process 0 moved."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _changes(record: Mapping[str, Any], provenance: Mapping[str, Any]) -> dict[str, list]:
    """{key: [saved, now]} of the provenance keys whose value differs from the checkpoint's record."""
    saved = record.get("provenance") or {}
    now = json.loads(json.dumps(provenance))
    return {key: [saved[key], now[key]] for key in sorted(now) if key in saved and saved[key] != now[key]}


def _describe_changes(changes: Mapping[str, list]) -> str:
    return ", ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in changes.items())


def _changes_message(checkpointer, step: int, changes: Mapping[str, list]) -> str:
    return (
        f"the checkpoint of step {step} in {checkpointer.directory} was trained with other hyper-parameters "
        f"({_describe_changes(changes)}); resuming would make config.json describe weights it did not train. "
        "Restore the original values, start a new --workdir, or rerun with --config.checkpoint.accept_changes=True "
        "to continue with the change recorded in the workdir's history.jsonl. Nothing was changed."
    )
