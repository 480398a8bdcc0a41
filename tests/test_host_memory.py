"""core.host_memory: after `import core`, a large block a worker thread allocates comes from the heap the process
keeps (no mmap), as XLA:CPU's per-execution buffers must; with LOWBIT_HOST_MALLOC=system glibc maps it as usual.
Checked in fresh processes through glibc's own accounting (mallinfo2: bytes in mmapped blocks)."""

import ctypes
import os
import subprocess
import sys

import pytest

from core import host_memory

_GLIBC = sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "mallinfo2")

_PROBE = """
import ctypes, threading
import core
libc = ctypes.CDLL(None)
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
seen = []
def worker():  # XLA:CPU allocates an execution's buffers on its own threads
    for _ in range(2):
        before = libc.mallinfo2().hblkhd
        block = libc.malloc(96 << 20)
        ctypes.memset(block, 1, 96 << 20)
        seen.append((block, libc.mallinfo2().hblkhd - before))
        libc.free(block)
thread = threading.Thread(target=worker)
thread.start(); thread.join()
print(seen[0][1], seen[1][1], int(seen[0][0] == seen[1][0]))
"""


def _probe(**env) -> tuple[int, int, bool]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    mapped_first, mapped_second, same = done.stdout.split()
    return int(mapped_first), int(mapped_second), same == "1"


@pytest.mark.skipif(not _GLIBC, reason="glibc's malloc (Linux) only")
def test_large_blocks_stay_in_the_heap_and_are_reused():
    assert host_memory.applies({"JAX_PLATFORMS": "cpu"})
    mapped_first, mapped_second, same = _probe(JAX_PLATFORMS="cpu")
    assert (mapped_first, mapped_second) == (0, 0)  # neither allocation added a mapping
    assert same  # the second took the memory the first freed
    mapped_first, mapped_second, _ = _probe(JAX_PLATFORMS="cpu", **{host_memory.ENV: "system"})
    assert mapped_first >= 96 << 20 and mapped_second >= 96 << 20  # glibc's default: each one a fresh mapping


def test_applies_only_on_the_cpu_and_refuses_unknown_values():
    assert not host_memory.applies({"JAX_PLATFORMS": "cuda,cpu"})
    assert not host_memory.applies({"JAX_PLATFORMS": "cpu", host_memory.ENV: "system"})
    with pytest.raises(ValueError, match="LOWBIT_HOST_MALLOC = 'tcmalloc'.*'keep'.*'system'"):
        host_memory.applies({host_memory.ENV: "tcmalloc"})
