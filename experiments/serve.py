"""Serve prompts from a trained run's checkpoint through the engine, streaming the text as it is generated.

    python -m experiments.serve --workdir runs/quickstart-1dev --prompt "def " [--prompt "import "]
        [--max-new-tokens 200] [--kv-format bf16|fp8|fp4] [--scale-rule mse|mx] [--kv-memory-mib 64]
        [--temperature 0.7] [--seed 0] [--site 0]
    python -m experiments.serve --http --workdir runs/quickstart [--port 8000] ...  (OpenAI API: experiments.server)

Any run serves on this process's first device, whatever mesh it trained on (data, tensor or expert parallelism:
experiments.load). A federated run keeps one model per site (its own experts): `--site` picks it (default 0). Every
prompt is one request of a continuous-batching engine (kvcache.engine) over a paged KV pool of `--kv-memory-mib` in
the run's KV format (its `kvcache` section: format, and for fp4 the scale rule, K rotation and FP8 query), unless
`--kv-format` / `--scale-rule` say otherwise; stderr says which format and why. The engine's step is compiled for
every batch shape the requests can take before they are submitted ("compiled in X s"), so their times to first
token do not include compilation. The first prompt's text streams to the terminal, the others are printed when
done (with several prompts, each under a `--- request N:` line), followed on stderr by each request's time to
first token and time per output token.

Prompts are encoded, and the output decoded, by the run's tokenizer (its `data.tokenizer`: bytes, or a
Hugging Face tokenizer.json, core.tokenizer); a request ends at that tokenizer's EOS. A prompt is served as the bytes
given on the command line (an argument that is not valid UTF-8 reaches Python as surrogate escapes, which are turned
back into its bytes; the byte tokenizer takes them as they are, a BPE tokenizer reads invalid bytes as U+FFFD); text
is shown as UTF-8, invalid bytes as U+FFFD, and a character whose bytes arrive over several engine steps (or
tokens) is shown once it is complete (core.tokenizer.StreamDecoder).

Exit status: 0 served; 2 a bad flag, alone or for this run (a --site it lacks, a KV format that cannot hold its heads,
a pool too small for one block or for a prompt and its new tokens), or a workdir that is not a finished run: an
`error:` line naming the flag, the value and what is allowed, before the model is loaded; 1 a damaged checkpoint
(core.checkpoint.CheckpointError).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import TYPE_CHECKING

from experiments.bench import common

if TYPE_CHECKING:
    import ml_collections

    from kvcache.engine import EngineConfig
    from kvcache.formats import Format

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
    add_kv_flags(parser)
    parser.add_argument(
        "--temperature",
        type=common.number(0.0, low_open=False),
        default=0.7,
        help="sampling temperature; 0 = greedy",
    )
    parser.add_argument("--seed", type=common.integer(0), default=0, help="sampling seed (an integer >= 0)")
    parser.add_argument(
        "--http",
        action="store_true",
        help="serve the OpenAI API over HTTP instead (experiments.server.cli; `--http --help` lists its flags)",
    )
    parser.add_argument(
        "--site", type=common.integer(0), default=0, help="a federated run's site whose model serves (0 .. sites - 1)"
    )
    return parser


def add_kv_flags(parser: argparse.ArgumentParser) -> None:
    """--kv-format, --scale-rule and --kv-memory-mib: the KV pool's flags, shared with `serve --http`
    (experiments.server.cli); `kv_format` reads the first two."""
    # default=SUPPRESS: the defaults are the run's (main reads a missing one as None), not a value of the parser's
    parser.add_argument(
        "--kv-format",
        default=argparse.SUPPRESS,
        choices=("bf16", "fp8", "fp4"),
        help="format the KV pool stores keys/values in (default: the run's kvcache.format)",
    )
    parser.add_argument(
        "--scale-rule",
        default=argparse.SUPPRESS,
        choices=("mse", "mx"),
        help="fp4 scale rule, with the fp4 format only (default: the run's kvcache.scale_rule)",
    )
    parser.add_argument(
        "--kv-memory-mib",
        type=common.number(0.0, low_open=True, high=MAX_KV_MEMORY_MIB),
        default=64.0,
        help="KV pool size in MiB (at least one block of 16 tokens must fit)",
    )


class FlagError(ValueError):
    """A flag that cannot serve this run (its message names the flag, the value and what is allowed)."""


def main(argv=None) -> int:
    """Runs serve on `argv` (default sys.argv[1:]); returns the exit status (see the module docstring). Every flag is
    checked before the model is loaded: alone by argparse (SystemExit 2, an `error:` line), then against the run's
    config.json (an `error:` line, exit 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--http" in argv:  # the OpenAI-compatible server: its own flags
        from experiments.server import cli

        return cli.main([a for a in argv if a != "--http"])
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("kv_format", "scale_rule"):  # not given: the run's
        setattr(args, name, getattr(args, name, None))
    raw_prompts = []
    for i, text in enumerate(args.prompt):
        try:  # argv's undecodable bytes arrive as surrogate escapes: back to the bytes the user gave
            raw_prompts.append(text.encode("utf-8", errors="surrogateescape"))
        except UnicodeEncodeError as e:
            parser.error(
                f"argument --prompt: prompt {i + 1} = {text!r} holds {text[e.start : e.end]!r} at position {e.start}, "
                "which is neither UTF-8 text nor an escaped byte; allowed: text or raw bytes"
            )

    from core.tokenizer import StreamDecoder, TokenizerError
    from experiments import build, load
    from kvcache.engine import Engine

    try:
        load.check_workdir(args.workdir)
        run = load.run_config(args.workdir)
        tok = build.build_tokenizer(run)
    except (FileNotFoundError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts = [tok.encode_bytes(raw).tolist() for raw in raw_prompts]
    try:
        fmt, source = kv_format(args, run)
        config = engine_config(args, run, fmt, tok, prompts)
    except FlagError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"kv format: {source}", file=sys.stderr)
    model, status = load_model(args.workdir, args.site)
    if model is None:
        return status
    try:
        engine = Engine(model, fmt, config)
    except RuntimeError as e:  # jax.errors.JaxRuntimeError: the device has not that much memory
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        print(f"error: --kv-memory-mib={args.kv_memory_mib!r} does not fit in device memory: {e}", file=sys.stderr)
        return 2
    print(f"{fmt.label} KV pool: {engine.capacity_tokens:,} tokens in {args.kv_memory_mib:g} MiB", file=sys.stderr)
    print(
        f"compiled in {warm_up(engine):.1f} s (the engine's steps for batches of up to "
        f"{config.max_num_batched_tokens} tokens; the times to first token below exclude it)",
        file=sys.stderr,
    )
    requests = []
    for i, prompt in enumerate(prompts):
        try:  # (they fit the pool: engine_config checked it)
            requests.append(engine.submit(prompt, args.max_new_tokens))
        except ValueError as e:
            print(f"error: prompt {i + 1} cannot be served by this model: {e}", file=sys.stderr)
            return 2
    if len(requests) > 1:
        print(_header(requests[0]))
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
        print(f"{_header(request)}\n{tok.decode(prompt + request.output)}")
    for request in requests:
        print(
            f"request {request.id}: {len(request.output)} tokens, time to first token {request.ttft * 1e3:.0f} ms, "
            f"{request.tpot * 1e3:.1f} ms per output token",
            file=sys.stderr,
        )
    return 0


def load_model(workdir: str, site: int):
    """(the run's model, 0), or (None, exit status) after an `error:` line: 1 a damaged checkpoint, 2 a workdir that is
    not a finished run or lacks the site."""
    from core.checkpoint import CheckpointError
    from experiments import load

    try:
        return load.trained_model(workdir, site=site)[1], 0
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return None, 1
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None, 2


def warm_up(engine) -> float:
    """Compiles the engine's step for every batch shape its requests can take (`Engine.warmup`), so that no request's
    time to first token includes compilation; returns the seconds it took."""
    started = time.perf_counter()
    engine.warmup()
    return time.perf_counter() - started


def _header(request) -> str:
    """The line above each request's text when several are served (the first one's streams below it)."""
    return f"--- request {request.id}:"


def kv_format(args: argparse.Namespace, run: ml_collections.ConfigDict) -> tuple[Format, str]:
    """(the KV format serving uses, a line saying which and why): the run's `kvcache` section (format, and for fp4
    its scale rule, K rotation and FP8 query), with `--kv-format` / `--scale-rule` replacing its format / scale rule
    when given. Raises FlagError for --scale-rule without fp4, or a format that cannot hold the model's heads."""
    from core import config as config_lib
    from experiments import build
    from kvcache import config as kv_config
    from kvcache import formats

    kv = config_lib.from_config(kv_config.KVCacheConfig, run.kvcache)
    name = args.kv_format or kv.format
    why = "--kv-format" if args.kv_format else "the run's kvcache.format; --kv-format overrides"
    if args.scale_rule is not None and name != "fp4":
        raise FlagError(
            f"--scale-rule={args.scale_rule} applies to the fp4 KV format only, and the format is {name} ({why}); "
            "allowed: --scale-rule with --kv-format=fp4 (or a run whose kvcache.format is fp4), or no --scale-rule"
        )
    kv = dataclasses.replace(kv, format=name, scale_rule=args.scale_rule or kv.scale_rule)
    head_dim = build.model_config(run).head_dim
    fits = [n for n in formats.NAMES if _holds(kv_config.make_format(dataclasses.replace(kv, format=n)), head_dim)]
    fmt = kv_config.make_format(kv)
    try:
        fmt.check_head_dim(head_dim)
    except ValueError as e:
        flag = f"--kv-format={name}" if args.kv_format else f"kv format {name} (the run's kvcache.format)"
        raise FlagError(
            f"{flag} cannot hold this model's keys and values: {e}; allowed for this model: --kv-format in {fits}"
        ) from None
    source = f"{name} ({why})"
    if name == "fp4":
        rule = "--scale-rule" if args.scale_rule else "the run's kvcache.scale_rule; --scale-rule overrides"
        source += f", scale rule {kv.scale_rule} ({rule})"
    return fmt, source


def _holds(fmt: Format, head_dim: int) -> bool:
    """Whether `fmt` can store heads of `head_dim` (Format.check_head_dim)."""
    try:
        fmt.check_head_dim(head_dim)
    except ValueError:
        return False
    return True


def engine_config(
    args: argparse.Namespace, run: ml_collections.ConfigDict, fmt: Format, tok, prompts: list[list[int]]
) -> EngineConfig:
    """The engine's config for these flags and prompts (ids, BOS included), from the run's config alone (nothing is
    loaded). Raises FlagError for a --site the run lacks, a --kv-memory-mib that holds no block of the model's KV,
    or a prompt that (with --max-new-tokens) the pool cannot hold.

    The pool holds floor(memory / block bytes) blocks of 16 tokens (kvcache.paged); a request needs
    ceil((prompt + max_new_tokens) / 16) of them (kvcache.engine.Scheduler.submit). The step's token budget is
    capped at the tokens all requests can ever hold (it then never binds), so that warm-up compiles only the batch
    shapes these requests can take."""
    from experiments import build
    from kvcache.engine import EngineConfig

    sites = run.mesh.site
    if args.site >= sites:
        raise FlagError(
            f"--site={args.site}: the run in {args.workdir} has mesh.site = {sites} site(s); allowed "
            f"--site in 0..{sites - 1}"
        )
    cfg = build.model_config(run)
    mib, bs = args.kv_memory_mib, EngineConfig.block_size
    per_block = cfg.num_layers * bs * fmt.bytes_per_token(cfg.num_kv_heads, cfg.head_dim)
    blocks = int(mib * 2**20) // per_block
    if blocks < 1:
        raise FlagError(
            f"--kv-memory-mib={mib!r} holds no KV block; the minimum is {per_block / 2**20!r} MiB ({per_block} "
            f"bytes: one block of {bs} tokens x {cfg.num_layers} layers in {fmt.label})"
        )
    capacity = blocks * bs
    for i, prompt in enumerate(prompts):
        need = len(prompt) + args.max_new_tokens
        if need <= capacity:
            continue
        enough = -(-need // bs) * per_block / 2**20
        if len(prompt) >= capacity:
            raise FlagError(
                f"--prompt: prompt {i + 1} ({len(prompt)} tokens, BOS included) is longer than "
                f"--kv-memory-mib={mib!r} holds with a new token ({capacity} tokens in {fmt.label}); allowed: a "
                f"prompt of at most {capacity - 1} tokens, or --kv-memory-mib >= {enough!r} for this one with "
                f"--max-new-tokens={args.max_new_tokens}"
            )
        raise FlagError(
            f"prompt {i + 1} ({len(prompt)} tokens, BOS included) and --max-new-tokens={args.max_new_tokens} need "
            f"{need} tokens and do not fit --kv-memory-mib={mib!r} ({capacity} tokens in {fmt.label}); allowed: "
            f"--max-new-tokens <= {capacity - len(prompt)}, or --kv-memory-mib >= {enough!r}"
        )
    longest = max(map(len, prompts)) + args.max_new_tokens
    return EngineConfig(
        memory_bytes=int(mib * 2**20),
        block_size=bs,
        max_num_batched_tokens=min(256, sum(len(p) + args.max_new_tokens for p in prompts)),
        max_model_len=max(512, -(-longest // 256) * 256),
        temperature=args.temperature,
        seed=args.seed,
        eos_id=tok.eos_id,
        never=tok.never_sampled,
        num_ids=tok.vocab_size,
    )


if __name__ == "__main__":
    sys.exit(main())
