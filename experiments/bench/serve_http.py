"""The OpenAI-compatible server under the multi-round agent workload: bf16 / fp8 / fp4 KV at the same KV memory
through HTTP with N concurrent clients, and the HTTP layer's cost against the in-process engine.

    python -m experiments.bench.serve_http [--out runs/bench] [--clients 32] [--kv-memory-mib 6]
        [--formats bf16,fp8,fp4] [--model-out runs/kvcache]

The model is the trained quickstart model of `experiments.reproduce.kvcache` (reused from `<--model-out>/runs/model`,
trained there if absent), the one results/serving measured. The workload is
`kvcache.serving.workload.AgentWorkload` with one conversation per client, all at once: a 64-token shared and a
256-token own prefix, 3 rounds of 32-64 new input and 16 output tokens (greedy, `ignore_eos`), each round sent when
the last one's answer has arrived.

For each format, side by side in one run:
  * in-process: `kvcache.serving.Engine` serves it through `kvcache.serving.workload.run` (no HTTP, no client);
  * HTTP: `python -m experiments.serve --http` serves it in its own process (model loaded from the workdir, every
    batch shape compiled before it listens), and N `openai.AsyncOpenAI` clients in this process drive it, streaming
    (time to first token = from sending the request to the first chunk carrying a token, measured by the client).
Both engines have the same limits: N sequences and 256 tokens per step, the same KV memory. Reported: P50 / P90 time
to first token (all rounds, and the later rounds, which the prefix cache serves), output tokens per second, the
prefix-cache hit rate, and the HTTP layer's cost = 1 - HTTP throughput / in-process throughput (goal: <= 10% at 32
clients). Client and server share this machine's cores: the cost includes the client's work.
-> serve_http.json, serve_http.md, serve_http.png in --out.
"""

from __future__ import annotations

import asyncio
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import numpy as np

from core.model import Transformer
from core.tokenizer import Tokenizer
from experiments import command, harness, plotting
from experiments import engine as engine_lib
from experiments.reproduce import kvcache as kv_repro
from kvcache import formats
from kvcache.serving import Engine, EngineConfig
from kvcache.serving import workload as workload_lib

FORMATS = formats.NAMES
STEP_TOKENS = 256
GOAL = 0.10  # the HTTP layer may cost at most this fraction of the in-process throughput at 32 clients


def workload_for(clients: int) -> workload_lib.AgentWorkload:
    """The benchmark's workload for `clients` clients (module docstring): one conversation each, all at once."""
    return workload_lib.AgentWorkload(
        conversations=clients,
        concurrency=clients,
        rounds=3,
        system_prefix=64,
        conversation_prefix=256,
        new_input=(32, 64),
        output_tokens=16,
    )


