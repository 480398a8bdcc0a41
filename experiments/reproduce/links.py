"""FoMoE over real rate-limited links: wall-clock per round, split into compute and synchronisation, against DDP and
the full replica, and against the system model's predicted round time.

    python -m experiments.reproduce.links [--out runs/fomoe_links] [--sites 4] [--rates 10,100,1000] [--steps 128]
        [--calibration-runs 1]

Needs root (Linux network namespaces: experiments.links). For every link rate, and once on links of
`UNLIMITED_MBIT` (the calibration: at these sizes the link is not what limits a round), M sites are made, each its
own network namespace behind a link of that rate each way (tbf), and every method trains the same model on the same
tokens for the same steps, one process per site (`experiments.launch --links`, jax.distributed over gloo):

    ddp               gradients all-reduced every step (mesh.data = M)
    full_local_adamw  the full replica (O_e = M), LocalAdamW rounds of K local steps (parameters and both moments)
    full_diloco       the full replica, DiLoCo rounds (parameters; an outer Nesterov step)
    fomoe_o1, _o2     FoMoE, every expert on one (two) sites, LocalAdamW
    fomoe_o2_...      O_e = 2 with low-bit synchronisation (int8, fp4; error feedback; second moments kept local),
                      and behind compute (one round late; in 2 fragments) next to the same synchronisation blocking

(experiments.reproduce.links_methods: every method's flags and the model, experiments/configs/fomoe.py made smaller
so that at 10 Mbit/s the link dominates a round.)
Each run is in `<out>/runs/<rate>/<method>` (reused when finished with its link record, as the other reproductions).

Reported (links.md, links.json, links_loss.png, links_round.png):
  * per round (K steps; DDP: K of its steps), means over the rounds after the first: the wall-clock, its local
    steps (compute) and its synchronisation (the round's second program: moe.rounds.make_round_parts; a site's
    includes its wait for the slowest site), and the host's work between (batches, metrics, the routing probe).
    DDP's all-reduce is inside its step's program: its compute is taken from the full replica's local steps at the
    same rate (a DDP device computes the same step on the same rows), its synchronisation is the rest (derived,
    marked so);
  * held-out loss against training wall-clock (rounds x the measured mean round; evaluation and compilation
    excluded), and the time each method needs to reach the loss every method reaches (the highest final loss);
  * the bytes each site put on its link during the run (its veth's shaper: every frame with its headers) per round,
    against the compiled program's count (core.hlo: what the round's collectives move per site), as a ratio;
  * moe.system_model.round_seconds at the link's rate, calibrated on the unlimited run of the same method (its
    local steps' time, and the rest of its round: processor work, which a round behind compute does not hide),
    with the round's compiled bytes as moe.system_model.link_bytes puts them on the wire (framing and fixed bytes
    per round fitted on the unlimited runs; the fixed bytes are the host's gathers between the programs, which a
    round behind compute does not hide), against the measured round: the relative error, and the same model with
    the measured wire bytes in place of those;
  * for each method behind compute, its round against max(compute, sync) of the same synchronisation blocking.
`--calibration-runs N` runs every method N times on the unlimited links and calibrates on the median run (the
table lists every run's round). The runs go method by method, each method's calibration runs in turn with its
limited-rate runs (`schedule`), each run over a network made for it. `--keep-others` reruns only the --methods
given and takes the other rows from the existing links.json (the table says which rows were measured when).
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import threading
import time
from collections.abc import Sequence

from experiments import command, harness
from experiments.cluster import links
from experiments.reproduce import links_report, runs
from experiments.reproduce.links_methods import (
    CONFIG,
    METHODS,
    MODEL,
    UNLIMITED_MBIT,
    K,
    flags,
    model_shape,
    rate_name,
)
from moe import system_model as sm

__all__ = ["CONFIG", "METHODS", "MODEL", "UNLIMITED_MBIT", "K"]
__all__ += ["flags", "main", "measure", "predict", "schedule", "train"]

ATTEMPTS = 2  # a failed run is set aside and run again once; the table says which runs were retried


def schedule(methods: Sequence[str], rates: Sequence[float], calibration_runs: int) -> list[tuple[str, float, int]]:
    """The order of the runs, as (method, rate in Mbit/s, repeat): method after method, each method's calibration
    runs on the unlimited links taken in turn with its limited-rate runs (unlimited, the first rate, unlimited, the
    second, ...), so that a row and its calibration are measured minutes apart, not an hour: this machine's speed
    drifts over an hour (local steps of 0.28 s in one phase, 0.19 s in another), more than the model's margin."""
    order = []
    for method in methods:
        for j in range(max(calibration_runs, len(rates))):
            if j < calibration_runs:
                order.append((method, UNLIMITED_MBIT, j + 1))
            if j < len(rates):
                order.append((method, float(rates[j]), 1))
    return order


