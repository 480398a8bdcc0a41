"""What the training driver logs and saves, on a stand-in stepper (no model, nothing to compile): TensorBoard
scalars read back from the event files equal metrics.jsonl's rows, across a crash and a resume; checkpoints in
whole rounds, the last `keep` kept; console output without a terminal (plain lines, no bar) and with one (tqdm)."""

import glob
import importlib
import io
import json
import os
import struct
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from core import checkpoint as checkpoint_lib
from core import train as train_lib
from core import workdir as workdir_lib
from moe.stepper import FederatedStepper

from helpers import make_tiny_config

K = 3  # steps per round of the stand-in stepper


def event_scalars(workdir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} as TensorBoard shows a workdir's event files: the files in name order, each a
    TFRecord stream (uint64 length, uint32 CRC, an Event proto, uint32 CRC), a SessionLog START at step s dropping
    what earlier files logged at steps >= s (TensorBoard's purge of orphaned data)."""
    event_pb2 = importlib.import_module("tensorboardX.proto.event_pb2")
    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(str(workdir), "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            data = f.read()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                scalars = {tag: [(s, v) for s, v in points if s < event.step] for tag, points in scalars.items()}
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return {tag: points for tag, points in scalars.items() if points}


def jsonl_scalars(workdir, drop=()) -> dict[str, list[tuple[int, float]]]:
    """The numeric columns of metrics.jsonl as {column: [(step, value as float32), ...]}, in row order."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    with open(os.path.join(str(workdir), "metrics.jsonl")) as f:
        for row in map(json.loads, f):
            for name, value in row.items():
                if name != "step" and name not in drop and isinstance(value, (int, float)):
                    scalars.setdefault(name, []).append((row["step"], float(np.float32(value))))
    return scalars


class RoundStepper(train_lib.Stepper):
    """A stand-in for a federated round: K steps per call, a `round` tag, losses that depend on the call and the
    state (so a resume that restored the wrong state would write other rows)."""

    steps_per_call, unit = K, "round"

    def completed_steps(self, state):
        return int(state["step"])

    def step(self, state, call):
        w = state["w"] + 1.0 / (call + 1)
        loss = float(jnp.sum(w))
        return {"w": w, "step": state["step"] + K}, {"loss": loss, "grad_norm": 0.5 + call, "stand_in/m": call / 7}

    def evaluate(self, state):
        return {"val_loss": float(jnp.sum(state["w"])) / 3, "val_bits_per_byte": float(jnp.max(state["w"]))}

    def tags(self, call):
        return {"round": call + 1}


def _config(every):
    c = make_tiny_config()
    c.train.steps, c.train.log_every, c.train.eval_every, c.train.progress = 5 * K, K, 2 * K, True
    c.checkpoint.every, c.checkpoint.keep = every, 2
    return c


def _run(workdir, every=4, hooks=(), init_from=""):
    state = {"w": jnp.zeros(4, jnp.float32), "step": jnp.zeros((), jnp.int32)}
    config = _config(every)
    config.checkpoint.init_from = init_from  # (the loop only reads whether it is set)
    return train_lib.run(config, RoundStepper(), state, workdir=str(workdir), compat={}, hooks=hooks)


def test_a_pretrained_start_logs_step_0_once_across_a_crash_before_its_first_checkpoint(tmp_path, capsys):
    """A fresh start from pretrained weights (checkpoint.init_from set) evaluates before its first call: a held-out
    row at step 0. Crashed before its first checkpoint and rerun from scratch, the workdir holds that row once, in
    metrics.jsonl and in what TensorBoard shows, as an uninterrupted run does; a run from random weights has none."""
    full = tmp_path / "full"
    _run(full, init_from="hf:somewhere")
    assert "step 0 (the starting weights): held-out 0.000 bits/byte" in capsys.readouterr().out
    assert [s for s, _ in jsonl_scalars(full)["val_loss"]] == [0, 6, 12, 15]
    crashed = tmp_path / "crashed"
    with pytest.raises(Crash):
        _run(crashed, hooks=[_crash_at(3)], init_from="hf:somewhere")  # before the first checkpoint (6)
    _run(crashed, init_from="hf:somewhere")
    timing = ("tokens_per_second",)
    assert jsonl_scalars(crashed, drop=timing) == jsonl_scalars(full, drop=timing)
    assert event_scalars(crashed) == jsonl_scalars(crashed)
    _run(tmp_path / "random")
    assert [s for s, _ in jsonl_scalars(tmp_path / "random")["val_loss"]] == [6, 12, 15]


class Crash(Exception):
    pass


def _crash_at(step):
    def hook(done, metrics):
        if done == step:
            raise Crash(step)

    return hook


def test_rounds_log_tensorboard_scalars_save_in_whole_rounds_and_resume(tmp_path, capsys):
    """5 rounds of 3 steps, checkpoint.every = 4 steps -> every 2 rounds (steps 6, 12) and the last (15), the last
    2 kept. The event files hold metrics.jsonl's rows as float32 scalars. A crash after round 3 (step 9, last
    checkpoint at 6) and a rerun: metrics.jsonl and the scalars TensorBoard shows equal the uninterrupted run's,
    although the crashed run's file still holds round 3."""
    full = _run(tmp_path / "full")
    out = capsys.readouterr()
    assert checkpoint_lib.Checkpointer(tmp_path / "full" / "checkpoints").all_steps() == [12, 15]
    assert "checkpoints: every 2 rounds (6 steps: checkpoint.every = 4 in whole rounds of 3 steps)" in out.out
    assert "compiling the round" in out.out and "compiled: the first round took" in out.out
    # no terminal (pytest captures both streams): plain progress lines, no tqdm bar
    assert "round 5/5 (step 15): train loss" in out.out and "round 1/5 (step 3)" in out.out
    assert "\r" not in out.err and "it/s" not in out.err and "round/s" not in out.err
    events = event_scalars(tmp_path / "full")
    assert events == jsonl_scalars(tmp_path / "full")
    assert {"train_loss", "grad_norm", "learning_rate", "round", "stand_in/m", "val_loss"} <= set(events)
    assert [s for s, _ in events["val_loss"]] == [6, 12, 15] and events["round"][-1] == (15, 5.0)

    crashed = tmp_path / "crashed"
    with pytest.raises(Crash):
        _run(crashed, hooks=[_crash_at(9)])
    assert checkpoint_lib.Checkpointer(crashed / "checkpoints").all_steps() == [6]
    assert max(s for s, _ in event_scalars(crashed)["train_loss"]) == 9  # logged before the crash
    resumed = _run(crashed)
    assert resumed["resumed_from"] == 6 and resumed["val_loss"] == full["val_loss"]
    assert len(glob.glob(str(crashed / "events.out.tfevents.*"))) == 2
    no_timing = ("tokens_per_second",)
    assert jsonl_scalars(crashed, no_timing) == jsonl_scalars(tmp_path / "full", no_timing)
    assert event_scalars(crashed) == jsonl_scalars(crashed)  # round 3 of the crashed run purged, logged once
    # a rerun of the finished run writes no rows and no event file
    _run(crashed)
    assert len(glob.glob(str(crashed / "events.out.tfevents.*"))) == 2


@pytest.mark.parametrize("every, rounds", [(0, 0), (1, 1), (9, 1), (10, 1), (11, 2), (100, 10), (101, 11)])
def test_federated_checkpoints_in_whole_rounds(every, rounds):
    """checkpoint.every steps -> a checkpoint every ceil(every / K) rounds of K = 10 steps (0: only the last)."""
    round_ = types.SimpleNamespace(steps_per_call=10)
    cadence = FederatedStepper.checkpoint_every(round_, every)  # type: ignore[arg-type]
    assert cadence == rounds * 10
    saved = [r for r in range(1, 31) if train_lib.crossed(r * 10, cadence, 10)]
    assert saved == ([r for r in range(1, 31) if r % rounds == 0] if rounds else [])


def test_progress_bar_is_tqdm_on_a_terminal_only(capsys):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    bar = train_lib.progress_bar(0, 4, enabled=True, stream=Terminal())
    assert type(bar).__module__.startswith("tqdm")
    bar.close()
    lines = train_lib.progress_bar(0, 40, enabled=True, unit="round", steps=5, stream=io.StringIO())
    for _ in range(40):
        lines.update(1)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("round 4/40 (step 20):") and printed[-1].startswith("round 40/40 (step 200):")
    assert len(printed) == 10
    quiet = train_lib.progress_bar(0, 40, enabled=False, stream=io.StringIO())
    quiet.update(40)
    assert capsys.readouterr().out == ""


def test_progress_lines_name_a_step_once_leave_compilation_out_of_the_estimate_and_show_at_zero_width(
    capsys, monkeypatch
):
    """Plain lines of a step-by-step run read `step 2/10: ...` (no `(step 2)` beside it); the time left is
    estimated from the calls after the first (which compiles: 100 s here, then 1 s a step); a terminal whose width
    is unknown (0 columns, as a new pseudo-terminal has), where tqdm would draw nothing, gets the plain lines."""
    clock = iter([0.0, 100.0, *(100.0 + i for i in range(1, 10))])
    monkeypatch.setattr(train_lib.progress, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    lines = train_lib.progress_bar(0, 10, enabled=True, stream=io.StringIO())
    for _ in range(10):
        lines.update(1)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("step 1/10: 1:40 elapsed") and "left" not in printed[0]
    assert printed[1] == "step 2/10: 1:41 elapsed, about 0:08 left"
    monkeypatch.undo()
    primary, secondary = os.openpty()
    try:
        with os.fdopen(secondary, "w", closefd=False) as terminal:
            assert os.get_terminal_size(terminal.fileno()).columns == 0
            assert isinstance(train_lib.progress_bar(0, 4, enabled=True, stream=terminal), type(lines))
    finally:
        os.close(primary)
        os.close(secondary)


def test_without_tensorboardx_a_run_stops_before_it_starts_unless_events_are_off(tmp_path, monkeypatch):
    """tensorboardX missing: the run is refused before any call, naming the package and the switch; with
    train.tensorboard = False it trains and writes metrics.jsonl only."""
    monkeypatch.setitem(sys.modules, "tensorboardX.event_file_writer", None)  # import raises ImportError
    with pytest.raises(workdir_lib.WorkdirError, match=r"tensorboardX.*--config.train.tensorboard=False"):
        _run(tmp_path / "refused")
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()
    config = _config(every=4)
    config.train.tensorboard = False
    state = {"w": jnp.zeros(4, jnp.float32), "step": jnp.zeros((), jnp.int32)}
    train_lib.run(config, RoundStepper(), state, workdir=str(tmp_path / "off"), compat={})
    assert (tmp_path / "off" / "metrics.jsonl").exists() and not glob.glob(str(tmp_path / "off" / "events.*"))
