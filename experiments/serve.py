"""Serve prompts from a trained run's checkpoint through the engine, streaming the text as it is generated.

    python -m experiments.serve --workdir runs/quickstart-1dev --prompt "def " [--prompt "import "]
        [--max-new-tokens 200] [--kv-format fp4] [--scale-rule mse] [--kv-memory-mib 64] [--temperature 0.7]
        [--seed 0] [--site 0]

A federated run keeps one model per site (its own experts): `--site` picks it (default 0). Every
prompt is one request of a continuous-batching engine (kvcache.engine) over a paged KV pool of `--kv-memory-mib` in
the chosen format; the first prompt's text streams to the terminal, the others are printed when done, followed
by each request's time to first token and time per output token.

Prompts are encoded, and the output decoded, by the run's tokenizer (its `data.tokenizer`: bytes, or a
Hugging Face tokenizer.json, core.tokenizer); a request ends at that tokenizer's EOS. A prompt is served as the bytes
given on the command line (an argument that is not valid UTF-8 reaches Python as surrogate escapes, which are turned
back into its bytes; the byte tokenizer takes them as they are, a BPE tokenizer reads invalid bytes as U+FFFD); text
is shown as UTF-8, invalid bytes as U+FFFD, and a character whose bytes arrive over several engine steps (or
tokens) is shown once it is complete (core.tokenizer.StreamDecoder).

Exit status: 0 served; 2 a bad flag (before anything is loaded), a run that cannot be served with these flags or
a workdir that is not a finished run; 1 a damaged checkpoint (core.checkpoint.CheckpointError).
"""

from __future__ import annotations

import argparse
import sys

from experiments.bench import common

MAX_KV_MEMORY_MIB = 2.0**40  # 1 EiB: larger pools cannot be allocated anywhere (and overflow XLA's shape sizes)


def build_parser() -> argparse.ArgumentParser:
    """serve's command line; every flag's value is checked as it is parsed (nothing is loaded)."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.serve",
        description=(__doc__ or "").split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    # required flags: default=SUPPRESS keeps "(default: None)" out of the help
    parser.add_argument(
        "--workdir",
        required=True,
        default=argparse.SUPPRESS,
        help="a finished run's directory (config.json, data.json, checkpoints/)",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        required=True,
        default=argparse.SUPPRESS,
        help="a prompt, served as the bytes given (repeat for several requests; the first one streams)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=common.integer(1),
        default=200,
        help="new tokens per prompt at most; a request also ends at EOS",
    )
    parser.add_argument(
        "--kv-format", default="fp4", choices=("bf16", "fp8", "fp4"), help="format the KV pool stores keys/values in"
    )
    parser.add_argument("--scale-rule", default="mse", choices=("mse", "mx"), help="fp4 scale rule (fp4 only)")
    parser.add_argument(
        "--kv-memory-mib",
        type=common.number(0.0, low_open=True, high=MAX_KV_MEMORY_MIB),
        default=64.0,
        help="KV pool size in MiB (at least one block of 16 tokens must fit)",
    )
    parser.add_argument(
        "--temperature",
        type=common.number(0.0, low_open=False),
        default=0.7,
        help="sampling temperature; 0 = greedy",
    )
    parser.add_argument("--seed", type=common.integer(0), default=0, help="sampling seed (an integer >= 0)")
    parser.add_argument(
        "--site", type=common.integer(0), default=0, help="a federated run's site whose model serves (0 .. sites - 1)"
    )
    return parser


def main(argv=None) -> int:
    """Runs serve on `argv` (default sys.argv[1:]); returns the exit status (see the module docstring). Flag errors
    exit through argparse (SystemExit 2, an `error:` line) before anything is imported or loaded."""
    parser = build_parser()
    args = parser.parse_args(argv)
    raw_prompts = []
    for i, text in enumerate(args.prompt):
        try:  # argv's undecodable bytes arrive as surrogate escapes: back to the bytes the user gave
            raw_prompts.append(text.encode("utf-8", errors="surrogateescape"))
        except UnicodeEncodeError as e:
            parser.error(
                f"argument --prompt: prompt {i + 1} = {text!r} holds {text[e.start : e.end]!r} at position {e.start}, "
                "which is neither UTF-8 text nor an escaped byte; allowed: text or raw bytes"
            )

    from core.checkpoint import CheckpointError
    from core.tokenizer import StreamDecoder
    from experiments import build, load
    from kvcache import formats
    from kvcache.engine import Engine, EngineConfig

    try:
        run_config, model = load.trained_model(args.workdir, site=args.site)
        tok = build.build_tokenizer(run_config)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fmt = formats.get("fp4", scale_rule=args.scale_rule) if args.kv_format == "fp4" else formats.get(args.kv_format)
    cfg = model.cfg
    try:
        fmt.check_head_dim(cfg.head_dim)
    except ValueError as e:
        print(f"error: --kv-format={args.kv_format} cannot hold this model's keys and values: {e}", file=sys.stderr)
        return 2
    prompts = [tok.encode_bytes(raw).tolist() for raw in raw_prompts]
    longest = max(map(len, prompts)) + args.max_new_tokens
    config = EngineConfig(
        memory_bytes=int(args.kv_memory_mib * 2**20),
        max_model_len=max(512, -(-longest // 256) * 256),
        temperature=args.temperature,
        seed=args.seed,
        eos_id=tok.eos_id,
        never=tok.never_sampled,
        num_ids=tok.vocab_size,
    )
    per_block = cfg.num_layers * config.block_size * fmt.bytes_per_token(cfg.num_kv_heads, cfg.head_dim)
    if config.memory_bytes < per_block:
        print(
            f"error: --kv-memory-mib={args.kv_memory_mib!r} holds no KV block; the minimum is {per_block / 2**20!r} "
            f"MiB ({per_block} bytes: one block of {config.block_size} tokens x {cfg.num_layers} layers in "
            f"{fmt.label})",
            file=sys.stderr,
        )
        return 2
    try:
        engine = Engine(model, fmt, config)
    except RuntimeError as e:  # jax.errors.JaxRuntimeError: the device has not that much memory
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        print(f"error: --kv-memory-mib={args.kv_memory_mib!r} does not fit in device memory: {e}", file=sys.stderr)
        return 2
    requests = []
    for i, prompt in enumerate(prompts):
        try:
            requests.append(engine.submit(prompt, args.max_new_tokens))
        except ValueError as e:
            print(
                f"error: prompt {i + 1} ({len(prompt)} tokens, BOS included) and "
                f"--max-new-tokens={args.max_new_tokens} do not fit --kv-memory-mib={args.kv_memory_mib!r}: {e}",
                file=sys.stderr,
            )
            return 2
    print(f"{fmt.label} KV pool: {engine.capacity_tokens:,} tokens in {args.kv_memory_mib:g} MiB", file=sys.stderr)
    stream = StreamDecoder(tok)
    sys.stdout.write(stream.feed(prompts[0]))
    shown = 0
    while engine.has_work:
        engine.step()
        new = requests[0].output[shown:]
        sys.stdout.write(stream.feed(new))
        sys.stdout.flush()
        shown += len(new)
    print(stream.flush())
    for prompt, request in zip(prompts[1:], requests[1:]):
        print(f"--- request {request.id}:\n{tok.decode(prompt + request.output)}")
    for request in requests:
        print(
            f"request {request.id}: {len(request.output)} tokens, time to first token {request.ttft * 1e3:.0f} ms, "
            f"{request.tpot * 1e3:.1f} ms per output token",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