def train(
    method: str, sites: int, rate_mbit: float, steps: int, eval_every: int, out: str, net, repeat: int = 1
) -> dict:
    """Runs (or reuses) one method over `net`'s links; returns {"summary", "rows", "links"} of the run. Repeat
    i >= 2 of the same method and rate is a run of its own, in `<method>.<i>`."""
    name = method if repeat == 1 else f"{method}.{repeat}"
    workdir = os.path.abspath(os.path.join(out, "runs", rate_name(rate_mbit), name))
    record_path = os.path.join(workdir, "links.json")
    if os.path.exists(os.path.join(workdir, "summary.json")) and not os.path.exists(record_path):
        runs.set_aside(workdir, ["links.json: <absent> (a run not made over this script's links)"])
    if not os.path.exists(record_path):
        launcher = [sys.executable, "-m", "experiments.launch", "--processes", str(sites), "--links", "--"]
        hub = ["ip", "netns", "exec", net.hub.netns]
        # No persistent compilation cache: process 0 alone would find the programs there and reach the first
        # collective while the others still compile, past gloo's 30 s timeout (it failed two runs so).
        env = net.environment()
        for attempt in range(1, ATTEMPTS + 1):
            before, load_before = net.counters(), os.getloadavg()
            try:
                with _Snapshots(net, os.path.join(workdir, "metrics.jsonl")) as snapshots:
                    summary = runs.run_or_reuse(
                        CONFIG,
                        workdir,
                        flags(method, sites, steps, eval_every),
                        steps,
                        command=lambda args: [*hub, *launcher, *args],
                        env=env,
                    )
                break
            except RuntimeError as e:
                if attempt == ATTEMPTS:
                    raise
                print(f"{method}: attempt {attempt} failed ({str(e).splitlines()[0][:200]}); once more", flush=True)
                runs.set_aside(workdir, [f"attempt {attempt} failed"])
        after = net.counters()
        record = {
            "rate_mbit": rate_mbit,
            "sites": [_sent(a, b) for a, b in zip(after, before)],
            "snapshots": snapshots.taken,
            "load_average_before": load_before[0],
            "load_average_after": os.getloadavg()[0],
            "resumed_from": summary.get("resumed_from"),
            "attempts": attempt,
        }
        with open(record_path, "w") as f:
            json.dump(record, f, indent=2)
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    with open(record_path) as f:
        record = json.load(f)
    return {"summary": summary, "rows": rows, "links": record}


def _sent(after, before) -> dict[str, int]:
    return {name: getattr(after, name) - getattr(before, name) for name in ("tx_bytes", "tx_wire_bytes")}


class _Snapshots:
    """While a run goes: every site's counters each time a training row reaches its metrics.jsonl (polled every
    `POLL_SECONDS`), as {"step", "tx_wire_bytes": [per site]}; the bytes between two rows are what the rounds between
    them (and any evaluation among them) sent, without the run's start (coordination, compilation) and end
    (checkpoint)."""

    POLL_SECONDS = 0.05

    def __init__(self, net, path: str):
        self.net, self.path = net, path
        self.taken: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> _Snapshots:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        offset = 0
        while not self._stop.wait(self.POLL_SECONDS):
            if not os.path.exists(self.path):
                continue
            with open(self.path) as f:
                f.seek(offset)
                text = f.read()
            complete = text[: text.rfind("\n") + 1]
            offset += len(complete.encode())
            steps = [json.loads(line)["step"] for line in complete.splitlines() if '"train_loss"' in line]
            if steps:
                sent = [c.tx_wire_bytes for c in self.net.counters()]
                self.taken.append({"step": steps[-1], "tx_wire_bytes": sent})


