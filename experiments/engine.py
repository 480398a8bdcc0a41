"""The serving engine of a finished run, built from the serve commands' parsed flags (experiments.args) and the
run's config: its KV format, the engine's config, the HTTP server's lengths, and the run and model loaded.

    run, tok = engine.load_run(ns.workdir)                                   # FlagError: not a finished run
    fmt, why = engine.kv_format(ns, run)                                     # the run's KV format unless a flag says
    config = engine.engine_config(ns, run, fmt, tok, prompts=[...] | None)   # FlagError naming the flag
    model, status = engine.load_model(ns.workdir, ns.site)                   # None, exit status after an error line

Both serve commands (`python -m experiments.serve`, `python -m experiments.serve --http`) and the HTTP benchmark
build their engine through it. Every check is made on flags and the run's config.json alone, before a model is loaded
or an engine built, and fails with experiments.args.FlagError naming the flag, the value and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import ml_collections

from core import fields as fields_lib
from core.byte_tokenizer import TokenizerError
from core.checkpoint import CheckpointError
from core.model import Transformer
from core.tokenizer import Tokenizer
from experiments import load, schema, schema_kvcache
from experiments.args import FlagError
from experiments.hf import generation
from experiments.hf import load as hf_load
from kvcache import capacity, formats
from kvcache.formats import Format
from kvcache.serving import EngineConfig

__all__ = [
    "IN_PROCESS_MODEL_LEN",
    "IN_PROCESS_STEP_TOKENS",
    "SERVED_STEP_TOKENS",
    "engine_config",
    "kv_format",
    "load_model",
    "load_run",
    "precision_line",
    "served_lengths",
]

IN_PROCESS_STEP_TOKENS = 256
"""The in-process command's step budget at most (its requests are known: it is capped at what they can hold)."""

SERVED_STEP_TOKENS = 256
"""The HTTP server's step budget by default (or half its max_model_len, if less)."""

IN_PROCESS_MODEL_LEN = 256
"""The in-process command's max_model_len is a multiple of this, and at least twice it."""


def precision_line(args: argparse.Namespace, run: ml_collections.ConfigDict) -> str:
    """The console line saying what the served model's GEMMs compute in, and why (--precision, the run's recipe)."""
    recipe = run.precision.recipe
    if recipe == "none":
        return "GEMMs: float (the run trained in float)"
    if args.precision == "float":
        return f"GEMMs: float (--precision float; the run trained with the {recipe} recipe, which its export drops too)"
    return f"GEMMs: {recipe} (the run's training recipe; --precision float computes in float, as its export does)"


