"""FoMoE over real rate-limited links: wall-clock per round, split into compute and synchronisation, against DDP and
the full replica, and against the system model's predicted round time.

    python -m experiments.reproduce.links [--out runs/fomoe_links] [--sites 4] [--rates 10,100,1000] [--steps 128]

Needs root (Linux network namespaces: experiments.links). For every link rate, and once on links of
`UNLIMITED_MBIT` (the calibration: at these sizes the link is not what limits a round), M sites are made, each its
own network namespace behind a link of that rate each way (tbf), and every method trains the same model on the same
tokens for the same steps, one process per site (`experiments.launch --links`, jax.distributed over gloo):

    ddp               gradients all-reduced every step (mesh.data = M)
    full_local_adamw  the full replica (O_e = M), LocalAdamW rounds of K local steps (parameters and both moments)
    full_diloco       the full replica, DiLoCo rounds (parameters; an outer Nesterov step)
    fomoe_o1          FoMoE, every expert on one site (O_e = 1), LocalAdamW
    fomoe_o2          FoMoE, every expert on two sites (O_e = 2), LocalAdamW

The model is experiments/configs/fomoe.py made smaller (`MODEL`: d_model 64, 2 layers, 8 experts of 128, top-2,
sequences of 128 bytes) so that at 10 Mbit/s the link dominates a round and at 1000 Mbit/s it does not (there, on
2 shared cores, gloo's own CPU work does).
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
  * moe.system_model.round_seconds at the link's rate with the round's compiled bytes, its compute time (the
    effective FLOP rate) and fixed per-round overhead (the latency term) calibrated on the unlimited run of the same
    method, against the measured round: the relative error, and the same model with the measured wire bytes in
    place of the compiled ones.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from collections.abc import Sequence

from experiments import links, plotting
from experiments.bench import common
from experiments.reproduce import runs
from moe import system_model as sm

CONFIG = runs.config_path("fomoe")
UNLIMITED_MBIT = 10_000.0
K = 8  # local steps per round (and DDP steps per reported "round")
MODEL = {
    "model.d_model": 64,
    "model.num_layers": 2,
    "model.num_heads": 1,
    "model.num_kv_heads": 1,
    "moe.num_experts": 8,
    "moe.top_k": 2,
    "moe.expert_size": 128,
    "data.seq_len": 128,
    "data.batch_size": 16,
    "optim.warmup_steps": 16,
    "train.eval_batches": 4,
    "sample.num_tokens": 0,
}
_LOCAL_NU = {"second_moments": "local"}
Method = tuple[str, int | None, int | None, str | None, dict[str, object]]
METHODS: dict[str, Method] = {  # name: (label, mesh.site, fomoe.overlap (None: M), fomoe.outer, other fomoe keys)
    "ddp": ("DDP", 1, None, None, {}),
    "full_local_adamw": ("full replica, LocalAdamW", None, None, "local_adamw", {}),
    "full_diloco": ("full replica, DiLoCo", None, None, "diloco", {}),
    "fomoe_o1": ("FoMoE O_e = 1, LocalAdamW", None, 1, "local_adamw", {}),
    "fomoe_o2": ("FoMoE O_e = 2, LocalAdamW", None, 2, "local_adamw", {}),
    "fomoe_o2_int8_ef": ("FoMoE O_e = 2, int8 + EF", None, 2, "local_adamw", {"sync_format": "int8",
                                                                              "error_feedback": True}),
    "fomoe_o2_fp4": ("FoMoE O_e = 2, fp4", None, 2, "local_adamw", {"sync_format": "fp4"}),
    "fomoe_o2_fp4_ef": ("FoMoE O_e = 2, fp4 + EF", None, 2, "local_adamw", {"sync_format": "fp4",
                                                                            "error_feedback": True}),
    "fomoe_o2_fp4_ef_local": ("FoMoE O_e = 2, fp4 + EF, nu local", None, 2, "local_adamw",
                              {"sync_format": "fp4", "error_feedback": True, **_LOCAL_NU}),
    "fomoe_o2_overlap": ("FoMoE O_e = 2, behind compute", None, 2, "local_adamw", {"delay": 1, **_LOCAL_NU}),
    "fomoe_o2_stream": ("FoMoE O_e = 2, 2 fragments behind compute", None, 2, "local_adamw",
                        {"delay": 1, "fragments": 2, **_LOCAL_NU}),
}  # fmt: skip
"""Low-bit synchronisation: UE8M0 scales per 32 values, nearest rounding (LocalAdamW's second moments as bf16
unless "nu local"); "behind compute": fomoe.delay = 1 (moe.streaming)."""
TOLERANCE = 0.20  # the bound on the system model's relative error that the table checks
ATTEMPTS = 2  # a failed run is set aside and run again once; the table says which runs were retried


def flags(method: str, sites: int, steps: int, eval_every: int) -> list[str]:
    """The experiments.run flags of `method` at M = `sites`."""
    _, site, overlap, outer, extra = METHODS[method]
    out = [f"--config.{key}={value}" for key, value in MODEL.items()]
    out += [f"--config.train.eval_every={eval_every}", f"--config.checkpoint.every={steps}"]
    if site == 1:
        return out + ["--config.mesh.site=1", f"--config.mesh.data={sites}", "--config.train.log_every=1"]
    return out + [
        f"--config.mesh.site={sites}",
        "--config.mesh.data=1",
        f"--config.fomoe.overlap={overlap or sites}",
        f"--config.fomoe.local_steps={K}",
        f"--config.fomoe.outer={outer}",
        "--config.fomoe.placement=fixed",
        f"--config.train.log_every={K}",
        *(f"--config.fomoe.{key}={value}" for key, value in extra.items()),
    ]


def rate_name(rate_mbit: float) -> str:
    return "unlimited" if rate_mbit == UNLIMITED_MBIT else f"{rate_mbit:g}mbit"


def train(method: str, sites: int, rate_mbit: float, steps: int, eval_every: int, out: str, net) -> dict:
    """Runs (or reuses) one method over `net`'s links; returns {"summary", "rows", "links"} of the run."""
    workdir = os.path.abspath(os.path.join(out, "runs", rate_name(rate_mbit), method))
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


