"""Ours against transformers + torch on the identical model, each side at its best: the same random checkpoint,
tokens and optimizer; every process setting of each side side by side in one run; the train step's phases, and
greedy generation.

    python -m experiments.bench.peer --torch-python /path/to/env/bin/python [--parts train,generate]
        [--models qwen3,qwen3_moe] [--sizes quickstart,8x] [--variants ...] [--rounds 2] [--repeats 5]
        [--threads 2] [--jemalloc PATH] [--tcmalloc PATH] [--out runs/bench]

Per model (`qwen3`: the quickstart's dense SwiGLU model with q/k RMSNorm; `qwen3_moe`: its MoE as Qwen3-MoE writes
it, 8 experts, softmax top-2 with normalised gates) and size (`quickstart`: d_model 128, 4 layers, 2 query heads
sharing 1 KV head of dim 64, vocab 264; `8x`: about 8x the parameters, d_model 256, 8 layers, 4 / 2 heads), a
random model is built here, exported as a Hugging Face checkpoint (`experiments.hf.export`) and loaded by
transformers (`experiments/bench/peer_torch.py`, float32, run by `--torch-python`, an environment with torch and
transformers: this repository's own has neither). torch runs with `--threads` intra-op threads (XLA:CPU uses every
core).

`--variants`: the process settings compared, each `side[+option...]`, comma-separated:
  ours[+glibc | +jemalloc | +tcmalloc]   (`experiments/bench/peer_ours.py`) bare: the library's host-memory
                                          settings (`core.host_memory`, what every command of this project applies);
                                          +glibc: glibc's defaults (LOWBIT_HOST_MALLOC=system); +jemalloc /
                                          +tcmalloc: glibc's defaults with that allocator preloaded (LD_PRELOAD)
  torch[+eager][+jemalloc | +tcmalloc][+compile][+fused]
                                          bare: transformers' default attention (sdpa) on glibc's allocator; +eager:
                                          eager attention; +jemalloc / +tcmalloc: that allocator preloaded, as
                                          PyTorch's CPU performance guide recommends; +compile: the loss under
                                          torch.compile; +fused: AdamW(fused=True)
The allocators are the files `--jemalloc` / `--tcmalloc` name (default: found with `ldconfig -p`, e.g. Debian's
libjemalloc2 and libtcmalloc-minimal4; a variant whose allocator is not found is refused before anything runs);
each process reports the allocator mapped into it, and one that is not the variant's stops the run.

`train`: every variant computes the next-token cross-entropy of the same batch of 8 x 256 random byte tokens in its
own process, in `--rounds` rounds (each round runs every variant once, the order rotated round by round); each
process times (median of `--repeats` calls after 2 warm-up calls):
  forward           the loss, no gradients
  forward_backward  the loss and its gradients
  step              forward_backward and an AdamW update (torch.optim.AdamW; ours: optax.adamw), nothing else
  step_with_extras  ours only: the training loop's step (gradient clipping, the schedule, the weight-decay mask and
                    the loop's metrics)
A variant's time is the median over rounds of its processes' medians. The best of each side is its variant with
the lowest step time; the row's ratio is our best over torch's best, beside our library settings over torch's best.
The first forward's loss of every process is reported: they must agree (the same model).

`generate` (the quickstart size): greedy continuation of random 32-token prompts by exactly 256 tokens (no end
token, every id allowed), batch 1 and 16; tokens per second = batch x 256 / the median seconds of `--repeats`
calls after one warm-up (which compiles ours; our two are timed in interleaved rounds). Ours, in this process
(the library's settings): `core.generate.generate` (one program: prefill and a scan of decode steps, bf16
`DenseKVCache`) and the serving engine (`kvcache.serving.Engine`, bf16 paged pool, the requests submitted at once,
`Engine.run`); theirs: `model.generate` (its float32 cache) under every torch variant without +compile or +fused
(those change training only), the best of them compared. How many leading tokens of each row equal the best torch
variant's is reported (bf16 keys and values against float32 ones may flip a near tie).

The load average is read after every process. Writes peer.json and peer.md into `--out` (`--out results/bench`
for the table docs/performance.md quotes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

from core.model import count_params
from experiments import command, harness
from experiments.bench.peer_ours import MODELS, PHASES, SIZES, batch_for, config_for

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TORCH_SCRIPT = os.path.join(HERE, "peer_torch.py")
ALLOCATORS = {
    "jemalloc": ("libjemalloc.so.2", "libjemalloc.so"),
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
}
OPTIONS = {"ours": ("glibc", "jemalloc", "tcmalloc"), "torch": ("eager", "jemalloc", "tcmalloc", "compile", "fused")}
DEFAULT_VARIANTS = (
    "ours,ours+glibc,ours+jemalloc,ours+tcmalloc,torch+eager,torch,torch+jemalloc,torch+tcmalloc,"
    "torch+jemalloc+compile+fused,torch+tcmalloc+compile+fused"
)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One process setting of one side (see the module docstring's `--variants`)."""

    name: str
    side: str
    options: frozenset[str]

    def __str__(self) -> str:  # as the table's command line writes it
        return self.name

    @property
    def allocator(self) -> str:
        return next((a for a in ALLOCATORS if a in self.options), "glibc")

    @property
    def trains_only(self) -> bool:
        return bool(self.options & {"compile", "fused"})

    def label(self) -> str:
        """How the tables name it, e.g. "torch sdpa + tcmalloc + compile + fused AdamW"."""
        if self.side == "ours":
            settings = {"glibc": "glibc defaults", "jemalloc": "jemalloc", "tcmalloc": "tcmalloc"}
            return "ours, " + settings.get(self.allocator if self.options else "", "library settings")
        words = ["torch", "eager" if "eager" in self.options else "sdpa"]
        words += [a for a in ALLOCATORS if a in self.options]
        words += ["compile"] * ("compile" in self.options) + ["fused AdamW"] * ("fused" in self.options)
        return " + ".join(words).replace("torch + ", "torch ", 1)


