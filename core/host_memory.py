"""Keeping XLA:CPU's per-execution buffers in memory the process already holds.

XLA:CPU allocates every execution's temporary buffer (all of a train step's activations: 150-180 MB for the
quickstart-size models' steps) with `malloc` and frees it when the execution ends. glibc serves an allocation that
large with a fresh `mmap` and returns it with `munmap`, so every step faults in and zeroes every page again: a
quarter of a single-device train step's time on the CPU was the kernel's (docs/performance.md has the evidence).
Two settings keep the memory instead:

    jax_cpu_enable_async_dispatch = False   a single-device program runs on the thread that calls it (JAX's
                                            documented switch; programs over several devices are unaffected), so
                                            its buffers come from the main heap: a worker thread's own glibc
                                            arena cannot hold such a block and maps it whatever the options say
    mallopt M_MMAP_MAX = 0                  no allocation of the main heap is served by mmap
    mallopt M_TRIM_THRESHOLD = 2 GiB        freed memory at the heap's top is kept (the largest value mallopt
                                            takes), not given back to the system

Numerics do not change. What changes: a single-device call on the CPU returns when its result is ready (the GIL is
released meanwhile, so other threads run), and the process's resident memory stays at its high-water mark, as under
tcmalloc or jemalloc. The alternative that would keep the worker threads (M_ARENA_MAX = 1: one heap for every
thread) was measured and refused: it made the 2-device quickstart 20% slower (its threads contend for that heap).

`keep_freed_memory` acts on Linux with glibc when JAX computes on the CPU (no GPU or TPU plugin installed, or
JAX_PLATFORMS naming "cpu" first), unless the environment sets LOWBIT_HOST_MALLOC=system; an explicit
JAX_CPU_ENABLE_ASYNC_DISPATCH in the environment is left as it is. Importing this module (or any package of the
project) changes nothing: the project's commands call it (experiments.command), and so does the test suite
(tests/conftest.py); a user's own program calls it before its first computation, since JAX reads the dispatch switch
when it starts its CPU client.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys

__all__ = ["ENV", "applies", "keep_freed_memory"]

ENV = "LOWBIT_HOST_MALLOC"
"""Set to "system" to leave glibc's allocator and JAX's CPU dispatch as they are."""

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's malloc.h
_KEEP = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))
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
    """Applies the settings of the module docstring where `applies(environ)`: returns whether glibc took both
    mallopt options (False: not applicable, or not glibc; the dispatch switch is set on the CPU all the same)."""
    if not applies(environ):
        return False
    if "JAX_CPU_ENABLE_ASYNC_DISPATCH" not in environ:
        import jax

        jax.config.update("jax_cpu_enable_async_dispatch", False)
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl's mallopt does nothing)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(option, value) == 1 for option, value in _KEEP)
