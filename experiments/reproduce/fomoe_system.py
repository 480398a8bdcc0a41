"""FoMoE's system model: the paper's parameter table, and the 104B projection at M = 32 sites.

    python -m experiments.reproduce.fomoe_system [--out runs/fomoe]

Writes into `--out` (`--out results/fomoe` for the tables and plots docs/fomoe.md quotes) system_model.md (parameter
counts against the paper's table; bytes per site per round, memory per site and training hours for FoMoE at O_e in
{1, 2, 4, 8, 16, 32} and for DDP, at 1, 10 and 100 Gbps), system_model.json, cumulative_bytes.png (bytes each site
has sent against training tokens) and training_hours.png (hours against O_e). Every assumption the paper does not
state is a documented default of `moe.system_model` (fp32 parameters on the wire, 20 tokens per active parameter,
4M-token global batch, K = 32, a 64-accelerator site at MFU 0.4, 50 ms latency)."""

from __future__ import annotations

import dataclasses

import numpy as np

from core.codec import WireFormat
from experiments import command, harness, plotting
from moe import system_model as sm

OVERLAPS = (1, 2, 4, 8, 16, 32)
BANDWIDTHS = (1, 10, 100)
SITES = 32


def parameter_table() -> list[dict]:
    """Per model of the paper's table: its shape, the paper's count, ours and the relative difference."""
    rows = []
    for name, (shape, stated) in sm.PAPER_MODELS.items():
        p = sm.param_count(shape.d_model, shape.num_layers, shape.num_experts, shape.expert_size, shape.vocab_size)
        rows.append(
            {
                "model": name,
                "d_model": shape.d_model,
                "layers": shape.num_layers,
                "experts": shape.num_experts,
                "active": shape.top_k,
                "paper": stated,
                "ours": p["total"],
                "dense": p["dense"],
                "expert_params": p["experts"] + p["router"],
                "relative_difference": p["total"] / stated - 1,
            }
        )
    return rows


# label: (outer method, wire format or None for float32, LocalAdamW's second moments, fragments)
SYNC_VARIANTS = {
    "LocalAdamW, float32": ("local_adamw", None, "sent", 1),
    "LocalAdamW, bf16": ("local_adamw", WireFormat("bf16"), "sent", 1),
    "LocalAdamW, int8 (second moments bf16)": ("local_adamw", WireFormat("int8"), "sent", 1),
    "LocalAdamW, fp4 (second moments bf16)": ("local_adamw", WireFormat("fp4"), "sent", 1),
    "LocalAdamW, fp4, second moments local": ("local_adamw", WireFormat("fp4"), "local", 1),
    "LocalAdamW, float32, 4 fragments (second moments local)": ("local_adamw", None, "local", 4),
    "DiLoCo, float32": ("diloco", None, "sent", 1),
    "DiLoCo, fp4": ("diloco", WireFormat("fp4"), "sent", 1),
}
SYNC_OVERLAPS = (4, SITES)


def sync_projection(shape: sm.ModelShape) -> list[dict]:
    """The 104B projection per synchronisation variant (SYNC_VARIANTS: UE8M0 scales per 32 values), at O_e in
    SYNC_OVERLAPS and each bandwidth, blocking and hidden behind the next round's compute."""
    rows = []
    for label, (outer, wire, second, count) in SYNC_VARIANTS.items():
        for o in SYNC_OVERLAPS:
            row: dict = {"variant": label, "overlap": o}
            for hidden in (False, True):
                projection = sm.project(
                    shape, sites=SITES, overlaps=(o,), bandwidths_gbps=BANDWIDTHS, optimizer=outer, wire=wire,
                    second_moments=second, hidden=hidden, fragments=count,
                )  # fmt: skip
                fomoe = [r for r in projection if r.method != "DDP"]
                row["bytes_per_site_per_round"] = fomoe[0].bytes_per_site_per_round
                row["sync_period_steps"] = fomoe[0].sync_period_steps
                row["staleness_steps" if hidden else "staleness_steps_blocking"] = fomoe[0].staleness_steps
                row["hours_hidden" if hidden else "hours"] = {r.bandwidth_gbps: r.hours for r in fomoe}
                row["ddp_bytes_per_step"] = next(r for r in projection if r.method == "DDP").bytes_per_site_per_round
            rows.append(row)
    return rows