def variant(text: str) -> Variant:
    """`side[+option...]` as a Variant; argparse.ArgumentTypeError naming the word and what is allowed."""
    side, *options = text.strip().split("+")
    if side not in OPTIONS:
        raise argparse.ArgumentTypeError(f"{text!r}: the side {side!r}; allowed: {list(OPTIONS)}")
    for o in options:
        if o not in OPTIONS[side]:
            raise argparse.ArgumentTypeError(f"{text!r}: the option {o!r}; allowed for {side}: {list(OPTIONS[side])}")
    if len(set(options)) != len(options) or sum(o in options for o in (*ALLOCATORS, "glibc")) > 1:
        raise argparse.ArgumentTypeError(f"{text!r}: an option repeated, or more than one allocator")
    return Variant(text.strip(), side, frozenset(options))


def variants(text: str) -> list[Variant]:
    """A comma-separated list of distinct variants, at least one per side."""
    parsed = [variant(t) for t in text.split(",") if t.strip()]
    if len({v.options for v in parsed if v.side == "ours"}) + len(
        {v.options for v in parsed if v.side == "torch"}
    ) != len(parsed):
        raise argparse.ArgumentTypeError(f"{text!r}: a variant named twice")
    if {v.side for v in parsed} != set(OPTIONS):
        raise argparse.ArgumentTypeError(f"{text!r}: at least one variant of each side, {list(OPTIONS)}")
    return parsed


def find_library(names: tuple[str, ...]) -> str | None:
    """The path `ldconfig -p` gives for the first of `names` it knows, else None."""
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return None
    for name in names:
        for line in listing.splitlines():
            if line.strip().startswith(name + " ") and "=>" in line:
                return line.split("=>")[-1].strip()
    return None


def run_variant(v: Variant, work: dict[str, Any], libraries: dict[str, str]) -> dict:
    """One process of `v` timing the train step (`work`: model, size, checkpoint, tokens, torch_python, threads,
    repeats) or generation (`work["generate"]`: new tokens): its JSON. RuntimeError with its stderr if it fails,
    or if the allocator mapped into it is not the variant's."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if v.side == "ours":
        cmd = [sys.executable, "-m", "experiments.bench.peer_ours", "--model", work["model"], "--size", work["size"]]
        cmd += ["--tokens", work["tokens"], "--repeats", str(work["repeats"])]
        if v.options:
            env["LOWBIT_HOST_MALLOC"] = "system"
    else:
        cmd = [work["torch_python"], TORCH_SCRIPT, "--checkpoint", work["checkpoint"], "--tokens", work["tokens"]]
        cmd += ["--threads", str(work["threads"]), "--repeats", str(work["repeats"])]
        cmd += ["--attention", "eager" if "eager" in v.options else "sdpa"]
        cmd += ["--compile"] * ("compile" in v.options) + ["--fused"] * ("fused" in v.options)
        cmd += ["--warmup", "1", "--generate", str(work["generate"])] if work.get("generate") else ["--warmup", "2"]
    if v.allocator != "glibc":
        env["LD_PRELOAD"] = libraries[v.allocator]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{v.name}: {' '.join(cmd)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["allocator"] != v.allocator:
        raise RuntimeError(f"{v.name}: the process ran on {result['allocator']}, not {v.allocator} (LD_PRELOAD)")
    result["load"] = os.getloadavg()[0]
    return result


def exported(config, tokens: np.ndarray, tmp: str) -> tuple[str, str, str, Any]:
    """(checkpoint dir, tokens .npy, architecture, the model): the config's model (seed 0) as a Hugging Face
    checkpoint and `tokens` saved in `tmp`."""
    from flax import nnx

    from experiments.hf import export

    graphdef, state, _ = harness.one_device_state(config)
    model = nnx.merge(graphdef, state.params, state.rest)
    checkpoint, tokens_path = os.path.join(tmp, "checkpoint"), os.path.join(tmp, "tokens.npy")
    export.save(config, model, checkpoint)
    np.save(tokens_path, tokens)
    with open(os.path.join(checkpoint, "config.json")) as f:
        return checkpoint, tokens_path, json.load(f)["architectures"][0], model


def best(seconds: dict[str, float], chosen: list[Variant], side: str) -> str:
    """The name of `side`'s variant with the lowest time in `seconds`."""
    return min((v.name for v in chosen if v.side == side), key=lambda name: seconds[name])


