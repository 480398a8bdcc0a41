"""Serving a multi-round agent workload under KV-cache pressure: bf16, fp8 and fp4 KV at the same KV memory.

    python -m experiments.reproduce.serving [--out runs/serving] [--memory-kib 4096] [--formats bf16,fp8,fp4]
        [--sweep-kib 2048,3072,6144,8192] [--project]

The trained quickstart model (the one `experiments.reproduce.kvcache` trains, reused from `<--model-out>/runs`) is
served by `kvcache.serving.Engine` (continuous batching, 256-token steps, prefix caching, XLA attention) on
`kvcache.workload.AgentWorkload()`: 24 conversations, 8 at a time, 4 rounds each; 64 shared + 768 per-conversation
prefix tokens, 64-96 new input and 16 output tokens per round (the spec's 100 x 32 x 6 rounds, 2K + 25K prefix,
2-3K in, 200 out, scaled to 2 CPU cores). The same KV memory for every format (default 4 MiB: 4,096 bf16 tokens of
this model against a working set of about 8 x 1,000, so bf16 must evict; fp4 holds 3.76x as many tokens).

Reported per format: P50 / P90 time to first token per round, KV hit rate (prompt tokens found in the prefix cache),
output throughput, preemptions -> table.md, table.json, ttft.png. The published result (UltraQuant against FP8 KV):
late-round P50 TTFT 3.47x lower, output throughput 1.63x higher. `--sweep-kib` repeats fp8 against fp4 at other
KV memories (the ratios depend on how much of the working set each format keeps) -> sweep.md, sweep.json,
sweep.png.

`--project`: the published workload (100 conversations, 32 concurrent, 6 rounds, 2,048 shared + 25,000 own prefix
tokens, 2,000-3,000 new input and 200 output tokens per round) on the spec's model and one H200, by the same
scheduler on a cost model (`kvcache.simulate`: every hardware and model number is a stated parameter; the decode
kernels are assumed to reach 80% of the bandwidth, fp4 75%, until a GPU session measures them), across KV budgets
-> projection.md, projection.json, projection.png.

Everything goes into `--out` (`--out results/serving` for the tables and plots docs/kvcache.md quotes).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from experiments import command, harness, plotting

FORMATS = ("bf16", "fp8", "fp4")


def serve(model, fmt_name: str, memory_bytes: int, workload) -> dict:
    """Serves `workload` with `model` on an engine with `memory_bytes` of `fmt_name` KV; the workload's measures
    (kvcache.workload.run) and the pool's capacity in tokens."""
    from core.byte_tokenizer import ByteTokenizer
    from kvcache import formats
    from kvcache.serving import Engine, EngineConfig
    from kvcache.serving import workload as workload_lib

    engine = Engine(
        model,
        formats.get(fmt_name),
        EngineConfig.for_tokenizer(
            ByteTokenizer(),  # the quickstart model's
            memory_bytes=memory_bytes,
            max_num_seqs=workload.concurrency,
            max_num_batched_tokens=256,
            max_model_len=-(-workload.max_tokens // 256) * 256 + 512,
        ),
    )
    harness.compiling(f"the engine's step programs ({fmt_name} KV)")
    engine.warmup()

    def progress(done, total):
        if done % 8 == 0 or done == total:
            print(
                f"  {fmt_name}: {done}/{total} requests, {engine.stats['steps']} steps, "
                f"{engine.stats['preemptions']} preemptions",
                flush=True,
            )

    result = workload_lib.run(engine, workload, progress=progress)
    result["pool_tokens"] = engine.capacity_tokens
    return result


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    from experiments.reproduce import kvcache as kv_repro
    from kvcache.serving.workload import AgentWorkload

    study = harness.Study(__doc__, module="experiments.reproduce.serving", topic="serving")
    parser = study.parser
    parser.add_argument(
        "--model-out",
        default="runs/kvcache",
        help="the --out of experiments.reproduce.kvcache: its runs/model holds the trained model (trained there, "
        "about 2 minutes, if absent; the committed tables used results/kvcache)",
    )
    parser.add_argument(
        "--memory-kib", type=harness.integer(1), default=4096, help="KV memory of every format, in KiB, >= 1"
    )
    parser.add_argument(
        "--formats",
        type=harness.names(FORMATS),
        default=",".join(FORMATS),
        help=f"KV formats to serve with: a comma-separated subset of {list(FORMATS)}",
    )
    parser.add_argument(
        "--sweep-kib",
        type=harness.integers(1, empty=True),
        default="",
        help="instead of the table: fp8 against fp4 at each of these KV memories (comma-separated KiB, >= 1)",
    )
    parser.add_argument(
        "--project",
        action="store_true",
        help="instead of serving: the published-scale workload on the spec's model and an H200 cost model",
    )
    args = study.parse(argv)
    defaults = {name: parser.parse_args([]).__dict__[name] for name in ("model_out", "memory_kib", "formats")}
    if args.project:  # the other flags do not apply: the command states only what made the tables
        return project(study, **defaults, sweep_kib=[])
    sweep_kib, names = args.sweep_kib, args.formats
    _, model = kv_repro.trained_model(args.model_out)
    workload = AgentWorkload()
    if sweep_kib:
        return sweep(model, sweep_kib, workload, study, **{**defaults, "model_out": args.model_out})
    results = {}
    for name in names:
        print(f"serving with {name} KV ({args.memory_kib} KiB)", flush=True)
        r = serve(model, name, args.memory_kib * 1024, workload)
        results[name] = dict(r.items())
    summary = {
        "memory_bytes": args.memory_kib * 1024,
        "workload": dict(vars(workload).items()),
        "formats": results,
    }
    study.write("table", summary, markdown, {"ttft.png": plot})


PUBLISHED_WORKLOAD: dict[str, Any] = dict(
    conversations=100,
    concurrency=32,
    rounds=6,
    system_prefix=2048,
    conversation_prefix=25000,
    new_input=(2000, 3000),
    output_tokens=200,
)
PROJECTION_GIB = (6.0, 8.0, 10.0, 12.0, 14.5, 20.0)
KERNEL_EFFICIENCY = {"bf16": 0.8, "fp8": 0.8, "fp4": 0.75}  # assumed until measured on a GPU


SENSITIVITY_GIB = (8.0, 14.5)
FP4_EFFICIENCIES = (0.75, 0.5, 0.35, 0.25)


def simulate(gib: float, name: str, efficiency: float, workload) -> dict:
    """The published workload on the spec's model with `gib` GiB of `name` KV, decode kernels at `efficiency`."""
    from core.byte_tokenizer import ByteTokenizer
    from kvcache import capacity, formats
    from kvcache.serving import EngineConfig
    from kvcache.serving import workload as workload_lib
    from kvcache.serving.simulate import H200, SPEC_MODEL_SERVING, SimulatedEngine, StepCost

    fmt = formats.get(name)
    cost = StepCost(SPEC_MODEL_SERVING, H200, capacity.kv_bytes_per_token(capacity.SPEC_MODEL, fmt), efficiency)
    engine = SimulatedEngine(
        fmt,
        EngineConfig.for_tokenizer(
            ByteTokenizer(),  # byte tokens (the workload's)
            memory_bytes=int(gib * 2**30),
            max_num_seqs=32,
            max_num_batched_tokens=8192,
            max_model_len=65536,
        ),
        SPEC_MODEL_SERVING,
        cost,
    )
    r = workload_lib.run(engine, workload)
    return {
        "pool_tokens": engine.capacity_tokens,
        "hit_rate": r["hit_rate"],
        "ttft_p50": r["ttft_p50"],
        "late_ttft_p50": late_ttft_p50(r, workload.rounds),
        "output_throughput": r["output_throughput"],
        "preemptions": r["preemptions"],
        "round_ttft_p50": [x["ttft_p50"] for x in r["rounds"]],
    }


def project(study: harness.Study, **overrides) -> None:
    """projection.md/json/png in `study.out`: the published workload simulated at each KV budget per format, and
    the fp4 kernel's sensitivity; the command they state has `overrides` (by dest: the flags that do not apply
    set back to their defaults)."""
    from kvcache.serving import workload as workload_lib
    from kvcache.serving.simulate import H200, SPEC_MODEL_SERVING

    workload = workload_lib.AgentWorkload(**PUBLISHED_WORKLOAD)
    points = []
    for gib in PROJECTION_GIB:
        point: dict[str, Any] = {"kv_gib": gib}
        for name in FORMATS:
            point[name] = r = simulate(gib, name, KERNEL_EFFICIENCY[name], workload)
            print(
                f"{gib:5.1f} GiB {name:>5}: hit {100 * r['hit_rate']:.0f}%, P50 TTFT {r['ttft_p50']:.2f} s, "
                f"{r['output_throughput']:.0f} tok/s",
                flush=True,
            )
        points.append(point)
    # The fp4 decode kernel's speed is the one number a GPU session has not measured: how slow may it be?
    sensitivity = []
    for gib in SENSITIVITY_GIB:
        point = next(p for p in points if p["kv_gib"] == gib)
        fp8 = point["fp8"]
        for eff in FP4_EFFICIENCIES:  # the projection's own efficiency was simulated above
            r = point["fp4"] if eff == KERNEL_EFFICIENCY["fp4"] else simulate(gib, "fp4", eff, workload)
            sensitivity.append(
                {
                    "kv_gib": gib,
                    "fp4_efficiency": eff,
                    "ttft_ratio": fp8["late_ttft_p50"] / r["late_ttft_p50"],
                    "throughput_ratio": r["output_throughput"] / fp8["output_throughput"],
                }
            )
            print(
                f"{gib:5.1f} GiB fp4 at {eff:.0%} of bandwidth: TTFT {sensitivity[-1]['ttft_ratio']:.2f}x, "
                f"throughput {sensitivity[-1]['throughput_ratio']:.2f}x against fp8",
                flush=True,
            )
    result = {
        "workload": PUBLISHED_WORKLOAD,
        "hardware": vars(H200),
        "kernel_efficiency": KERNEL_EFFICIENCY,
        "model": {
            "full_attention_layers": 10,
            "num_kv_heads": 2,
            "head_dim": 256,
            "num_heads": 16,
            "active_params": SPEC_MODEL_SERVING.active_params,
            "weight_bytes": SPEC_MODEL_SERVING.weight_bytes,
        },
        "points": points,
        "fp4_kernel_sensitivity": sensitivity,
    }
    study.write("projection", result, projection_markdown, {"projection.png": projection_plot}, **overrides)


def projection_markdown(result: dict) -> str:
    """projection.md: one row per KV budget, then the fp4 kernel sensitivity."""
    lines = [
        "# Projection: the published agent workload on the spec's model and one H200",
        "",
        f"`{result['command']}`: the engine's scheduler (prefix caching, chunked "
        "prefill of 8,192 tokens per step, 32 sequences) on a cost model (`kvcache.simulate`; H200 989 TFLOP/s "
        "at 50% MFU, 4.8 TB/s at 80% for weights; decode kernels at 80% of it for bf16 and fp8, 75% for fp4, "
        "assumed; 70 GB of bf16 weights read per step, 3B active parameters). Workload: 100 conversations, "
        "32 concurrent, 6 rounds, 2,048 + 25,000 prefix tokens, 2,000-3,000 in and 200 out per round. A "
        "projection, not a measurement.",
        "",
        "| KV budget (GiB) | hit rate bf16 / fp8 / fp4 | late-round P50 TTFT (s) bf16 / fp8 / fp4 | "
        "output tok/s bf16 / fp8 / fp4 | fp4 vs fp8: TTFT / throughput |",
        "|---|---|---|---|---|",
    ]
    for p in result["points"]:
        a, b = p["fp8"], p["fp4"]
        lines.append(
            f"| {p['kv_gib']:g} | "
            + " / ".join(f"{100 * p[f]['hit_rate']:.0f}%" for f in FORMATS)
            + " | "
            + " / ".join(f"{p[f]['late_ttft_p50']:.2f}" for f in FORMATS)
            + " | "
            + " / ".join(f"{p[f]['output_throughput']:,.0f}" for f in FORMATS)
            + f" | {a['late_ttft_p50'] / b['late_ttft_p50']:.2f}x / "
            f"{b['output_throughput'] / a['output_throughput']:.2f}x |"
        )
    lines += [
        "",
        "How slow may the fp4 decode kernel be? fp4 at a lower fraction of the bandwidth against fp8 at "
        f"{KERNEL_EFFICIENCY['fp8']:.0%} (the fp4 kernel's speed on a GPU is not measured yet).",
        "",
        "| KV budget (GiB) | fp4 kernel efficiency | fp4 vs fp8: TTFT | fp4 vs fp8: throughput |",
        "|---|---|---|---|",
    ]
    for s in result["fp4_kernel_sensitivity"]:
        lines.append(
            f"| {s['kv_gib']:g} | {s['fp4_efficiency']:.0%} | {s['ttft_ratio']:.2f}x | {s['throughput_ratio']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def projection_plot(result: dict, path: str) -> None:
    """projection.png: projected late-round P50 TTFT (log) and output throughput against the KV budget."""
    points = result["points"]
    xs = [p["kv_gib"] for p in points]
    color = plotting.colors(FORMATS)
    title = f"{result['command']} (a projection on a cost model, not a measurement)"
    with plotting.figure(path, size=(11, 4.3), ncols=2, legend_size=8, title=title) as (ax1, ax2):
        for name in FORMATS:
            ax1.plot(xs, [p[name]["late_ttft_p50"] for p in points], "o-", color=color[name], label=name)
            ax2.plot(xs, [p[name]["output_throughput"] for p in points], "o-", color=color[name], label=name)
        ax1.set_yscale("log")
        ax1.set_ylabel("late-round P50 time to first token (s)")
        ax2.set_ylabel("output tokens / s")
        for ax in (ax1, ax2):
            ax.set_xlabel("KV budget (GiB)")
        ax1.set_title("Projected TTFT, published workload, spec model on one H200", fontsize=9)
        ax2.set_title("Projected output throughput", fontsize=9)


def late_ttft_p50(result: dict, rounds: int) -> float:
    """Median time to first token over the second half of the rounds."""
    return float(np.median([x["ttft"] for x in result["records"] if x["round"] >= max(1, rounds // 2)]))


def sweep(model, memories_kib: list[int], workload, study: harness.Study, **overrides) -> None:
    """sweep.md/json/png in `study.out`: fp8 against fp4 at each KV memory; the command they state has `overrides`
    (by dest: the flags that do not apply set back to their defaults)."""
    points = []
    for kib in memories_kib:
        point: dict[str, Any] = {"memory_kib": kib}
        for name in ("fp8", "fp4"):
            print(f"serving with {name} KV ({kib} KiB)", flush=True)
            r = serve(model, name, kib * 1024, workload)
            point[name] = {
                "late_ttft_p50": late_ttft_p50(r, workload.rounds),
                "hit_rate": r["hit_rate"],
                "output_throughput": r["output_throughput"],
                "preemptions": r["preemptions"],
                "pool_tokens": r["pool_tokens"],
            }
        points.append(point)
    result = {"workload": vars(workload), "points": points}
    study.write("sweep", result, sweep_markdown, {"sweep.png": sweep_plot}, **overrides)


def sweep_markdown(result: dict) -> str:
    """sweep.md: one row per KV memory."""
    lines = [
        "# fp4 against fp8 KV across KV memories",
        "",
        f"`{result['command']}`: the workload of table.md at each KV memory.",
        "",
        "| KV memory (KiB) | pool tokens fp8 / fp4 | hit rate fp8 / fp4 | late-round P50 TTFT fp8 / fp4 (s) | "
        "TTFT ratio | output tok/s fp8 / fp4 | throughput ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        a, b = p["fp8"], p["fp4"]
        lines.append(
            f"| {p['memory_kib']:,} | {a['pool_tokens']:,} / {b['pool_tokens']:,} | "
            f"{100 * a['hit_rate']:.0f}% / {100 * b['hit_rate']:.0f}% | {a['late_ttft_p50']:.2f} / "
            f"{b['late_ttft_p50']:.2f} | {a['late_ttft_p50'] / b['late_ttft_p50']:.2f}x | "
            f"{a['output_throughput']:.1f} / {b['output_throughput']:.1f} | "
            f"{b['output_throughput'] / a['output_throughput']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def sweep_plot(result: dict, path: str) -> None:
    """sweep.png: fp4's advantage over fp8 (TTFT and throughput ratios, log) against the KV memory, beside the
    paper's 3.47x and 1.63x."""
    points = result["points"]
    xs = [p["memory_kib"] / 1024 for p in points]
    with plotting.figure(path, size=(6.4, 4.3), title=result["command"]) as ax:
        ax.plot(
            xs,
            [p["fp8"]["late_ttft_p50"] / p["fp4"]["late_ttft_p50"] for p in points],
            "o-",
            label="late-round P50 TTFT, fp8 / fp4",
        )
        ax.plot(
            xs,
            [p["fp4"]["output_throughput"] / p["fp8"]["output_throughput"] for p in points],
            "s-",
            label="output throughput, fp4 / fp8",
        )
        ax.axhline(3.47, color="C0", ls=":", lw=1, label="paper: TTFT 3.47x")
        ax.axhline(1.63, color="C1", ls=":", lw=1, label="paper: throughput 1.63x")
        ax.axhline(1.0, color="k", lw=0.5)
        ax.set_xlabel("KV memory (MiB)")
        ax.set_ylabel("fp4 advantage")
        ax.set_yscale("log")
        ax.set_title("fp4 against fp8 KV across memory pressure", fontsize=9)


def markdown(summary: dict) -> str:
    """table.md: one row per format, then fp4 against fp8."""
    res, w = summary["formats"], summary["workload"]
    late = max(1, w["rounds"] // 2)  # "late rounds": the second half
    lines = [
        "# Multi-round agent serving under KV-cache pressure",
        "",
        f"`{summary['command']}`. KV memory {summary['memory_bytes'] // 1024} KiB for every "
        f"format; {w['conversations']} conversations, {w['concurrency']} concurrent, {w['rounds']} rounds, "
        f"{w['system_prefix']} shared + {w['conversation_prefix']} own prefix tokens, {w['new_input'][0]}-"
        f"{w['new_input'][1]} new input and {w['output_tokens']} output tokens per round. Quickstart model, "
        "engine steps of up to 256 tokens, XLA attention. Hit rate = prompt tokens found in the prefix "
        "cache at admission; a preempted request counts again when it is re-admitted (finding its own blocks "
        "if they survived), as vLLM counts its queries. The ratios depend on the memory chosen: here fp4 "
        "holds the whole working set and fp8 does not.",
        "",
        "| KV format | pool tokens | P50 TTFT per round (s) | P90 TTFT per round (s) | hit rate per round | "
        "late-round P50 TTFT (s) | output tok/s | preemptions |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res.items():
        rounds = r["rounds"]
        late_p50 = late_ttft_p50(r, w["rounds"])
        r["late_ttft_p50"] = late_p50
        lines.append(
            f"| {name} | {r['pool_tokens']:,} | "
            + " / ".join(f"{x['ttft_p50']:.2f}" for x in rounds)
            + " | "
            + " / ".join(f"{x['ttft_p90']:.2f}" for x in rounds)
            + " | "
            + " / ".join(f"{100 * x['hit_rate']:.0f}%" for x in rounds)
            + f" | {late_p50:.2f} | {r['output_throughput']:.1f} | {r['preemptions']} |"
        )
    if "fp4" in res and "fp8" in res:
        ttft = res["fp8"]["late_ttft_p50"] / res["fp4"]["late_ttft_p50"]
        thr = res["fp4"]["output_throughput"] / res["fp8"]["output_throughput"]
        lines += [
            "",
            f"fp4 against fp8: late-round (rounds >= {late}) P50 TTFT **{ttft:.2f}x lower**, output "
            f"throughput **{thr:.2f}x** (the paper: 3.47x and 1.63x; goal here: TTFT >= 2x lower and "
            f"throughput higher: {'met' if ttft >= 2 and thr > 1 else 'missed'}).",
        ]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: str) -> None:
    """ttft.png: P50 and P90 time to first token per round, and the KV hit rate per round, per format."""
    color = plotting.colors(FORMATS)
    with plotting.figure(
        path, size=(11, 4.6), ncols=2, title=summary["command"], legend_below=True, legend_columns=6
    ) as (ax1, ax2):
        for name, r in summary["formats"].items():
            rounds = [x["round"] + 1 for x in r["rounds"]]
            ax1.plot(rounds, [x["ttft_p50"] for x in r["rounds"]], "o-", color=color[name], label=f"{name} P50")
            ax1.plot(
                rounds,
                [x["ttft_p90"] for x in r["rounds"]],
                "x--",
                color=color[name],
                alpha=0.5,
                label=f"{name} P90",
            )
            ax2.plot(rounds, [100 * x["hit_rate"] for x in r["rounds"]], "o-", color=color[name])  # colour: format
        ax1.set_xticks(rounds)
        ax2.set_xticks(rounds)
        ax1.set_xlabel("round")
        ax1.set_ylabel("time to first token (s)")
        ax1.set_title(f"TTFT per round at {summary['memory_bytes'] // 1024} KiB of KV", fontsize=9)
        ax2.set_xlabel("round")
        ax2.set_ylabel("prompt tokens found in the prefix cache (%)")
        ax2.set_title("KV hit rate per round", fontsize=9)


if __name__ == "__main__":
    command.run(main)
