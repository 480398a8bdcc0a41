"""Hugging Face checkpoints from the command line.

    python -m experiments.hf import --hf-dir path/to/checkpoint --workdir runs/imported [--data-path P]
    python -m experiments.hf export --workdir runs/quickstart --out exported/ [--site 0] [--max-shard-mib 5120]

`import` writes a checkpoint (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM,
Qwen3MoeForCausalLM) into a new workdir as a run at step 0, with its held-out loss and bits per byte on the corpus
(experiments.pretrained): serve, sample or export it as any run. `export` writes a trained run's model (a federated
run: site `--site`'s model, its own experts) as a Hugging Face checkpoint (config.json, safetensors and the tokenizer
files) of the architecture it fits (experiments.hf.export); a killed export leaves --out as it was or complete, and
rerunning it finishes (or finds the same export there: exit 0). Exit codes: 0 written; 2 bad input (a config.json
field or a tensor we cannot honour, a workdir that is not a finished run or already holds one, a model no supported
architecture expresses, an --out that is not empty or cannot be written: nothing written); 1 an unusable checkpoint,
or a write that failed (a full disk: nothing written to --out, the partial files removed).
"""

from __future__ import annotations

import argparse
import os
import sys

from core.checkpoint import CheckpointError
from core.workdir import WorkdirError
from experiments import args as arg_types
from experiments import command, load, pretrained, schema
from experiments.hf import export


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.hf",
        description=(__doc__ or "").split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser(
        "import",
        help="write a Hugging Face checkpoint into a new workdir (a run at step 0)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    imp.add_argument("--hf-dir", required=True, help="the checkpoint directory (config.json, *.safetensors)")
    imp.add_argument("--workdir", required=True, help="a new run directory to write it into")
    imp.add_argument(
        "--data-path",
        default="",
        help="the corpus the held-out numbers are measured on (data.path; '' = the built-in one)",
    )
    imp.add_argument(
        "--tokenizer",
        default="",
        help="the tokenizer (data.tokenizer: a tokenizer.json or a directory holding one; default: the checkpoint's "
        "tokenizer.json, or the byte tokenizer for a checkpoint without one whose vocabulary can be the byte "
        "tokenizer's)",
    )
    imp.add_argument(
        "--eval-batches",
        type=arg_types.integer(0),
        default=8,
        help="held-out batches to evaluate (0: no evaluation, and the corpus is not tokenized)",
    )
    imp.add_argument(
        "--eval-batch-size",
        type=arg_types.integer(1),
        default=None,
        help="sequences per held-out batch (data.batch_size; default: its default, 32); the held-out split needs "
        "--eval-batches x this many windows of data.seq_len + 1 tokens",
    )
    out = commands.add_parser(
        "export",
        help="write a trained run's model as a Hugging Face checkpoint",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    out.add_argument("--workdir", required=True, help="a finished run's directory (config.json, checkpoints/)")
    out.add_argument("--out", required=True, help="the directory to write config.json and the safetensors into")
    out.add_argument(
        "--site", type=arg_types.integer(0), default=0, help="a federated run's site whose model is exported"
    )
    out.add_argument(
        "--dtype",
        choices=list(export.DTYPES),
        default=None,
        help="the tensors' dtype (default: the dtype of the checkpoint the run was imported from, else float32)",
    )
    out.add_argument(
        "--replace",
        action="store_true",
        help="write into a folder that holds a model: its model files (safetensors, index, configs, tokenizer) are "
        "removed first, other files kept (without it, --out must be new or empty)",
    )
    out.add_argument(
        "--max-shard-mib",
        type=arg_types.number(0.0, low_open=True),
        default=5120.0,
        help="safetensors files are cut past this size",
    )
    args = parser.parse_args(argv)

    try:
        return _import(args) if args.command == "import" else _export(args)
    except (CheckpointError, export.ExportWriteError) as e:  # an unusable checkpoint; a write that failed (full disk)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError, WorkdirError) as e:  # the HF, config and data errors are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2


def _import(args) -> int:
    why = schema.hf_checkpoint_problem(args.hf_dir)
    if why is not None:
        raise FileNotFoundError(f"--hf-dir={args.hf_dir}: {why}; allowed: a Hugging Face checkpoint directory")
    config = schema.default_config()
    config.data.path = args.data_path
    if args.tokenizer:
        config.data.tokenizer = args.tokenizer
    if args.eval_batch_size is not None:
        config.data.batch_size = args.eval_batch_size
    summary = pretrained.import_to(args.workdir, args.hf_dir, config=config, eval_batches=args.eval_batches)
    held_out = (
        f"; held-out loss {summary['val_loss']:.4f}, {summary['val_bits_per_byte']:.4f} bits/byte"
        if "val_loss" in summary
        else ""
    )
    print(f"imported {args.hf_dir} into {args.workdir}: {summary['num_params']:,} parameters{held_out}")
    return 0


def _export(args) -> int:
    export.recover(args.out)  # (what a killed export left; then --out's refusals, before the model is loaded)
    export.check_out(args.out, replace=args.replace)
    rerun = not args.replace and bool(export.model_files(args.out))  # (check_out: only a model is there)
    config, model = load.trained_model(args.workdir, site=args.site)
    files = export.save(
        config,
        model,
        args.out,
        max_shard_bytes=int(args.max_shard_mib * 2**20),
        replace=args.replace,
        dtype=args.dtype,
    )
    names = ", ".join(os.path.basename(f) for f in files)
    if rerun:  # (save refuses a folder holding another model)
        print(f"{args.out} already holds this export ({len(files)} files, the same bytes): nothing written; {names}")
    else:
        print(f"wrote {len(files)} files to {args.out}: {names}")
    return 0


if __name__ == "__main__":
    command.run(main)
