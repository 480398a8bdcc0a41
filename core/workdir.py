"""A run's working directory: one run at a time (a lock), its metric rows (metrics.jsonl, and the same scalars as
TensorBoard event files beside it), and the history of accepted changes.

    with workdir.lock(path):      # WorkdirError naming the holder if another run has it
        log = workdir.MetricsLog(path)
        events = workdir.EventLog(path, resumed_from=None)

The lock is an exclusive `flock` on `<workdir>/.lock`, which records the holder's pid, host and start time for the
error message of a second run. The kernel releases it when the holding process ends, however it ends (kill -9
included), so a crashed run never leaves a stale lock. One process of a multi-process run takes it (process 0);
within one process it is re-entrant, so a CLI that holds it can call the training driver, which takes it too.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import glob
import importlib
import json
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

__all__ = [
    "EventLog",
    "MetricsLog",
    "WorkdirError",
    "append_history",
    "check_files",
    "free_name",
    "lock",
    "prepare",
    "tensorboard_writer",
]


class WorkdirError(RuntimeError):
    """The workdir cannot be used: not a directory, not writable, in use by another run, or holding a metrics
    file that cannot be read. The message names the path and what to do."""


class WriteError(WorkdirError):
    """A file of the workdir could not be written (the disk is full, ...): the message names the file, the cause
    and what was kept."""


@contextlib.contextmanager
def _writing(path: str, kept: str):
    """An OSError writing `path` as one WriteError naming it, the cause, and `kept` (what survives)."""
    try:
        yield
    except OSError as e:
        raise WriteError(f"{path} could not be written: {e.strerror or e}; {kept}") from None


_held: dict[str, tuple[int, int]] = {}  # realpath -> (file descriptor, depth) of the locks this process holds


def prepare(path: str) -> str:
    """Creates `path` if needed and checks that it is a writable directory. Returns its absolute path."""
    path = os.path.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        raise WorkdirError(f"--workdir {path} exists and is not a directory; give a directory path") from None
    except OSError as e:
        raise WorkdirError(f"--workdir {path} cannot be created: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise WorkdirError(f"--workdir {path} is not writable by this user; give a writable directory")
    return path


@contextlib.contextmanager
def lock(path: str) -> Iterator[None]:
    """Holds the exclusive lock of the workdir `path` (created if needed) for the body. Raises WorkdirError if
    another process holds it (naming its pid, host and start time) or if the lock file cannot be written.

    A body that raises (a refused run, or one stopped) leaves the lock file as it found it: one this call created is
    removed (and the workdir too if this call created it and nothing else was written into it), and an earlier lock
    record is written back with its times, so a refusal that says "Nothing was changed" changed nothing."""
    existed = os.path.isdir(path)
    path = prepare(path)
    key, lock_path = os.path.realpath(path), os.path.join(path, ".lock")
    outer = key not in _held
    if outer:
        before = _read(lock_path)
        times = _times(lock_path)
        _held[key] = (_acquire(lock_path), 1)
    else:
        fd, depth = _held[key]
        _held[key] = (fd, depth + 1)
    try:
        yield
    except BaseException:
        if outer:  # (still holding the flock: no other run can be reading or taking it)
            _undo_lock(path, lock_path, before, times, created_dir=not existed)
        raise
    finally:
        fd, depth = _held[key]
        if depth > 1:
            _held[key] = (fd, depth - 1)
        else:
            del _held[key]
            os.close(fd)  # releases the flock


def _times(path: str) -> tuple[int, int] | None:
    """(atime, mtime) of `path` in nanoseconds, or None if there is no such file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_atime_ns, st.st_mtime_ns


def _undo_lock(
    path: str, lock_path: str, before: bytes | None, times: tuple[int, int] | None, *, created_dir: bool
) -> None:
    """Puts the lock file back as `lock` found it: removed if there was none (the workdir too, if `created_dir` and it
    is empty then), else its earlier bytes and times. A failure to do so (the disk became read-only) is left: the
    body's own exception is the one to report."""
    with contextlib.suppress(OSError):
        if before is None:
            os.remove(lock_path)
            if created_dir and not os.listdir(path):
                os.rmdir(path)
            return
        with open(lock_path, "r+b") as f:
            f.write(before)
            f.truncate(len(before))
        if times is not None:
            os.utime(lock_path, ns=times)


