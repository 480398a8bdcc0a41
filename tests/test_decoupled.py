"""Decoupled DiLoCo: the synchroniser's merge rule against a float64 reference, its quorum, grace window, late and
lost learners (moe.decoupled), and the runner's processes with a learner killed and restarted (experiments.decoupled,
with NumPy stand-in learners)."""

import itertools
import json
import os
import sys

import numpy as np
import pytest

from experiments import args as args_lib
from experiments import decoupled
from moe.decoupled import Contribution, Synchroniser, merge_weights
from optim import diloco_outer

LR, MU = 0.7, 0.9


def _sync(learners=4, quorum=3, grace=10.0, shapes=((3, 2), (5,))):
    rng = np.random.default_rng(0)
    frags = [[rng.standard_normal(s).astype(np.float32) for s in shapes]]
    return Synchroniser(frags, diloco_outer(LR, momentum=MU), learners=learners, quorum=quorum, grace=grace)


def _push(sync, m, now, tokens=100, steps=4, scale=1.0, base=None):
    rng = np.random.default_rng(100 + m)
    delta = [scale * rng.standard_normal(a.shape).astype(np.float32) for a in sync.params[0]]
    base = sync.versions[0] if base is None else base
    return sync.submit(Contribution(m, 0, delta, tokens, steps, base), now), delta


def test_merge_is_token_weighted_nesterov_in_float64():
    """Two merges with unequal tokens and steps equal a float64 token-weighted mean followed by Nesterov SGD."""
    sync = _sync(learners=3, quorum=3)
    for m in range(3):
        sync.join(m)
    theta = [a.astype(np.float64) for a in sync.params[0]]
    velocity = [np.zeros_like(a) for a in theta]
    for merge in range(2):
        counts = [(100 * (m + 1), 4 + m) for m in range(3)]
        deltas = []
        for m, (tokens, steps) in enumerate(counts):
            replies, delta = _push(sync, m, now=float(merge), tokens=tokens, steps=steps, scale=merge + 1.0)
            deltas.append(delta)
        assert sorted(r.learner for r in replies) == [0, 1, 2]  # the third push completes the quorum: all answered
        w = np.array([t * t / s for t, s in counts], np.float64)
        w /= w.sum()
        for i in range(len(theta)):
            g = sum(w[m] * deltas[m][i].astype(np.float64) for m in range(3))
            velocity[i] = MU * velocity[i] + g
            theta[i] = theta[i] - LR * (g + MU * velocity[i])
            np.testing.assert_allclose(sync.params[0][i], theta[i], rtol=1e-5, atol=1e-6)
    assert sync.versions == [2]
    np.testing.assert_allclose(merge_weights([2, 2], [1, 1]), [0.5, 0.5])
    with pytest.raises(ValueError, match="must be positive"):
        merge_weights([0], [1])


def test_a_merge_does_not_depend_on_the_order_of_arrival():
    """Deltas whose float64 sum depends on the order ((x + 1) - x = 0 at x = 1e16, x - x + 1 = 1): the merged
    parameters are the same whichever learner arrives first."""
    results = []
    for order in ([0, 1, 2], [0, 2, 1]):
        sync = _sync(learners=3, quorum=3, shapes=((2,),))
        for m in order:
            value = (3e16, 3.0, -3e16)[m]
            sync.submit(Contribution(m, 0, [np.full(2, value, np.float32)], 100, 4, 0), 0.0)
        results.append(sync.params[0][0])
    np.testing.assert_array_equal(results[0], results[1])


def test_quorum_waits_the_grace_window_then_answers_a_late_learner_at_once():
    sync = _sync(learners=4, quorum=3, grace=10.0)
    for m in range(4):
        sync.join(m)
    assert _push(sync, 0, 0.0)[0] == [] and _push(sync, 1, 0.5)[0] == []
    assert _push(sync, 2, 1.0)[0] == []  # quorum reached at t = 1, learner 3 still live: grace until t = 11
    assert sync.deadline() == 11.0 and sync.poll(10.9) == []
    merged = sync.poll(11.0)
    assert sorted(r.learner for r in merged) == [0, 1, 2] and sync.versions == [1]
    replies, _ = _push(sync, 3, 12.0, base=0)  # late: based on version 0, now 1
    assert [(r.learner, r.version) for r in replies] == [(3, 1)]
    assert [c.learner for c in sync.pending[0]] == [3]  # kept for the next merge
    for m in range(3):
        _push(sync, m, 13.0)
    assert sync.versions == [2] and sync.merges[-1].staleness == (0, 0, 0, 1)  # learner order
    assert sync.merges[-1].tokens == 400


