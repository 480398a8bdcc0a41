"""Ours against transformers + torch on the identical model: the same random checkpoint, tokens and optimizer, side by
side in one run; the train step's phases, and greedy generation.

    python -m experiments.bench.peer --torch-python /path/to/env/bin/python [--parts train,generate]
        [--models qwen3,qwen3_moe] [--sizes quickstart,8x] [--repeats 5] [--threads 2] [--out runs/bench]

Per model (`qwen3`: the quickstart's dense SwiGLU model with q/k RMSNorm; `qwen3_moe`: its MoE as Qwen3-MoE writes
it, 8 experts, softmax top-2 with normalised gates) and size (`quickstart`: d_model 128, 4 layers, 2 query heads
sharing 1 KV head of dim 64, vocab 264; `8x`: about 8x the parameters, d_model 256, 8 layers, 4 / 2 heads), a
random model is built here, exported as a Hugging Face checkpoint (`experiments.hf.export`) and loaded by
transformers (`experiments/bench/peer_torch.py`, float32, eager attention, run by `--torch-python`, an environment
with torch and transformers: this repository's own has neither). torch runs with `--threads` intra-op threads
(XLA:CPU uses every core). The load average is read at each phase: a benchmark on a shared machine says how busy it
was.

`train`: both sides compute the next-token cross-entropy of the same batch of 8 x 256 random byte tokens; timed
(median of `--repeats` after 2 warm-up calls):
  forward           the loss, no gradients (ours: one jitted program)
  forward_backward  the loss and its gradients
  step              forward_backward and an AdamW update (torch.optim.AdamW; ours: optax.adamw), nothing else
  step_with_extras  ours only: the training loop's step (core.train.make_train_step with the config's optimizer:
                    gradient clipping, the warm-up + cosine schedule, weight-decay mask, and its metrics: the MoE's
                    auxiliary losses and routing statistics, the gradient norm)
Our side is timed before and after torch's, the same programs (the median of both passes). The first forward's
loss of both sides is reported: they must agree (the same model).

`generate` (the quickstart size): greedy continuation of random 32-token prompts by exactly 256 tokens (no end
token, every id allowed), batch 1 and 16; tokens per second = batch x 256 / the median seconds of `--repeats`
calls after one warm-up (which compiles ours; our two are timed in interleaved rounds). Ours:
`core.generate.generate` (one program: prefill and a scan of decode steps, bf16 `DenseKVCache`) and the serving
engine (`kvcache.serving.Engine`, bf16 paged pool, the requests submitted at once, `Engine.run`); theirs:
`model.generate` (its float32 cache). How many leading tokens of each row equal transformers' is reported (bf16
keys and values against float32 ones may flip a near tie).

Writes peer.json and peer.md into `--out` (`--out results/bench` for the table docs/performance.md quotes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

from core.model import count_params
from experiments import command, harness

MODELS = {
    "qwen3": {"moe": {"every": 0}, "model": {"qk_norm": True}},
    "qwen3_moe": {
        "moe": {"router": "softmax", "normalize_gates": True, "expert_mlp": "swiglu"},
        "model": {"qk_norm": True},
    },
}
SIZES = {
    "quickstart": {},
    "8x": {
        "model": {"d_model": 256, "num_layers": 8, "num_heads": 4, "num_kv_heads": 2, "d_ff": 768},
        "moe": {"expert_size": 256},
    },
}
PHASES = ("forward", "forward_backward", "step")
TORCH_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_torch.py")


def config_for(model: str, size: str):
    """The quickstart config with the model's and size's overrides, on one device."""
    from experiments.configs import quickstart

    c = quickstart.get_config()
    for overrides in (MODELS[model], SIZES[size]):
        for section, values in overrides.items():
            c[section].update(values)
    c.mesh.update(site=1, data=1)
    return c


def ours(config, tokens: np.ndarray) -> tuple[dict[str, Callable[[], object]], float, Any]:
    """({phase: a call running it} for our four phases, the first forward's loss, the model to export). The step
    calls carry their state from call to call."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from core import train as train_lib

    graphdef, state, optimizer = harness.one_device_state(config)
    model = nnx.merge(graphdef, state.params, state.rest)
    batch = jnp.asarray(tokens)

    def loss(params, batch):
        logits, _, _ = nnx.merge(graphdef, params, state.rest)(batch[:, :-1])
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]))

    adamw = optax.adamw(1e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    forward = jax.jit(loss)
    forward_backward = jax.jit(jax.value_and_grad(loss))

    @jax.jit
    def bare_step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = adamw.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    full_step = train_lib.make_train_step(graphdef, optimizer)
    first_loss = float(forward(state.params, batch))
    carried = {"bare": (state.params, adamw.init(state.params)), "full": jax.tree.map(jnp.copy, state)}

    def run_bare():
        params, opt_state, value = bare_step(*carried["bare"], batch)
        carried["bare"] = (params, opt_state)
        return value

    def run_full():  # the state is donated: thread it through
        carried["full"], metrics = full_step(carried["full"], batch)
        return metrics

    calls = {
        "forward": lambda: forward(state.params, batch),
        "forward_backward": lambda: forward_backward(state.params, batch),
        "step": run_bare,
        "step_with_extras": run_full,
    }
    return calls, first_loss, model


def torch_side(python: str, checkpoint: str, tokens_path: str, threads: int, repeats: int, *extra: str) -> dict:
    """peer_torch.py's JSON for the checkpoint (`extra`: more of its flags); raises RuntimeError with its stderr if it
    fails."""
    cmd = [python, TORCH_SCRIPT, "--checkpoint", checkpoint, "--tokens", tokens_path]
    cmd += ["--threads", str(threads), "--repeats", str(repeats), *extra]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def exported(config, model, tokens: np.ndarray, tmp: str) -> tuple[str, str, str]:
    """(checkpoint dir, tokens .npy, architecture): `model` as a Hugging Face checkpoint and `tokens` saved in
    `tmp`."""
    from experiments.hf import export

    checkpoint, tokens_path = os.path.join(tmp, "checkpoint"), os.path.join(tmp, "tokens.npy")
    export.save(config, model, checkpoint)
    np.save(tokens_path, tokens)
    with open(os.path.join(checkpoint, "config.json")) as f:
        return checkpoint, tokens_path, json.load(f)["architectures"][0]


def bench(model: str, size: str, python: str, threads: int, repeats: int) -> dict:
    """One (model, size) training row: ours before, torch, ours after, with the load average at each phase."""
    config = config_for(model, size)
    tokens = np.random.default_rng(0).integers(0, 256, (config.data.batch_size, config.data.seq_len + 1))
    tokens = tokens.astype(np.int32)
    loads = {"before": os.getloadavg()[0]}
    calls, our_loss, built = ours(config, tokens)
    first = harness.interleaved_medians(calls, repeats=repeats, warmup=2, what="our four phases")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint, tokens_path, architecture = exported(config, built, tokens, tmp)
        loads["ours, first pass"] = os.getloadavg()[0]
        print(f"{model} {size}: transformers + torch ({architecture}) ...", flush=True)
        theirs = torch_side(python, checkpoint, tokens_path, threads, repeats, "--warmup", "2")
    loads["torch"] = os.getloadavg()[0]
    second = harness.interleaved_medians(calls, repeats=repeats, warmup=1)
    loads["ours, second pass"] = os.getloadavg()[0]
    our_seconds = {k: float(np.median([first[k], second[k]])) for k in first}
    row = {
        "model": model,
        "size": size,
        "architecture": architecture,
        "params": count_params(built),
        "batch": int(tokens.shape[0]),
        "seq_len": int(tokens.shape[1] - 1),
        "ours_seconds": our_seconds,
        "ours_passes": {"first": first, "second": second},
        "torch_seconds": theirs["seconds"],
        "torch_calls": theirs["calls"],
        "ours_loss": our_loss,
        "torch_loss": theirs["loss"],
        "ratio": {p: our_seconds[p] / theirs["seconds"][p] for p in PHASES},
        "load_average": loads,
        "torch_versions": theirs["versions"],
        "torch_threads": theirs["threads"],
    }
    print(
        f"{model} {size}: step ours {1e3 * our_seconds['step']:.0f} ms ({1e3 * our_seconds['step_with_extras']:.0f} "
        f"with the loop's extras), torch {1e3 * theirs['seconds']['step']:.0f} ms: {row['ratio']['step']:.2f}x; "
        f"losses {our_loss:.5f} / {theirs['loss']:.5f}",
        flush=True,
    )
    return row


def our_generation(config, model, prompts: np.ndarray, new_tokens: int, repeats: int) -> dict:
    """{"generate" | "engine": {"seconds": median, "ids": [B, new_tokens]}} for greedy continuation of `prompts`."""
    import jax

    from core import generate as generate_lib
    from kvcache import capacity, formats
    from kvcache.serving import Engine, EngineConfig

    batch, prompt_len = prompts.shape
    rows = [np.asarray(p) for p in prompts]
    cfg = config.model

    def generate():
        return generate_lib.generate(
            model, rows, max_new_tokens=new_tokens, key=jax.random.key(0), eos_id=None, never=(), num_ids=None
        )

    fmt = formats.get("bf16")
    shape = capacity.ModelShape(cfg.num_layers, cfg.num_kv_heads, cfg.d_model // cfg.num_heads)
    blocks = batch * -(-(prompt_len + new_tokens) // 16) + 1
    engine = Engine(  # sized for the workload: its sequences, their tokens, prefill in steps of 128 tokens
        model,
        fmt,
        EngineConfig(
            memory_bytes=blocks * capacity.block_bytes(shape, fmt, block_size=16),
            max_num_seqs=batch,
            max_num_batched_tokens=128,
            max_model_len=max(256, prompt_len + new_tokens),
            eos_id=None,
            never=(),
            num_ids=None,
        ),
    )
    engine.warmup()

    def serve():
        requests = [engine.submit(p.tolist(), new_tokens, ignore_eos=True) for p in prompts]
        engine.run()
        return np.asarray([r.output for r in requests])

    calls = {"generate": generate, "engine": serve}
    print(f"ours, batch {batch}: the first calls (generate compiles) ...", flush=True)
    ids = {name: np.asarray(call()).tolist() for name, call in calls.items()}
    seconds = harness.interleaved_medians(calls, repeats=repeats, warmup=0)
    return {name: {"seconds": seconds[name], "ids": ids[name]} for name in calls}


def bench_generation(model: str, python: str, threads: int, repeats: int, new_tokens: int = 256) -> list[dict]:
    """Rows of greedy generation at batch 1 and 16 (the quickstart size): ours (generate, engine) and torch's."""
    from flax import nnx

    config = config_for(model, "quickstart")
    graphdef, state, _ = harness.one_device_state(config)
    built = nnx.merge(graphdef, state.params, state.rest)
    rows = []
    for batch in (1, 16):
        prompts = np.random.default_rng(batch).integers(0, 256, (batch, 32)).astype(np.int32)
        loads = {"before": os.getloadavg()[0]}
        mine = our_generation(config, built, prompts, new_tokens, repeats)
        loads["ours"] = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint, prompts_path, architecture = exported(config, built, prompts, tmp)
            print(f"{model}: transformers generate, batch {batch} ...", flush=True)
            extra = ("--warmup", "1", "--generate", str(new_tokens))
            theirs = torch_side(python, checkpoint, prompts_path, threads, repeats, *extra)
        loads["torch"] = os.getloadavg()[0]
        reference = np.asarray(theirs["ids"])
        row: dict[str, Any] = {"model": model, "architecture": architecture, "batch": batch, "new_tokens": new_tokens}
        row["tokens_per_second"] = {"torch": batch * new_tokens / theirs["seconds"]}
        row["equal_leading_tokens"] = {}
        for name, result in mine.items():
            row["tokens_per_second"][name] = batch * new_tokens / result["seconds"]
            ids = np.asarray(result["ids"])
            leading = [int(np.argmin(np.append(a == b, False))) for a, b in zip(ids, reference, strict=True)]
            row["equal_leading_tokens"][name] = float(np.mean(leading))
        row.update(seconds={"torch": theirs["seconds"], **{n: r["seconds"] for n, r in mine.items()}}, load=loads)
        row.update(torch_versions=theirs["versions"], torch_threads=theirs["threads"])
        rate = row["tokens_per_second"]
        print(
            f"{model} batch {batch}: tokens/s generate {rate['generate']:.0f}, engine {rate['engine']:.0f}, "
            f"transformers {rate['torch']:.0f}",
            flush=True,
        )
        rows.append(row)
    return rows


def markdown(result: dict) -> str:
    """peer.md: per model and size, ms per phase on both sides and our time over theirs; then generation."""
    lines = ["# Ours against transformers + torch on the identical model", ""]
    rows, gen = result.get("rows", []), result.get("generation", [])
    any_row = (rows or gen)[0]
    lines += [
        f"`{result['command']}`: float32 weights; torch {any_row['torch_versions']['torch']} with "
        f"{any_row['torch_threads']} threads, transformers {any_row['torch_versions']['transformers']} (eager "
        "attention).",
        "",
    ]
    if rows:
        lines += [
            f"Train step: batch {rows[0]['batch']} x {rows[0]['seq_len']} tokens, AdamW. Medians of "
            f"{result['repeats']} calls; ours timed before and after torch's, the median of both passes. Load average "
            "(1 min) per row: before / after our first pass / after torch / after our second pass.",
            "",
            "| model | params | forward ms (ours / torch) | forward + backward ms | step ms | ours / torch (step) | "
            "our step with the loop's extras | loss (ours / torch) | load |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            o, t = r["ours_seconds"], r["torch_seconds"]
            cells = [f"{1e3 * o[p]:.0f} / {1e3 * t[p]:.0f}" for p in PHASES]
            load = " / ".join(f"{v:.1f}" for v in r["load_average"].values())
            lines.append(
                f"| {r['architecture']} ({r['size']}) | {r['params']:,} | " + " | ".join(cells) + f" | "
                f"**{r['ratio']['step']:.2f}x** | {1e3 * o['step_with_extras']:.0f} ms | {r['ours_loss']:.5f} / "
                f"{r['torch_loss']:.5f} | {load} |"
            )
        lines.append("")
    if gen:
        lines += [
            f"Greedy generation: 32-token prompts, {gen[0]['new_tokens']} new tokens, tokens per second (medians of "
            f"{result['repeats']} calls after a warm-up); ours with bf16 keys and values, transformers with its "
            "float32 cache. Equal leading tokens: the mean over rows of how many first tokens equal transformers'. "
            "Load average: before / after ours / after torch.",
            "",
            "| model | batch | core.generate tok/s | engine tok/s | transformers generate tok/s | generate / "
            "transformers | equal leading tokens (generate, engine) | load |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in gen:
            rate, eq = r["tokens_per_second"], r["equal_leading_tokens"]
            load = " / ".join(f"{v:.1f}" for v in r["load"].values())
            lines.append(
                f"| {r['architecture']} | {r['batch']} | {rate['generate']:,.0f} | {rate['engine']:,.0f} | "
                f"{rate['torch']:,.0f} | **{rate['generate'] / rate['torch']:.2f}x** | {eq['generate']:.0f}, "
                f"{eq['engine']:.0f} of {r['new_tokens']} | {load} |"
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
    parser.add_argument("--threads", type=harness.integer(1), default=2, help="torch intra-op threads, >= 1")
    args = study.parse(argv)
    if not os.access(args.torch_python, os.X_OK):
        parser.error(f"--torch-python = {args.torch_python!r}: not an executable file")
    result: dict[str, Any] = {"repeats": args.repeats, "python": sys.version.split()[0]}
    train = [(m, s) for s in args.sizes for m in args.models] if "train" in args.parts else []
    generate = list(args.models) if "generate" in args.parts else []
    n, i = len(train) + len(generate), 0
    if train:
        result["rows"] = []
        for m, s in train:
            i += 1
            study.progress(i, n, f"{m} {s}: train step, ours and transformers + torch")
            result["rows"].append(bench(m, s, args.torch_python, args.threads, args.repeats))
    if generate:
        result["generation"] = []
        for m in generate:
            i += 1
            study.progress(i, n, f"{m}: greedy generation, ours and transformers + torch")
            result["generation"] += bench_generation(m, args.torch_python, args.threads, args.repeats)
    study.write("peer", result, markdown, torch_python="ENV/bin/python")


if __name__ == "__main__":
    command.run(main)