def bench(model: str, size: str, chosen: list[Variant], work: dict[str, Any], libraries: dict[str, str]) -> dict:
    """One (model, size) training row: every variant in `work["rounds"]` rounds, the order rotated each round."""
    config = config_for(model, size)
    tokens = batch_for(config)
    runs: dict[str, list[dict]] = {v.name: [] for v in chosen}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint, tokens_path, architecture, built = exported(config, tokens, tmp)
        work = {**work, "model": model, "size": size, "checkpoint": checkpoint, "tokens": tokens_path}
        for r in range(work["rounds"]):
            for v in chosen[r % len(chosen) :] + chosen[: r % len(chosen)]:
                print(f"{model} {size}, round {r + 1}: {v.label()} ...", flush=True)
                runs[v.name].append(run_variant(v, work, libraries))
    phases = (*PHASES, "step_with_extras")
    seconds = {
        name: {p: float(np.median([x["seconds"][p] for x in xs])) for p in phases if p in xs[0]["seconds"]}
        for name, xs in runs.items()
    }
    step = {name: s["step"] for name, s in seconds.items()}
    top = {side: best(step, chosen, side) for side in OPTIONS}
    row = {
        "model": model,
        "size": size,
        "architecture": architecture,
        "params": count_params(built),
        "batch": int(tokens.shape[0]),
        "seq_len": int(tokens.shape[1] - 1),
        "variants": {
            v.name: {
                "label": v.label(),
                "seconds": seconds[v.name],
                "step_per_round": [x["seconds"]["step"] for x in runs[v.name]],
                "loss": runs[v.name][0]["loss"],
                "load": [x["load"] for x in runs[v.name]],
            }
            for v in chosen
        },
        "best": top,
        "ratio_best": step[top["ours"]] / step[top["torch"]],
        "torch_versions": next(x[0]["versions"] for n, x in runs.items() if "versions" in x[0]),
        "threads": work["threads"],
    }
    if "ours" in step:
        row["ratio_library"] = step["ours"] / step[top["torch"]]
    print(
        f"{model} {size}: best ours {top['ours']} {1e3 * step[top['ours']]:.0f} ms, best torch {top['torch']} "
        f"{1e3 * step[top['torch']]:.0f} ms: {row['ratio_best']:.2f}x",
        flush=True,
    )
    return row


def our_generation(config, model, prompts: np.ndarray, new_tokens: int, repeats: int) -> dict:
    """{"generate" | "engine": {"seconds": median, "ids": [B, new_tokens]}} for greedy continuation of `prompts`:
    `experiments.bench.engine_step`'s calls, the engine at its default decode steps per call."""
    from experiments.bench import engine_step
    from kvcache.serving import EngineConfig

    batch, prompt_len = prompts.shape
    engine = engine_step.make_engine(model, config, batch, prompt_len, new_tokens, EngineConfig.decode_steps)
    calls = {
        "generate": engine_step.generate_call(model, prompts, new_tokens),
        "engine": engine_step.serve_call(engine, prompts, new_tokens),
    }
    print(f"ours, batch {batch}: the first calls (generate compiles) ...", flush=True)
    ids = {name: call().tolist() for name, call in calls.items()}
    seconds = harness.interleaved_medians(calls, repeats=repeats, warmup=0)
    return {name: {"seconds": seconds[name], "ids": ids[name]} for name in calls}