def max_model_len(workload: workload_lib.AgentWorkload) -> int:
    """The longest request both engines take: the workload's longest, rounded up to whole steps, plus two steps."""
    return -(-workload.max_tokens // STEP_TOKENS) * STEP_TOKENS + 2 * STEP_TOKENS


def in_process(
    model: Transformer, tok: Tokenizer, name: str, memory_bytes: int, workload: workload_lib.AgentWorkload
) -> dict:
    """The workload on an in-process engine (kvcache.serving.workload.run) in KV format `name`, with the limits and the
    tokenizer's ids the server gets."""
    engine = Engine(
        model,
        formats.get(name),
        EngineConfig.for_tokenizer(
            tok,
            memory_bytes=memory_bytes,
            max_num_seqs=workload.concurrency,
            max_num_batched_tokens=STEP_TOKENS,
            max_model_len=max_model_len(workload),
        ),
    )
    harness.compiling(f"the engine's step programs ({name} KV, in-process)")
    engine.warmup()
    result = workload_lib.run(engine, workload)
    return {**summarize(result["records"], result["seconds"]), "steps": engine.stats["steps"]}


def engine_counters(url: str) -> dict[str, float]:
    """The server's engine steps and seconds spent in them, from its /metrics."""
    text = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
    found = dict(re.findall(r"^lowbit_(engine_steps_total|engine_step_seconds_total)\{[^}]*\} (\S+)$", text, re.M))
    return {"steps": float(found["engine_steps_total"]), "step_seconds": float(found["engine_step_seconds_total"])}


def start_server(workdir: str, name: str, mib: float, workload) -> tuple[subprocess.Popen, str]:
    """`python -m experiments.serve --http` on a free loopback port; (process, base URL) once it listens."""
    flags = {
        "--workdir": workdir,
        "--port": "0",
        "--kv-format": name,
        "--kv-memory-mib": repr(mib),
        "--max-num-seqs": str(workload.concurrency),
        "--max-num-batched-tokens": str(STEP_TOKENS),
        "--max-model-len": str(max_model_len(workload)),
        "--max-waiting": str(4 * workload.concurrency),
    }
    command = [sys.executable, "-m", "experiments.serve", "--http", *(w for kv in flags.items() for w in kv)]
    harness.compiling(f"the server's step programs ({name} KV, its own process)")
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    assert server.stderr is not None
    lines = []
    with selectors.DefaultSelector() as selector:
        selector.register(server.stderr, selectors.EVENT_READ)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if not selector.select(timeout=1.0):
                continue
            line = server.stderr.readline()
            if not line:
                break
            lines.append(line)
            if found := re.search(r"serving `([^`]*)` on (http://\S+/v1)", line):
                # keep reading its stderr (to ours), so that a full pipe can never block it
                threading.Thread(target=shutil.copyfileobj, args=(server.stderr, sys.stderr), daemon=True).start()
                return server, found.group(2)
    server.kill()
    raise RuntimeError(f"the server did not start:\n{''.join(lines)}")


def stop_server(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGINT)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()


async def drive(url: str, workload, progress=None) -> tuple[list[dict], float]:
    """The workload through HTTP: `concurrency` clients, each serving conversations round after round (streamed
    completions of token-id prompts); (per-request records, wall seconds)."""
    import openai  # the [test] extra's client: only this benchmark needs it

    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    pending = workload_lib.conversations(workload)[::-1]
    records: list[dict] = []
    total = workload.conversations * workload.rounds

    async def one_client():
        while pending:
            conv = pending.pop()
            for r in range(workload.rounds):
                prompt = conv.history + conv.inputs[r]
                sent = time.perf_counter()
                first: float | None = None
                ids: list[int] = []
                cached = 0
                stream = await client.completions.create(
                    model=model,
                    prompt=prompt,
                    max_tokens=workload.output_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True, "return_token_ids": True},
                )
                async for chunk in stream:
                    if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
                        cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
                    for choice in chunk.choices:
                        new = (choice.model_extra or {}).get("token_ids") or []
                        if new and first is None:
                            first = time.perf_counter()
                        ids += new
                done = time.perf_counter()
                assert first is not None and len(ids) == workload.output_tokens, (len(ids), conv.id, r)
                records.append(
                    {
                        "conversation": conv.id,
                        "round": r,
                        "prompt_tokens": len(prompt),
                        "cached_tokens": cached,
                        "ttft": first - sent,
                        "tpot": (done - first) / max(1, len(ids) - 1),
                        "output_tokens": len(ids),
                    }
                )
                conv.history = prompt + ids
                if progress is not None:
                    progress(len(records), total)

    started = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(workload.concurrency)))
    seconds = time.perf_counter() - started
    await client.close()
    return records, seconds


