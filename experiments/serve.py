"""Serve prompts from a trained run's checkpoint through the engine, streaming the text as it is generated.

    python -m experiments.serve --workdir runs/quickstart-1dev --prompt "def " [--prompt "import "]
        [--max-new-tokens 200] [--kv-format bf16|fp8|fp4] [--scale-rule mse|mx] [--kv-memory-mib 64]
        [--temperature 0.7] [--seed 0] [--site 0]
    python -m experiments.serve --http --workdir runs/quickstart [--port 8000] ...  (OpenAI API: experiments.server)

Any run serves on this process's first device, whatever mesh it trained on (data, tensor or expert parallelism:
experiments.load). A federated run keeps one model per site (its own experts): `--site` picks it (default 0). Every
prompt is one request of a continuous-batching engine (kvcache.serving) over a paged KV pool of `--kv-memory-mib` in
the run's KV format (its `kvcache` section: format, and for fp4 the scale rule, K rotation and FP8 query), unless
`--kv-format` / `--scale-rule` say otherwise; stderr says which format and why. The engine's step is compiled for
every batch shape the requests can take before they are submitted ("compiled in X s"), so their times to first
token do not include compilation. The first prompt's text streams to the terminal, the others are printed when
done (with several prompts, each under a `--- request N:` line), followed on stderr by each request's time to
first token and time per output token.

Prompts are encoded, and the output decoded, by the run's tokenizer (its `data.tokenizer`: bytes, or a
Hugging Face tokenizer.json, core.tokenizer), framed as the run's model was trained (experiments.hf.generation.
run_tokenizer: a run trained here, BOS first; an imported checkpoint, its tokenizer's post-processor's framing); a
request ends at that tokenizer's EOS or at an end id of the model's generation config (an imported checkpoint's
generation_config.json `eos_token_id`, experiments.hf.generation). A prompt is served as the bytes given on the
command line, special tokens' names in it read as text (an argument that is not valid UTF-8 reaches Python as
surrogate escapes, which are turned back into its bytes; the byte tokenizer takes them as they are, a BPE tokenizer
reads invalid bytes as U+FFFD); text is shown as UTF-8, invalid bytes as U+FFFD, and a character whose bytes arrive
over several engine steps (or tokens) is shown once it is complete (core.tokenizer.StreamDecoder).

Exit status: 0 served; 2 a bad flag, alone or for this run (a --site it lacks, a KV format that cannot hold its heads,
a pool too small for one block or for a prompt and its new tokens), or a workdir that is not a finished run: an
`error:` line naming the flag, the value and what is allowed, before the model is loaded; 1 a damaged checkpoint
(core.checkpoint.CheckpointError).
"""

from __future__ import annotations

import argparse
import sys
import time

from core.tokenizer import StreamDecoder
from experiments import args as args_lib
from experiments import command
from experiments import engine as engine_lib
from experiments.hf import generation
from kvcache import serving as kv_serving


def build_parser() -> argparse.ArgumentParser:
    """serve's command line; every flag's value is checked as it is parsed (nothing is loaded)."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.serve",
        description=(__doc__ or "").split("\n")[0],
        formatter_class=args_lib.HelpFormatter,
    )
    args_lib.add_run_flags(parser)
    parser.add_argument(
        "--prompt",
        action="append",
        required=True,
        default=argparse.SUPPRESS,  # required: no "(default: None)" in the help
        help="a prompt, served as the bytes given (repeat for several requests; the first one streams)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=args_lib.integer(1),
        default=200,
        help="new tokens per prompt at most; a request also ends at EOS",
    )
    args_lib.add_kv_flags(parser)
    parser.add_argument(
        "--temperature",
        type=args_lib.number(0.0, low_open=False),
        default=0.7,
        help="sampling temperature; 0 = greedy",
    )
    parser.add_argument(
        "--seed",
        type=args_lib.integer(0, maximum=args_lib.MAX_SEED),
        default=0,
        help="sampling seed (an integer in [0, 2**64))",
    )
    parser.add_argument(
        "--http",
        action="store_true",
        help="serve the OpenAI API over HTTP instead (experiments.server.cli; `--http --help` lists its flags)",
    )
    return parser


def main(argv=None) -> int:
    """Runs serve on `argv` (default sys.argv[1:]); returns the exit status (see the module docstring). Every flag is
    checked before the model is loaded: alone by argparse (SystemExit 2, an `error:` line), then against the run's
    config.json (an `error:` line, exit 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--http" in argv:
        # the OpenAI-compatible server needs the optional [serve] extra (FastAPI, uvicorn): imported only for it
        from experiments.server import cli

        return cli.main([a for a in argv if a != "--http"])
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
    try:
        run, tok = engine_lib.load_run(args.workdir)
        prefix, suffix = tok.framing
        prompts = [[*prefix, *tok.encode_bytes(raw, bos=False).tolist(), *suffix] for raw in raw_prompts]
        fmt, source = engine_lib.kv_format(args, run)
        eos_ids = generation.for_run(run, "auto").eos_ids
        config = engine_lib.engine_config(args, run, fmt, tok, prompts=prompts, eos_ids=eos_ids)
    except (args_lib.FlagError, generation.GenerationConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"kv format: {source}", file=sys.stderr)
    print(engine_lib.precision_line(args, run), file=sys.stderr)
    model, status = engine_lib.load_model(args.workdir, args.site, args.precision)
    if model is None:
        return status
    try:
        engine = kv_serving.Engine(model, fmt, config)
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


def warm_up(engine: kv_serving.Engine) -> float:
    """Compiles the engine's step for every batch shape its requests can take (`Engine.warmup`), so that no request's
    time to first token includes compilation; returns the seconds it took."""
    started = time.perf_counter()
    engine.warmup()
    return time.perf_counter() - started


def _header(request: kv_serving.Request) -> str:
    """The line above each request's text when several are served (the first one's streams below it)."""
    return f"--- request {request.id}:"


if __name__ == "__main__":
    command.run(main)
