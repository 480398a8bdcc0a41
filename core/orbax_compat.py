"""The one module that touches a private orbax internal: how orbax runs its asynchronous reads and writes.

orbax runs each restore's coroutine in a fresh event loop (`orbax.checkpoint._src.asyncio_utils` `RUNNER`): it runs
the coroutine until it returns or raises, then closes the loop. When one read of a restore fails (a truncated array
file, a missing OCDBT manifest), `asyncio.gather` raises at once while the restore's other reads are still in
flight in TensorStore's threads; each of those, finishing later, calls the closed loop's `call_soon_threadsafe`,
which raises `RuntimeError: Event loop is closed` in TensorStore's thread, printed as a traceback (one per read
still in flight: hundreds for a large state, at random). `draining_event_loops` runs orbax's coroutines in a loop
that, before it closes, waits for every task still pending in it: the failed restore's other reads end inside the
loop, and nothing calls into a closed one. On success nothing is pending and nothing changes.

The symbol is named once, in `RUNNER`; tests/test_checkpoint.py checks that the installed orbax has it, so a release
that renames it fails there first. Importing this module changes nothing: the runner is swapped only inside
`draining_event_loops`, and put back when the last caller leaves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

__all__ = ["RUNNER", "draining_event_loops", "root_logging_as_it_was", "run_draining"]

RUNNER = ("orbax.checkpoint._src.asyncio_utils", "_run_sync_via_new_loop")
"""(module, attribute) of the function orbax runs every coroutine of a synchronous call through, in a new event loop
that it closes afterwards (orbax-checkpoint 0.12)."""

_T = TypeVar("_T")


class _Swap:
    """Callers inside `draining_event_loops` (any thread; the runner is swapped while there is one) and orbax's own
    runner, put back when the last one leaves."""

    lock = threading.Lock()
    depth = 0
    original: Any = None


def run_draining(coro: Coroutine[Any, Any, _T]) -> _T:
    """Runs `coro` to completion in a new event loop, as orbax's runner does, but before closing the loop waits for
    every task still pending in it (the other reads of a restore that failed), whatever the coroutine returned or
    raised. Returns its result or raises its exception."""
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            while pending := [task for task in asyncio.all_tasks(loop) if not task.done()]:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        finally:
            asyncio.set_event_loop(None)
            loop.close()


@contextlib.contextmanager
def draining_event_loops() -> Iterator[None]:
    """Within the body, orbax runs its coroutines through `run_draining` (re-entrant and thread-safe: the original
    runner is put back when the last caller leaves). Where the installed orbax has no `RUNNER` the body runs as it
    is (tests/test_checkpoint.py fails first on such a release)."""
    module = importlib.import_module(RUNNER[0])
    if not hasattr(module, RUNNER[1]):
        yield
        return
    with _Swap.lock:
        if _Swap.depth == 0:
            _Swap.original = getattr(module, RUNNER[1])
            setattr(module, RUNNER[1], run_draining)
        _Swap.depth += 1
    try:
        yield
    finally:
        with _Swap.lock:
            _Swap.depth -= 1
            if _Swap.depth == 0:
                setattr(module, RUNNER[1], _Swap.original)
                _Swap.original = None


@contextlib.contextmanager
def root_logging_as_it_was() -> Iterator[None]:
    """Leaves the root logger's handlers and level as they were before the block. For `import orbax.checkpoint`:
    orbax logs through absl while it imports, and absl's logging calls `logging.basicConfig()` when the root logger has
    no handler, which would give every program importing core.checkpoint a stderr handler it did not ask for."""
    handlers, level = list(logging.root.handlers), logging.root.level
    try:
        yield
    finally:
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)
