"""Real-model interoperability end to end: a BPE tokenizer and a Qwen3-MoE-shaped model trained here, exported as a
Hugging Face checkpoint, reloaded from the exporter's own files, and served through the KV formats (bf16, fp8, 4-bit).

    python -m experiments.reproduce.hf [--out runs/hf] [--steps 700] [--vocab-size 1024]

1. tokenizer: a byte-level BPE of `--vocab-size` ids trained on the built-in corpus's train split
   (experiments.tokenizer) -> <out>/tokenizer/.
2. Two runs of the same Qwen3-MoE-shaped model (the quickstart's d_model 128, 4 layers, 2 query heads sharing one KV
   head of dim 64, 8 SwiGLU experts of 128, but with Qwen3-MoE's softmax top-2 router with normalised gates and
   q/k RMSNorm), one device, the same steps, batch and sequence length: one on bytes (vocab 264), one on the BPE
   (vocab `--vocab-size`). Held-out bits per byte is the total NLL over the bytes of the held-out text, so the two
   compare directly; the BPE run reads more text per step (its tokens hold more bytes).
3. The BPE run exported (`experiments.hf export`: config.json, model.safetensors, tokenizer.json) and imported back
   from those files alone (`experiments.hf import`): its held-out bits per byte must equal the run's own.
4. The reloaded model reads held-out sequences through each KV format as a server would (a 32-token prefill, then
   one token per step; experiments.reproduce.kvcache.served_loss) -> bits per byte per format.

Writes <out>/table.{md,json}, <out>/curves.png (held-out bits per byte against steps and against bytes of text
trained on) and <out>/tokenizer/ (`--out results/hf` for the table docs/huggingface.md quotes); the runs, the export
and the reloaded run go to <out>/runs (each run's progress shown prefixed by its name; finished runs are reused
when their configuration is unchanged).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import numpy as np

from experiments import command, harness, plotting
from experiments.reproduce import runs

CONFIG = runs.config_path("quickstart")
SHAPE = [  # the quickstart MoE as Qwen3-MoE writes it, trained on one device
    "--config.mesh.site=1",
    "--config.mesh.data=1",
    "--config.moe.router=softmax",
    "--config.moe.normalize_gates=True",
    "--config.moe.expert_mlp=swiglu",
    "--config.model.qk_norm=True",
]
KV_VARIANTS = (  # labels of experiments.reproduce.kvcache.VARIANTS
    "bf16",
    "fp8",
    "fp4 (UltraQuant: mse, K rotated)",
    "fp4 mx, K rotated",
    "fp4 e1m2 (uniform grid), mse, K rotated",
    "fp4 e1m2 (uniform grid), mx, K rotated",
    "nvfp4 (E4M3 per 16, max)",
    "nvfp4 (E4M3 per 16, 4 over 6)",
    "k8v4 (fp8 K, fp4 mse V)",
)
EVAL_BATCHES = 4  # held-out batches of 8 x 256 tokens read through each KV format


def tokenizer(out: str, vocab_size: int) -> str:
    """Trains the BPE into <out>/tokenizer unless a tokenizer of that size is there (`python -m experiments.tokenizer
    train`, in its own process as every run of a reproduction is); returns the directory."""
    from core import tokenizer as tokenizer_lib

    directory = os.path.join(out, "tokenizer")
    if (
        os.path.exists(os.path.join(directory, "tokenizer.json"))
        and tokenizer_lib.load(directory).vocab_size == vocab_size
    ):
        return directory
    flags = ["--vocab-size", str(vocab_size), "--out", os.path.abspath(directory)]
    cmd = [sys.executable, "-m", "experiments.tokenizer", "train", *flags]
    code = subprocess.run(cmd, cwd=runs.ROOT, check=False).returncode
    if code != 0:
        raise RuntimeError(f"training the tokenizer failed (exit {code})")
    return directory


def train(out: str, steps: int, vocab_size: int, tokenizer_dir: str) -> dict[str, dict[str, Any]]:
    """{"bytes": summary, "bpe": summary} of the two runs (trained, or reused when finished)."""
    flags = [*SHAPE, f"--config.checkpoint.every={steps}"]
    arms = {
        "bytes": flags,
        "bpe": [
            *flags,
            f"--config.data.tokenizer={os.path.abspath(tokenizer_dir)}",
            f"--config.model.vocab_size={vocab_size}",
        ],
    }
    summaries = {}
    for name, arm_flags in arms.items():
        print(f"training the {name} model ({steps} steps) ...", flush=True)
        summaries[name] = runs.run_or_reuse(CONFIG, os.path.join(out, "runs", name), arm_flags, steps)
        print(f"  held-out {summaries[name]['val_bits_per_byte']:.4f} bits/byte", flush=True)
    return summaries


def round_trip(out: str) -> tuple[dict[str, Any], str]:
    """Exports the BPE run and imports the export into a fresh workdir, evaluated on the run's held-out batches;
    returns (the import's summary, its workdir)."""
    from experiments import load, schema
    from experiments import pretrained as importer
    from experiments.hf import export

    config, model = load.trained_model(os.path.join(out, "runs", "bpe"))
    exported = os.path.join(out, "runs", "export")
    shutil.rmtree(exported, ignore_errors=True)
    files = export.save(config, model, exported, replace=True)  # a rerun writes over its own export
    print(f"exported: {', '.join(sorted(os.path.basename(f) for f in files))}", flush=True)
    again = schema.default_config()  # the run's data and evaluation; the model and tokenizer from the export alone
    again.data.update({k: v for k, v in config.data.items() if k != "tokenizer"})
    workdir = os.path.join(out, "runs", "reloaded")
    shutil.rmtree(workdir, ignore_errors=True)
    harness.compiling("the reloaded model's held-out evaluation")
    summary = importer.import_to(workdir, exported, config=again, eval_batches=config.train.eval_batches)
    return summary, workdir


def kv_table(workdir: str) -> list[dict[str, Any]]:
    """Held-out bits per byte of the model in `workdir` read through each KV format (and without a cache)."""
    import jax
    import jax.numpy as jnp

    from core import generate
    from core import tokenizer as tokenizer_lib
    from experiments import build, load
    from experiments.reproduce import kvcache as kv_repro
    from kvcache import paged_cache_factory

    config, model = load.trained_model(workdir)
    lengths = tokenizer_lib.load(config.data.tokenizer).byte_lengths
    _, batches = build.build_data(config)
    val = batches.val_batches(EVAL_BATCHES)
    targets = np.concatenate([t[:, 1:].ravel() for t in val])
    nats_per_byte = targets.size / float(lengths[targets].sum())  # mean loss per token -> per byte
    cfg = model.cfg

    def uncached(tokens):
        logits = model(jnp.asarray(tokens[:, :-1]))[0]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return float(-jnp.mean(jnp.take_along_axis(logp, jnp.asarray(tokens[:, 1:])[..., None], axis=-1)))

    losses = {"no cache (float32 forward)": float(np.mean([uncached(t) for t in val]))}
    factories = {"dense float32 cache": generate.dense_cache_factory(model, jnp.float32)}
    for label in KV_VARIANTS:
        factories[label] = paged_cache_factory(
            kv_repro._fmt(label),
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            implementation="xla_split",
        )
    for label, factory in factories.items():
        harness.compiling(f"decoding through the {label} KV cache")
        losses[label] = float(np.mean([kv_repro.served_loss(model, t, factory) for t in val]))
        print(f"  {label}: {losses[label] * nats_per_byte / np.log(2):.4f} bits/byte", flush=True)
    base = losses["no cache (float32 forward)"]
    return [
        {
            "format": label,
            "loss": loss,
            "bits_per_byte": loss * nats_per_byte / np.log(2),
            "delta_bits_per_byte": (loss - base) * nats_per_byte / np.log(2),
        }
        for label, loss in losses.items()
    ]


def markdown(result: dict[str, Any]) -> str:
    """table.md: the two runs, the export round trip, and the reloaded model through each KV format."""
    r, kv = result["runs"], result["kv"]
    lines = [
        "# A BPE tokenizer and a Qwen3-MoE-shaped model: trained, exported, reloaded, served",
        "",
        f"`{result['command']}` ({result['steps']} steps of 8 x 256 tokens each, "
        "one device). Held-out bits per byte = total NLL over the bytes of the held-out "
        "text, so tokenizers compare directly.",
        "",
        "| model | vocab | parameters | held-out bytes per token | text trained on (MB) | held-out bits per byte |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("bytes", "bpe"):
        x = r[name]
        lines.append(
            f"| {x['label']} | {x['vocab_size']:,} | {x['num_params']:,} | {x['bytes_per_token']:.3f} | "
            f"{x['bytes_trained'] / 1e6:.1f} | {x['val_bits_per_byte']:.4f} |"
        )
    rt = result["round_trip"]
    lines += [
        "",
        f"Exported as {rt['architecture']} ({', '.join(rt['files'])}) and imported back from those files: held-out "
        f"{rt['reloaded_bits_per_byte']:.6f} bits per byte against the run's {rt['run_bits_per_byte']:.6f} "
        f"(difference {rt['difference']:.1e}).",
        "",
        f"## The reloaded model through each KV format ({result['kv_sequences']} held-out sequences x 256 tokens: a "
        "32-token prefill, then one token per step, every token's K/V quantised on write)",
        "",
        "| KV cache | held-out bits per byte | minus uncached |",
        "|---|---|---|",
    ]
    lines += [f"| {x['format']} | {x['bits_per_byte']:.4f} | {x['delta_bits_per_byte']:+.4f} |" for x in kv]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: str) -> None:
    """curves.png at `path`: held-out bits per byte of the two runs against step and against bytes of text trained
    on (`result`: table.json's record)."""
    names = ("bytes", "bpe")
    colors = plotting.colors(list(names))
    title = (
        f"held-out bits per byte, quickstart MoE as Qwen3-MoE, {result['steps']} steps, one CPU device\n"
        f"{result['command']}"
    )
    with plotting.figure(path, size=(9, 3.6), ncols=2, title=title) as (by_step, by_bytes):
        for name in names:
            x = result["runs"][name]
            steps, values = zip(*x["curve"])
            per_step = x["bytes_trained"] / result["steps"]
            by_step.plot(steps, values, color=colors[name], label=x["label"])
            by_bytes.plot(np.array(steps) * per_step / 1e6, values, color=colors[name], label=x["label"])
        by_step.set_xlabel("step")
        by_bytes.set_xlabel("text trained on (MB)")
        for ax in (by_step, by_bytes):
            ax.set_ylabel("held-out bits per byte")


def main(argv: list[str] | None = None) -> None:
    """The command line: see the module docstring, or --help."""
    study = harness.Study(__doc__ or "", module="experiments.reproduce.hf", topic="hf")
    harness.add_steps(study.parser, default=700, multiple_of=10, why="the log cadence")
    study.parser.add_argument(
        "--vocab-size", type=harness.integer(259), default=1024, help="ids of the BPE tokenizer (>= 259)"
    )
    args = study.parse(argv)
    from experiments import load

    tokenizer_dir = tokenizer(args.out, args.vocab_size)
    summaries = train(args.out, args.steps, args.vocab_size, tokenizer_dir)
    reloaded, workdir = round_trip(args.out)
    print("the reloaded model through each KV format ...", flush=True)
    kv = kv_table(workdir)
    result_runs = {}
    for name, label in (
        ("bytes", "bytes (the quickstart's tokenizer)"),
        ("bpe", f"byte-level BPE, {args.vocab_size:,} ids"),
    ):
        workdir_run = os.path.join(args.out, "runs", name)
        config = load.run_config(workdir_run)
        per_token = held_out_bytes_per_token(config)
        tokens = args.steps * config.data.batch_size * config.data.seq_len
        result_runs[name] = {
            "label": label,
            "vocab_size": config.model.vocab_size,
            "num_params": summaries[name]["num_params"],
            "bytes_per_token": per_token,
            "bytes_trained": tokens * per_token,
            "val_bits_per_byte": summaries[name]["val_bits_per_byte"],
            "curve": runs.read_metric(workdir_run, "val_bits_per_byte"),
        }
    with open(os.path.join(args.out, "runs", "export", "config.json")) as f:
        architecture = json.load(f)["architectures"][0]
    run_bpb, again = summaries["bpe"]["val_bits_per_byte"], reloaded["val_bits_per_byte"]
    result = {
        "steps": args.steps,
        "runs": result_runs,
        "round_trip": {
            "architecture": architecture,
            "files": sorted(os.listdir(os.path.join(args.out, "runs", "export"))),
            "run_bits_per_byte": run_bpb,
            "reloaded_bits_per_byte": again,
            "difference": abs(again - run_bpb),
        },
        "kv": kv,
        "kv_sequences": EVAL_BATCHES * 8,
    }
    study.write("table", result, markdown, {"curves.png": plot})


def held_out_bytes_per_token(config) -> float:
    """Bytes of text per token of the held-out split under the config's tokenizer (specials count as tokens)."""
    from core import tokenizer as tokenizer_lib
    from experiments import build

    corpus, _ = build.build_data(config)
    return float(tokenizer_lib.load(config.data.tokenizer).byte_lengths[corpus.val].sum() / corpus.val.size)


if __name__ == "__main__":
    command.run(main)
