"""The training driver's care of its workdir, on a stepper with no model (the driver is the same for every model):
one run at a time (a real SIGKILL frees the lock), metric rows after every restart reading as one run, torn and
malformed lines, changed hyper-parameters refused or recorded, damaged checkpoints refused or fallen back from, a
non-finite held-out loss stopping the run."""

import builtins
import errno
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from core import checkpoint as checkpoint_lib
from core import train as train_lib
from core import workdir as workdir_lib
from experiments import run, schema

from helpers import make_tiny_config, metric_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "experiments", "configs", "quickstart.py")


class Counter(train_lib.Stepper):
    """state {"step", "w"}: each step adds 1 to w; the loss is a function of w, the held-out loss of the step
    (`nan_at`: NaN there)."""

    def __init__(self, nan_at=None):
        self.nan_at = nan_at

    def completed_steps(self, state):
        return int(state["step"])

    def step(self, state, call):
        w = np.asarray(state["w"]) + 1.0
        return {"step": np.int32(call + 1), "w": w}, {"loss": float(1.0 / w[0]), "grad_norm": 1.0}

    def evaluate(self, state):
        step = int(state["step"])
        return {"val_loss": float("nan") if step == self.nan_at else 1.0 / step, "val_bits_per_byte": 0.5}


class Crash(Exception):
    pass


def _config(steps=6, every=2):
    c = make_tiny_config()
    c.train.steps, c.train.log_every, c.train.eval_every, c.checkpoint.every = steps, 1, 3, every
    return c


def _run(config, workdir, *, stepper=None, crash_at=None, on_start=None, model="counter", hooks=()):
    def hook(step, metrics):
        if step == crash_at:
            raise Crash

    state = {"step": np.int32(0), "w": np.arange(3, dtype=np.float32)}
    return train_lib.run(
        config,
        stepper or Counter(),
        state,
        workdir=str(workdir),
        compat={"model": model},
        provenance=schema.provenance(config),
        hooks=[hook, *hooks],
        on_start=on_start,
    )


