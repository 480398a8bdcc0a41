"""The links reproduction's report (experiments.reproduce.links): links.md's table and notes from its rows, and the
plots of held-out loss against wall-clock and of the rounds' split."""

from __future__ import annotations

from collections.abc import Sequence

from experiments import plotting
from experiments.reproduce.links_methods import BLOCKING, METHODS, TOLERANCE, UNLIMITED_MBIT, K, rate_name

__all__ = ["loss_plot", "markdown", "overlap_lines", "round_plot"]


def markdown(result: dict) -> str:
    """links.md: the commands that measured the rows, the setting, every row's round (measured, split, modelled)
    and bytes, and the notes on retried runs, the overlap, the calibration runs, the wire bytes, the target loss and
    the system model's largest error."""
    rows, rates = result["rows"], result["rates"]
    commands = result.get("commands", [result["command"]])
    shown = " then ".join(f"`{c}`" for c in commands)
    runs = result.get("calibration_runs", 1)
    median = f": the median of {runs} runs of each method" if runs > 1 else ""
    lines = [
        "# FoMoE over real links",
        "",
        f"{shown} (root; the runs took {result['run_minutes']:.0f} min). M = {result['sites']} "
        f"sites, one process each, each in its own network namespace behind a tbf-limited veth link (each way); "
        f"the same model ({result['num_params']:,} parameters), tokens and {result['steps']} steps for every run, "
        f"K = {K}. Load average during the runs {result['load_min']:.1f}-{result['load_max']:.1f}"
        " (the runs themselves load every core). Latency is not emulated (no netem here): only bandwidth.",
        "",
        "Per round of K steps (means over rounds 2..): measured wall-clock, its compute (local steps) and "
        "synchronisation (DDP: compute = the full replica's local steps, sync = the rest; marked *), the system "
        "model's round time (moe.system_model.round_seconds, calibrated on each method's unlimited-link run: its "
        "local steps' time and the rest of its round, the processor work a hidden round cannot hide; the round's "
        "compiled bytes on the wire by moe.system_model.link_bytes, fitted on the unlimited runs: "
        f"{result['link_bytes_fit']['framing']:.3f} x compiled + "
        f"{result['link_bytes_fit']['fixed_bytes'] / 1e3:,.0f} kB per round, the fixed bytes the host's gathers "
        "between the programs, which a hidden round does not hide) and its error; the same with the "
        f"bytes measured on the wire. Unlimited = links of {UNLIMITED_MBIT:,.0f} Mbit/s (the calibration{median}).",
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
    if len(commands) > 1:
        lines.append("")
        for c in commands:
            made = [r for r in rows if r.get("measured_by", commands[0]) == c]
            names = list(dict.fromkeys(METHODS[r["method"]][0] for r in made))  # (rows are in METHODS' order)
            when = sorted({r.get("measured_on", "earlier") for r in made})
            lines.append(f"- measured by `{c}` ({', '.join(when)}): {'; '.join(names)}")
    lines += overlap_lines(rows, rates)
    repeated = [r for r in rows if len(r.get("calibration_rounds", ())) > 1]
    if repeated:
        lines += ["", "Calibration runs on the unlimited links, each one's round (s; the median one is the row):", ""]
        lines += [
            f"- {METHODS[r['method']][0]}: {', '.join(f'{v:.3f}' for v in r['calibration_rounds'])}" for r in repeated
        ]
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


def overlap_lines(rows: list[dict], rates: Sequence[float]) -> list[str]:
    """The markdown lines that set each round behind compute against the same synchronisation blocking (BLOCKING)
    at the same rate: its round over max(compute, sync) of the blocking one, the overlap goal's ratio."""
    by = {(r["method"], r["rate_mbit"]): r for r in rows}
    out = []
    for hidden, blocking in BLOCKING.items():
        for rate in rates:
            h, b = by.get((hidden, rate)), by.get((blocking, rate))
            if h is None or b is None:
                continue
            bound = max(b["seconds_compute"], b["seconds_sync"])
            out.append(
                f"- {rate_name(rate)}: {METHODS[hidden][0]} {h['seconds_round']:.3f} s a round = "
                f"{h['seconds_round'] / bound:.2f} x max(compute {b['seconds_compute']:.3f}, sync "
                f"{b['seconds_sync']:.3f}) of {METHODS[blocking][0]} (its round {b['seconds_round']:.3f} s, "
                f"{b['seconds_round'] / h['seconds_round']:.2f}x the hidden one's)"
            )
    return ["", "Behind compute against the same synchronisation blocking:", "", *out] if out else []


def loss_plot(result: dict, path: str) -> None:
    """links_loss.png: held-out loss of the result's rows against training wall-clock, one panel per link rate, a
    line per method; the command that made it as the title."""
    from matplotlib import ticker

    rows, rates = result["rows"], result["rates"]
    colors = plotting.colors(list(METHODS))
    with plotting.figure(path, size=(4.2 * len(rates), 4.2), ncols=len(rates), squeeze=False, legend_below=True,
                         legend_columns=3, title=result["command"]) as axes:  # fmt: skip
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


def round_plot(result: dict, path: str) -> None:
    """links_round.png: seconds per round split into compute, synchronisation and host work, per method and rate,
    with the system model's prediction as a marker; the command that made it as the title."""
    rows, rates = result["rows"], result["rates"]
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    with plotting.figure(path, size=(5.2 * len(rates), 5.6), ncols=len(rates), squeeze=False, legend_below=True,
                         legend_columns=4, title=result["command"]) as axes:  # fmt: skip
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
            ax.set_xticks(list(xs), methods, fontsize=7, rotation=60, ha="right", rotation_mode="anchor")
            ax.set_ylabel("seconds per round of K steps")
            ax.set_title(f"{rate_name(rate)} links", fontsize=9)
