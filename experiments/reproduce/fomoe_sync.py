"""FoMoE with low-bit synchronisation: bytes per round and held-out loss of every wire format, against float32
synchronisation's seed spread and DDP.

    python -m experiments.reproduce.fomoe_sync [--out runs/fomoe] [--steps 256] [--seeds 0,1]

Trains experiments/configs/fomoe.py (d_model 128, 4 layers, 8 experts top-2) at M = 4 sites, O_e = 2, K = 32 (the
spec's ratio setting), fixed placement, on the same tokens for `--steps` steps, once per seed (`train.seed`: the
initialisation and the sites' rounding draws; the data order is the corpus's), with LocalAdamW rounds whose
synchronisation sends float32 (the exact mean), bf16, int8 or fp4 (E2M1), the low-bit ones with UE8M0 scales per 32
values and nearest rounding, with and without error feedback (LocalAdamW's second moments as bf16 under a block
format, moe.rounds.second_moment_wire, or kept on each site), with DES-LOC's moment periods (3, 6) (moe.desloc:
first moments averaged every 3rd round, second every 6th) in float32 and fp4 with error feedback, and with DiLoCo
rounds in float32 and fp4 with error feedback; plus DDP on 4 devices (gradients all-reduced every step; one seed,
for its bytes and loss). Each run is `python -m experiments.run` with 4 virtual CPU devices in
`<out>/runs/sync_<method>_s<seed>`, reused when finished.

Reported (sync.md, sync.json, sync.png): per method the bytes each site sends per round, read from the compiled
synchronisation (and whether they equal moe.system_model's formula), how many times fewer than float32
synchronisation of the same outer method and than DDP over the K steps of a round, and the held-out loss per seed,
their mean, and where the mean lies against float32 synchronisation's seed range (min..max over the seeds) of the
same outer method.
"""

from __future__ import annotations

import math
import os

from experiments import command, harness, plotting
from experiments.reproduce import runs

CONFIG = runs.config_path("fomoe")
SITES, OVERLAP, K = 4, 2, 32
DESLOC = (3, 6)  # the DES-LOC rows' moment periods (the paper's K_u = 3 K_x, K_v = 6 K_x)
# name: (label, fomoe.outer, fomoe.sync_format, fomoe.error_feedback, fomoe.second_moments)
METHODS = {
    "f32": ("LocalAdamW, float32", "local_adamw", "float32", False, "sent"),
    "bf16": ("LocalAdamW, bf16", "local_adamw", "bf16", False, "sent"),
    "int8": ("LocalAdamW, int8 (second moments bf16)", "local_adamw", "int8", False, "sent"),
    "int8_ef": ("LocalAdamW, int8 + error feedback (second moments bf16)", "local_adamw", "int8", True, "sent"),
    "fp4": ("LocalAdamW, fp4 (second moments bf16)", "local_adamw", "fp4", False, "sent"),
    "fp4_ef": ("LocalAdamW, fp4 + error feedback (second moments bf16)", "local_adamw", "fp4", True, "sent"),
    "fp4_ef_local": ("LocalAdamW, fp4 + error feedback, second moments local", "local_adamw", "fp4", True, "local"),
    "desloc_f32": ("LocalAdamW, float32, DES-LOC moment periods (3, 6)", "local_adamw", "float32", False, "sent"),
    "desloc_fp4_ef": (
        "LocalAdamW, fp4 + error feedback, DES-LOC moment periods (3, 6)",
        "local_adamw",
        "fp4",
        True,
        "sent",
    ),
    "diloco_f32": ("DiLoCo, float32", "diloco", "float32", False, "sent"),
    "diloco_fp4_ef": ("DiLoCo, fp4 + error feedback", "diloco", "fp4", True, "sent"),
}


def flags(method: str, seed: int, steps: int) -> list[str]:
    """The experiments.run flags of one run (`method` "ddp" or one of METHODS)."""
    out = [f"--config.train.eval_every={steps}", f"--config.train.seed={seed}"]
    if method == "ddp":
        return out + ["--config.mesh.site=1", f"--config.mesh.data={SITES}"]
    _, outer, fmt, feedback, second = METHODS[method]
    return (
        out
        + [
            f"--config.mesh.site={SITES}",
            "--config.mesh.data=1",
            f"--config.fomoe.overlap={OVERLAP}",
            f"--config.fomoe.local_steps={K}",
            f"--config.fomoe.outer={outer}",
            f"--config.fomoe.sync_format={fmt}",
            f"--config.fomoe.error_feedback={feedback}",
            f"--config.fomoe.second_moments={second}",
        ]
        + ([f"--config.fomoe.moment_periods={DESLOC}"] if method.startswith("desloc") else [])
    )


def train(method: str, seed: int, steps: int, out: str) -> dict:
    """Trains (or reuses) one run in `<out>/runs/sync_<method>_s<seed>`; returns its summary.json."""
    workdir = os.path.join(out, "runs", f"sync_{method}_s{seed}")
    return runs.run_or_reuse(CONFIG, workdir, flags(method, seed, steps), steps, devices=SITES)


