"""The links reproduction's bookkeeping (experiments.reproduce.links): what a run's metrics and link counters give per
round, the system model's calibration and prediction, the time to a loss, the counter snapshots taken while a run
goes, and its command-line errors. The runs themselves (root, minutes) are the committed results' command."""

import json
import threading
import time

import pytest

from experiments.reproduce import links as repro

K = repro.K
TOKENS = repro.MODEL["data.batch_size"] * repro.MODEL["data.seq_len"]


def _run(method, rate, *, compute, sync, host, compiled, wire_per_round, rounds=4, resumed=None):
    """A run's summary, metric rows and link record as the script writes them, from chosen per-round numbers."""
    ddp = method == "ddp"
    rows, snapshots = [], []
    for r in range(1, rounds + 1):
        if ddp:
            for s in range(K):
                rows.append({"step": (r - 1) * K + s + 1, "train_loss": 3.0, "tokens_per_second": TOKENS * K / compute})
        else:
            row = {"seconds/local_steps": compute, "seconds/sync": sync, "seconds/round": compute + sync + host}
            rows.append({"step": r * K, "round": r, "train_loss": 3.0, **row})
        snapshots.append({"step": r * K, "tx_wire_bytes": [1000 + r * wire_per_round, 2000 + r * wire_per_round]})
        rows.append({"step": r * K, "val_loss": 5.0 - r})
    summary = {"bytes_per_device_per_step": compiled / K} if ddp else {"bytes_per_site_per_round": compiled}
    record = {
        "rate_mbit": rate,
        "sites": [{"tx_wire_bytes": 7 * wire_per_round, "tx_bytes": 1}] * 2,
        "snapshots": snapshots,
        "load_average_before": 0.5,
        "load_average_after": 1.5,
        "attempts": 1,
        "resumed_from": resumed,
    }
    return {"summary": summary, "rows": rows, "links": record}


def test_measure_reads_the_split_and_the_bytes_per_round_between_snapshots():
    """Means over rounds 2.. of the three timings; wire bytes per round between the first and last snapshot (not
    the whole run's, which holds the start and the end); DDP's round is K of its steps, from its throughput."""
    fed = repro.measure(
        "fomoe_o2",
        2,
        4 * K,
        _run("fomoe_o2", 10.0, compute=0.4, sync=2.0, host=0.1, compiled=1e6, wire_per_round=1.2e6),
    )
    assert fed["seconds_round"] == pytest.approx(2.5) and fed["seconds_host"] == pytest.approx(0.1)
    assert fed["wire_bytes"] == pytest.approx(1.2e6) and fed["wire_over_compiled"] == pytest.approx(1.2)
    assert fed["wire_bytes_whole_run_per_round"] == pytest.approx(7 * 1.2e6 / 4)
    assert fed["curve"] == [(8, 4.0), (16, 3.0), (24, 2.0), (32, 1.0)] and fed["val_loss"] == 1.0
    assert fed["load_average"] == 1.5
    ddp = repro.measure("ddp", 2, 4 * K, _run("ddp", 10.0, compute=3.0, sync=0, host=0, compiled=8e6, wire_per_round=1))
    assert ddp["seconds_round"] == pytest.approx(3.0) and ddp["compiled_bytes"] == pytest.approx(8e6)
    with pytest.raises(ValueError, match="too short|fewer than two training rows"):
        run = _run("fomoe_o1", 10.0, compute=1, sync=1, host=0, compiled=1, wire_per_round=1, rounds=1)
        repro.measure("fomoe_o1", 2, K, run)


FRAMING, FIXED = 1.25, 5e4  # the wire's bytes per round of the synthetic rows: FRAMING x compiled + FIXED


