"""Importing a library package changes nothing process-wide: in a fresh process, `import core` (and each of moe,
optim, quant, kvcache) leaves JAX's configuration, the environment, signal handlers, warning filters, logging, NumPy's
settings, the garbage collector and the recursion limit as they were; none of moe, optim, quant and kvcache (every
module of each) loads ml_collections; and glibc's allocator gives a freed 256 MiB
array back to the system (it kept it when `import core` applied core.host_memory's settings). The settings are a
program's choice: the commands apply them explicitly (experiments.command), and so does the probe's second half,
which shows the allocator check can fail."""

import json
import subprocess
import sys

import pytest

_PROBE = r"""
import gc, json, logging, os, signal, sys, warnings
import numpy as np
import jax

def snapshot():
    return {
        "jax.config": {k: repr(v) for k, v in sorted(jax.config.values.items())},
        "os.environ": dict(os.environ),
        "signals": {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals() if isinstance(s, signal.Signals)},
        "warnings.filters": [repr(f) for f in warnings.filters],
        "logging": [logging.root.level, [repr(h) for h in logging.root.handlers], logging.lastResort is not None],
        "numpy": [sorted(np.geterr().items()), sorted(np.get_printoptions().items(), key=str)],
        "gc": [gc.isenabled(), gc.get_threshold()],
        "recursionlimit": sys.getrecursionlimit(),
    }

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def kept_after_free():
    base = rss()
    a = np.ones(256 << 20, np.uint8)
    del a
    return rss() - base

before = snapshot()
import importlib, pkgutil
for name in sys.argv[1].split(','):
    package = importlib.import_module(name)
    for module in pkgutil.walk_packages(package.__path__, name + "."):  # every module of it, not only __init__
        importlib.import_module(module.name)
after = snapshot()
configuration_library = sorted(m for m in sys.modules if m.split(".")[0] == "ml_collections")
changed = {k: [before[k], after[k]] for k in before if before[k] != after[k]}
kept = kept_after_free()
from core import host_memory
applied = host_memory.keep_freed_memory()
print(json.dumps({"changed": changed, "kept": kept, "ml_collections": configuration_library,
                  "applied": applied, "kept_applied": kept_after_free(),
                  "async_dispatch": jax.config.read("jax_cpu_enable_async_dispatch")}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm and glibc's allocator")
@pytest.mark.parametrize("packages", ["core", "moe", "optim", "quant", "kvcache"])
def test_importing_a_package_changes_nothing_process_wide(packages):
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", _PROBE, packages], env=env, capture_output=True, text=True, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["changed"] == {}, out["changed"]
    if packages != "core":  # the libraries take typed arguments; core.schema (the ConfigDict machinery) may load it
        assert out["ml_collections"] == [], out["ml_collections"]
    assert out["kept"] < 32 << 20, out["kept"]  # the 256 MiB were given back
    if out["applied"]:  # the program's own choice, applied explicitly: the same allocation stays resident
        assert out["kept_applied"] > 200 << 20 and out["async_dispatch"] is False, out
