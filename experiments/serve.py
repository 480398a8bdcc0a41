"""Serve prompts from a trained run's checkpoint through the engine, streaming the text as it is generated.

    python -m experiments.serve --workdir runs/quickstart-1dev --prompt "def " [--prompt "import "]
        [--max-new-tokens 200] [--kv-format fp4] [--scale-rule mse] [--kv-memory-mib 64] [--temperature 0.7]
        [--site 0]

A federated run keeps one model per site (its own experts): `--site` picks it (default 0). Every
prompt is one request of a continuous-batching engine (kvcache.engine) over a paged KV pool of `--kv-memory-mib` in
the chosen format; the first prompt's text streams to the terminal, the others are printed when done, followed
by each request's time to first token and time per output token.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True, help="a finished run's directory (config.json, checkpoints/)")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--kv-format", default="fp4", choices=("bf16", "fp8", "fp4"))
    parser.add_argument("--scale-rule", default="mse", choices=("mse", "mx"), help="fp4 scale rule")
    parser.add_argument("--kv-memory-mib", type=float, default=64.0, help="KV pool size in MiB")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--site", type=int, default=0, help="a federated run's site whose model serves")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens = {args.max_new_tokens} must be >= 1")
    if args.kv_memory_mib <= 0:
        parser.error(f"--kv-memory-mib = {args.kv_memory_mib} must be > 0")
    if args.temperature < 0:
        parser.error(f"--temperature = {args.temperature} must be >= 0")

    from core.data import ByteTokenizer
    from experiments import load
    from kvcache import formats
    from kvcache.engine import Engine, EngineConfig

    try:
        _, model = load.trained_model(args.workdir, site=args.site)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fmt = formats.get("fp4", scale_rule=args.scale_rule) if args.kv_format == "fp4" else formats.get(args.kv_format)
    tok = ByteTokenizer()
    prompts = [tok.encode(p).tolist() for p in args.prompt]
    longest = max(map(len, prompts)) + args.max_new_tokens
    config = EngineConfig(
        memory_bytes=int(args.kv_memory_mib * 2**20),
        max_model_len=max(512, -(-longest // 256) * 256),
        temperature=args.temperature,
        seed=args.seed,
    )
    engine = Engine(model, fmt, config)
    try:
        requests = [engine.submit(p, args.max_new_tokens) for p in prompts]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{fmt.label} KV pool: {engine.capacity_tokens:,} tokens in {args.kv_memory_mib:g} MiB", file=sys.stderr)
    shown = 0
    sys.stdout.write(args.prompt[0])
    while engine.has_work:
        engine.step()
        new = requests[0].output[shown:]
        sys.stdout.write(tok.decode(new))
        sys.stdout.flush()
        shown += len(new)
    print()
    for text, request in zip(args.prompt[1:], requests[1:]):
        print(f"--- request {request.id}:\n{text}{tok.decode(request.output)}")
    for request in requests:
        print(
            f"request {request.id}: {len(request.output)} tokens, time to first token {request.ttft * 1e3:.0f} ms, "
            f"{request.tpot * 1e3:.1f} ms per output token",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