def model_shape(sites: int) -> sm.ModelShape:
    return sm.ModelShape(
        d_model=MODEL["model.d_model"],
        num_layers=MODEL["model.num_layers"],
        num_experts=MODEL["moe.num_experts"],
        top_k=MODEL["moe.top_k"],
        expert_size=MODEL["moe.expert_size"],
        vocab_size=256,
        seq_len=MODEL["data.seq_len"],
    )


def predict(rows: list[dict], sites: int) -> list[dict]:
    """Adds to every row the system model's round time at its rate and its relative error, once with the compiled
    bytes and once with the wire's: calibrated on the unlimited row of its method, whose round less the time its
    bytes take at UNLIMITED_MBIT is the compute (the local steps' measured time; DDP: all of it, its all-reduce's
    arithmetic included) plus a fixed per-round overhead (the model's latency term). Then DDP's derived split."""
    calibration = {r["method"]: r for r in rows if r["rate_mbit"] == UNLIMITED_MBIT}
    tokens_per_site_step = MODEL["data.batch_size"] * MODEL["data.seq_len"] / sites
    for r in rows:
        cal = calibration[r["method"]]
        ddp = METHODS[r["method"]][1] == 1
        overlap = METHODS[r["method"]][2] or sites
        flops = sm.flops_per_token(model_shape(sites), 1 if ddp else sites, 1 if ddp else overlap)["total"]
        period = 1 if ddp else K  # steps between two synchronisations
        scale = period / K  # a round's quantity -> per synchronisation
        for key, count in (("model", "compiled_bytes"), ("model_wire", "wire_bytes")):
            # what the calibration's round takes besides moving its bytes, split into compute and a fixed overhead
            # (DDP's all-reduce is inside its step: all of it counts as compute)
            untransferred = scale * cal["seconds_round"] - 8 * scale * cal[count] / (UNLIMITED_MBIT * 1e6)
            compute = untransferred if ddp else scale * cal["seconds_compute"]
            overhead = untransferred - compute
            effective_flops = flops * tokens_per_site_step * period / compute
            t = sm.round_seconds(
                flops_per_token=flops,
                tokens_per_step=tokens_per_site_step,
                local_steps=period,
                round_bytes=scale * r[count],
                bandwidth_bits_per_second=r["rate_mbit"] * 1e6,
                latency_seconds=overhead,
                peak_flops=effective_flops,
                mfu=1.0,
                hidden=bool(METHODS[r["method"]][4].get("delay")),
            )
            r[f"seconds_{key}"] = t["total"] / scale
            r[f"error_{key}"] = r["seconds_round"] / r[f"seconds_{key}"] - 1
            if key == "model":
                r["effective_gflops_per_site"] = effective_flops / 1e9
                r["calibrated_overhead_seconds"] = overhead / scale
    for r in rows:  # DDP's split, derived: its per-device step computes what a full replica's local step does
        if METHODS[r["method"]][1] == 1:
            same = [q for q in rows if q["method"] == "full_local_adamw" and q["rate_mbit"] == r["rate_mbit"]]
            r["seconds_compute"] = same[0]["seconds_compute"] if same else None
            r["seconds_sync"] = r["seconds_round"] - same[0]["seconds_compute"] if same else None
    return rows


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


