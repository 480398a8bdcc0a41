"""What every command of this project does around its work: the process-wide settings that a program may choose
and a library must not, applied explicitly here, by each command's `__main__` block (`python -m experiments.run`,
`.serve`, `.hf`, `.launch`, the benchmarks and the reproductions).

    if __name__ == "__main__":
        command.run(main)

Importing any package of this project changes nothing process-wide; a user's own program that wants the same CPU
memory settings calls `core.host_memory.keep_freed_memory()` before its first computation.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from core import host_memory

__all__ = ["run"]


def run(main: Callable[[], int | None]) -> None:
    """Applies `core.host_memory.keep_freed_memory()` (XLA:CPU's per-execution buffers kept in memory the process
    holds, on Linux with glibc when JAX computes on the CPU; LOWBIT_HOST_MALLOC=system opts out) before anything is
    computed, then exits with `main()`'s status (None: 0)."""
    host_memory.keep_freed_memory()
    sys.exit(main())