def _rows():
    """Rows whose rounds follow the model exactly: compute + processor work + the wire's bytes at the rate (behind
    compute: only what of the synchronisation's outlasts the compute, and the fixed bytes, the host's gathers,
    whole), per method and rate."""
    truth = {  # method: (compute per round, processor work per round, compiled bytes per round)
        "ddp": (2.0, 0.0, 8e6),
        "full_local_adamw": (0.4, 0.3, 6e6),
        "fomoe_o1": (0.35, 0.2, 1e6),
        "fomoe_o2_overlap": (0.3, 0.25, 2e6),
    }
    rows = []
    for rate in (repro.UNLIMITED_MBIT, 10.0, 100.0):
        for method, (compute, cpu, nbytes) in truth.items():
            wire = FRAMING * nbytes + FIXED
            transfer, host = 8 * FRAMING * nbytes / (rate * 1e6), 8 * FIXED / (rate * 1e6)
            hidden = method == "fomoe_o2_overlap"
            seconds = compute + cpu + (max(0.0, transfer - compute) if hidden else transfer) + host
            rows.append(
                {
                    "method": method,
                    "rate_mbit": rate,
                    "seconds_round": seconds,
                    "seconds_compute": None if method == "ddp" else compute,
                    "seconds_sync": None if method == "ddp" else seconds - compute - 0.05,
                    "seconds_host": None if method == "ddp" else 0.05,
                    "compiled_bytes": nbytes,
                    "wire_bytes": wire,
                }
            )
    return rows


def test_the_calibrated_model_predicts_rounds_that_follow_it():
    """On rounds that are compute + processor work + the wire's bytes at the rate (behind compute: the part of the
    synchronisation's transfer the compute does not cover), the model calibrated on the unlimited rows predicts
    every round exactly, from the wire bytes and from the compiled ones (the wire's framing and fixed bytes fitted on
    the unlimited runs alone); it recovers each method's processor work, and DDP's split takes the full replica's
    compute."""
    rows, fit = repro.predict(_rows(), sites=2)
    assert fit == pytest.approx({"framing": FRAMING, "fixed_bytes": FIXED}, rel=1e-6)
    for r in rows:
        assert r["error_model_wire"] == pytest.approx(0, abs=1e-9) and r["error_model"] == pytest.approx(0, abs=1e-6)
    by = {(r["method"], r["rate_mbit"]): r for r in rows}
    assert by[("fomoe_o1", 10.0)]["calibrated_sync_cpu_seconds"] == pytest.approx(0.2, abs=1e-4)
    # 2.5 MB of synchronisation: 2 s on the link, of which 0.3 s hide behind the compute; the 50 kB the host gathers
    # (0.04 s) hide behind nothing
    hidden = by[("fomoe_o2_overlap", 10.0)]
    assert hidden["seconds_model_wire"] == pytest.approx(0.3 + 0.25 + 8 * 2.5e6 / 1e7 - 0.3 + 0.04)
    assert hidden["calibrated_sync_cpu_seconds"] == pytest.approx(0.25)
    assert by[("fomoe_o2_overlap", 100.0)]["seconds_model_wire"] == pytest.approx(0.554)  # 0.2 s hide whole
    ddp = by[("ddp", 10.0)]
    assert ddp["seconds_compute"] == 0.4 and ddp["seconds_sync"] == pytest.approx(ddp["seconds_round"] - 0.4)


def test_runs_of_one_compiled_size_fit_the_framing_alone():
    """Two methods that compile the same bytes (a method and its twin behind compute, rerun alone) leave the fixed
    bytes undetermined: the fit takes the framing alone, the least-squares ratio of wire to compiled bytes."""
    rows = [r for r in _rows() if r["method"] == "fomoe_o2_overlap"]
    rows += [{**r, "method": "fomoe_o2_local", "wire_bytes": r["wire_bytes"] * 1.1} for r in rows]
    framing, fixed = repro.fit_link_bytes(rows)
    x = [r["compiled_bytes"] / r["wire_bytes"] for r in rows if r["rate_mbit"] == repro.UNLIMITED_MBIT]
    assert fixed == 0.0 and framing == pytest.approx(sum(x) / sum(v * v for v in x), rel=1e-12)


def test_the_calibration_is_the_median_of_repeated_runs():
    """--calibration-runs: of repeated unlimited-link runs of a method, the row is the run of the median round (the
    lower middle one of an even count), carrying every run's round."""
    runs = [{"method": "fomoe_o1", "rate_mbit": repro.UNLIMITED_MBIT, "seconds_round": v, "run": i}
            for i, v in enumerate([1.18, 0.65, 0.82])]  # fmt: skip
    row = repro.median_run(runs)
    assert row["run"] == 2 and row["calibration_rounds"] == [0.65, 0.82, 1.18]
    assert repro.median_run(runs[:2])["run"] == 1  # even: the lower of the two


