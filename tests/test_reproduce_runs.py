"""The reproductions' run reuse: a finished run is reused only when the config experiments.run wrote for it equals the
config the call would train (config file + flags + steps), and any other workdir is moved aside, never mixed."""

import json
import os
import sys

import pytest

from core import workdir as workdir_lib
from experiments import args as args_lib
from experiments.reproduce import runs

CASES = {  # config name -> flags a reproduction passes (the shapes of mgup, fomoe and composed)
    "quickstart": ["--config.mesh.site=1", "--config.mesh.data=1", "--config.optim.learning_rate=0.005"],
    "fomoe": ["--config.mesh.site=2", "--config.fomoe.local_steps=8", "--config.fomoe.outer=diloco"],
    "composed": ["--config.optim.name=mgup_adamw", "--config.train.seed=1", "--config.data.seed=1"],
}


def _argv(config: str, workdir: str, flags: list[str], steps: int) -> list[str]:
    return ["experiments.run", f"--config={config}", f"--workdir={workdir}", f"--config.train.steps={steps}", *flags]


def _finished_run(workdir, config: str, flags: list[str], steps: int, *, with_config=True, summary=True) -> dict:
    """A workdir as experiments.run leaves it: config.json written by run.py's own writer from run.py's own parse
    of the command line, summary.json with the run's numbers, a checkpoint directory."""
    os.makedirs(os.path.join(workdir, "checkpoints", str(steps)), exist_ok=True)
    if with_config:
        resolved, _ = args_lib.parse_run_args(_argv(config, str(workdir), flags, steps))
        workdir_lib.write_json(os.path.join(workdir, "config.json"), resolved.to_dict())
    result = {"steps": steps, "val_loss": 1.2345, "marker": "old"}
    if summary:
        workdir_lib.write_json(os.path.join(workdir, "summary.json"), result)
    return result


@pytest.fixture
def launches(monkeypatch):
    """Replaces the training process: records each command and writes what a finished run writes."""
    calls = []

    def fake_launch(cmd, **kwargs):
        calls.append(cmd)
        args = cmd[cmd.index("experiments.run") + 1 :]
        workdir = next(a.split("=", 1)[1] for a in args if a.startswith("--workdir="))
        os.makedirs(workdir, exist_ok=True)
        resolved, _ = args_lib.parse_run_args(["experiments.run", *args])
        workdir_lib.write_json(os.path.join(workdir, "config.json"), resolved.to_dict())
        workdir_lib.write_json(os.path.join(workdir, "summary.json"), {"steps": resolved.train.steps, "marker": "new"})
        return 0, []

    monkeypatch.setattr(runs, "launch", fake_launch)
    return calls


@pytest.mark.parametrize("name", list(CASES))
def test_a_finished_run_of_the_same_config_is_reused(name, tmp_path, launches):
    workdir = tmp_path / "run"
    old = _finished_run(workdir, runs.config_path(name), CASES[name], 40)
    assert runs.run_or_reuse(runs.config_path(name), str(workdir), CASES[name], 40) == old
    assert launches == [] and sorted(os.listdir(tmp_path)) == ["run"]


@pytest.mark.parametrize(
    "name, change, differs",
    [
        ("quickstart", ["--config.optim.learning_rate=0.01"], "optim.learning_rate: 0.005 -> 0.01"),
        ("fomoe", ["--config.fomoe.outer=local_adamw"], "fomoe.outer: 'diloco' -> 'local_adamw'"),
        ("composed", ["--config.data.seed=2"], "data.seed: 1 -> 2"),
    ],
)
def test_same_steps_other_flags_is_rerun_and_the_old_run_moved_aside(name, change, differs, tmp_path, launches, capsys):
    workdir = tmp_path / "run"
    config, flags = runs.config_path(name), CASES[name]
    old = _finished_run(workdir, config, flags, 40)
    summary = runs.run_or_reuse(config, str(workdir), flags + change, 40)
    assert summary["marker"] == "new" and len(launches) == 1
    assert f"--workdir={workdir}" in launches[0] and change[0] in launches[0]
    stale = tmp_path / "run.stale-1"
    with open(stale / "summary.json") as f:
        assert json.load(f) == old  # the old run is kept whole, beside the new one
    assert (stale / "checkpoints" / "40").is_dir() and not (workdir / "checkpoints").exists()
    out = capsys.readouterr().out
    assert differs in out and "run.stale-1" in out


def test_other_steps_is_rerun_afresh_not_resumed(tmp_path, launches):
    workdir = tmp_path / "run"
    config, flags = runs.config_path("quickstart"), CASES["quickstart"]
    _finished_run(workdir, config, flags, 40)
    assert runs.run_or_reuse(config, str(workdir), flags, 80)["steps"] == 80
    assert len(launches) == 1 and "--config.train.steps=80" in launches[0]
    assert (tmp_path / "run.stale-1" / "checkpoints" / "40").is_dir()  # no checkpoint of the 40-step run to resume
    assert not (workdir / "checkpoints").exists()


def test_a_run_without_config_json_cannot_be_checked_and_is_moved_aside(tmp_path, launches):
    workdir = tmp_path / "run"
    config, flags = runs.config_path("quickstart"), CASES["quickstart"]
    _finished_run(workdir, config, flags, 40, with_config=False)
    assert runs.run_or_reuse(config, str(workdir), flags, 40)["marker"] == "new"
    assert len(launches) == 1 and (tmp_path / "run.stale-1" / "summary.json").exists()