def summarize(records: list[dict], seconds: float) -> dict[str, Any]:
    """P50 / P90 time to first token (all rounds; rounds >= 1, which find their history cached), output tokens
    per second, hit rate (cached / prompt tokens)."""
    ttft = np.array([x["ttft"] for x in records])
    late = np.array([x["ttft"] for x in records if x["round"] >= 1])
    out_tokens = sum(x["output_tokens"] for x in records)
    return {
        "requests": len(records),
        "seconds": seconds,
        "output_tokens": out_tokens,
        "output_throughput": out_tokens / seconds,
        "ttft_p50": float(np.percentile(ttft, 50)),
        "ttft_p90": float(np.percentile(ttft, 90)),
        "late_ttft_p50": float(np.percentile(late, 50)) if len(late) else float("nan"),
        "hit_rate": sum(x["cached_tokens"] for x in records) / sum(x["prompt_tokens"] for x in records),
    }


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    study = harness.Study(__doc__ or "", module="experiments.bench.serve_http", topic="bench")
    parser = study.parser
    parser.add_argument("--clients", type=harness.integer(1), default=32, help="concurrent clients (conversations)")
    parser.add_argument(
        "--kv-memory-mib",
        type=harness.number(0.0, low_open=True),
        default=6.0,
        help="KV memory of every format, in MiB (6 MiB holds 6,144 bf16, ~11,500 fp8 and ~23,000 fp4 tokens of the "
        "model; 32 clients' histories grow to ~16,000)",
    )
    parser.add_argument(
        "--formats",
        type=harness.names(FORMATS),
        default=",".join(FORMATS),
        help=f"KV formats: a comma-separated subset of {list(FORMATS)}",
    )
    parser.add_argument(
        "--model-out",
        default="runs/kvcache",
        help="the --out of experiments.reproduce.kvcache: its runs/model holds the trained model (trained there if "
        "absent; the committed tables used results/kvcache)",
    )
    args = study.parse(argv)
    _, model = kv_repro.trained_model(args.model_out)
    workdir = os.path.join(args.model_out, "runs", "model")
    _, tok = engine_lib.load_run(workdir)
    workload = workload_for(args.clients)
    memory = int(args.kv_memory_mib * 2**20)
    results: dict[str, Any] = {}
    n = 2 * len(args.formats)
    for i, name in enumerate(args.formats):
        study.progress(2 * i + 1, n, f"{name}: in-process engine, {args.clients} conversations")
        local = in_process(model, tok, name, memory, workload)
        study.progress(2 * i + 2, n, f"{name}: HTTP server, {args.clients} clients")
        server, url = start_server(workdir, name, args.kv_memory_mib, workload)
        try:

            def progress(done, total, name=name):
                if done % args.clients == 0 or done == total:
                    print(f"  {name} over HTTP: {done}/{total} requests", flush=True)

            records, seconds = asyncio.run(drive(url, workload, progress))
            counters = engine_counters(url)
        finally:
            stop_server(server)
        http = summarize(records, seconds)
        http["steps"], http["busy"] = int(counters["steps"]), counters["step_seconds"] / seconds
        http["cost"] = 1 - http["output_throughput"] / local["output_throughput"]
        results[name] = {"in_process": local, "http": http}
        print(
            f"  {name}: {http['output_throughput']:.1f} tok/s over HTTP vs {local['output_throughput']:.1f} "
            f"in-process (cost {100 * http['cost']:.1f}%), P50 TTFT {1e3 * http['ttft_p50']:.0f} ms",
            flush=True,
        )
    summary = {
        "clients": args.clients,
        "kv_memory_mib": args.kv_memory_mib,
        "workload": dict(vars(workload).items()),
        "goal_cost": GOAL,
        "formats": results,
    }
    study.write("serve_http", summary, markdown, {"serve_http.png": plot})