def kv_format(args: argparse.Namespace, run: ml_collections.ConfigDict) -> tuple[Format, str]:
    """(the KV format serving uses, a line saying which and why): the run's `kvcache` section (format, and for a
    format with options, its options: experiments.schema_kvcache.make_format), with `--kv-format` / `--scale-rule`
    replacing its format / scale rule when given (a replaced format keeps the run's options it takes, the others at
    their defaults: experiments.schema_kvcache.with_format). Raises FlagError for --scale-rule with a format that has
    no scale rule (kvcache.formats.options), or a format that cannot hold the model's heads."""
    given_format, given_rule = getattr(args, "kv_format", None), getattr(args, "scale_rule", None)
    kv = fields_lib.from_config(schema_kvcache.KVCacheConfig, run.kvcache)
    name = given_format or kv.format
    why = "--kv-format" if given_format else "the run's kvcache.format; --kv-format overrides"
    ruled = [n for n in formats.NAMES if "scale_rule" in formats.options(n)]  # the formats with a scale rule
    if given_rule is not None and name not in ruled:
        raise FlagError(
            f"--scale-rule={given_rule} applies to the {'/'.join(ruled)} KV format only, and the format is {name} "
            f"({why}); allowed: --scale-rule with --kv-format in {ruled} (or a run whose kvcache.format is one), "
            "or no --scale-rule"
        )
    kv = schema_kvcache.with_format(kv, name)
    kv = dataclasses.replace(kv, scale_rule=given_rule or kv.scale_rule)
    head_dim = schema.model_config(run).head_dim
    fits = [n for n in formats.NAMES if _holds(schema_kvcache.make_format(schema_kvcache.with_format(kv, n)), head_dim)]
    fmt = schema_kvcache.make_format(kv)
    try:
        fmt.check_head_dim(head_dim)
    except ValueError as e:
        flag = f"--kv-format={name}" if given_format else f"kv format {name} (the run's kvcache.format)"
        raise FlagError(
            f"{flag} cannot hold this model's keys and values: {e}; allowed for this model: --kv-format in {fits}"
        ) from None
    source = f"{name} ({why})"
    if name in ruled:
        rule = "--scale-rule" if given_rule else "the run's kvcache.scale_rule; --scale-rule overrides"
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
    args: argparse.Namespace,
    run: ml_collections.ConfigDict,
    fmt: Format,
    tok: Tokenizer,
    *,
    prompts: list[list[int]] | None = None,
    eos_ids: tuple[int, ...] = (),
) -> EngineConfig:
    """The engine's config for these flags (--site, --kv-memory-mib, --decode-steps, --seed), the run's model, the
    KV format and the tokenizer (its EOS and `eos_ids`, the generation config's end ids, end a request; its PAD / BOS
    and the ids past its vocabulary are never sampled), from the run's config alone (nothing is loaded).

    The pool holds floor(memory / block bytes) blocks of `EngineConfig.block_size` tokens (kvcache.paged); a request
    needs ceil((prompt + new tokens) / block size) of them. Two kinds of caller:
      * `prompts` given (ids, BOS included; the in-process command, whose requests are all known before the engine
        starts): each must fit the pool with --max-new-tokens; sampling is at --temperature; the step's token budget
        is capped at the tokens all requests can ever hold and max_model_len at what the longest needs, so that
        warm-up compiles only the batch shapes these requests take;
      * `prompts` None (the HTTP server): the limits are --max-num-seqs and `served_lengths`' --max-model-len and
        --max-num-batched-tokens; every request brings its own sampling parameters.

    Raises FlagError for a --site the run lacks, a --kv-memory-mib that holds no block of the model's KV, a prompt
    that (with --max-new-tokens) the pool cannot hold, a --max-model-len below 2 x --max-num-batched-tokens, or an
    end id in `eos_ids` outside the tokenizer's ids.
    """
    outside = [i for i in eos_ids if not 0 <= i < tok.vocab_size]
    if outside:
        raise FlagError(
            f"the generation config's eos_token_id holds {outside[0]}, outside the tokenizer's ids [0, "
            f"{tok.vocab_size}); allowed: ids of the tokenizer (or --generation-config FOLDER with other ids)"
        )
    sites = run.mesh.site
    if args.site >= sites:
        raise FlagError(
            f"--site={args.site}: the run in {args.workdir} has mesh.site = {sites} site(s); allowed "
            f"--site in 0..{sites - 1}"
        )
    if prompts is None:
        model_len, step = served_lengths(args, run)
    cfg = schema.model_config(run)
    mib, bs = args.kv_memory_mib, EngineConfig.block_size
    memory = int(mib * 2**20)
    per_block = bs * capacity.kv_bytes_per_token(
        capacity.ModelShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim), fmt
    )
    blocks = memory // per_block
    if blocks < 1:
        raise FlagError(
            f"--kv-memory-mib={mib!r} holds no KV block; the minimum is {per_block / 2**20!r} MiB ({per_block} "
            f"bytes: one block of {bs} tokens x {cfg.num_layers} layers in {fmt.label})"
        )
    if prompts is None:
        seqs, temperature = args.max_num_seqs, 1.0  # (every request brings its own temperature)
    else:
        _check_prompts_fit(prompts, args.max_new_tokens, blocks * bs, per_block, mib, fmt)
        longest = max(map(len, prompts)) + args.max_new_tokens
        seqs = EngineConfig.max_num_seqs
        step = min(IN_PROCESS_STEP_TOKENS, sum(len(p) + args.max_new_tokens for p in prompts))
        model_len = max(2 * IN_PROCESS_MODEL_LEN, -(-longest // IN_PROCESS_MODEL_LEN) * IN_PROCESS_MODEL_LEN)
        temperature = args.temperature
    return EngineConfig.for_tokenizer(
        tok,
        eos_ids=eos_ids,
        memory_bytes=memory,
        block_size=bs,
        max_num_seqs=seqs,
        max_num_batched_tokens=step,
        max_model_len=model_len,
        temperature=temperature,
        seed=args.seed,
        decode_steps=args.decode_steps,
    )


def served_lengths(args: argparse.Namespace, run: ml_collections.ConfigDict) -> tuple[int, int]:
    """(max_model_len, max_num_batched_tokens) of the HTTP server: --max-model-len, by default the model's context
    (experiments.hf.load.context_length: an imported checkpoint's max_position_embeddings, else the run's
    data.seq_len); --max-num-batched-tokens, by default 256 or half max_model_len if less. Raises FlagError if
    max_model_len < 2 x max_num_batched_tokens (a step's padded batch is addressed like one sequence)."""
    model_len, source = (args.max_model_len, "--max-model-len") if args.max_model_len else hf_load.context_length(run)
    step = args.max_num_batched_tokens or max(1, min(SERVED_STEP_TOKENS, model_len // 2))
    if model_len < 2 * step:
        given = f"--max-model-len={model_len}" if args.max_model_len else f"max_model_len = {model_len} ({source})"
        raise FlagError(
            f"{given} must be >= 2 x --max-num-batched-tokens = {2 * step}: allowed a larger --max-model-len or a "
            "smaller --max-num-batched-tokens"
        )
    return model_len, step


def _check_prompts_fit(
    prompts: list[list[int]], max_new_tokens: int, capacity_tokens: int, per_block: int, mib: float, fmt: Format
) -> None:
    """Raises FlagError naming --prompt or --max-new-tokens, and the --kv-memory-mib that would do, for the first
    prompt that with `max_new_tokens` new tokens does not fit a pool of `capacity_tokens` tokens."""
    bs = EngineConfig.block_size
    for i, prompt in enumerate(prompts):
        need = len(prompt) + max_new_tokens
        if need <= capacity_tokens:
            continue
        enough = -(-need // bs) * per_block / 2**20
        if len(prompt) >= capacity_tokens:
            raise FlagError(
                f"--prompt: prompt {i + 1} ({len(prompt)} tokens, BOS included) is longer than "
                f"--kv-memory-mib={mib!r} holds with a new token ({capacity_tokens} tokens in {fmt.label}); allowed: "
                f"a prompt of at most {capacity_tokens - 1} tokens, or --kv-memory-mib >= {enough!r} for this one "
                f"with --max-new-tokens={max_new_tokens}"
            )
        raise FlagError(
            f"prompt {i + 1} ({len(prompt)} tokens, BOS included) and --max-new-tokens={max_new_tokens} need "
            f"{need} tokens and do not fit --kv-memory-mib={mib!r} ({capacity_tokens} tokens in {fmt.label}); "
            f"allowed: --max-new-tokens <= {capacity_tokens - len(prompt)}, or --kv-memory-mib >= {enough!r}"
        )


# ------------------------------------------------------------------------------------------------ loading


def load_run(workdir: str) -> tuple[ml_collections.ConfigDict, Tokenizer]:
    """(the run's config, its tokenizer framing prompts as the run's model was trained: experiments.hf.generation.
    run_tokenizer) from `workdir`, without loading the model (experiments.load). Raises FlagError (its message the
    loader's) for a workdir that is not a finished run or a tokenizer that cannot be read."""
    try:
        load.check_workdir(workdir)
        run = load.run_config(workdir)
        return run, generation.run_tokenizer(run)
    except (FileNotFoundError, TokenizerError, load.RunConfigError) as e:
        raise FlagError(str(e)) from e


def load_model(workdir: str, site: int, precision: str = "trained") -> tuple[Transformer | None, int]:
    """(the run's model on this process's first device, 0) by `experiments.load.trained_model`, or (None, exit
    status) after an `error:` line on stderr: 1 a damaged checkpoint (core.checkpoint.CheckpointError), 2 a workdir
    that is not a finished run or lacks the site."""
    try:
        return load.trained_model(workdir, site=site, precision=precision)[1], 0
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return None, 1
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None, 2