def sync_markdown(rows: list[dict]) -> list[str]:
    """The lines of system_model.md's table of synchronisation variants."""
    lines = [
        "",
        f"What low-bit synchronisation and overlap change at 104B (M = {SITES}, K = 32; wire formats with UE8M0 "
        "scales per 32 values, moe.lowbit_sync; F fragments: a round moves 1/F of the bytes, each fragment every F "
        "rounds; 'hidden': each round's synchronisation runs behind the next round's local steps and is applied one "
        "round (K steps) late, so a round takes max(compute, transfer) instead of their sum; moe.streaming):",
        "",
        "| synchronisation | O_e | GB per site per round | x fewer than DDP over K steps | a parameter synced "
        "every (steps) | hidden: applied (steps) late | "
        + " | ".join(f"hours at {g} Gbps" for g in BANDWIDTHS)
        + " | "
        + " | ".join(f"hidden, {g} Gbps" for g in BANDWIDTHS)
        + " |",
        "|---|---|---|---|---|---|" + "---|" * (2 * len(BANDWIDTHS)),
    ]
    for r in rows:
        ratio = 32 * r["ddp_bytes_per_step"] / r["bytes_per_site_per_round"]
        lines.append(
            f"| {r['variant']} | {r['overlap']} | {r['bytes_per_site_per_round'] / 1e9:,.0f} | {ratio:,.0f}x | "
            f"{r['sync_period_steps']} | {r['staleness_steps']} | "
            + " | ".join(f"{r['hours'][g]:,.0f}" for g in BANDWIDTHS)
            + " | "
            + " | ".join(f"{r['hours_hidden'][g]:,.0f}" for g in BANDWIDTHS)
            + " |"
        )
    return lines


def projections(result: dict) -> list[sm.Projection]:
    """The 104B projection's rows of a result (its "projection", as dicts) as moe.system_model.Projection."""
    return [sm.Projection(**r) for r in result["projection"]]