def bench_generation(model: str, chosen: list[Variant], work: dict[str, Any], libraries: dict[str, str]) -> list[dict]:
    """Rows of greedy generation at batch 1 and 16 (the quickstart size): ours (generate, engine) and every torch
    variant that is not for training only."""
    config = config_for(model, "quickstart")
    new_tokens, theirs_chosen = work["generate"], [v for v in chosen if v.side == "torch" and not v.trains_only]
    rows = []
    for batch in (1, 16):
        prompts = np.random.default_rng(batch).integers(0, 256, (batch, 32)).astype(np.int32)
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint, prompts_path, architecture, built = exported(config, prompts, tmp)
            mine = our_generation(config, built, prompts, new_tokens, work["repeats"])
            theirs = {}
            for v in theirs_chosen:
                print(f"{model}: transformers generate, batch {batch}, {v.label()} ...", flush=True)
                theirs[v.name] = run_variant(v, {**work, "checkpoint": checkpoint, "tokens": prompts_path}, libraries)
        top = min(theirs, key=lambda name: theirs[name]["seconds"])
        reference = np.asarray(theirs[top]["ids"])
        row: dict[str, Any] = {"model": model, "architecture": architecture, "batch": batch, "new_tokens": new_tokens}
        row["tokens_per_second"] = {name: batch * new_tokens / r["seconds"] for name, r in {**theirs, **mine}.items()}
        row["labels"] = {v.name: v.label() for v in theirs_chosen}
        row["best_torch"] = top
        row["equal_leading_tokens"] = {}
        for name, result in mine.items():
            ids = np.asarray(result["ids"])
            leading = [int(np.argmin(np.append(a == b, False))) for a, b in zip(ids, reference, strict=True)]
            row["equal_leading_tokens"][name] = float(np.mean(leading))
        row.update(load={name: r["load"] for name, r in theirs.items()}, torch_versions=theirs[top]["versions"])
        rate = row["tokens_per_second"]
        print(
            f"{model} batch {batch}: tokens/s generate {rate['generate']:.0f}, engine {rate['engine']:.0f}, "
            f"transformers ({row['labels'][top]}) {rate[top]:.0f}",
            flush=True,
        )
        rows.append(row)
    return rows


