"""FoMoE at CPU scale: a small version of the paper's Table 6, the skip-token throughput curve, the system model.

    python -m experiments.reproduce.fomoe [--out runs/fomoe] [--steps 256] [--parts table,throughput,system]
                                          [--only NAME,...]

table: trains the byte-level sigma-MoE of experiments/configs/fomoe.py (d_model 128, 4 layers, 8 experts top-2,
expert size 128) on the built-in corpus, every run with the same global batch (16 x 256 tokens) and number of steps,
so the same tokens. The grid: M in {2, 4} sites; O_e in {1, 2, 4} up to M; K in {8, 32}; LocalAdamW and DiLoCo;
fixed placement, and random placement (reshuffled every 4 rounds) for LocalAdamW at K = 8; plus DDP on M devices
(gradients all-reduced every step). Each run is `python -m experiments.run` in its own process with M virtual CPU
devices, in `<out>/runs/<name>`, its progress shown prefixed by that name; a run that finished is not run again
(and one that was interrupted resumes).
Reports held-out perplexity (per byte-token, mean over sites) and the bytes each site sent over the whole run,
measured from the compiled programs' collectives (and by the formulas) -> table.md, table.json, pareto.png.
Everything goes into `--out` (`--out results/fomoe` for the tables and plots docs/fomoe.md quotes).

throughput: `experiments.bench.skip_token` (training throughput against the number of ghost experts).
system: `experiments.reproduce.fomoe_system` (parameter table and the 104B projection).
"""

from __future__ import annotations

import math
import os
import time

from experiments import command, harness, plotting
from experiments.reproduce import runs
from moe import system_model as sm

CONFIG = runs.config_path("fomoe")
PARTS = ("table", "throughput", "system")


def grid() -> list[dict]:
    """The runs: name, sites M, overlap O_e (None for DDP), K, outer method, placement."""
    runs = []
    for m in (2, 4):
        runs.append({"name": f"ddp_M{m}", "sites": m, "overlap": None, "k": 1, "outer": "ddp", "placement": "-"})
        for outer in ("local_adamw", "diloco"):
            for k in (8, 32):
                for o in (1, 2, 4):
                    if o <= m:
                        runs.append(
                            {
                                "name": f"{outer}_M{m}_O{o}_K{k}",
                                "sites": m,
                                "overlap": o,
                                "k": k,
                                "outer": outer,
                                "placement": "fixed",
                            }
                        )
        for o in (1, 2, 4):
            if o < m:
                runs.append(
                    {
                        "name": f"local_adamw_M{m}_O{o}_K8_random",
                        "sites": m,
                        "overlap": o,
                        "k": 8,
                        "outer": "local_adamw",
                        "placement": "random",
                    }
                )
    return runs


def _flags(run: dict, steps: int) -> list[str]:
    """The experiments.run flags of one run of the grid."""
    shared = [f"--config.train.eval_every={steps}"]
    if run["outer"] == "ddp":
        return shared + ["--config.mesh.site=1", f"--config.mesh.data={run['sites']}"]
    return shared + [
        f"--config.mesh.site={run['sites']}",
        "--config.mesh.data=1",
        f"--config.fomoe.overlap={run['overlap']}",
        f"--config.fomoe.local_steps={run['k']}",
        f"--config.fomoe.outer={run['outer']}",
        f"--config.fomoe.placement={run['placement']}",
        "--config.fomoe.reshuffle_every=4",
    ]


def train(run: dict, steps: int, out: str) -> dict:
    """Runs (or resumes, or reuses) one configuration; returns its summary.json."""
    return runs.run_or_reuse(
        CONFIG, os.path.join(out, "runs", run["name"]), _flags(run, steps), steps, devices=run["sites"]
    )


def row(run: dict, summary: dict, steps: int, tokens_per_step: int) -> dict:
    """One table row: quality, and the bytes each site sent over the run (measured and by formula)."""
    if run["outer"] == "ddp":
        per_step = summary["bytes_per_device_per_step"]
        measured = steps * per_step
        formula = steps * 2 * (run["sites"] - 1) / run["sites"] * 4 * summary["num_params"]  # fp32 gradients
        per_token = sm.bytes_per_token(per_step, run["sites"], 1, tokens_per_step)
    else:
        rounds = steps // run["k"]
        measured = rounds * summary["bytes_per_site_per_round"]
        formula = rounds * summary["bytes_per_site_per_round_formula"]
        per_token = summary["bytes_per_token"]
    return {
        **run,
        "val_loss": summary["val_loss"],
        "perplexity": math.exp(summary["val_loss"]),
        "val_bits_per_byte": summary["val_bits_per_byte"],
        "worst_site_bits_per_byte": summary.get("val_bits_per_byte_worst_site", summary["val_bits_per_byte"]),
        "bytes_per_site": measured,
        "bytes_per_site_formula": formula,
        "bytes_per_token": per_token,
        "tokens_per_second": summary["tokens_per_second"],
    }


