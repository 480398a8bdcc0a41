"""Where the serving engine's decode time goes, beside core.generate: tokens per second of the same greedy
generation, and the engine's step cut into its parts, one device call per token against several.

    python -m experiments.bench.engine_step [--models qwen3,qwen3_moe] [--batches 1,16] [--decode-steps 1,8]
        [--repeats 5] [--profile TOP] [--out runs/bench]

The workload is `experiments.bench.peer`'s generation: the quickstart-size random model (`experiments.bench.
peer_ours`: `qwen3` dense, `qwen3_moe` its MoE), random 32-token prompts continued greedily by exactly 256 tokens (no
end token, every id allowed). Per model and batch, timed in interleaved rounds (median of `--repeats` after a
warm-up): `core.generate.generate` (one program: prefill and a scan of decode steps, bf16 `DenseKVCache`) and the
serving engine (`kvcache.serving.Engine`, bf16 paged pool sized for the workload, prefill in steps of 128 tokens,
the requests submitted at once, `Engine.run`) at each `--decode-steps` K (`EngineConfig.decode_steps`). Every
engine's tokens are compared with core.generate's.

Then each engine runs once more with its step's parts timed (wall clock around each call, summed over the run, per
generated token): the device calls (`programs.forward` and `programs.decode_steps`: on the CPU a call returns when
its result is ready, the library's host-memory settings applied), building the batch (`Engine._arrays`,
`Engine._sampling_rows`), the scheduler (`schedule`, `reserve`, `update_from_output`), and the rest of the run
(recording log-probabilities, reading the results back, the loop). With `--profile TOP`, each engine serves once
more under XLA's trace (`jax.profiler`) and the TOP operations XLA:CPU ran longest are listed, in microseconds per
generated token (names as in the compiled HLO; loops and the executor's own spans are left out, the operations
inside loops counted). Writes engine_step.json and engine_step.md.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from experiments import command, harness
from experiments.bench.peer_ours import MODELS, config_for

PARTS = {
    "device calls": ("programs", ("forward", "decode_steps")),
    "building the batch": ("engine", ("_arrays", "_sampling_rows")),
    "scheduler": ("scheduler", ("schedule", "reserve", "update_from_output")),
}


def make_engine(model, config, batch: int, prompt_len: int, new_tokens: int, decode_steps: int):
    """A warmed-up engine sized for the workload (bf16 pool of its sequences' tokens, `batch` sequences, prefill in
    steps of 128 tokens) at `decode_steps` (`EngineConfig.decode_steps`); what `experiments.bench.peer` serves with."""
    from kvcache import capacity, formats
    from kvcache.serving import Engine, EngineConfig

    fmt, cfg = formats.get("bf16"), config.model
    shape = capacity.ModelShape(cfg.num_layers, cfg.num_kv_heads, cfg.d_model // cfg.num_heads)
    blocks = batch * -(-(prompt_len + new_tokens) // 16) + 1
    engine = Engine(
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
            decode_steps=decode_steps,
        ),
    )
    engine.warmup()
    return engine


def generate_call(model, prompts: np.ndarray, new_tokens: int) -> Callable[[], np.ndarray]:
    """A call of `core.generate.generate` continuing `prompts` [B, P] greedily by exactly `new_tokens` (no end
    token, every id allowed): the ids [B, new_tokens]."""
    import jax

    from core import generate as generate_lib

    rows = [np.asarray(p) for p in prompts]
    return lambda: np.asarray(
        generate_lib.generate(
            model, rows, max_new_tokens=new_tokens, key=jax.random.key(0), eos_id=None, never=(), num_ids=None
        )
    )


def serve_call(engine, prompts: np.ndarray, new_tokens: int) -> Callable[[], np.ndarray]:
    """A call serving `prompts` [B, P] with `engine`, submitted at once, each `new_tokens` tokens ignoring EOS
    (`Engine.run`): the ids [B, new_tokens]."""

    def serve():
        requests = [engine.submit(p.tolist(), new_tokens, ignore_eos=True) for p in prompts]
        engine.run()
        return np.asarray([r.output for r in requests])

    return serve


@contextlib.contextmanager
def timed_parts(engine) -> Iterator[dict[str, float]]:
    """Seconds spent in each of PARTS' calls while the block runs (the engine's module names and its own and its
    scheduler's methods wrapped with a timer, restored after)."""
    from kvcache.serving import engine as engine_module

    spent = dict.fromkeys(PARTS, 0.0)
    owners = {"programs": engine_module, "engine": engine, "scheduler": engine.scheduler}
    saved: list[tuple[Any, str, Any, bool]] = []

    def wrap(part: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - start

        return call

    for part, (owner, names) in PARTS.items():
        target = owners[owner]
        for name in names:
            saved.append((target, name, getattr(target, name), name in vars(target)))
            setattr(target, name, wrap(part, getattr(target, name)))
    try:
        yield spent
    finally:
        for target, name, value, own in saved:
            if own:
                setattr(target, name, value)
            else:
                delattr(target, name)


_WRAPPERS = re.compile(r"^(ThunkExecutor.*|(while|conditional|call)(\.\d+)?)$")


def profile_ops(call: Callable[[], Any], tokens: int, top: int) -> list[tuple[str, float]]:
    """The `top` operations XLA:CPU spent longest in during `call()` (XLA's trace through `jax.profiler`), as (HLO
    name, microseconds per generated token of `tokens`), after their sum ("(all operations)"): events of the
    runtime's threads, without loops and the executor's own spans (the operations inside a loop are counted)."""
    import jax

    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        try:
            call()
        finally:
            jax.profiler.stop_trace()
        (path,) = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    spent: collections.Counter[str] = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if line.name == "python":
                continue
            for event in line.events:
                if not _WRAPPERS.match(event.name):
                    spent[event.name] += event.duration_ns
    total = ("(all operations)", sum(spent.values()) / 1e3 / tokens)
    return [total] + [(name, ns / 1e3 / tokens) for name, ns in spent.most_common(top)]


def bench(
    model_name: str, batch: int, decode_steps: list[int], repeats: int, new_tokens: int = 256, profile: int = 0
) -> dict:
    """One (model, batch) row: tokens per second of core.generate and of each engine, tokens equal, and each
    engine's parts in ms per generated token."""
    from flax import nnx

    config = config_for(model_name, "quickstart")
    graphdef, state, _ = harness.one_device_state(config)
    model = nnx.merge(graphdef, state.params, state.rest)
    prompts = np.random.default_rng(batch).integers(0, 256, (batch, 32)).astype(np.int32)
    engines = {k: make_engine(model, config, batch, prompts.shape[1], new_tokens, k) for k in decode_steps}
    calls: dict[str, Callable[[], np.ndarray]] = {"generate": generate_call(model, prompts, new_tokens)}
    for k, e in engines.items():
        calls[f"engine, K = {k}"] = serve_call(e, prompts, new_tokens)
    reference = np.asarray(calls["generate"]())
    equal = {name: bool(np.array_equal(call(), reference)) for name, call in calls.items() if name != "generate"}
    seconds = harness.interleaved_medians(calls, repeats=repeats, warmup=0)
    tokens = batch * new_tokens
    parts: dict[str, dict[str, float]] = {}
    for k, engine in engines.items():
        with timed_parts(engine) as spent:
            start = time.perf_counter()
            serve_call(engine, prompts, new_tokens)()
            total = time.perf_counter() - start
        per_token = {part: 1e3 * s / tokens for part, s in spent.items()}
        per_token["rest"] = 1e3 * total / tokens - sum(per_token.values())
        parts[f"engine, K = {k}"] = per_token
    ops = {
        f"engine, K = {k}": profile_ops(serve_call(engine, prompts, new_tokens), tokens, profile)
        for k, engine in engines.items()
        if profile
    }
    row: dict[str, Any] = {
        "model": model_name,
        "batch": batch,
        "new_tokens": new_tokens,
        "seconds": seconds,
        "equal": equal,
        "ops": ops,
    }
    row.update(tokens_per_second={n: tokens / s for n, s in seconds.items()}, ms_per_token=parts)
    rate = row["tokens_per_second"]
    print(f"{model_name} batch {batch}: " + ", ".join(f"{n} {r:,.0f} tok/s" for n, r in rate.items()), flush=True)
    return row


def markdown(result: dict) -> str:
    """engine_step.md: tokens per second and the engine against core.generate; then the parts per token."""
    lines = ["# The serving engine's decode step beside core.generate", "", f"`{result['command']}`.", ""]
    lines += [
        "Greedy generation, 32-token prompts, 256 new tokens, bf16 keys and values; tokens per second (medians of "
        f"{result['repeats']} interleaved calls); K: decode steps per device call. Tokens equal: every token of every "
        "row equals core.generate's.",
        "",
        "| model | batch | core.generate tok/s | engine | engine tok/s | engine / core.generate | tokens equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        rate = r["tokens_per_second"]
        for name in (n for n in rate if n != "generate"):
            lines.append(
                f"| {r['model']} | {r['batch']} | {rate['generate']:,.0f} | {name} | {rate[name]:,.0f} | "
                f"**{rate[name] / rate['generate']:.2f}x** | {'yes' if r['equal'][name] else 'no'} |"
            )
    parts = [*PARTS, "rest"]
    lines += [
        "",
        "The engine's run cut into its parts, ms per generated token (one run each, timers around the calls):",
        "",
        "| model | batch | engine | " + " | ".join(parts) + " | total |",
        "|---|---|---|" + "---|" * (len(parts) + 1),
    ]
    for r in result["rows"]:
        for name, per in r["ms_per_token"].items():
            cells = " | ".join(f"{per[p]:.3f}" for p in parts)
            lines.append(f"| {r['model']} | {r['batch']} | {name} | {cells} | {sum(per.values()):.3f} |")
    if any(r["ops"] for r in result["rows"]):
        lines += [
            "",
            "The operations XLA:CPU ran longest (XLA's trace of one more run each; us per generated token):",
            "",
            "| model | batch | engine | operation | us per token |",
            "|---|---|---|---|---|",
        ]
        for r in result["rows"]:
            for name, ops in r["ops"].items():
                lines += [f"| {r['model']} | {r['batch']} | {name} | `{op}` | {us:.1f} |" for op, us in ops]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    study = harness.Study(__doc__, module="experiments.bench.engine_step", topic="bench", repeats=5)
    parser = study.parser
    parser.add_argument(
        "--models",
        type=harness.names(MODELS),
        default=",".join(MODELS),
        help=f"a comma-separated subset of {list(MODELS)}",
    )
    parser.add_argument(
        "--batches", type=harness.integers(1, distinct=True), default="1,16", help="batch sizes, each >= 1"
    )
    parser.add_argument(
        "--decode-steps",
        type=harness.integers(1, distinct=True),
        default="1,8",
        help="the engines' decode steps per device call (EngineConfig.decode_steps), each >= 1",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="TOP",
        help="list the TOP operations of each engine's run under XLA's trace (0: no trace)",
    )
    args = study.parse(argv)
    if args.profile < 0:
        parser.error(f"--profile = {args.profile}; allowed: an integer >= 0")
    rows: list[dict] = []
    n = len(args.models) * len(args.batches)
    for m in args.models:
        for b in args.batches:
            study.progress(len(rows) + 1, n, f"{m}, batch {b}: core.generate and the engines")
            rows.append(bench(m, b, args.decode_steps, args.repeats, profile=args.profile))
    study.write("engine_step", {"repeats": args.repeats, "profile": args.profile, "rows": rows}, markdown)


if __name__ == "__main__":
    command.run(main)