def measure(method: str, sites: int, steps: int, run: dict) -> dict:
    """One run's numbers per round (means over rounds 2..): seconds (round, compute, sync, host), compiled and wire
    bytes per site, the held-out curve [(step, loss)], the final held-out loss."""
    summary, rows, record = run["summary"], run["rows"], run["links"]
    tokens_per_step = MODEL["data.batch_size"] * MODEL["data.seq_len"]
    if METHODS[method][1] == 1:  # DDP: one row per step
        seconds = [tokens_per_step / r["tokens_per_second"] for r in rows if r.get("tokens_per_second")]
        step_seconds = _mean(seconds[K:] if len(seconds) > K else seconds)
        timing = {"round": K * step_seconds, "compute": None, "sync": None, "host": None}
        compiled = K * summary["bytes_per_device_per_step"]
    else:
        per_round = [r for r in rows if "seconds/round" in r][1:]
        mean = lambda name: _mean([r[name] for r in per_round])  # noqa: E731
        compute, sync, whole = mean("seconds/local_steps"), mean("seconds/sync"), mean("seconds/round")
        timing = {"round": whole, "compute": compute, "sync": sync, "host": whole - compute - sync}
        compiled = summary["bytes_per_site_per_round"]
    # bytes per round: between the first and the last training row seen while the run went
    first, last = record["snapshots"][0], record["snapshots"][-1]
    if last["step"] - first["step"] < K:
        raise ValueError(f"{method}: fewer than two training rows were seen during the run: no bytes per round")
    sent = [b - a for a, b in zip(first["tx_wire_bytes"], last["tx_wire_bytes"])]
    wire = _mean(sent) / ((last["step"] - first["step"]) / K)
    rounds_run = (steps - (record.get("resumed_from") or 0)) / K
    whole_run = _mean([s["tx_wire_bytes"] for s in record["sites"]]) / rounds_run
    curve = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    return {
        "method": method,
        "rate_mbit": record["rate_mbit"],
        **{f"seconds_{name}": v for name, v in timing.items()},
        "compiled_bytes": compiled,
        "wire_bytes": wire,
        "wire_over_compiled": wire / compiled,
        "wire_bytes_whole_run_per_round": whole_run,
        "curve": curve,
        "val_loss": curve[-1][1],
        "load_average": max(record["load_average_before"], record["load_average_after"]),
        "attempts": record.get("attempts", 1),
        "wall_seconds": summary.get("wall_seconds_this_process", 0.0),
    }


