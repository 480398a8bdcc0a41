"""Checkpoint integrity: the content checksum against a direct evaluation of its formula, independence of the
sharding, and damaged bytes in every kind of file a checkpoint holds refused (or, where orbax never reads them for
values, restored bit-identical), with nothing on disk changed."""

import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from core import checkpoint as checkpoint_lib


def _fmix(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def _formula(x: np.ndarray) -> str:
    """The docstring's checksum, word by word in Python integers."""
    words = np.ascontiguousarray(x).view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[x.itemsize])
    lanes = [0, 0]
    for i, w in enumerate(words.reshape(-1).tolist()):
        for lane, c in enumerate((0x9E3779B9, 0x7FEB352D)):
            lanes[lane] = (lanes[lane] + _fmix((w + c * i) & 0xFFFFFFFF)) & 0xFFFFFFFF
    return f"{lanes[0]:08x}{lanes[1]:08x}"


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.normal(size=(96, 128)).astype(np.float32),  # 48 KiB: stored in a data file of its own
        "b": rng.normal(size=(9,)).astype(jnp.bfloat16),
        "n": rng.integers(-9, 9, size=(3, 2)).astype(np.int32),
        "d": rng.normal(size=(4,)).astype(np.float64),
        "step": np.int32(seed),
    }


def test_checksum_is_the_formula_and_catches_every_one_word_change():
    state = _state(0)
    got = checkpoint_lib.digest(state).checksums
    for key, value in state.items():
        assert got[key] == _formula(np.asarray(value)), key
    rng = np.random.default_rng(1)
    w = state["w"].copy()
    for _ in range(20):  # any one word changed, by any amount, changes the checksum
        flat = w.view(np.uint32).reshape(-1).copy()
        flat[rng.integers(flat.size)] ^= np.uint32(1 << int(rng.integers(32)))
        assert checkpoint_lib.digest({"w": flat.view(np.float32)}).checksums["w"] != got["w"]
    moved = np.roll(w.reshape(-1), 1).reshape(w.shape)  # the same words at other positions
    assert checkpoint_lib.digest({"w": moved}).checksums["w"] != got["w"]


def test_checksum_and_nonfinite_count_do_not_depend_on_the_sharding():
    """A [16, 6] array sharded over 8 devices (rows), over 4 x 2 (rows and columns), replicated: one checksum; NaN
    and Inf counted once however many replicas hold them."""
    x = np.random.default_rng(2).normal(size=(16, 6)).astype(np.float32)
    x[3, 1], x[11, 4] = np.nan, np.inf
    expected = _formula(x)
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    for spec in (PartitionSpec(("a", "b")), PartitionSpec("a", "b"), PartitionSpec(), PartitionSpec(None, "b")):
        sharded = jax.device_put(x, NamedSharding(mesh, spec))
        d = checkpoint_lib.digest({"x": sharded})
        assert d.checksums["x"] == expected and d.nonfinite == {"x": 2}, spec


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of a small state of several dtypes (step 3) and the state."""
    root = tmp_path_factory.mktemp("ckpt")
    state = _state(3)
    ckpt = checkpoint_lib.Checkpointer(root / "checkpoints")
    ckpt.save(3, state, loop={"window_calls": 1}, compat={"model": {"d": 4}}, provenance={"optim.lr": 0.1})
    ckpt.wait()
    ckpt.close()
    return root / "checkpoints", state


def _restore(directory, like):
    ckpt = checkpoint_lib.Checkpointer(directory)
    try:
        return ckpt.restore(3, like, compat={"model": {"d": 4}})[0]
    finally:
        ckpt.close()


def _files(directory):
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_damaged_bytes_in_any_file_are_refused_or_never_read(saved, tmp_path):
    """Flip 16 bytes in the middle of each file of the checkpoint in turn (a 1-byte flip too in the array data):
    the restore raises CheckpointError naming the step and changes no file, or (bytes orbax does not read for
    values: a timestamp, b-tree nodes the merged index no longer uses) restores every array bit-identical. The file
    holding w's bytes (the largest) and the metadata record are always refused."""
    directory, state = saved
    assert _restore(directory, state)["w"].dtype == np.float32  # intact: restores
    outcomes: dict[tuple[str, int], str] = {}
    for victim in _files(directory):
        rel = victim.relative_to(directory)
        for width in (16, 1) if "/d/" in str(rel) else (16,):
            copy = tmp_path / f"{len(outcomes)}"
            shutil.copytree(directory, copy)
            target = copy / rel
            data = bytearray(target.read_bytes())
            middle = len(data) // 2
            for i in range(middle, min(middle + width, len(data))):
                data[i] ^= 0xFF
            target.write_bytes(bytes(data))
            before = _files(copy)
            try:
                restored = _restore(copy, state)
            except checkpoint_lib.CheckpointError as e:
                assert "step 3" in str(e) and "Nothing was changed" in str(e), str(e)
                outcomes[(str(rel), width)] = "refused"
            else:
                for key, value in state.items():
                    np.testing.assert_array_equal(np.asarray(restored[key]), np.asarray(value), err_msg=str(rel))
                outcomes[(str(rel), width)] = "identical"
            assert _files(copy) == before
    refused = {name for (name, _), how in outcomes.items() if how == "refused"}
    biggest = max(_files(directory).items(), key=lambda item: len(item[1]))[0].relative_to(directory)
    assert {str(biggest), "3/meta/metadata"} <= refused, outcomes  # w's bytes; the record