def _files(root):
    """Every file's bytes under `root`, and the lock record's time of change: a refused run changes none of them."""
    files: dict = {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    if (root / ".lock").exists():
        files["lock modified"] = (root / ".lock").stat().st_mtime_ns
    return files


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    _run(_config(), workdir)
    return metric_rows(workdir)


def test_a_restart_from_scratch_and_a_torn_line_read_as_one_run(uninterrupted, tmp_path):
    """Killed at step 1, before its first checkpoint, and rerun: the dead run's rows are set aside, not appended to;
    a crash after a checkpoint that leaves a torn last line: recovered the same way."""
    with pytest.raises(Crash):
        _run(_config(), tmp_path, crash_at=1)
    assert [r["step"] for r in metric_rows(tmp_path)] == [1]
    with pytest.raises(Crash):
        _run(_config(), tmp_path, crash_at=5)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "train_lo')  # a crash in the middle of writing a row
    _run(_config(), tmp_path)
    assert metric_rows(tmp_path) == uninterrupted
    aside = [json.loads(line) for line in (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()]
    assert [r.get("step") for r in aside] == [1, 5, None] and aside[-1] == {"torn_line": '{"step": 5, "train_lo'}


def test_a_malformed_line_is_refused_naming_file_and_line(tmp_path):
    with pytest.raises(Crash):
        _run(_config(), tmp_path, crash_at=3)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    lines[1] = "not json"
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    before = _files(tmp_path)
    with pytest.raises(workdir_lib.WorkdirError, match=r"metrics.jsonl line 2 cannot be read"):
        _run(_config(), tmp_path)
    assert _files(tmp_path) == before


def test_changed_hyperparameters_are_refused_unless_accepted_and_recorded(tmp_path):
    """A resume with changed hyper-parameters is refused naming each change; accepted, the changes are recorded
    (history.jsonl, and the run's records through on_start) only with the first checkpoint trained under them: a run
    stopped before it records nothing."""
    _run(_config(steps=4), tmp_path)
    before = _files(tmp_path)
    changed = _config(steps=6)
    changed.optim.learning_rate, changed.data.seed = 1e-4, 7
    with pytest.raises(checkpoint_lib.CheckpointError) as e:
        _run(changed, tmp_path)
    for needle in (
        "optim.learning_rate: 0.003 -> 0.0001",
        "data.seed: 0 -> 7",
        "train.steps: 4 -> 6",
        "accept_changes",
    ):
        assert needle in str(e.value), str(e.value)
    assert _files(tmp_path) == before
    changed.checkpoint.accept_changes = True
    started: list[int | None] = []
    with pytest.raises(Crash):  # stopped at step 5, before the first checkpoint (6) trained under the changes
        _run(changed, tmp_path, crash_at=5, on_start=started.append)
    assert not (tmp_path / "history.jsonl").exists() and started == []  # nothing records the unsaved change
    assert _run(changed, tmp_path, on_start=started.append)["steps"] == 6 and started == [4]
    (record,) = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert record["resumed_from"] == 4 and record["changes"]["optim.learning_rate"] == [0.003, 1e-4]
    changed.checkpoint.accept_changes = False  # the checkpoints now record the new values: a rerun needs nothing
    assert _run(changed, tmp_path)["resumed_from"] == 6


def _damage(checkpoint):
    """Flips one bit in the middle of the largest file of a checkpoint folder."""
    biggest = max((p for p in checkpoint.rglob("*") if p.is_file()), key=os.path.getsize)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0x01
    biggest.write_bytes(bytes(data))


@pytest.mark.parametrize("steps", [6, 2])
def test_another_programs_checkpoint_is_named_as_such_before_any_changed_hyperparameter(tmp_path, steps):
    """A workdir holding another model's checkpoint, resumed with a config whose train.steps also differs (more, or
    fewer than the checkpoint's step): the refusal names the program difference (compat), not the steps as a change
    one could accept or raise, and changes nothing (the lock record included)."""
    _run(_config(steps=4), tmp_path)
    before = _files(tmp_path)
    with pytest.raises(checkpoint_lib.CheckpointError) as e:
        _run(_config(steps=steps), tmp_path, model="another")
    assert "was written with a different model (checkpoint 'counter', now 'another')" in str(e.value)
    assert "train.steps" not in str(e.value)
    assert _files(tmp_path) == before


def test_a_damaged_checkpoint_is_refused_and_fallen_back_from_only_when_told(uninterrupted, tmp_path):
    """Refused unless checkpoint.fallback; with it, the damaged checkpoint moves to checkpoints.damaged/6 and the run
    resumes from 4; damaged again, it moves beside the first (6.1, not an OSError); with every checkpoint damaged,
    fallback refuses and changes nothing (no silent start from step 0)."""
    _run(_config(), tmp_path)
    _damage(tmp_path / "checkpoints" / "6")
    before = _files(tmp_path)
    with pytest.raises(checkpoint_lib.DamagedCheckpointError, match="step 6.*--config.checkpoint.fallback=True"):
        _run(_config(), tmp_path)
    assert _files(tmp_path) == before
    config = _config()
    config.checkpoint.fallback = True
    result = _run(config, tmp_path)
    assert result["resumed_from"] == 4 and (tmp_path / "checkpoints.damaged" / "6").is_dir()
    assert metric_rows(tmp_path) == uninterrupted
    _damage(tmp_path / "checkpoints" / "6")
    assert _run(config, tmp_path)["resumed_from"] == 4 and (tmp_path / "checkpoints.damaged" / "6.1").is_dir()
    for step in checkpoint_lib.Checkpointer(tmp_path / "checkpoints").all_steps():
        _damage(tmp_path / "checkpoints" / str(step))
    before = _files(tmp_path)
    with pytest.raises(checkpoint_lib.DamagedCheckpointError, match="every checkpoint .* is damaged .*start over"):
        _run(config, tmp_path)
    assert _files(tmp_path) == before


def test_a_nonfinite_held_out_loss_stops_the_run_before_its_checkpoint(tmp_path):
    with pytest.raises(train_lib.NonFiniteLossError, match="held-out loss is nan") as e:
        _run(_config(), tmp_path, stepper=Counter(nan_at=6))
    assert e.value.last_checkpoint == 4
    assert checkpoint_lib.Checkpointer(tmp_path / "checkpoints").latest_step() == 4


def test_one_run_per_workdir_and_a_killed_holder_frees_it(tmp_path, capsys):
    """A second run (here: a process holding the lock) is refused naming its pid and host; after a real SIGKILL of
    the holder the lock is free. In one process the lock is re-entrant (the CLI holds it around the driver)."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from core import workdir; held = workdir.lock({str(tmp_path)!r}); held.__enter__(); "
            "print(1, flush=True); import time; time.sleep(600)",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "1"
        with pytest.raises(workdir_lib.WorkdirError, match=f"in use by another run \\(pid {holder.pid} on host "):
            _run(_config(), tmp_path)
        assert run.main(["run", f"--config={CONFIG}", f"--workdir={tmp_path}"]) == 2  # the CLI: before any work
        assert f"in use by another run (pid {holder.pid}" in capsys.readouterr().err
        assert not (tmp_path / "metrics.jsonl").exists()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        with workdir_lib.lock(str(tmp_path)), workdir_lib.lock(str(tmp_path)):
            record = json.loads((tmp_path / ".lock").read_text())
            assert record["pid"] == os.getpid()
    finally:
        holder.kill()


@pytest.mark.parametrize("where", ["a file", "/sys", "/proc/self", "/proc/none/x"])
def test_a_workdir_that_cannot_be_used_is_an_error_line(tmp_path, capsys, where):
    """A path that is a file, a read-only directory (sysfs, procfs: read-only even for root), one that cannot be
    created: `error:` naming it and exit 2, before anything is built."""
    path = tmp_path / "file" if where == "a file" else where
    if where == "a file":
        path.write_text("x")
    assert run.main(["run", f"--config={CONFIG}", f"--workdir={path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(path) in err and "Traceback" not in err, err


def test_a_full_disk_stops_the_run_in_one_error_keeping_the_checkpoints_and_resume_is_exact(
    uninterrupted, tmp_path, monkeypatch
):
    """The disk fills before the checkpoint of step 6 (its free space reported below what the state needs): one
    CheckpointWriteError naming the folder, the cause and the checkpoints kept (2, 4), nothing partial left; the same
    for metrics.jsonl and summary.json-style writes (WriteError naming the file). Once space is back, the rerun
    resumes from 4 and writes the uninterrupted run's rows."""
    real = shutil.disk_usage
    full = [False]

    def disk_usage(path):
        usage = real(path)
        return usage._replace(free=100) if full[0] else usage

    def fill_at(step, metrics):
        full[0] = full[0] or step == 5

    monkeypatch.setattr(checkpoint_lib.shutil, "disk_usage", disk_usage)
    with pytest.raises(checkpoint_lib.CheckpointWriteError) as e:
        _run(_config(), tmp_path, hooks=[fill_at])
    message = str(e.value)
    assert "the checkpoint of step 6 needs up to" in message and "No space left on device" in message
    assert "nothing was written, and the checkpoints kept are steps [2, 4]" in message and "\n" not in message
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]
    full[0] = False
    assert _run(_config(), tmp_path)["resumed_from"] == 4
    assert metric_rows(tmp_path) == uninterrupted
    monkeypatch.setattr(builtins, "open", _no_space(builtins.open, str(tmp_path / "metrics.jsonl")))
    with pytest.raises(workdir_lib.WriteError, match=r"metrics.jsonl could not be written: No space left on device"):
        workdir_lib.MetricsLog(str(tmp_path)).write({"step": 7})
    monkeypatch.setattr(builtins, "open", _no_space(builtins.open, str(tmp_path / "summary.json.tmp")))
    with pytest.raises(workdir_lib.WriteError, match=r"summary.json could not be written: No space left"):
        workdir_lib.write_json(str(tmp_path / "summary.json"), {"a": 1})
    assert not (tmp_path / "summary.json.tmp").exists()


def _no_space(real_open, path):
    """`open` that fails with ENOSPC for `path` (as a full disk does), and opens everything else."""

    def fake(file, *args, **kwargs):
        if os.fspath(file) == path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real_open(file, *args, **kwargs)

    return fake