def median_run(measured: Sequence[dict]) -> dict:
    """Of repeated runs of one method at one rate (measure's rows), the one whose mean round is the median (the
    lower of the two middle ones for an even count), with every run's round in "calibration_rounds": the repeats
    of the unlimited-link calibration (--calibration-runs), whose one run's round on a loaded machine can be 40%
    off another's."""
    ordered = sorted(measured, key=lambda r: r["seconds_round"])
    return {**ordered[(len(ordered) - 1) // 2], "calibration_rounds": [r["seconds_round"] for r in ordered]}


def fit_link_bytes(rows: list[dict]) -> tuple[float, float]:
    """(framing, fixed bytes) of moe.system_model.link_bytes fitted to the unlimited runs' wire bytes against their
    compiled bytes per round (least squares on the relative residual: every method counts alike). Runs of one
    compiled size cannot tell the two apart: then the framing alone (fixed bytes 0)."""
    cal = [r for r in rows if r["rate_mbit"] == UNLIMITED_MBIT]
    # minimise sum ((a c + b - w) / w)^2: the normal equations of x = c / w, y = 1 / w against 1
    xx = sum((r["compiled_bytes"] / r["wire_bytes"]) ** 2 for r in cal)
    xy = sum(r["compiled_bytes"] / r["wire_bytes"] ** 2 for r in cal)
    yy = sum(1 / r["wire_bytes"] ** 2 for r in cal)
    x1 = sum(r["compiled_bytes"] / r["wire_bytes"] for r in cal)
    y1 = sum(1 / r["wire_bytes"] for r in cal)
    det = xx * yy - xy * xy
    if det <= 1e-9 * xx * yy:  # x proportional to y: one compiled size
        return x1 / xx, 0.0
    return (x1 * yy - y1 * xy) / det, (y1 * xx - x1 * xy) / det


def predict(rows: list[dict], sites: int) -> tuple[list[dict], dict[str, float]]:
    """Adds to every row the system model's round time at its rate and its relative error, once from the compiled
    bytes (through moe.system_model.link_bytes, fitted on the unlimited runs: `fit_link_bytes`) and once from the
    bytes measured on the wire. Each method is calibrated on its own unlimited run: its local steps' measured time
    is the compute (the effective FLOP rate) and the rest of its round, less what its bytes take there, is the
    synchronisation's processor work (`sync_cpu_seconds`, which a hidden round does not hide, nor the fixed bytes:
    `host_bytes`); DDP's all-reduce is inside its step: all of its round counts as compute. Then DDP's derived
    split. Returns the rows and the fit."""
    framing, fixed = fit_link_bytes(rows)
    calibration = {r["method"]: r for r in rows if r["rate_mbit"] == UNLIMITED_MBIT}
    tokens = MODEL["data.batch_size"] * MODEL["data.seq_len"] / sites  # one site's per step
    for r in rows:
        cal = calibration[r["method"]]
        ddp = METHODS[r["method"]][1] == 1
        overlap = METHODS[r["method"]][2] or sites
        flops = sm.flops_per_token(model_shape(sites), 1 if ddp else sites, 1 if ddp else overlap)["total"]
        period = 1 if ddp else K  # steps between two synchronisations
        scale = period / K  # a round's quantity -> per synchronisation
        hidden = bool(METHODS[r["method"]][4].get("delay"))
        at = functools.partial(_round_seconds, flops=flops, tokens=tokens, period=period, hidden=hidden)
        # (the synchronisation's bytes, the host's: the fixed bytes, its gathers between the programs)
        for key, bytes_of in (
            ("model", lambda q: (sm.link_bytes(q["compiled_bytes"], framing=framing), fixed)),
            ("model_wire", lambda q: (q["wire_bytes"] - fixed, fixed)),
        ):
            (sync_c, host_c), (sync_m, host_m) = ([scale * b for b in bytes_of(q)] for q in (cal, r))
            if ddp:  # its collectives are inside its step: all but the bytes' time is compute
                compute = scale * cal["seconds_round"] - 8 * (sync_c + host_c) / (UNLIMITED_MBIT * 1e6)
                cpu = 0.0
            else:
                compute = scale * cal["seconds_compute"]
                cpu = scale * cal["seconds_round"] - at(sync_c, host_c, UNLIMITED_MBIT, compute, 0.0)
            r[f"seconds_{key}"] = at(sync_m, host_m, r["rate_mbit"], compute, cpu) / scale
            r[f"error_{key}"] = r["seconds_round"] / r[f"seconds_{key}"] - 1
            if key == "model":
                r["effective_gflops_per_site"] = flops * tokens * period / compute / 1e9
                r["calibrated_sync_cpu_seconds"] = cpu / scale
    for r in rows:  # DDP's split, derived: its per-device step computes what a full replica's local step does
        if METHODS[r["method"]][1] == 1:
            same = [q for q in rows if q["method"] == "full_local_adamw" and q["rate_mbit"] == r["rate_mbit"]]
            r["seconds_compute"] = same[0]["seconds_compute"] if same else None
            r["seconds_sync"] = r["seconds_round"] - same[0]["seconds_compute"] if same else None
    return rows, {"framing": framing, "fixed_bytes": fixed}


def _round_seconds(nbytes, host_bytes, rate_mbit, compute, cpu, *, flops, tokens, period, hidden) -> float:
    """moe.system_model.round_seconds of a synchronisation moving `nbytes` (and the host `host_bytes`) at
    `rate_mbit`, whose `period` local steps take `compute` seconds and whose other processor work `cpu`."""
    return sm.round_seconds(
        flops_per_token=flops,
        tokens_per_step=tokens,
        local_steps=period,
        round_bytes=nbytes,
        bandwidth_bits_per_second=rate_mbit * 1e6,
        latency_seconds=0.0,
        peak_flops=flops * tokens * period / compute,
        mfu=1.0,
        hidden=hidden,
        sync_cpu_seconds=cpu,
        host_bytes=host_bytes,
    )["total"]


def time_to_loss(curve: Sequence[tuple[int, float]], seconds_per_step: float, target: float) -> float | None:
    """Training seconds until the held-out curve first reaches `target` (linear between evaluations), or None."""
    previous = (0, math.inf)
    for step, loss in curve:
        if loss <= target:
            s0, l0 = previous
            frac = 1.0 if not math.isfinite(l0) else (l0 - target) / (l0 - loss)
            return (s0 + frac * (step - s0)) * seconds_per_step
        previous = (step, loss)
    return None


def add_time_to_loss(rows: list[dict]) -> float:
    """Adds every row's seconds to the target loss: the highest final held-out loss of all rows (every run reaches
    it). Returns the target."""
    target = max(r["val_loss"] for r in rows)
    for r in rows:
        r["seconds_to_target"] = time_to_loss(r["curve"], r["seconds_round"] / K, target)
    return target


def _mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("no timed rounds in the run's metrics (was it too short?)")
    return sum(values) / len(values)


def _kept(args, rates: list[float]) -> list[dict]:
    """--keep-others: the rows of <out>/links.json whose methods are not rerun (their measurement, with the command
    that made it and when: the model's columns are derived again). ValueError when it does not match."""
    path = os.path.join(args.out, "links.json")
    if not os.path.exists(path):
        raise ValueError(f"--keep-others: {path} does not exist (run every method once without it)")
    with open(path) as f:
        before = json.load(f)
    before.setdefault("calibration_runs", 1)  # (a table made before the flag)
    for name in ("sites", "steps", "rates", "calibration_runs"):
        now = rates if name == "rates" else getattr(args, name)
        if before[name] != now:
            raise ValueError(f"--keep-others: {path} has {name} {before[name]}, this run {now}; they must match")
    derived = ("seconds_model", "error_model", "effective_gflops", "calibrated", "seconds_to_target")
    rows = [
        {k: v for k, v in r.items() if not k.startswith(derived)}
        for r in before["rows"]
        if r["method"] not in args.methods and r["method"] in METHODS
    ]
    for r in rows:
        r.setdefault("measured_on", "earlier")
        if METHODS[r["method"]][1] == 1:  # DDP's split is derived again
            r["seconds_compute"] = r["seconds_sync"] = None
    for r in rows:
        r.setdefault("measured_by", before.get("commands", [before["command"]])[0])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: see the module docstring, or --help. Returns 2 where links cannot be made (not root)."""
    study = harness.Study(__doc__, module="experiments.reproduce.links", topic="fomoe_links")
    p = study.parser
    p.add_argument("--sites", type=harness.integer(2, maximum=8), default=4, help="sites M (processes), 2..8")
    p.add_argument("--rates", type=harness.integers(1, distinct=True), default="10,100,1000",
                   help="link rates in Mbit/s, each way (besides the unlimited calibration)")  # fmt: skip
    harness.add_steps(p, default=128, multiple_of=K, why=f"whole rounds of K = {K}")
    p.add_argument("--methods", type=harness.names(METHODS), default=",".join(METHODS), help="the methods to run")
    p.add_argument("--eval-every", type=harness.integer(K, multiple_of=K), default=16, help="steps between evaluations")
    p.add_argument("--calibration-runs", type=harness.integer(1, maximum=5), default=1,
                   help="runs of each method on the unlimited links, 1..5: the system model is calibrated on the "
                   "median one")  # fmt: skip
    p.add_argument("--keep-others", action="store_true",
                   help="the table's rows of the methods not given to --methods come from <out>/links.json (of the "
                   "same sites, steps and rates), as they were measured then")  # fmt: skip
    args = study.parse(argv)
    for _, _, overlap, _, _ in (METHODS[m] for m in args.methods):
        if overlap is not None and args.sites % overlap:
            p.error(f"--sites {args.sites}: O_e = {overlap} must divide it")
    reason = links.unavailable()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    always = ("steps", "sites", "rates")
    command = study.command(always=always)
    rates = [UNLIMITED_MBIT, *sorted(float(r) for r in args.rates)]
    try:
        kept = _kept(args, rates) if args.keep_others else []
    except ValueError as e:
        p.error(str(e))
    measured: dict[tuple[str, float], list[dict]] = {}
    for method, rate, repeat in schedule(args.methods, rates[1:], args.calibration_runs):
        print(f"{method} over links of {rate_name(rate)} ({rate:g} Mbit/s each way), {args.sites} sites"
              + (f", calibration run {repeat}" if rate == UNLIMITED_MBIT else ""), flush=True)  # fmt: skip
        with links.Network(sites=args.sites, rate_mbit=rate) as net:
            run = train(method, args.sites, rate, args.steps, args.eval_every, args.out, net, repeat)
        measured.setdefault((method, rate), []).append(measure(method, args.sites, args.steps, run))
    today = time.strftime("%Y-%m-%d")
    new = [{**(median_run(m) if len(m) > 1 else m[0]), "measured_on": today, "measured_by": command}
           for m in measured.values()]  # fmt: skip
    rows, fit = predict([*kept, *new], args.sites)
    rows.sort(key=lambda r: (rates.index(r["rate_mbit"]), list(METHODS).index(r["method"])))
    target = add_time_to_loss(rows)
    with open(os.path.join(args.out, "runs", "unlimited", args.methods[0], "summary.json")) as f:
        num_params = json.load(f)["num_params"]
    loads = [r["load_average"] for r in rows]
    result = {
        "commands": list(dict.fromkeys(r["measured_by"] for r in [*kept, *rows])),
        "link_bytes_fit": fit,
        "sites": args.sites,
        "steps": args.steps,
        "calibration_runs": args.calibration_runs,
        "k": K,
        "rates": rates,
        "model": MODEL,
        "num_params": num_params,
        "load_min": min(loads),
        "load_max": max(loads),
        "run_minutes": sum(r["wall_seconds"] for r in rows) / 60,
        "target": target,
        "rows": rows,
    }
    plots = {"links_loss.png": links_report.loss_plot, "links_round.png": links_report.round_plot}
    study.write("links", result, links_report.markdown, plots, always=always)
    return 0


if __name__ == "__main__":
    command.run(main)
