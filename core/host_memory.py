"""The host allocator setting that keeps XLA:CPU's per-execution buffers in memory the process already holds.

XLA:CPU allocates every execution's temporary buffer (all of a train step's activations: 181 MB for the quickstart
model's forward and backward) with `malloc` and frees it when the execution ends. glibc serves an allocation that
large with a fresh `mmap` and returns it with `munmap`, so every step faults in and zeroes every page again: a
quarter of a train step's time on the CPU was the kernel's (docs/performance.md has the evidence). Set before
JAX's CPU client starts its threads, three glibc options (mallopt(3)) make the process keep and reuse the memory:

    M_ARENA_MAX = 1          every thread allocates from the main heap (a worker thread's own arena cannot hold
                             such a block and would fall back to mmap whatever the other options say)
    M_MMAP_MAX = 0           no allocation is served by mmap
    M_TRIM_THRESHOLD = 2 GiB  freed memory at the heap's top is kept (up to the largest value mallopt takes),
                             not given back to the system

Numerics do not change; what changes is that the process's resident memory stays at its high-water mark, as it does
under tcmalloc or jemalloc. `import core` (and so every package of this project) applies it on Linux with glibc
when JAX computes on the CPU (no GPU or TPU plugin installed, or JAX_PLATFORMS naming "cpu" first), unless the
environment sets LOWBIT_HOST_MALLOC=system. Imported after JAX has run a computation, it cannot move the threads
that already allocate from their own arenas; import this project first.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys

__all__ = ["ENV", "applies", "keep_freed_memory"]

ENV = "LOWBIT_HOST_MALLOC"
"""Set to "system" to leave glibc's allocator as it is."""

_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8  # glibc's malloc.h
_KEEP = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))
_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")


def applies(environ=os.environ) -> bool:
    """Whether `keep_freed_memory` acts here: Linux, not opted out (ENV = "system"; any other value but "" or
    "keep" is refused with a ValueError naming it), and JAX computing on the CPU (JAX_PLATFORMS names "cpu" first,
    or is unset and no accelerator plugin is installed)."""
    choice = environ.get(ENV, "")
    if choice not in ("", "keep", "system"):
        raise ValueError(f"environment variable {ENV} = {choice!r}; allowed: 'keep' (the default) or 'system'.")
    if choice == "system" or not sys.platform.startswith("linux"):
        return False
    platforms = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return platforms[0] == "cpu"
    return not any(importlib.util.find_spec(name) is not None for name in _ACCELERATOR_PLUGINS)


def keep_freed_memory(environ=os.environ) -> bool:
    """Applies the three mallopt settings of the module docstring where `applies(environ)`; returns whether glibc
    took all three (False: not applicable, not glibc, or an option refused)."""
    if not applies(environ):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl's mallopt does nothing)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(option, value) == 1 for option, value in _KEEP)