def _design_snippet(name: str) -> str:
    """The python block that follows `<!-- name: ... -->` in docs/design.md, as it is written there."""
    text = (Path(__file__).parents[1] / "docs" / "design.md").read_text()
    after = text[text.index(f"<!-- {name}:") :]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_documented_plain_orbax_recipe_reads_a_sharded_checkpoint_on_other_devices(tmp_path):
    """A state sharded over the 8 devices (a site-stacked matrix over 4 x 2, a replicated bfloat16 vector, step,
    key) saved by core.checkpoint; docs/design.md's plain-orbax snippet, run as written in a process with one device
    (where `StandardCheckpointer().restore(path)` refuses the topology), gives every array bit-identical to what
    core.checkpoint restores, as does `load_numpy`, which also refuses damaged bytes."""
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    rng = np.random.default_rng(4)
    w, b = rng.normal(size=(4, 3072)).astype(np.float32), jnp.asarray(rng.normal(size=(6,)), jnp.bfloat16)
    state = {
        "train": {
            "w": jax.device_put(w, NamedSharding(mesh, PartitionSpec("a", "b"))),  # 48 KiB: a data file of its own
            "b": jax.device_put(b, NamedSharding(mesh, PartitionSpec())),
        },
        "step": jnp.int32(7),
        "key": jax.random.PRNGKey(3),
    }
    ckpt = checkpoint_lib.Checkpointer(tmp_path / "checkpoints")
    ckpt.save(7, state, loop={}, compat={})
    ckpt.wait()
    expected = checkpoint_lib.flatten(jax.device_get(ckpt.restore(7, state, compat={})[0]))
    ckpt.close()

    snippet = _design_snippet("restore-with-orbax")
    assert snippet.count('path = "runs/quickstart/checkpoints/700/state"') == 1
    snippet = snippet.replace("runs/quickstart/checkpoints/700/state", str(tmp_path / "checkpoints" / "7" / "state"))
    out = tmp_path / "arrays.pkl"
    program = f"{snippet}\nimport pickle\nassert len(jax.devices()) == 1\npickle.dump(arrays, open({str(out)!r}, 'wb'))"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(out, "rb") as f:
        loaded = {"plain orbax": pickle.load(f), "load_numpy": checkpoint_lib.load_numpy(tmp_path)}
    for how, arrays in loaded.items():
        assert sorted(arrays) == sorted(expected) == ["key", "step", "train/b", "train/w"], how
        for key, value in expected.items():
            assert type(arrays[key]) is np.ndarray and arrays[key].dtype == value.dtype, (how, key)
            assert arrays[key].shape == value.shape and arrays[key].tobytes() == value.tobytes(), (how, key)

    biggest = max((p for p in (tmp_path / "checkpoints" / "7").rglob("*") if p.is_file()), key=os.path.getsize)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    biggest.write_bytes(bytes(data))
    with pytest.raises(checkpoint_lib.DamagedCheckpointError, match="7/state"):
        checkpoint_lib.load_numpy(tmp_path / "checkpoints")