def markdown(result: dict) -> str:
    rows, rates = result["rows"], result["rates"]
    lines = [
        "# FoMoE over real links",
        "",
        f"`{result['command']}` (root; the runs took {result['run_minutes']:.0f} min). M = {result['sites']} "
        f"sites, one process each, each in its own network namespace behind a tbf-limited veth link (each way); "
        f"the same model ({result['num_params']:,} parameters), tokens and {result['steps']} steps for every run, "
        f"K = {K}. "
        f"Machine: {result['machine'].rstrip('.')}; load average during the runs "
        f"{result['load_min']:.1f}-{result['load_max']:.1f}"
        " (the runs themselves load both cores). Latency is not emulated (no netem here): only bandwidth.",
        "",
        "Per round of K steps (means over rounds 2..): measured wall-clock, its compute (local steps) and "
        "synchronisation (DDP: compute = the full replica's local steps, sync = the rest; marked *), the system "
        "model's round time "
        "(moe.system_model.round_seconds: compute and per-round overhead calibrated on the unlimited-link run, "
        "the compiled bytes at the link's rate) and its error; the same with the bytes measured on the wire. "
        f"Unlimited = links of {UNLIMITED_MBIT:,.0f} Mbit/s (the calibration).",
        "",
        "| rate | method | round s | compute s | sync s | model s | error | model (wire bytes) s | error | "
        "compiled MB/round | wire MB/round | wire / compiled | held-out loss | s to target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate in rates:
        for r in (r for r in rows if r["rate_mbit"] == rate):
            mark = "*" if METHODS[r["method"]][1] == 1 else ""
            split = [f"{v:.3f}{mark}" if v is not None else "-" for v in (r["seconds_compute"], r["seconds_sync"])]
            reach = "-" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.1f}"
            lines.append(
                f"| {rate_name(rate)} | {METHODS[r['method']][0]} | {r['seconds_round']:.3f} | "
                f"{split[0]} | {split[1]} | {r['seconds_model']:.3f} | "
                f"{100 * r['error_model']:+.0f}% | {r['seconds_model_wire']:.3f} | "
                f"{100 * r['error_model_wire']:+.0f}% | "
                f"{r['compiled_bytes'] / 1e6:.3f} | {r['wire_bytes'] / 1e6:.3f} | {r['wire_over_compiled']:.3f} | "
                f"{r['val_loss']:.3f} | {reach} |"
            )
    limited = [r for r in rows if r["rate_mbit"] != UNLIMITED_MBIT]
    worst = max(limited, key=lambda r: abs(r["error_model"]))
    worst_wire = max(limited, key=lambda r: abs(r["error_model_wire"]))
    whole = [r["wire_bytes_whole_run_per_round"] / r["compiled_bytes"] for r in rows]
    retried = [f"{METHODS[r['method']][0]} at {rate_name(r['rate_mbit'])}" for r in rows if r["attempts"] > 1]
    if retried:
        lines += ["", f"Run again after a failed first attempt (set aside as `.stale-1`): {'; '.join(retried)}."]
    lines += [
        "",
        f"Wire / compiled is per round, between the first and the last round's metric rows; over whole runs (their "
        f"start and end, evaluations and the checkpoint included) it is {min(whole):.3f}-{max(whole):.3f}.",
        "",
        f"Target loss {result['target']:.3f} (the highest final held-out loss: every run reaches it); 's to target' is "
        "the training wall-clock until a run's held-out loss first reaches it.",
        "",
        f"System model: the largest error with compiled bytes is {100 * worst['error_model']:+.0f}% "
        f"({METHODS[worst['method']][0]} at {rate_name(worst['rate_mbit'])}); with the wire's bytes "
        f"{100 * worst_wire['error_model_wire']:+.0f}% ({METHODS[worst_wire['method']][0]} at "
        f"{rate_name(worst_wire['rate_mbit'])}); the bound is {100 * TOLERANCE:.0f}%.",
    ]
    return "\n".join(lines) + "\n"


def loss_plot(rows: list[dict], rates: Sequence[float], path: str, command: str) -> None:
    """links_loss.png: held-out loss against training wall-clock, one panel per link rate, a line per method."""
    from matplotlib import ticker

    colors = plotting.colors(list(METHODS))
    with plotting.figure(path, size=(4.2 * len(rates), 4.2), ncols=len(rates), squeeze=False, legend_below=True,
                         legend_columns=3, title=command) as axes:  # fmt: skip
        for ax, rate in zip(axes, rates):
            for r in (r for r in rows if r["rate_mbit"] == rate):
                per_step = r["seconds_round"] / K
                ax.plot([s * per_step for s, _ in r["curve"]], [v for _, v in r["curve"]], "o-", ms=3,
                        color=colors[r["method"]], label=METHODS[r["method"]][0])  # fmt: skip
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(ticker.NullFormatter())
            ax.set_xlabel("training wall-clock (s, log scale)")
            ax.set_ylabel("held-out loss")
            ax.set_title(f"{rate_name(rate)} links", fontsize=9)