def ratios(rows: list[dict]) -> list[dict]:
    """Bytes of DDP and of the full replica (O_e = M, same outer method and K) over each partial-replica run."""
    by = {(r["sites"], r["overlap"], r["k"], r["outer"], r["placement"]): r for r in rows}
    ddp = {r["sites"]: r for r in rows if r["outer"] == "ddp"}
    out = []
    for r in rows:
        if r["outer"] == "ddp" or r["overlap"] == r["sites"]:
            continue
        full = by.get((r["sites"], r["sites"], r["k"], r["outer"], "fixed"))
        out.append(
            {
                "name": r["name"],
                "vs_ddp": ddp[r["sites"]]["bytes_per_site"] / r["bytes_per_site"],
                "vs_full_replica": full["bytes_per_site"] / r["bytes_per_site"] if full else None,
                "perplexity": r["perplexity"],
                "full_replica_perplexity": full["perplexity"] if full else None,
                "ddp_perplexity": ddp[r["sites"]]["perplexity"],
            }
        )
    return out


def markdown(result: dict) -> str:
    """table.md: every run's quality and bytes, then the bytes saved against DDP and the full replica."""
    rows, steps = result["rows"], result["steps"]
    lines = [
        "# FoMoE at CPU scale: a small Table 6",
        "",
        f"`{result['command']}`: experiments/configs/fomoe.py (d_model 128, 4 "
        f"layers, 8 experts top-2, expert size 128, sigmoid router, partitioned routing), {steps} steps of 16 x "
        f"256 byte-tokens for every run ({result['tokens']:,} tokens), AdamW lr 5e-3. Perplexity: exp(held-out "
        "loss per byte-token), mean over sites (worst site in bits/byte). Bytes: what each site sent over the "
        "whole run, read from the compiled programs' all-reduce / all-gather ops (formula in brackets where it "
        "differs). DDP: M devices, gradients all-reduced every step.",
        "",
        "| run | M | O_e | K | outer | placement | perplexity | bits/byte (worst site) | MB per site | bytes per "
        "token |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        formula = (
            ""
            if math.isclose(r["bytes_per_site"], r["bytes_per_site_formula"], rel_tol=1e-9)
            else (f" ({r['bytes_per_site_formula'] / 1e6:,.1f})")
        )
        lines.append(
            f"| {r['name']} | {r['sites']} | {r['overlap'] or '-'} | {r['k']} | {r['outer']} | "
            f"{r['placement']} | {r['perplexity']:.3f} | {r['val_bits_per_byte']:.3f} "
            f"({r['worst_site_bits_per_byte']:.3f}) | {r['bytes_per_site'] / 1e6:,.1f}{formula} | "
            f"{r['bytes_per_token']:,.0f} |"
        )
    lines += [
        "",
        "Bytes saved by partial replication (DDP's or the full replica's bytes over the run's, same token "
        "budget; the full replica has the same M, K and outer method):",
        "",
        "| run | vs DDP | vs full replica | perplexity | full replica | DDP |",
        "|---|---|---|---|---|---|",
    ]
    for q in result["ratios"]:
        full = f"{q['vs_full_replica']:.2f}x" if q["vs_full_replica"] else "-"
        fpp = f"{q['full_replica_perplexity']:.3f}" if q["full_replica_perplexity"] else "-"
        lines.append(
            f"| {q['name']} | {q['vs_ddp']:.2f}x | {full} | {q['perplexity']:.3f} | {fpp} | {q['ddp_perplexity']:.3f} |"
        )
    return "\n".join(lines) + "\n"


PARETO_CAPTION = (
    "Point labels: LA = LocalAdamW, DL = DiLoCo (the outer method), DDP = gradients all-reduced every step; "
    "M = sites; O = O_e, the sites holding each expert (O = M: full replica); K = local steps per round; "
    "rnd = random placement, reshuffled every 4 rounds (otherwise fixed). Marker: circle LocalAdamW, square DiLoCo, "
    "star DDP; colour O_e; filled K = 8, hollow K = 32 or random placement."
)


def point_label(r: dict) -> str:
    """A run's short label in pareto.png (PARETO_CAPTION explains it): e.g. 'LA M4 O2 K8', 'DL M2 O1 K32',
    'LA M4 O2 K8 rnd', 'DDP M4'."""
    if r["outer"] == "ddp":
        return f"DDP M{r['sites']}"
    outer = {"local_adamw": "LA", "diloco": "DL"}[r["outer"]]
    return f"{outer} M{r['sites']} O{r['overlap']} K{r['k']}" + (" rnd" if r["placement"] == "random" else "")


