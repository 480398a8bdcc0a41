"""Regroup a federated run onto another number of sites, from its last checkpoint (moe.elastic): a site lost, or
one joining.

    python -m experiments.elastic --workdir runs/fomoe --sites 3 --lost 2     # site 2 is gone: go on with 3
    python -m experiments.elastic --workdir runs/fomoe --sites 5              # a fifth site joins

then rerun the run's command with the `--config...` flags it prints (and `--processes` the new number of sites);
`experiments.launch --elastic` does both by itself when a site fails. What it does to the workdir: the latest
checkpoint (step t, of M sites) is regrouped onto the new sites, the placement of moe.elastic.regrouped_overlap
(every expert kept: with O_e = 1 the experts of a lost site are refused by name unless --reinitialise-lost-experts),
and saved as the workdir's checkpoint of step t for the new config (mesh.site, fomoe.overlap, data.batch_size = the
same rows per site); the M-site checkpoints move to `checkpoints.sites-<M>` (nothing is deleted), and history.jsonl
records what happened. The rerun resumes from step t; the metric rows past it are set aside as on any resume.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import jax
import numpy as np

from core import checkpoint
from core import workdir as workdir_lib
from experiments import command, federated, load, schema
from moe import elastic
from moe.placement import fixed_placement

__all__ = ["main", "regroup_workdir"]


def regroup_workdir(workdir: str, sites: int, *, lost=(), reinitialise_lost: bool = False) -> dict[str, Any]:
    """Regroups the federated run in `workdir` onto `sites` sites (module docstring). Returns {"flags": the
    experiments.run flags of the new config, "step", "sites_before", "overlap_before", "overlap", "lost",
    "lost_experts", "copied" ({new site: {expert: old site}}), "joined", "shipped_bytes" ({new site: bytes of state
    it did not hold: its copied experts and their optimizer state; a joiner's whole state})}.
    Raises ValueError naming what refuses it: no federated run or checkpoint, a random placement, SPES, a bad site
    count, lost sites outside the run's, or (moe.elastic.LostExpertsError) experts that died with their sites."""
    config = load.run_config(workdir)
    m, f = config.mesh.site, config.fomoe
    if m < 2:
        raise ValueError(f"{workdir}: mesh.site = {m}; only a federated run (mesh.site >= 2) regroups.")
    if f.placement != "fixed":
        raise ValueError(f"{workdir}: fomoe.placement = {f.placement!r}; regrouping needs the fixed placement.")
    if f.outer == "spes":  # (each site's OwnedState says which experts it trains: a new M re-deals them)
        raise ValueError(f"{workdir}: fomoe.outer = 'spes'; a SPES run does not regroup (expert ownership is per M).")
    lost = sorted(set(lost))
    if any(not 0 <= s < m for s in lost):
        raise ValueError(f"--lost {lost}: the run's sites are 0..{m - 1}.")
    survivors = [s for s in range(m) if s not in lost]
    if sites < 2 or sites < len(survivors):
        raise ValueError(
            f"--sites {sites}: at least 2, and at least the {len(survivors)} surviving sites (sites only join or "
            "are lost)."
        )
    directory = os.path.join(workdir, "checkpoints")
    checkpointer = checkpoint.Checkpointer(directory)
    step = checkpointer.latest_step()
    if step is None:
        raise ValueError(f"{directory} holds no checkpoint to regroup from.")
    record = checkpointer.read_record(step)
    checkpointer.close()
    old = checkpoint.load_numpy(directory, step)
    experts = config.moe.num_experts if config.moe.every else 1
    overlap = elastic.regrouped_overlap(experts, sites, f.overlap)
    new = config.copy_and_resolve_references()
    new.mesh.site, new.fomoe.overlap = sites, overlap
    new.data.batch_size = config.data.batch_size // m * sites
    if config.mesh.num_processes > 1:  # a multi-process run keeps its sites per process (the launcher: one)
        sites_per_process = m // config.mesh.num_processes
        new.mesh.num_processes, new.mesh.process_id = sites // sites_per_process, 0
    schema.validate(new)
    _, optimizer, outer, like = federated.initial_state(new)
    like = jax.tree.map(np.asarray, like)
    before = fixed_placement(experts, m, f.overlap)
    after = fixed_placement(experts, sites, overlap)
    state, report = elastic.regroup(
        old, like, before, after, survivors, optimizer, outer, reinitialise_lost=reinitialise_lost
    )
    with open(os.path.join(workdir, "data.json")) as fh:
        fingerprint = json.load(fh)["fingerprint"]
    aside = workdir_lib.free_name(os.path.join(workdir, f"checkpoints.sites-{m}"))
    os.replace(directory, aside)
    writer = checkpoint.Checkpointer(directory)
    writer.save(
        step,
        state,
        loop=record.get("loop", {}),
        compat=schema.checkpoint_compat(new, fingerprint),
        provenance=schema.provenance(new),
    )
    writer.close()
    flags = [
        f"--config.mesh.site={sites}",
        f"--config.fomoe.overlap={overlap}",
        f"--config.data.batch_size={new.data.batch_size}",
    ]
    out = {
        "step": step,
        "sites_before": m,
        "sites": sites,
        "overlap_before": f.overlap,
        "overlap": overlap,
        "lost": lost,
        "lost_experts": report["lost_experts"],
        "reinitialised": report["lost_experts"] if reinitialise_lost else [],
        "copied": report["copied"],
        "joined": report["joined"],
        "shipped_bytes": report["shipped_bytes"],
        "checkpoints_before": aside,
        "flags": flags,
    }
    workdir_lib.append_history(workdir, {"regrouped": {k: v for k, v in out.items() if k != "flags"}})
    return out


def describe(out: dict[str, Any]) -> str:
    """What a regroup did, in a few lines (what the launcher and the command print)."""
    lines = [
        f"regrouped the checkpoint of step {out['step']}: {out['sites_before']} -> {out['sites']} sites, O_e "
        f"{out['overlap_before']} -> {out['overlap']}"
        + (f"; lost site {', '.join(map(str, out['lost']))}" if out["lost"] else "")
        + (f"; joining site {', '.join(map(str, out['joined']))}" if out["joined"] else "")
    ]
    if out["reinitialised"]:
        lines.append(f"re-initialised experts {out['reinitialised']} (they died with their site)")
    else:
        lines.append("every expert kept (copied from a surviving replica where a site did not host it)")
    for s, copied in sorted(out["copied"].items()):
        pairs = ", ".join(f"{e} from site {src}" for e, src in sorted(copied.items()))
        lines.append(f"  new site {s} receives experts {pairs} ({out['shipped_bytes'][s] / 1e6:,.2f} MB)")
    for s in out["joined"]:
        lines.append(f"  new site {s} joins with {out['shipped_bytes'][s] / 1e6:,.2f} MB of state")
    lines.append(f"the {out['sites_before']}-site checkpoints are in {out['checkpoints_before']}")
    lines.append("rerun with: " + " ".join(out["flags"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.elastic",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(__doc__ or "").split("\n\n", 1)[1],
    )
    parser.add_argument("--workdir", required=True, help="the federated run's workdir")
    parser.add_argument("--sites", type=int, required=True, help="the number of sites to go on with (>= 2)")
    parser.add_argument("--lost", default="", help="comma-separated indices of the sites that are gone")
    parser.add_argument(
        "--reinitialise-lost-experts",
        action="store_true",
        help="experts no surviving site hosts (O_e = 1) start afresh instead of being refused",
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line (for the launcher)")
    args = parser.parse_args(argv)
    try:
        lost = [int(s) for s in args.lost.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--lost {args.lost!r}: comma-separated site indices, e.g. --lost 2")
    try:
        out = regroup_workdir(args.workdir, args.sites, lost=lost, reinitialise_lost=args.reinitialise_lost_experts)
    except (ValueError, OSError, checkpoint.CheckpointError, load.RunConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({**out, "description": describe(out)}, default=str) if args.json else describe(out), flush=True)
    return 0


if __name__ == "__main__":
    command.run(main)