def markdown(s: dict) -> str:
    """serve_http.md: per format, the in-process and the HTTP row, and the HTTP cost against its goal."""
    w = s["workload"]
    lines = [
        f"# The OpenAI-compatible server: {s['clients']} clients, the agent workload, {s['kv_memory_mib']:g} MiB of KV",
        "",
        f"`{s['command']}`",
        "",
        f"{w['conversations']} conversations ({w['concurrency']} at once), {w['rounds']} rounds, "
        f"{w['system_prefix']} + {w['conversation_prefix']} prefix tokens, {w['new_input'][0]}-{w['new_input'][1]} "
        f"new input and {w['output_tokens']} output tokens per round.",
        "",
        "| KV | path | P50 TTFT (ms) | P90 TTFT (ms) | later rounds P50 TTFT (ms) | output tok/s | KV hit rate | "
        "engine steps | engine busy | HTTP cost |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in s["formats"].items():
        for path, label in (("in_process", "in-process"), ("http", "HTTP")):
            x = r[path]
            cost = f"{100 * x['cost']:.1f}%" if "cost" in x else ""
            busy = f"{100 * x['busy']:.0f}%" if "busy" in x else ""
            lines.append(
                f"| {name} | {label} | {1e3 * x['ttft_p50']:.0f} | {1e3 * x['ttft_p90']:.0f} | "
                f"{1e3 * x['late_ttft_p50']:.0f} | {x['output_throughput']:.1f} | {100 * x['hit_rate']:.0f}% | "
                f"{x['steps']} | {busy} | {cost} |"
            )
    costs = {name: r["http"]["cost"] for name, r in s["formats"].items()}
    worst = max(costs, key=lambda k: costs[k])
    verdict = (
        "met" if costs[worst] <= s["goal_cost"] else f"missed by {100 * (costs[worst] - s['goal_cost']):.1f} points"
    )
    lines += [
        "",
        "Engine busy: the server's seconds in engine steps / the workload's wall seconds (the rest it waited for "
        "requests). "
        f"HTTP cost = 1 - HTTP output throughput / in-process output throughput (the client runs on the same cores). "
        f"Goal: at most {100 * s['goal_cost']:.0f}% at 32 clients; the largest here, {100 * costs[worst]:.1f}% "
        f"({worst}), {verdict}.",
    ]
    if "fp8" in s["formats"] and "fp4" in s["formats"]:
        a, b = s["formats"]["fp8"]["http"], s["formats"]["fp4"]["http"]
        lines.append(
            f"Through HTTP, fp4 against fp8: later-round P50 TTFT {a['late_ttft_p50'] / b['late_ttft_p50']:.2f}x "
            f"lower, output throughput {b['output_throughput'] / a['output_throughput']:.2f}x."
        )
    return "\n".join(lines) + "\n"


def plot(s: dict, path: str) -> None:
    """Two panels: output throughput in-process and over HTTP per format; P50 / P90 time to first token over HTTP."""
    names = list(s["formats"])
    x = np.arange(len(names))
    title = f"{s['clients']} clients, {s['kv_memory_mib']:g} MiB of KV per format: {s['command']}"
    with plotting.figure(path, size=(10, 4.2), ncols=2, grid_axis="y", legend_size=8, title=title) as (left, right):
        for i, (key, label) in enumerate((("in_process", "in-process engine"), ("http", "HTTP server"))):
            left.bar(
                x + (i - 0.5) * 0.38, [s["formats"][n][key]["output_throughput"] for n in names], 0.38, label=label
            )
        left.set_ylabel("output tokens / s")
        left.set_title("Output throughput", fontsize=9)
        stats = (("ttft_p50", "P50"), ("ttft_p90", "P90"), ("late_ttft_p50", "later rounds P50"))
        for i, (key, label) in enumerate(stats):
            right.bar(x + (i - 1) * 0.27, [1e3 * s["formats"][n]["http"][key] for n in names], 0.27, label=label)
        right.set_yscale("log")
        right.set_ylabel("time to first token over HTTP (ms, log scale)")
        right.set_title("Time to first token (client-measured)", fontsize=9)
        for ax in (left, right):
            ax.set_xticks(x, names)
            ax.set_xlabel("KV format")


if __name__ == "__main__":
    command.run(main)