def pareto_plot(result: dict, path: str) -> None:
    """pareto.png: held-out perplexity of the result's rows against MB sent per site (log), the Pareto front dashed;
    every point labelled (labels placed clear of each other and of the points) and the labels' code explained in a
    caption; the command that made the table as the title."""
    rows = result["rows"]
    styles = {"local_adamw": "o", "diloco": "s", "ddp": "*"}
    colors = {1: "tab:blue", 2: "tab:orange", 4: "tab:green", None: "tab:red"}
    with plotting.figure(
        path,
        size=(8, 6.4),
        grid="both",
        legend_size=7,
        legend_columns=4,
        legend_below=True,
        title=result["command"],
        caption=PARETO_CAPTION,
    ) as ax:
        for r in rows:
            hollow = r["placement"] == "random" or r["k"] == 32
            ax.scatter(
                r["bytes_per_site"] / 1e6,
                r["perplexity"],
                marker=styles[r["outer"]],
                s=60 if r["k"] != 32 else 40,
                facecolors="none" if hollow else colors[r["overlap"]],
                edgecolors=colors[r["overlap"]],
                zorder=3,
            )
        plotting.place_labels(
            ax,
            [r["bytes_per_site"] / 1e6 for r in rows],
            [r["perplexity"] for r in rows],
            [point_label(r) for r in rows],
            fontsize=6,
        )
        front, best = [], math.inf
        for r in sorted(rows, key=lambda r: r["bytes_per_site"]):
            if r["perplexity"] < best:
                best = r["perplexity"]
                front.append(r)
        ax.plot(
            [r["bytes_per_site"] / 1e6 for r in front],
            [r["perplexity"] for r in front],
            "k--",
            lw=0.8,
            label="Pareto front",
        )
        for label, marker in (("LocalAdamW", "o"), ("DiLoCo", "s"), ("DDP", "*")):
            ax.scatter([], [], marker=marker, c="gray", label=label)
        for o, c in colors.items():
            if o is not None:
                ax.scatter([], [], marker="o", c=c, label=f"O_e = {o}")
        ax.scatter([], [], marker="o", facecolors="none", edgecolors="gray", label="K = 32 or random placement")
        ax.set_xscale("log")
        ax.set_xlabel("MB sent per site over the run (measured)")
        ax.set_ylabel("held-out perplexity (byte tokens)")
        ax.set_title("FoMoE at CPU scale: quality against communication", fontsize=9)


def table(study: harness.Study, steps: int, only: list[str]) -> None:
    """Trains (or reuses) the grid's runs (`only` of them if given) for `steps` steps each in the study's output
    directory; writes table.md, table.json and pareto.png there, which state the command of the table part."""
    runs = [r for r in grid() if not only or r["name"] in only]
    tokens_per_step = 16 * 256
    rows = []
    for i, run in enumerate(runs):
        t0 = time.time()
        study.progress(i + 1, len(runs), f"{run['name']} on {run['sites']} virtual CPU devices")
        summary = train(run, steps, study.out)
        rows.append(row(run, summary, steps, tokens_per_step))
        study.progress(
            i + 1,
            len(runs),
            f"{run['name']}: perplexity {rows[-1]['perplexity']:.3f}, "
            f"{rows[-1]['bytes_per_site'] / 1e6:,.1f} MB per site ({time.time() - t0:.0f} s)",
        )
    result = {"steps": steps, "tokens": steps * tokens_per_step, "rows": rows, "ratios": ratios(rows)}
    study.write("table", result, markdown, {"pareto.png": pareto_plot}, parts=["table"])


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    study = harness.Study(__doc__, module="experiments.reproduce.fomoe", topic="fomoe")
    harness.add_steps(study.parser, default=256, multiple_of=32, why="whole rounds at K = 32")
    harness.add_parts(study.parser, PARTS)
    study.parser.add_argument(
        "--only",
        type=harness.names([r["name"] for r in grid()], empty=True),
        default="",
        help="run names of the table to train (comma-separated; empty: the whole grid)",
    )
    args = study.parse(argv)
    parts = args.parts
    if "table" in parts:
        table(study, args.steps, args.only)
    if "throughput" in parts:
        from experiments.bench import skip_token

        skip_token.main(["--out", args.out])
    if "system" in parts:
        from experiments.reproduce import fomoe_system

        fomoe_system.main(["--out", args.out])


if __name__ == "__main__":
    command.run(main)
