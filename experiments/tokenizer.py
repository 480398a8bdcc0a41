"""Train a byte-level BPE tokenizer on a corpus, for `data.tokenizer`.

    python -m experiments.tokenizer train --vocab-size 4096 --out runs/tokenizer-4k
        [--data-path P] [--jsonl-field text] [--val-fraction 0.02]

Reads the corpus exactly as the data section does (core.corpus.load_documents: the built-in Python standard library
sources by default, else `--data-path`, a file, directory or glob) and trains on its TRAIN split only, so the
held-out documents a run evaluates on stay unseen. The tokenizer is the `tokenizers` library's BPE with a ByteLevel
pre-tokenizer and decoder (as GPT-2, Llama 3, Qwen use): all 256 byte characters are in the initial alphabet, so any
text encodes. Ids: the specials `<|pad|>`, `<|bos|>`, `<|eos|>` are 0, 1, 2, the 256 byte characters 3 .. 258 (in
the order of GPT-2's byte-to-unicode characters), the merges 259 and up, most frequent first. It is written with
core.tokenizer's `save` as DIR/tokenizer.json + DIR/tokenizer_config.json (transformers' AutoTokenizer loads them);
train with it by `--config.data.tokenizer=DIR` and a `model.vocab_size` of at least its vocabulary. The last line
reports the held-out bytes per token (the byte tokenizer's is 1.0).

Exit status: 0 written; 2 a bad flag or an unusable corpus (an `error:` line naming the flag or data field).
"""

from __future__ import annotations

import argparse
import sys
import time

from core import corpus as corpus_lib
from core.byte_tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN
from core.hf_tokenizer import HFTokenizer
from experiments import args as arg_types
from experiments import command

MIN_VOCAB = 259  # the 256 byte characters and the three specials


def train(
    documents: list[bytes], vocab_size: int, *, show_progress: bool = False, min_frequency: int = 2
) -> HFTokenizer:
    """A byte-level BPE of at most `vocab_size` ids (>= 259) trained on `documents` (read as UTF-8, invalid bytes as
    U+FFFD): specials `<|pad|>`, `<|bos|>`, `<|eos|>` = ids 0, 1, 2, the 256 byte characters next, then merges of
    pairs seen at least `min_frequency` times, most frequent first (fewer ids when the corpus runs out of them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # optional ([experiments])

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size = {vocab_size}; must be >= {MIN_VOCAB} (256 byte characters + 3 specials)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    texts = (doc.decode("utf-8", errors="replace") for doc in documents)
    tok.train_from_iterator(texts, trainer, length=len(documents))
    return HFTokenizer(tok.to_str(pretty=True), source="the trained tokenizer")


def build_parser() -> argparse.ArgumentParser:
    """The command line: `train` and its flags, each checked as it is parsed (nothing is read)."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.tokenizer",
        description=(__doc__ or "").split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    t = commands.add_parser(
        "train",
        help="train a byte-level BPE on a corpus's train split and write tokenizer.json + tokenizer_config.json",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    t.add_argument(
        "--vocab-size",
        type=arg_types.integer(MIN_VOCAB),
        required=True,
        default=argparse.SUPPRESS,
        help=f"ids of the tokenizer, specials included (>= {MIN_VOCAB}: 256 byte characters + 3 specials)",
    )
    t.add_argument(
        "--out",
        required=True,
        default=argparse.SUPPRESS,
        help="directory to write tokenizer.json and tokenizer_config.json into (created if missing; overwritten)",
    )
    t.add_argument(
        "--data-path",
        default="",
        help="the corpus (data.path): '' = the built-in one (the Python standard library's sources), else a "
        ".txt/.md/.py/.jsonl file, a directory or a glob",
    )
    t.add_argument("--jsonl-field", default="text", help="string field holding a document in .jsonl files")
    t.add_argument(
        "--val-fraction",
        type=arg_types.number(0.0, low_open=True, high=0.5),
        default=0.02,
        help="fraction of documents held out (never trained on; as data.val_fraction, so a run with the same value "
        "evaluates on them)",
    )
    t.add_argument(
        "--min-frequency", type=arg_types.integer(1), default=2, help="a pair is merged only if seen this many times"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command line on `argv` (default sys.argv[1:]); returns the exit status (module docstring). Flag
    errors exit through argparse (SystemExit 2, an `error:` line) before anything is read."""
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        docs = corpus_lib.load_documents(
            args.data_path or None, val_fraction=args.val_fraction, jsonl_field=args.jsonl_field
        )
    except corpus_lib.DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    train_bytes = sum(map(len, docs.train))
    print(
        f"corpus {docs.info['source']}: {len(docs.train):,} train documents ({train_bytes / 1e6:.1f} MB), "
        f"{len(docs.val):,} held out ({time.perf_counter() - t0:.1f} s)",
        flush=True,
    )
    t0 = time.perf_counter()
    print(f"training a byte-level BPE of {args.vocab_size:,} ids on the train split ...", flush=True)
    tok = train(docs.train, args.vocab_size, show_progress=sys.stderr.isatty(), min_frequency=args.min_frequency)
    print(f"trained {tok.vocab_size:,} ids in {time.perf_counter() - t0:.1f} s", flush=True)
    tok.save(args.out)
    print(f"wrote {args.out}/tokenizer.json and tokenizer_config.json (use --config.data.tokenizer={args.out})")
    held_out = tok.encode_batch(docs.val, bos=False, eos=False)
    tokens = sum(len(ids) for ids in held_out)
    val_bytes = sum(int(tok.byte_lengths[ids].sum()) for ids in held_out)
    print(
        f"held out: {val_bytes:,} bytes in {tokens:,} tokens = {val_bytes / max(tokens, 1):.3f} bytes per token "
        "(bytes: 1.000)"
    )
    return 0


if __name__ == "__main__":
    command.run(main)