def round_plot(rows: list[dict], rates: Sequence[float], path: str, command: str) -> None:
    """links_round.png: seconds per round split into compute, synchronisation and host work, per method and rate,
    with the system model's prediction as a marker."""
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    with plotting.figure(path, size=(4.2 * len(rates), 4.4), ncols=len(rates), squeeze=False, legend_below=True,
                         legend_columns=4, title=command) as axes:  # fmt: skip
        for ax, rate in zip(axes, rates):
            by = {r["method"]: r for r in rows if r["rate_mbit"] == rate}
            xs = range(len(methods))
            split = [by[m]["seconds_compute"] is not None for m in methods]
            compute = [by[m]["seconds_compute"] if ok else 0.0 for m, ok in zip(methods, split)]
            sync = [by[m]["seconds_sync"] if ok else by[m]["seconds_round"] for m, ok in zip(methods, split)]
            host = [by[m]["seconds_host"] or 0.0 for m in methods]
            ax.bar(xs, compute, color="tab:blue", label="compute (local steps)")
            ax.bar(xs, sync, bottom=compute, color="tab:orange", label="synchronisation")
            ax.bar(xs, host, bottom=[c + s for c, s in zip(compute, sync)], color="tab:gray", label="host")
            ax.plot(xs, [by[m]["seconds_model"] for m in methods], "k_", ms=22, mew=2, label="system model")
            ax.set_xticks(list(xs), [m.replace("_", "\n", 1) for m in methods], fontsize=7)
            ax.set_ylabel("seconds per round of K steps")
            ax.set_title(f"{rate_name(rate)} links", fontsize=9)


def main(argv: Sequence[str] | None = None) -> int:
    p = common.parser(__doc__, module="experiments.reproduce.links", topic="fomoe_links")
    p.add_argument("--sites", type=common.integer(2, maximum=8), default=4, help="sites M (processes), 2..8")
    p.add_argument("--rates", type=common.integers(1, distinct=True), default="10,100,1000",
                   help="link rates in Mbit/s, each way (besides the unlimited calibration)")  # fmt: skip
    common.add_steps(p, default=128, multiple_of=K, why=f"whole rounds of K = {K}")
    p.add_argument("--methods", type=common.names(METHODS), default=",".join(METHODS), help="the methods to run")
    p.add_argument("--eval-every", type=common.integer(K, multiple_of=K), default=16, help="steps between evaluations")
    args = p.parse_args(argv)
    for _, _, overlap, _, _ in (METHODS[m] for m in args.methods):
        if overlap is not None and args.sites % overlap:
            p.error(f"--sites {args.sites}: O_e = {overlap} must divide it")
    reason = links.unavailable()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    command = common.command(p, args, always=("steps", "sites", "rates"))
    rates = [UNLIMITED_MBIT, *sorted(float(r) for r in args.rates)]
    measured = []
    for rate in rates:
        print(f"links of {rate_name(rate)} ({rate:g} Mbit/s each way), {args.sites} sites", flush=True)
        with links.Network(sites=args.sites, rate_mbit=rate) as net:
            for method in args.methods:
                run = train(method, args.sites, rate, args.steps, args.eval_every, args.out, net)
                measured.append(measure(method, args.sites, args.steps, run))
    rows = predict(measured, args.sites)
    target = add_time_to_loss(rows)
    with open(os.path.join(args.out, "runs", "unlimited", args.methods[0], "summary.json")) as f:
        num_params = json.load(f)["num_params"]
    loads = [r["load_average"] for r in rows]
    result = {
        "command": command,
        "sites": args.sites,
        "steps": args.steps,
        "k": K,
        "rates": rates,
        "model": MODEL,
        "num_params": num_params,
        "machine": common.describe(common.machine()),
        "load_min": min(loads),
        "load_max": max(loads),
        "run_minutes": sum(r["wall_seconds"] for r in rows) / 60,
        "target": target,
        "rows": rows,
    }
    common.write_results(args.out, "links", result, markdown)
    loss_plot(rows, rates, os.path.join(args.out, "links_loss.png"), command)
    round_plot(rows, rates, os.path.join(args.out, "links_round.png"), command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