@pytest.mark.parametrize("damage", ["truncated array file", "missing array metadata"])
def test_an_unreadable_checkpoint_is_one_line_without_tensorstores_spec(saved, tmp_path, damage):
    """An array file cut in half, and the OCDBT manifest removed: the DamagedCheckpointError is one line naming the
    checkpoint, with TensorStore's spec of the array (hundreds of characters of JSON) left out."""
    directory = tmp_path / "checkpoints"
    shutil.copytree(saved[0], directory)
    files = [p for p in (directory / "3" / "state").rglob("*") if p.is_file()]
    if damage == "truncated array file":
        biggest = max(files, key=lambda p: p.stat().st_size)
        with open(biggest, "r+b") as f:
            f.truncate(biggest.stat().st_size // 2)
    else:
        for manifest in (p for p in files if p.name == "manifest.ocdbt"):
            manifest.unlink()
    with pytest.raises(checkpoint_lib.DamagedCheckpointError) as e:
        _restore(directory, saved[1])
    message = str(e.value)
    assert "checkpoint of step 3" in message and "cannot be read" in message, message
    assert "tensorstore_spec" not in message and "\n" not in message and len(message) < 600, message
    assert "TensorStore(" not in message and "spec" not in message, message  # orbax's "See full TensorStore details"
    assert re.search(r'"(w|b|n|d|step)/', message), message  # TensorStore's status, naming the array


def test_a_truncated_sharded_array_is_one_line_naming_it(tmp_path):
    """Arrays sharded over a mesh, the largest data file cut short after their metadata: orbax wraps TensorStore's
    error in one quoting the array's whole spec ("See full TensorStore details: ..."); the DamagedCheckpointError is
    one line with TensorStore's own status instead, naming the array and the byte range that is missing."""
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    rng = np.random.default_rng(1)
    state = {
        f"w{i}": jax.device_put(
            jnp.asarray(rng.normal(size=(256, 256)), jnp.float32), NamedSharding(mesh, PartitionSpec("a", "b"))
        )
        for i in range(4)
    }
    ckpt = checkpoint_lib.Checkpointer(tmp_path / "checkpoints")
    ckpt.save(2, state, loop={}, compat={})
    ckpt.wait()
    ckpt.close()
    biggest = max((p for p in (tmp_path / "checkpoints" / "2").rglob("*") if p.is_file()), key=os.path.getsize)
    with open(biggest, "r+b") as f:
        f.truncate(biggest.stat().st_size // 3)
    ckpt = checkpoint_lib.Checkpointer(tmp_path / "checkpoints")
    with pytest.raises(checkpoint_lib.DamagedCheckpointError) as e:
        ckpt.restore(2, state, compat={})
    ckpt.close()
    message = str(e.value)
    assert "checkpoint of step 2" in message and "cannot be read" in message and "\n" not in message, message
    assert "TensorStore" not in message and "spec" not in message and len(message) < 600, message
    assert re.search(r'"w\d/[\d.]+"', message) and "byte range" in message, message


@pytest.mark.parametrize("damage", ["truncated array file", "missing manifest"])
def test_a_failed_restore_leaves_no_read_calling_a_closed_event_loop(tmp_path, capfd, monkeypatch, damage):
    """A restore whose reads fail while others are in flight (many arrays, one file cut short or the OCDBT manifest
    removed) raises DamagedCheckpointError and prints nothing: no "Event loop is closed" traceback from the reads
    that finish after orbax's event loop (core.orbax_compat), however often it is tried, and the next restore of an
    intact checkpoint in the same process is silent too."""
    rng = np.random.default_rng(0)
    state = {f"a{i:03d}": rng.normal(size=(64, 64)).astype(np.float32) for i in range(96)}
    ckpt = checkpoint_lib.Checkpointer(tmp_path / "checkpoints", keep=3)
    for step in (1, 2):
        ckpt.save(step, state, loop={}, compat={})
    ckpt.wait()
    ckpt.close()
    files = [p for p in (tmp_path / "checkpoints" / "2" / "state").rglob("*") if p.is_file()]
    if damage == "truncated array file":
        for victim in [p for p in files if "/d/" in str(p)]:
            with open(victim, "r+b") as f:
                f.truncate(victim.stat().st_size // 3)
    else:
        for manifest in (p for p in files if p.name == "manifest.ocdbt"):
            manifest.unlink()
    unraisable: list[str] = []  # (TensorStore's threads report the closed loop as unraisable exceptions)
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(f"{u.exc_type.__name__}: {u.exc_value}"))
    capfd.readouterr()
    for _ in range(4):
        ckpt = checkpoint_lib.Checkpointer(tmp_path / "checkpoints")
        with pytest.raises(checkpoint_lib.DamagedCheckpointError) as e:
            ckpt.restore(2, state, compat={})
        ckpt.close()
        message = str(e.value)
        assert "\n" not in message and "TensorStore(" not in message and "spec" not in message, message
        assert re.search(r'"[ab]\d+/', message), message
    ckpt = checkpoint_lib.Checkpointer(tmp_path / "checkpoints")
    restored, _ = ckpt.restore(1, state, compat={})
    ckpt.close()
    np.testing.assert_array_equal(restored["a000"], state["a000"])
    import gc
    import time

    gc.collect()
    time.sleep(0.5)  # a read that outlived its loop reports in TensorStore's thread, a moment later
    err = capfd.readouterr().err
    assert not unraisable, unraisable[:3]
    assert "Traceback" not in err and "Event loop is closed" not in err, err[-3000:]


def test_orbax_has_the_runner_orbax_compat_replaces():
    """core.orbax_compat swaps orbax's private coroutine runner: the installed orbax has it, and the swap is undone
    when the last caller leaves."""
    import importlib

    from core import orbax_compat

    module = importlib.import_module(orbax_compat.RUNNER[0])
    original = getattr(module, orbax_compat.RUNNER[1])
    with orbax_compat.draining_event_loops(), orbax_compat.draining_event_loops():
        assert getattr(module, orbax_compat.RUNNER[1]) is orbax_compat.run_draining
    assert getattr(module, orbax_compat.RUNNER[1]) is original