def test_an_interrupted_run_of_the_same_config_resumes_in_place(tmp_path, launches):
    workdir = tmp_path / "run"
    config, flags = runs.config_path("fomoe"), CASES["fomoe"]
    _finished_run(workdir, config, flags, 64, summary=False)
    assert runs.run_or_reuse(config, str(workdir), flags, 64, devices=2)["marker"] == "new"
    assert len(launches) == 1 and sorted(os.listdir(tmp_path)) == ["run"]
    assert (workdir / "checkpoints" / "64").is_dir()  # left for experiments.run to resume from


def test_every_mismatch_keeps_its_own_stale_copy(tmp_path, launches):
    workdir = tmp_path / "run"
    config, flags = runs.config_path("quickstart"), CASES["quickstart"]
    _finished_run(workdir, config, flags, 40)
    runs.run_or_reuse(config, str(workdir), flags, 50)
    runs.run_or_reuse(config, str(workdir), flags, 60)
    assert sorted(os.listdir(tmp_path)) == ["run", "run.stale-1", "run.stale-2"]
    steps = [
        json.loads((tmp_path / d / "summary.json").read_text())["steps"] for d in ("run.stale-1", "run.stale-2", "run")
    ]
    assert steps == [40, 50, 60]


def test_a_bad_flag_fails_before_anything_runs_or_moves(tmp_path, launches):
    workdir = tmp_path / "run"
    config = runs.config_path("quickstart")
    _finished_run(workdir, config, [], 40)
    with pytest.raises(args_lib.UsageError, match="optim.learning_rat"):
        runs.run_or_reuse(config, str(workdir), ["--config.optim.learning_rat=0.1"], 40)
    assert launches == [] and sorted(os.listdir(tmp_path)) == ["run"]


def test_a_run_differing_only_in_its_progress_display_is_reused(tmp_path, launches):
    workdir = tmp_path / "run"
    config, flags = runs.config_path("quickstart"), CASES["quickstart"]
    old = _finished_run(workdir, config, [*flags, "--config.train.progress=False"], 40)
    assert runs.run_or_reuse(config, str(workdir), flags, 40) == old
    assert launches == []


def test_launch_forwards_each_line_prefixed_and_thins_out_progress_bar_states(monkeypatch, capsys):
    """A child writing lines and tqdm-style states (each led by a carriage return): every line comes through as it
    is, prefixed; of the states, the first (the others come within PROGRESS_EVERY of it) and the final one, which
    ends with a newline; the blanks a bar writes to clear itself are dropped; stderr is merged in order."""
    monkeypatch.setattr(runs, "PROGRESS_EVERY", 3600.0)
    child = (
        "import sys\n"
        "print('model: 10 parameters')\n"
        "for i in range(5): sys.stderr.write(f'\\rtrain {i}/4'); sys.stderr.flush()\n"
        "sys.stderr.write('\\r          \\r'); print('held-out 2.5 bits/byte'); sys.stderr.write('\\rtrain 4/4\\n')\n"
        "sys.stderr.write('done, no newline')\n"
        "sys.exit(3)\n"
    )
    code, tail = runs.launch([sys.executable, "-c", child], env=dict(os.environ), cwd=runs.ROOT, label="r1")
    lines = capsys.readouterr().out.splitlines()
    expected = ["model: 10 parameters", "train 0/4", "held-out 2.5 bits/byte", "train 4/4", "done, no newline"]
    assert code == 3 and lines == [f"[r1] {x}" for x in expected] and tail == expected


def test_a_run_written_before_a_since_checkpoints_key_existed_is_reused(tmp_path, launches):
    """A finished run whose config.json lacks moe.shared_expert_gate (written before the key existed) is the same
    config as today's at the key's default: reused, not moved aside and rerun."""
    workdir = tmp_path / "run"
    config, flags = runs.config_path("quickstart"), CASES["quickstart"]
    old = _finished_run(workdir, config, flags, 40)
    saved = json.loads((workdir / "config.json").read_text())
    del saved["moe"]["shared_expert_gate"]
    (workdir / "config.json").write_text(json.dumps(saved))
    assert runs.run_or_reuse(config, str(workdir), flags, 40) == old
    assert launches == []


def test_env_adds_to_the_environment_and_its_xla_flags_follow_the_device_count(tmp_path, launches, monkeypatch):
    """A rerun under other XLA flags (experiments.reproduce.fomoe_peers --rerun-rows) passes its own XLA_FLAGS: they
    follow the device count's, and the other variables are added."""
    seen = []
    fake = runs.launch

    def recording(cmd, **kw):
        seen.append(kw["env"])
        return fake(cmd, **kw)

    monkeypatch.setattr(runs, "launch", recording)
    config, flags = runs.config_path("quickstart"), CASES["quickstart"]
    env = {"XLA_FLAGS": "--xla_cpu_enable_fast_math=true", "EXTRA": "1"}
    runs.run_or_reuse(config, str(tmp_path / "a"), flags, 40, devices=4, env=env)
    runs.run_or_reuse(config, str(tmp_path / "b"), flags, 40, devices=2)
    assert seen[0]["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4 --xla_cpu_enable_fast_math=true"
    assert seen[0]["EXTRA"] == "1" and env == {"XLA_FLAGS": "--xla_cpu_enable_fast_math=true", "EXTRA": "1"}
    assert seen[1]["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
