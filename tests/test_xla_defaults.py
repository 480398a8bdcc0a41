"""One tier compiled as users compile: the model's forward, the train step and the engine's steps under XLA's default
flags, checked against the same references as in the rest of the suite.

The suite compiles with XLA's fast CPU settings (tests/conftest.py: LLVM optimisation level 0, loop emitters instead
of fusion emitters), which fuse and vectorise differently from the defaults and so round floats differently: a
result that holds under them might not hold under the compilation a user gets. The test here starts a pytest process
with conftest's XLA_DEFAULTS variable set (conftest then adds only the 8 virtual devices to XLA_FLAGS, and the
persistent compilation cache is off, so every program is compiled afresh) and runs in it these tests of the suite,
unchanged:

* the forward pass of a transformer with every optional part (grouped heads, biases, QK norm, Llama-3 RoPE) against
  its float64 NumPy reference (test_model);
* three train steps on 8 devices (data x tensor parallel) against the same steps on one device: losses, parameters
  and the sharding of parameters and Adam's moments (test_sharding);
* the engine's steps with an FP4 KV cache (chunked prefills interleaved with decodes) against each request's
  isolated greedy generation by core.generate (test_engine).

About 45 s of one core, most of it XLA compiling at its default optimisation level: it runs with `-m slow`.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
XLA_DEFAULTS = "LOWBIT_TESTS_XLA_DEFAULTS"  # conftest.XLA_DEFAULTS
FAST_FLAGS = ("--xla_backend_optimization_level", "--xla_cpu_use_fusion_emitters")  # what conftest adds elsewhere
TIER = (
    "tests/test_model.py::test_forward_matches_float64_numpy[shape1-headdim-bias-qknorm-llama3]",
    "tests/test_sharding.py::test_train_steps_on_8_devices_equal_one_device[2-4]",
    "tests/test_engine.py::test_interleaved_requests_equal_isolated_generation[fp4]",
)


@pytest.mark.slow  # (45 s of one core: the default run keeps its margin under 10 minutes)
def test_model_forward_train_step_and_engine_hold_under_xla_default_flags():
    """TIER passes, every test of it, in a process whose XLA flags are the defaults plus the virtual devices."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "JAX_COMPILATION_CACHE_DIR"}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(FAST_FLAGS))
    env.update({XLA_DEFAULTS: "1", "JAX_ENABLE_COMPILATION_CACHE": "false"})
    cmd = [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "--rootdir", ROOT, *TIER]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    out = done.stdout + done.stderr
    header = re.search(r"^XLA_FLAGS: (.*)$", out, re.MULTILINE)
    assert header is not None, out
    assert "--xla_force_host_platform_device_count=8" in header.group(1).split(), header.group(0)
    assert not [f for f in header.group(1).split() if f.startswith(FAST_FLAGS)], header.group(0)
    assert done.returncode == 0 and re.search(rf"\b{len(TIER)} passed\b", out) and "skipped" not in out, out[-6000:]