def test_the_schedule_takes_each_calibration_run_in_turn_with_the_limited_rates():
    """Every (method, rate, repeat) once; method after method; a method's calibration runs (unlimited) alternate
    with its limited-rate runs: each of its first (calibration runs) rates comes right after a calibration run."""
    u = repro.UNLIMITED_MBIT
    order = repro.schedule(["ddp", "fomoe_o2"], [10.0, 100.0], 3)
    assert order[:5] == [("ddp", u, 1), ("ddp", 10.0, 1), ("ddp", u, 2), ("ddp", 100.0, 1), ("ddp", u, 3)]
    assert order[5:] == [("fomoe_o2", r, i) for _, r, i in order[:5]]
    for calibrations, rates in ((1, [10.0, 100.0, 1000.0]), (4, [10.0]), (2, [10.0, 100.0])):
        order = repro.schedule(["fomoe_o1"], rates, calibrations)
        expected = {("fomoe_o1", u, i) for i in range(1, calibrations + 1)} | {("fomoe_o1", r, 1) for r in rates}
        assert len(order) == len(expected) and set(order) == expected
        limited = [i for i, (_, rate, _) in enumerate(order) if rate != u]
        assert all(order[i - 1][1] == u for i in limited[:calibrations])


def test_time_to_loss_interpolates_between_evaluations():
    curve = [(16, 4.0), (32, 3.0), (48, 2.5)]
    assert repro.time_to_loss(curve, 0.5, 3.5) == pytest.approx(24 * 0.5)
    assert repro.time_to_loss(curve, 0.5, 2.5) == pytest.approx(48 * 0.5)
    assert repro.time_to_loss(curve, 0.5, 4.5) == pytest.approx(16 * 0.5)  # reached by the first evaluation
    assert repro.time_to_loss(curve, 0.5, 2.0) is None
    rows = [{"curve": curve, "val_loss": 2.5, "seconds_round": K}, {"curve": [(16, 3.2)], "val_loss": 3.2,
            "seconds_round": 2 * K}]  # fmt: skip
    assert repro.add_time_to_loss(rows) == 3.2
    assert rows[0]["seconds_to_target"] == pytest.approx(16 + 16 * 0.8) and rows[1]["seconds_to_target"] == 32


class _Net:
    def __init__(self):
        self.sent = 0

    def counters(self):
        self.sent += 100
        return [type("C", (), {"tx_wire_bytes": self.sent})()]


def test_snapshots_are_taken_as_training_rows_arrive(tmp_path):
    """One snapshot per batch of new training rows (evaluation rows alone take none), each tagged with the last
    training row's step; a half-written line waits for its end."""
    path, net = tmp_path / "metrics.jsonl", _Net()
    with repro._Snapshots(net, str(path)) as snapshots:
        time.sleep(0.2)  # no file yet
        with open(path, "a") as f:
            f.write(json.dumps({"step": 8, "train_loss": 2.0}) + "\n" + '{"step": 16, "train')
            f.flush()
            time.sleep(0.3)
            f.write('_loss": 1.5}\n' + json.dumps({"step": 16, "val_loss": 1.0}) + "\n")
            f.flush()
            time.sleep(0.3)
            f.write(json.dumps({"step": 24, "val_loss": 0.9}) + "\n")
            f.flush()
            time.sleep(0.3)
    assert [s["step"] for s in snapshots.taken] == [8, 16]
    assert [s["tx_wire_bytes"][0] for s in snapshots.taken] == [100, 200]
    assert not any(t.name == snapshots._thread.name for t in threading.enumerate())


def test_bad_flags_and_no_root_are_named(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        repro.main(["--sites", "3", "--methods", "fomoe_o2"])
    assert "--sites 3: O_e = 2 must divide it" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        repro.main(["--steps", "12"])
    assert "--steps" in capsys.readouterr().err
    monkeypatch.setattr(repro.links, "unavailable", lambda: "links need root (running as uid 1000)")
    assert repro.main(["--out", "unused"]) == 2
    assert "links need root" in capsys.readouterr().err