def markdown(result: dict) -> str:
    """system_model.md: the parameter table, then the 104B projection per method and O_e at each bandwidth, then
    the synchronisation variants' projection (`sync_markdown`)."""
    params, projection, command = result["parameters"], projections(result), result["command"]
    lines = [
        "# FoMoE system model",
        "",
        "Parameter counts (attention 4 d^2 per layer, experts 2 d h, router d N_e, "
        f"tied vocabulary 200,019; `{command}`):",
        "",
        "| model | d_model | layers | experts | active | paper | ours | difference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in params:
        lines.append(
            f"| {r['model']} | {r['d_model']} | {r['layers']} | {r['experts']} | {r['active']} | "
            f"{r['paper'] / 1e6:,.0f}M | {r['ours'] / 1e6:,.1f}M | {100 * r['relative_difference']:+.2f}% |"
        )
    lines += [
        "",
        f"104B (XXL) at M = {SITES} sites, LocalAdamW, K = 32, fixed placement, partitioned router "
        "(assumptions in `moe/system_model.py`):",
        "",
        "| method | O_e | GB per site per round | memory per site (GiB) | hours at 1 Gbps | at 10 Gbps | at 100 Gbps |",
        "|---|---|---|---|---|---|---|",
    ]
    by = {(r.method, r.overlap, r.bandwidth_gbps): r for r in projection}
    for method, overlaps in (("FoMoE local_adamw", OVERLAPS), ("DDP", (SITES,))):
        for o in overlaps:
            first = by[(method, o, BANDWIDTHS[0])]
            hours = " | ".join(f"{by[(method, o, g)].hours:,.0f}" for g in BANDWIDTHS)
            lines.append(
                f"| {method}{' (every step)' if method == 'DDP' else ''} | {o} | "
                f"{first.bytes_per_site_per_round / 1e9:,.0f} | {first.memory_gib_per_site:,.0f} | {hours} |"
            )
    lines += [
        "",
        "DDP's bytes are per step (it synchronises every step, K = 1); FoMoE's per round of K = 32 steps.",
        "Full replica = FoMoE at O_e = 32. The paper states the large model as ~1.8B (two significant "
        "digits), which our 1,819.6M rounds to.",
    ]
    lines += sync_markdown(result["synchronisation"])
    return "\n".join(lines) + "\n"


def cumulative_plot(result: dict, path: str) -> None:
    """cumulative_bytes.png: TB each site has sent against tokens trained (log-log, at the first bandwidth), to the
    model's whole token budget (moe.system_model.TOKENS_PER_ACTIVE_PARAM per active parameter); the command that
    made it as its title."""
    total_tokens = sm.TOKENS_PER_ACTIVE_PARAM * sm.active_params(sm.ModelShape(**result["shape"]))
    with plotting.figure(path, size=(6, 4.3), grid="both", title=f"{result['command']} (a projection)") as ax:
        for r in projections(result):
            if r.bandwidth_gbps != BANDWIDTHS[0]:
                continue
            tokens = np.geomspace(1e9, total_tokens, 50)
            per_token = r.bytes_per_site_per_round * r.rounds / total_tokens
            label = (
                "DDP (every step)"
                if r.method == "DDP"
                else f"FoMoE O_e={r.overlap}" + (" (full replica)" if r.overlap == SITES else "")
            )
            ax.loglog(tokens, tokens * per_token / 1e12, label=label, ls="--" if r.method == "DDP" else "-")
        ax.set_xlabel("tokens trained")
        ax.set_ylabel("cumulative TB sent per site")
        ax.set_title(f"104B MoE, M = {SITES} sites, LocalAdamW, K = 32", fontsize=9)


def hours_plot(result: dict, path: str) -> None:
    """training_hours.png: training hours against O_e per bandwidth, DDP dotted; the command that made it as its
    title."""
    projection = projections(result)
    title = f"{result['command']} (a projection)"
    with plotting.figure(path, size=(6, 4.8), grid="both", title=title, legend_below=True, legend_columns=3) as ax:
        for g in BANDWIDTHS:
            rows = [r for r in projection if r.bandwidth_gbps == g and r.method != "DDP"]
            line = ax.plot([r.overlap for r in rows], [r.hours for r in rows], "o-", label=f"FoMoE, {g} Gbps")
            ddp = next(r for r in projection if r.bandwidth_gbps == g and r.method == "DDP")
            ax.axhline(ddp.hours, color=line[0].get_color(), ls=":", lw=1, label=f"DDP, {g} Gbps")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("overlap O_e (sites per expert; 32 = full replica)")
        ax.set_ylabel("training hours")
        ax.set_title("104B MoE, M = 32 sites (projection)", fontsize=9)


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    study = harness.Study(__doc__, module="experiments.reproduce.fomoe_system", topic="fomoe")
    study.parse(argv)
    shape = sm.PAPER_MODELS["XXL"][0]
    projection = sm.project(shape, sites=SITES, overlaps=OVERLAPS, bandwidths_gbps=BANDWIDTHS)
    result = {
        "parameters": parameter_table(),
        "shape": dataclasses.asdict(shape),
        "projection": [dataclasses.asdict(r) for r in projection],
        "synchronisation": sync_projection(shape),
    }
    plots = {"cumulative_bytes.png": cumulative_plot, "training_hours.png": hours_plot}
    study.write("system_model", result, markdown, plots)


if __name__ == "__main__":
    command.run(main)
