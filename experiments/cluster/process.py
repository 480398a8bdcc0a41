"""Process plumbing shared by the network tool and the launcher: stopping processes, deferring or turning stop
signals into exits, binding a child's life to its parent, and the shell's view of exit codes.

Linux-only where it says so (prctl); the rest is POSIX.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = [
    "HAS_PDEATHSIG",
    "STOP_SIGNALS",
    "Silence",
    "alive",
    "cpu_seconds",
    "descendant",
    "die_with_parent",
    "exit_status",
    "signal_name",
    "signals_deferred",
    "stop",
    "stop_signals_exit",
    "stopped",
    "zombie",
]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals that ask a tool to stop (Ctrl-C, kill, a closed terminal)."""
HAS_PDEATHSIG = sys.platform.startswith("linux")
"""Whether prctl(PR_SET_PDEATHSIG) can bind a child to its parent here (`die_with_parent`)."""
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def alive(pid: int) -> bool:
    """Whether process `pid` exists (a zombie included; see `zombie`)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def descendant(root: int, *needle: str) -> int | None:
    """The pid of a descendant of `root` whose command line holds every string of `needle` as an argument, or None
    (Linux /proc; a process that exits meanwhile is skipped)."""
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                if not all(n in f.read().split("\0") for n in needle):
                    continue
            up = _parent(pid)
            while up not in (root, 0, 1):
                up = _parent(up)
        except OSError:
            continue
        if up == root:
            return pid
    return None


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (the state first), or None (not Linux, or gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def zombie(pid: int) -> bool:
    """Whether process `pid` has exited and waits to be reaped (Linux /proc; False where it cannot tell)."""
    fields = _stat(pid)
    return fields is not None and fields[0] == "Z"


def stopped(pid: int) -> bool:
    """Whether process `pid` is stopped: by SIGSTOP, SIGTSTP (Ctrl-Z) or a debugger (Linux /proc state T or t;
    False where it cannot tell)."""
    fields = _stat(pid)
    return fields is not None and fields[0] in ("T", "t")


def cpu_seconds(pid: int) -> float | None:
    """The CPU time process `pid` has used so far, all its threads, user and system (Linux /proc), or None where it
    cannot tell (not Linux, or the process is gone)."""
    fields = _stat(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


def stop(pids: Sequence[int], grace: float) -> None:
    """SIGTERM to `pids`, SIGKILL to those still there `grace` seconds later; returns once none runs (or 2 s after
    the SIGKILL)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while any(alive(p) and not zombie(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        pids = [p for p in pids if alive(p) and not zombie(p)]
        if not pids:
            return


class Silence:
    """Which of the processes `pids` have given no sign of life for longer than `timeout` seconds. A sign of life is
    a beat on the process's pipe (`beats`: the read ends, set non-blocking by the caller; any bytes count) or CPU time
    used (Linux /proc: a process whose beating thread is held up by a long call into a library still computes, a
    stopped or deadlocked one does not); a process is judged only after its first beat, and only while it runs."""

    def __init__(self, pids: Sequence[int], beats: Sequence[int], timeout: float):
        self.pids, self.beats, self.timeout = list(pids), list(beats), timeout
        self.last: list[float | None] = [None] * len(self.pids)  # the last sign of life (None: no beat yet)
        self.cpu: list[float | None] = [None] * len(self.pids)
        self.found: set[int] = set()

    def silent(self, now: float, codes: Sequence[int | None]) -> list[int]:
        """Reads what the processes wrote and returns the indices of those still running (`codes[i] is None`) that
        have been silent for longer than the timeout at time `now` (time.monotonic()); each is returned once and then
        no longer watched."""
        found = []
        for i, fd in enumerate(self.beats):
            beat = False
            with contextlib.suppress(OSError):  # (BlockingIOError: nothing written since)
                beat = bool(os.read(fd, 4096))  # (b"": the process closed it, i.e. exited)
            cpu = cpu_seconds(self.pids[i])
            if beat or (self.last[i] is not None and cpu is not None and cpu != self.cpu[i]):
                self.last[i] = now
            self.cpu[i] = cpu
            last = self.last[i]
            if codes[i] is None and i not in self.found and last is not None and now - last > self.timeout:
                self.found.add(i)
                found.append(i)
        return found


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Within the block, SIGINT, SIGTERM and SIGHUP are recorded instead of handled; after it the previous handlers
    are back and the recorded signals are raised again, in order (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for signum in dict.fromkeys(received):
            signal.raise_signal(signum)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def stop_signals_exit() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise SystemExit(128+N) (so that `finally` blocks and `__exit__` run)
    where their handlers are the default ones (which would end the process on the spot); main thread only."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(s) == signal.SIG_DFL:
                previous[s] = signal.signal(s, _exit_on_signal)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def die_with_parent() -> Callable[[], None]:
    """A `preexec_fn` that makes the child receive SIGTERM when this process dies, even by SIGKILL: Linux
    prctl(PR_SET_PDEATHSIG, SIGTERM) between fork and exec (libc's prctl is looked up here, before any fork); a
    parent that died before that call is caught by comparing the child's parent with it. Linux only
    (`HAS_PDEATHSIG`)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    parent = os.getpid()

    def preexec() -> None:
        if prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def signal_name(signum: int) -> str:
    """ "SIGTERM" for 15; "signal N" for a number no signal of this platform has."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_status(code: int) -> int:
    """Popen's return code as the shell reports it: 128+N for a process killed by signal N."""
    return 128 - code if code < 0 else code