def _read(path: str) -> bytes | None:
    """The bytes of the file at `path`, or None if there is none."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _acquire(lock_path: str) -> int:
    """The file descriptor of `lock_path` locked by this process (which writes its record there). A lock file that
    its holder removed (a refused run undoes the lock file it created) between our open and our lock is opened again,
    so that two runs never hold two different files of the same name."""
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise WorkdirError(f"cannot write the lock file {lock_path}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "{}"
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise WorkdirError(f"cannot lock {lock_path}: {e.strerror or e}") from None
            raise WorkdirError(
                f"{os.path.dirname(lock_path)} is in use by another run ({_describe(holder)}); wait for it to "
                "finish, stop it, or use another --workdir"
            ) from None
        try:
            current = os.stat(lock_path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            break
        os.close(fd)  # (we locked a file its holder had just removed: take the one there now)
    record = json.dumps(
        {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        }
    )
    os.ftruncate(fd, 0)
    os.pwrite(fd, record.encode() + b"\n", 0)
    return fd


def _describe(holder: str) -> str:
    try:
        h = json.loads(holder)
        return f"pid {h['pid']} on host {h['host']}, started {h['started']}"
    except (ValueError, KeyError, TypeError):
        return f"lock record {holder!r}"


class MetricsLog:
    """Appends one JSON object per line to `<workdir>/metrics.jsonl` (flushed at once, so a crash loses nothing
    written). A resume from step s (0: a fresh start) moves the rows after s, written by a crashed run and about to
    be recomputed, to `metrics.superseded.jsonl`, so metrics.jsonl reads as one uninterrupted run.

    `check` reads the file before anything changes: a torn last line (a crash while writing it) is set aside with
    those rows; any other line that is not a JSON object with an integer "step" raises WorkdirError naming the
    file and the line."""

    def __init__(self, workdir: str, *, enabled: bool = True):
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.superseded = os.path.join(workdir, "metrics.superseded.jsonl")
        self.enabled = enabled

    def check(self) -> tuple[list[dict[str, Any]], str]:
        """(the rows, a torn last line or ''), or WorkdirError for a malformed line."""
        if not (self.enabled and os.path.exists(self.path)):
            return [], ""
        with open(self.path, encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n")
        rows: list[dict[str, Any]] = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                    raise ValueError("not a JSON object with an integer 'step'")
            except ValueError as e:
                if number == len(lines):  # the last line, with no newline after it: torn by a crash
                    return rows, line
                raise WorkdirError(
                    f"{self.path} line {number} cannot be read ({e}): {line[:80]!r}. Fix or delete that line, "
                    "then rerun (rows after the resumed checkpoint are recomputed anyway)."
                ) from None
            rows.append(row)
        return rows, ""

    def truncate_after(self, step: int) -> None:
        """Keeps the rows of steps <= `step`; moves the others (and a torn last line) to metrics.superseded.jsonl."""
        rows, torn = self.check()
        keep = [r for r in rows if r["step"] <= step]
        if len(keep) == len(rows) and not torn:
            return
        with open(self.superseded, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows if r["step"] > step)
            if torn:
                f.write(json.dumps({"torn_line": torn}) + "\n")
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in keep)
        os.replace(tmp, self.path)

    def write(self, row: dict[str, Any]) -> None:
        """Appends `row`; raises WriteError naming the file if it cannot be written (the rows before it are kept,
        and a rerun resumes from the last checkpoint, recomputing the rows after it)."""
        if not self.enabled:
            return
        with (
            _writing(self.path, "the rows before it are kept; free space and rerun to resume"),
            open(self.path, "a") as f,
        ):
            f.write(json.dumps(row) + "\n")

    def read(self) -> list[dict[str, Any]]:
        return self.check()[0]


EVENTS_PREFIX = "events.out.tfevents."  # TensorBoard finds event files by this part of their name


def tensorboard_writer() -> Any:
    """tensorboardX's synchronous event-file writer class (`tensorboardX.event_file_writer.EventsWriter`), imported
    on first use so that only a run that writes TensorBoard events needs the package. Raises WorkdirError saying how
    to install it or turn the events off when it is missing."""
    try:
        return importlib.import_module("tensorboardX.event_file_writer").EventsWriter
    except ImportError as e:
        raise WorkdirError(
            f"train.tensorboard = True writes TensorBoard event files, which needs the package tensorboardX ({e}); "
            "install it (pip install 'lowbit-moe-lab[experiments]') or turn the events off with "
            "--config.train.tensorboard=False (metrics.jsonl holds the same rows)"
        ) from None


class EventLog:
    """The rows of metrics.jsonl as TensorBoard scalars, in event files beside it (`<workdir>/events.out.tfevents.*`,
    so `tensorboard --logdir <workdir>`, or `--logdir runs` for every run under it, shows them).

    Every row becomes one event at the row's "step" holding one scalar per numeric column, named as the column
    (`train_loss`, `val_bits_per_byte`, `moe/load_cv`, a federated run's `round`, ...); a column that is None or not a
    number is left out. TensorBoard keeps scalars as float32. Each event is written and flushed at once (a crash loses
    none). The file is created on the first row, so a run that writes none (a rerun of a finished run) leaves none.

    Resume: every process that writes starts a new file whose first event is a SessionLog START at step `resumed_from +
    1` (0 on a fresh start: a pretrained run's step-0 row too). TensorBoard's Python loader (its default
    `--purge_orphaned_data`) then drops the scalars of earlier files at that step and after: what a crashed run
    logged after its last checkpoint is hidden, as metrics.jsonl moves those rows to metrics.superseded.jsonl, and
    the scalars it shows equal metrics.jsonl's rows. Its Rust loader ignores the marker but drops a series' points
    from the step at which a later file writes the series again, which the rerun does for every recomputed row
    (docs/design.md says the one exception). Files are read in name order: `<seconds>.<host>.<n>`, n counting the
    files already there, so a rerun in the same second still sorts after the run it resumes.
    """

    def __init__(self, workdir: str, *, resumed_from: int | None, enabled: bool = True):
        self.workdir, self.enabled = workdir, enabled
        self.purge_from = 0 if resumed_from is None else resumed_from + 1
        self._writer: Any = None

    def write(self, row: dict[str, Any]) -> None:
        """Writes the numeric columns of `row` (a metrics.jsonl row, with an integer "step") as scalars at its step."""
        if not self.enabled:
            return
        event_pb2 = importlib.import_module("tensorboardX.proto.event_pb2")
        summary_pb2 = importlib.import_module("tensorboardX.proto.summary_pb2")
        if self._writer is None:
            self._writer = tensorboard_writer()(os.path.join(self.workdir, "events"), f".{self._files():03d}")
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self._writer.write_event(event_pb2.Event(step=self.purge_from, wall_time=time.time(), session_log=start))
        values = [
            summary_pb2.Summary.Value(tag=name, simple_value=float(value))
            for name, value in row.items()
            if name != "step" and isinstance(value, (int, float))
        ]
        summary = summary_pb2.Summary(value=values)
        self._writer.write_event(event_pb2.Event(step=row["step"], wall_time=time.time(), summary=summary))
        self._writer.flush()

    def _files(self) -> int:
        return len(glob.glob(os.path.join(glob.escape(self.workdir), EVENTS_PREFIX + "*")))

    def close(self) -> None:
        """Closes the event file (nothing to do when none was opened)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def write_json(path: str, obj: Any) -> None:
    """Writes `obj` as indented JSON to `path` atomically (a temporary file renamed over it): a crash leaves the old
    file or the new one, never a torn one. Values JSON cannot hold are written as their str(). Raises WriteError
    naming the file if it cannot be written (the old file, if any, is kept; the temporary one removed)."""
    tmp = path + ".tmp"
    try:
        with _writing(path, "its earlier version, if any, is kept"):
            with open(tmp, "w") as f:
                json.dump(obj, f, indent=2, default=str)
            os.replace(tmp, path)  # (a directory in its place: refused here, the temporary file removed)
    except WriteError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def check_files(path: str, files: tuple[str, ...], folders: tuple[str, ...] = ()) -> None:
    """Raises WorkdirError if one of `files` in the workdir `path` exists as something other than a regular file (a
    directory in place of config.json, a FIFO), or one of `folders` as something other than a directory: what a run
    reads and rewrites there, checked before it starts rather than when it first writes."""
    for name in files:
        where = os.path.join(path, name)
        if os.path.lexists(where) and not os.path.isfile(where):
            what = "a directory" if os.path.isdir(where) else "not a regular file"
            raise WorkdirError(
                f"{where} is {what}; a run writes its {name} there: move it away or use another --workdir"
            )
    for name in folders:
        where = os.path.join(path, name)
        if os.path.lexists(where) and not os.path.isdir(where):
            raise WorkdirError(
                f"{where} is not a directory; a run keeps its {name} there: move it away or use another --workdir"
            )


def free_name(path: str) -> str:
    """`path`, or `path.1`, `path.2`, ... : the first that does not exist (what is there already is kept)."""
    candidate, n = path, 0
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}.{n}"
    return candidate


def append_history(workdir: str, record: dict[str, Any]) -> None:
    """Appends `record` (with the time) to `<workdir>/history.jsonl`: the changes a resume accepted."""
    stamped = {"time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), **record}
    with open(os.path.join(workdir, "history.jsonl"), "a") as f:
        f.write(json.dumps(stamped) + "\n")
