"""Test setup: 8 virtual CPU devices (set before JAX is imported), cheap compilation (a cache the session shares,
XLA's fast-compiling CPU settings; not in the process test_xla_defaults starts, which compiles with XLA's defaults
as users do), and small shared fixtures.

Most of the suite's time is XLA compiling small programs, and many tests compile the same ones (a resumed run
compiles what the run it resumes compiled; the CLI tests start processes that compile the same train step). JAX's
persistent compilation cache, in a directory made for this session and removed at its end, lets every process of
the session (pytest-xdist workers and the CLI subprocesses, which inherit the environment) compile each program
once. Only programs that take a second or more to compile are cached (JAX's default: writing the many op-by-op
ones cost more than reading them back saved, about 12% of a file's time). It changes no result: a cached
executable is the one XLA would compile again.
"""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

# The suite's programs are tiny: compiling them costs far more than running them. On the CPU, XLA's fast LLVM level
# and its loop emitters instead of its fusion emitters compile them about twice as fast (results are checked against
# references either way; a few equalities hold only to float32 rounding with these, see test_optimizers).
_DEVICES = "--xla_force_host_platform_device_count=8"
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def _xla_accepts(flags):
    """Whether this jaxlib knows every flag: XLA aborts a process whose XLA_FLAGS hold one it does not. (A bare CPU
    client, without importing jax: a tenth of the time; a jaxlib without this entry point just keeps the defaults.)"""
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    probe = [sys.executable, "-c", "from jaxlib import xla_client; xla_client.make_cpu_client()"]
    return subprocess.run(probe, env=env, capture_output=True, check=False).returncode == 0


# The one tier compiled as users compile (test_xla_defaults) runs its tests in a process started with this variable:
# there XLA keeps its default flags (only the virtual devices are added).
XLA_DEFAULTS = "LOWBIT_TESTS_XLA_DEFAULTS"

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_given = os.environ.get("XLA_FLAGS", "").split()  # xdist workers inherit the first process's flags
_flags = [_DEVICES]
_fast = os.environ["JAX_PLATFORMS"] == "cpu" and not os.environ.get(XLA_DEFAULTS)
if _fast and not set(_FAST_COMPILE) <= set(_given) and _xla_accepts(_FAST_COMPILE):
    _flags += _FAST_COMPILE
os.environ["XLA_FLAGS"] = " ".join([*_given, *(f for f in _flags if f not in _given)])
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the first process of the session; workers inherit it
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="lowbit-moe-lab-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

from core import host_memory  # noqa: E402 (after XLA_FLAGS: applying it imports jax)

host_memory.keep_freed_memory()  # the commands' CPU memory settings (experiments.command), applied as they apply them


def pytest_report_header(config):
    """The XLA flags this process compiles with (test_xla_defaults reads them from the process it starts)."""
    return f"XLA_FLAGS: {os.environ['XLA_FLAGS']}"


@pytest.fixture
def tiny_config():
    """helpers.make_tiny_config(): a config small enough to train a few steps in seconds."""
    from helpers import make_tiny_config

    return make_tiny_config()