def test_a_lost_learner_is_not_waited_for_and_fewer_than_quorum_never_merge():
    sync = _sync(learners=4, quorum=3, grace=100.0)
    for m in range(4):
        sync.join(m)
    for m in range(3):
        _push(sync, m, 0.0)
    assert sync.versions == [0]
    replies = sync.leave(3, 1.0)  # every live learner has sent: merged without the grace window
    assert sorted(r.learner for r in replies) == [0, 1, 2] and sync.versions == [1]
    sync.leave(2, 2.0)
    _push(sync, 0, 3.0)
    _push(sync, 1, 3.0)
    assert sync.poll(1e9) == [] and sync.versions == [1]  # 2 live < quorum 3: the run waits
    replies, dropped = sync.finish(1e9)  # the end: below the quorum nothing merges, the rest is dropped
    assert replies == [] and sorted(c.learner for c in dropped) == [0, 1] and sync.versions == [1]


def test_refusals():
    with pytest.raises(ValueError, match="quorum = 5: allowed 1..learners"):
        _sync(learners=4, quorum=5)
    sync = _sync()
    with pytest.raises(ValueError, match="delta shapes"):
        sync.submit(Contribution(0, 0, [np.zeros(2)], 1, 1, 0), 0.0)
    with pytest.raises(ValueError, match="learner 7"):
        sync.join(7)
    with pytest.raises(args_lib.UsageError, match="--fail '9@1'"):
        decoupled.parse_failures(["9@1"], 4)


def test_runner_bad_config_is_one_line_naming_the_key(capsys):
    code = decoupled.main(["--", "--config", "experiments/configs/fomoe.py", "--workdir", "/tmp/unused"])
    assert code == 2
    assert "config key 'fomoe.outer' = 'local_adamw': Decoupled DiLoCo allows 'diloco'" in capsys.readouterr().err


def test_runner_survives_a_killed_learner_that_rejoins(tmp_path, monkeypatch):
    """Three stand-in learners, quorum 2; learner 1 killed at its second push and restarted 0.2 s later: every
    merge has at least the quorum, learner 1 is in merges after it rejoins, and the bytes are the formula's."""
    monkeypatch.setattr(
        decoupled.Runner, "learner", [sys.executable, os.path.join(os.path.dirname(__file__), "decoupled_standin.py")]
    )
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    monkeypatch.setenv("STANDIN_SLEEP", "0.25")  # seconds per round
    flags = [
        "--config", "experiments/configs/fomoe.py", "--workdir", str(tmp_path), "--config.mesh.site=3",
        "--config.fomoe.overlap=3", "--config.fomoe.outer=diloco", "--config.fomoe.local_steps=2",
        "--config.fomoe.fragments=2", "--config.train.steps=24",
    ]  # fmt: skip
    config, _ = args_lib.parse_run_args(["decoupled", *flags])
    scored = []

    def score(config, workdir, snapshots):
        scored.append(snapshots)
        return [(s, 0.0) for s, _ in snapshots]

    runner = decoupled.Runner(config, str(tmp_path), flags, 2, 0.5, {1: (2, 0.2)}, "127.0.0.1", score=score)
    assert runner.run() == 0
    merges = [json.loads(line) for line in (tmp_path / "merges.jsonl").read_text().splitlines()]
    assert all(len(set(m["learners"])) >= 2 for m in merges)
    with_1 = [i for i, m in enumerate(merges) if 1 in m["learners"]]
    assert len(with_1) > 2 and any(b - a > 1 for a, b in itertools.pairwise(with_1))  # missed merges, then came back
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["bytes_per_site_per_round"] == summary["bytes_per_site_per_round_formula"] == 4 * (6 + 5) / 2
    assert summary["useful_tokens"] == 100 * sum(len(m["learners"]) for m in merges)
    assert scored[0][-1][0] == 24


@pytest.mark.slow
def test_with_the_whole_quorum_it_trains_as_synchronous_diloco(tmp_path):
    """Real learners (experiments.decoupled_learner), quorum M, one fragment: the held-out loss after two rounds
    equals experiments.run's federated DiLoCo on the same config (the merges are DiLoCo's; short rounds keep the
    per-step rounding of the two programs apart from compounding)."""
    import subprocess

    from experiments.reproduce import links_methods

    flags = ["--config", "experiments/configs/fomoe.py"] + [f"--config.{k}={v}" for k, v in links_methods.MODEL.items()]
    flags += [
        "--config.mesh.site=2", "--config.fomoe.overlap=2", "--config.fomoe.outer=diloco",
        "--config.fomoe.local_steps=2", "--config.train.steps=4", "--config.train.eval_every=4",
    ]  # fmt: skip
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    for module, out in (("experiments.run", "sync"), ("experiments.decoupled", "decoupled")):
        cmd = [sys.executable, "-m", module, *(["--quorum", "2", "--"] if out == "decoupled" else [])]
        subprocess.run([*cmd, *flags, "--workdir", str(tmp_path / out)], env=env, check=True)
    losses = [json.loads((tmp_path / out / "summary.json").read_text())["val_loss"] for out in ("sync", "decoupled")]
    assert losses[1] == pytest.approx(losses[0], abs=1e-5)
