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
    "alive",
    "descendant",
    "die_with_parent",
    "exit_status",
    "signal_name",
    "signals_deferred",
    "stop",
    "stop_signals_exit",
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


def zombie(pid: int) -> bool:
    """Whether process `pid` has exited and waits to be reaped (Linux /proc; False where it cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


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