def rows(summaries: dict[str, dict[int, dict]], ddp: dict) -> list[dict]:
    """One row per method: bytes per round (measured, formula), ratios, losses per seed and their mean."""
    ddp_round = K * ddp["bytes_per_device_per_step"]
    ranges = {}  # float32 synchronisation's seed range per outer method
    for method, outer in (("f32", "local_adamw"), ("diloco_f32", "diloco")):
        losses = [s["val_loss"] for s in summaries[method].values()]
        ranges[outer] = (min(losses), max(losses))
    out = []
    for method, by_seed in summaries.items():
        label, outer, fmt, feedback, second = METHODS[method]
        first = next(iter(by_seed.values()))
        reference = next(iter(summaries["f32" if outer == "local_adamw" else "diloco_f32"].values()))
        losses = [s["val_loss"] for s in by_seed.values()]  # in the order of the seeds
        mean = sum(losses) / len(losses)
        low, high = ranges[outer]
        out.append(
            {
                "method": method,
                "label": label,
                "outer": outer,
                "sync_format": fmt,
                "error_feedback": feedback,
                "second_moments": second,
                "bytes_per_round": first["bytes_per_site_per_round"],
                "bytes_per_round_formula": first["bytes_per_site_per_round_formula"],
                "vs_float32": reference["bytes_per_site_per_round"] / first["bytes_per_site_per_round"],
                "vs_ddp": ddp_round / first["bytes_per_site_per_round"],
                "val_loss": losses,
                "val_loss_mean": mean,
                "float32_range": [low, high],
                "against_float32": "within"
                if low <= mean <= high
                else "below"
                if mean < low
                else f"above by {mean - high:.4f}",
            }
        )
    return out


def markdown(result: dict) -> str:
    """sync.md: per method its bytes per round, how many times fewer than float32 and than DDP, its held-out loss
    per seed and their mean against float32's seed range."""
    seeds = result["seeds"]
    lines = [
        "# FoMoE with low-bit synchronisation",
        "",
        f"`{result['command']}`: experiments/configs/fomoe.py at M = {SITES} sites, O_e = {OVERLAP}, K = {K}, fixed "
        f"placement, {result['steps']} steps of 16 x 256 byte-tokens for every run, seeds "
        f"{', '.join(map(str, seeds))}. "
        "Low-bit formats: UE8M0 scales per 32 values, nearest rounding; what travels is each site's change since the "
        "round's start, averaged in float32 (moe.lowbit_sync). Bytes: per site per round, read from the compiled "
        "synchronisation (= the formula where marked). DDP: gradients all-reduced every step "
        f"({result['ddp']['bytes_per_step'] / 1e6:,.2f} MB per step, {K} steps per round; held-out loss "
        f"{result['ddp']['val_loss']:.4f}, seed {seeds[0]}).",
        "",
        "| method | MB per site per round | = formula | x fewer than float32 | x fewer than DDP | "
        + " | ".join(f"held-out loss, seed {s}" for s in seeds)
        + " | mean | against float32's seed range |",
        "|---|---|---|---|---|" + "---|" * len(seeds) + "---|---|",
    ]
    for r in result["rows"]:
        same = "yes" if math.isclose(r["bytes_per_round"], r["bytes_per_round_formula"], rel_tol=1e-12) else "no"
        losses = " | ".join(f"{loss:.4f}" for loss in r["val_loss"])
        lines.append(
            f"| {r['label']} | {r['bytes_per_round'] / 1e6:,.3f} | {same} | {r['vs_float32']:.2f}x | "
            f"{r['vs_ddp']:.0f}x | {losses} | {r['val_loss_mean']:.4f} | {r['against_float32']} |"
        )
    ranges = {r["outer"]: r["float32_range"] for r in result["rows"] if r["sync_format"] == "float32"}
    lines += [
        "",
        "float32 synchronisation's seed range (min .. max over the seeds): "
        + "; ".join(f"{outer} {lo:.4f} .. {hi:.4f} (spread {hi - lo:.4f})" for outer, (lo, hi) in ranges.items())
        + ". 'x fewer than float32' and the range compare with float32 synchronisation of the same outer method "
        "('below': a lower held-out loss than every float32 seed).",
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """sync.png: held-out loss (each seed, and the mean) against MB per site per round, log scale."""
    with plotting.figure(path, size=(7, 4.8), grid="both", title=result["command"], legend_size=7) as ax:
        colors = plotting.colors([r["method"] for r in result["rows"]])
        for r in result["rows"]:
            x = r["bytes_per_round"] / 1e6
            ax.scatter([x] * len(r["val_loss"]), r["val_loss"], color=colors[r["method"]], s=12)
            ax.scatter([x], [r["val_loss_mean"]], color=colors[r["method"]], marker="D", s=40, label=r["label"])
        ax.set_xscale("log")
        ax.set_xlabel("MB per site per round (compiled)")
        ax.set_ylabel("held-out loss (nats per byte-token)")
        ax.set_title(f"M = {SITES}, O_e = {OVERLAP}, K = {K}: loss against synchronisation bytes", fontsize=9)


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    study = harness.Study(__doc__, module="experiments.reproduce.fomoe_sync", topic="fomoe")
    harness.add_steps(study.parser, default=256, multiple_of=K, why=f"whole rounds at K = {K}")
    harness.add_seeds(
        study.parser, default="0,1", what="initialisation and rounding draws; the float32 spread", at_least=2
    )
    args = study.parse(argv)
    total = len(METHODS) * len(args.seeds) + 1
    summaries: dict[str, dict[int, dict]] = {m: {} for m in METHODS}
    done = 0
    for seed in args.seeds:
        for method in METHODS:
            done += 1
            study.progress(done, total, f"{METHODS[method][0]}, seed {seed}")
            summaries[method][seed] = train(method, seed, args.steps, args.out)
    study.progress(total, total, f"DDP, seed {args.seeds[0]}")
    ddp = train("ddp", args.seeds[0], args.steps, args.out)
    result = {
        "steps": args.steps,
        "seeds": args.seeds,
        "ddp": {"bytes_per_step": ddp["bytes_per_device_per_step"], "val_loss": ddp["val_loss"]},
        "rows": rows(summaries, ddp),
    }
    study.write("sync", result, markdown, {"sync.png": plot})


if __name__ == "__main__":
    command.run(main)
