"""Hugging Face checkpoints from the command line.

    python -m experiments.hf export --workdir runs/quickstart --out exported/ [--site 0] [--max-shard-mib 5120]

`export` writes a trained run's model (a federated run: site `--site`'s model, its own experts) as a Hugging Face
checkpoint (config.json + safetensors) of the architecture it fits (experiments.hf.export). Exit codes: 0 written;
2 bad input (a workdir that is not a finished run, a model no supported architecture expresses: nothing written);
1 an unusable checkpoint.
"""

from __future__ import annotations

import argparse
import sys

from experiments.bench import common


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.hf",
        description=(__doc__ or "").split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    out = commands.add_parser("export", help="write a trained run's model as a Hugging Face checkpoint")
    out.add_argument("--workdir", required=True, help="a finished run's directory (config.json, checkpoints/)")
    out.add_argument("--out", required=True, help="the directory to write config.json and the safetensors into")
    out.add_argument("--site", type=common.integer(0), default=0, help="a federated run's site whose model is exported")
    out.add_argument(
        "--max-shard-mib",
        type=common.number(0.0, low_open=True),
        default=5120.0,
        help="safetensors files are cut past this size",
    )
    args = parser.parse_args(argv)

    from core.checkpoint import CheckpointError
    from experiments import load
    from experiments.hf import export

    try:
        config, model = load.trained_model(args.workdir, site=args.site)
        files = export.save(config, model, args.out, max_shard_bytes=int(args.max_shard_mib * 2**20))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError) as e:  # export.HFExportError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(files)} files to {args.out}: {', '.join(f.rsplit('/', 1)[-1] for f in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