def markdown(result: dict) -> str:
    """peer.md: per model and size, every variant's ms ordered by step time, then the best of each side; then
    generation."""
    lines = ["# Ours against transformers + torch on the identical model, each side at its best", ""]
    rows, gen = result.get("rows", []), result.get("generation", [])
    versions = (rows or gen)[0]["torch_versions"]
    libraries = ", ".join(f"{name}: `{path}`" for name, path in result["libraries"].items()) or "none preloaded"
    lines += [
        f"`{result['command']}`: float32 weights; torch {versions['torch']} with {result['threads']} intra-op "
        f"threads, transformers {versions['transformers']}; allocators {libraries}.",
        "",
    ]
    if rows:
        lines += [
            f"Train step: batch {rows[0]['batch']} x {rows[0]['seq_len']} tokens, AdamW, every variant in its own "
            f"process; rounds: {result['rounds']} (order rotated); a variant's ms is the median over rounds of its "
            f"processes' medians of {result['repeats']} calls. Best of each side against the best of the other:",
            "",
            "| model | params | best ours | step ms | best torch | step ms | **best ours / best torch** | ours "
            "(library settings) / best torch | torch sdpa (default) ms | torch eager ms |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            v, b = r["variants"], r["best"]
            ms = {name: f"{1e3 * x['seconds']['step']:.0f}" for name, x in v.items()}
            lines.append(
                f"| {r['architecture']} ({r['size']}) | {r['params']:,} | {v[b['ours']]['label']} | {ms[b['ours']]} | "
                f"{v[b['torch']]['label']} | {ms[b['torch']]} | **{r['ratio_best']:.2f}x** | "
                f"{r.get('ratio_library', float('nan')):.2f}x | {ms.get('torch', '-')} | {ms.get('torch+eager', '-')} |"
            )
        lines += ["", "Every variant, by step time (ms; step per round; load average after each process):", ""]
        for r in rows:
            losses = [x["loss"] for x in r["variants"].values()]
            lines += [
                f"{r['architecture']} ({r['size']}), first forward's loss {min(losses):.5f} - {max(losses):.5f}:",
                "",
                "| variant | step ms | per round | forward ms | forward + backward ms | step with the loop's "
                "extras | load |",
                "|---|---|---|---|---|---|---|",
            ]
            for x in sorted(r["variants"].values(), key=lambda x: x["seconds"]["step"]):
                s = x["seconds"]
                extras = f"{1e3 * s['step_with_extras']:.0f}" if "step_with_extras" in s else "-"
                per_round = " / ".join(f"{1e3 * t:.0f}" for t in x["step_per_round"])
                lines.append(
                    f"| {x['label']} | {1e3 * s['step']:.0f} | {per_round} | {1e3 * s['forward']:.0f} | "
                    f"{1e3 * s['forward_backward']:.0f} | {extras} | {' / '.join(f'{t:.1f}' for t in x['load'])} |"
                )
            lines.append("")
    if gen:
        lines += [
            f"Greedy generation: 32-token prompts, {gen[0]['new_tokens']} new tokens, tokens per second (medians of "
            f"{result['repeats']} calls after a warm-up); ours with bf16 keys and values and the library's settings, "
            "transformers with its float32 cache under each torch variant (the best named). Equal leading tokens: the "
            "mean over rows of how many first tokens equal the best torch variant's.",
            "",
            "| model | batch | core.generate tok/s | engine tok/s | best transformers generate tok/s | generate / "
            "transformers | engine / transformers | engine / generate | equal leading tokens (generate, engine) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in gen:
            rate, eq, top = r["tokens_per_second"], r["equal_leading_tokens"], r["best_torch"]
            lines.append(
                f"| {r['architecture']} | {r['batch']} | {rate['generate']:,.0f} | {rate['engine']:,.0f} | "
                f"{rate[top]:,.0f} ({r['labels'][top]}) | **{rate['generate'] / rate[top]:.2f}x** | "
                f"{rate['engine'] / rate[top]:.2f}x | {rate['engine'] / rate['generate']:.2f}x | {eq['generate']:.0f}, "
                f"{eq['engine']:.0f} of {r['new_tokens']} |"
            )
    return "\n".join(lines) + "\n"


PARTS = ("train", "generate")


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    study = harness.Study(__doc__, module="experiments.bench.peer", topic="bench", repeats=5)
    parser = study.parser
    parser.add_argument(
        "--torch-python",
        required=True,
        help="the python of an environment with torch and transformers (runs experiments/bench/peer_torch.py)",
    )
    harness.add_parts(parser, PARTS)
    parser.add_argument(
        "--models",
        type=harness.names(MODELS),
        default=",".join(MODELS),
        help=f"a comma-separated subset of {list(MODELS)}",
    )
    parser.add_argument(
        "--sizes", type=harness.names(SIZES), default=",".join(SIZES), help=f"a comma-separated subset of {list(SIZES)}"
    )
    parser.add_argument(
        "--variants", type=variants, default=DEFAULT_VARIANTS, help="the process settings compared (see above)"
    )
    parser.add_argument("--rounds", type=harness.integer(1), default=2, help="rounds of every training variant, >= 1")
    parser.add_argument("--threads", type=harness.integer(1), default=2, help="torch intra-op threads, >= 1")
    for name in ALLOCATORS:
        parser.add_argument(f"--{name}", default="", help=f"the {name} library (default: found by ldconfig -p)")
    args = study.parse(argv)
    if not os.access(args.torch_python, os.X_OK):
        parser.error(f"--torch-python = {args.torch_python!r}: not an executable file")
    libraries = {}
    for name in sorted({v.allocator for v in args.variants} - {"glibc"}):
        path = getattr(args, name) or find_library(ALLOCATORS[name])
        if not path or not os.path.isfile(path):
            parser.error(f"--{name} = {path or ''!r}: not a file, and a variant preloads {name}; allowed: its path")
        libraries[name] = os.path.realpath(path)
    work = {"torch_python": args.torch_python, "threads": args.threads, "repeats": args.repeats, "rounds": args.rounds}
    result: dict[str, Any] = {"repeats": args.repeats, "rounds": args.rounds, "threads": args.threads}
    result.update(libraries=libraries, python=sys.version.split()[0])
    train = [(m, s) for s in args.sizes for m in args.models] if "train" in args.parts else []
    generate = list(args.models) if "generate" in args.parts else []
    n, i = len(train) + len(generate), 0
    if train:
        result["rows"] = []
        for m, s in train:
            i += 1
            study.progress(i, n, f"{m} {s}: train step, {len(args.variants)} variants x {args.rounds} rounds")
            result["rows"].append(bench(m, s, args.variants, work, libraries))
    if generate:
        result["generation"] = []
        for m in generate:
            i += 1
            study.progress(i, n, f"{m}: greedy generation, ours and transformers + torch")
            result["generation"] += bench_generation(m, args.variants, {**work, "generate": 256}, libraries)
    study.write("peer", result, markdown, torch_python="ENV/bin/python")


if __name__ == "__main__":
    command.run(main)
