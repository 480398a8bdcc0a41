"""Decoupled DiLoCo over real links with a learner lost and back: goodput and final loss against the same run
uninterrupted, beside the synchronous launcher's churn result.

    python -m experiments.reproduce.links_decoupled [--out runs/fomoe_links] [--rate 10] [--steps 128]
        [--lose-after 4] [--down 20] [--quorum 3] [--grace 5]

Needs root (experiments.links). Both runs are `python -m experiments.decoupled --links` of the links reproduction's
model (experiments.reproduce.links_methods, full replica, DiLoCo's outer step) at M = 4 learners, each in its own
network namespace behind a link of `--rate` Mbit/s each way, the synchroniser in the hub. The churned run kills
learner 1's process when its `--lose-after`-th push arrives and starts it again `--down` seconds later (it joins at
the furthest step pushed, with the current global parameters and a fresh inner optimizer state). Goodput: tokens in
merged contributions per second of the command, start-up and compilation included (experiments.decoupled).

Reported (links_decoupled.md, links_decoupled.json): both runs' held-out loss, useful tokens, wall seconds and
goodput; the merges each run made; the synchronous launcher's churn result (links_churn.json in --out, when there)
beside it, as that file states it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from experiments import command, harness
from experiments.cluster import links
from experiments.reproduce import links_methods

SITES, LOST = 4, 1


def markdown(r: dict) -> str:
    u, c = r["uninterrupted"], r["churned"]
    lines = [
        "# Decoupled DiLoCo over real links: a learner lost and back",
        "",
        f"`{r['command']}` (root): the links model, full replica, DiLoCo's outer step, M = {SITES} learners, "
        f"K = {links_methods.K}, {r['steps']} steps, each learner behind a link of {r['rate']:g} Mbit/s each way, "
        f"quorum {r['quorum']}, grace {r['grace']:g} s. Churned: learner {LOST} killed at its push "
        f"{r['lose_after']}, started again {r['down']:g} s later. Goodput: tokens in merged contributions per second "
        "of the command (start-up and compilation included). The learners share this machine's cores.",
        "",
        "| run | held-out loss | difference | useful tokens | wall s | goodput tokens/s | vs uninterrupted | merges |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, x in (("uninterrupted", u), (f"learner {LOST} lost and back", c)):
        lines.append(
            f"| {name} | {x['val_loss']:.4f} | {100 * (x['val_loss'] / u['val_loss'] - 1):+.2f}% | "
            f"{x['useful_tokens']:,} | {x['wall_seconds']:.1f} | {x['goodput_tokens_per_second']:,.0f} | "
            f"{100 * x['goodput_tokens_per_second'] / u['goodput_tokens_per_second']:.0f}% | {x['merges']} |"
        )
    s = r.get("synchronous")
    if s:
        lines += [
            "",
            f"Beside it, the synchronous launcher (`{s['command']}`, {links_methods.METHODS[s['method']][0]}, a site "
            f"lost after round {s['lose_after']} and joining after round {s['join_after']}): goodput "
            f"{s['churned']['goodput']:,.0f} against {s['uninterrupted']['goodput']:,.0f} tokens/s uninterrupted "
            f"({100 * s['churned']['goodput'] / s['uninterrupted']['goodput']:.0f}%), held-out loss "
            f"{s['churned']['val_loss']:.4f} against {s['uninterrupted']['val_loss']:.4f}.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    study = harness.Study(__doc__, module="experiments.reproduce.links_decoupled", topic="fomoe_links")
    p = study.parser
    k = links_methods.K
    p.add_argument("--rate", type=harness.integer(1), default=10, help="the links' rate in Mbit/s, each way")
    harness.add_steps(p, default=128, multiple_of=k, why=f"whole rounds of K = {k}")
    p.add_argument("--lose-after", type=harness.integer(1), default=4, help="learner 1's push at which it is killed")
    p.add_argument("--down", type=harness.number(0.0), default=20.0, help="seconds before it starts again")
    p.add_argument("--quorum", type=harness.integer(1), default=3, help="learners a merge takes (1..4)")
    p.add_argument("--grace", type=harness.number(0.0), default=5.0, help="seconds a quorum waits for the rest")
    args = study.parse(argv)
    reason = links.unavailable()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    flags = links_methods.flags("full_diloco", SITES, args.steps, args.steps)
    results: dict[str, dict] = {}
    with links.Network(sites=SITES, rate_mbit=args.rate) as net:
        for run in ("uninterrupted", "churned"):
            study.progress(len(results) + 1, 2, run)
            workdir = os.path.abspath(
                os.path.join(args.out, "runs", links_methods.rate_name(args.rate), f"decoupled_{run}")
            )
            cmd = [sys.executable, "-m", "experiments.decoupled", "--links", "--quorum", str(args.quorum)]
            cmd += ["--grace", str(args.grace)]
            cmd += ["--fail", f"{LOST}@{args.lose_after}:{args.down:g}"] if run == "churned" else []
            cmd += [
                "--",
                f"--config={links_methods.CONFIG}",
                f"--workdir={workdir}",
                f"--config.train.steps={args.steps}",
            ]
            cmd += flags
            started = time.time()
            subprocess.run(
                ["ip", "netns", "exec", net.hub.netns, *cmd], env=dict(os.environ, **net.environment()), check=True
            )
            with open(os.path.join(workdir, "summary.json")) as f:
                results[run] = {**json.load(f), "command_seconds": time.time() - started}
    synchronous = None
    if os.path.exists(path := os.path.join(args.out, "links_churn.json")):
        with open(path) as f:
            synchronous = json.load(f)
    result = {
        "rate": float(args.rate), "steps": args.steps, "lose_after": args.lose_after, "down": args.down,
        "quorum": args.quorum, "grace": args.grace, **results,
        "synchronous": synchronous,
    }  # fmt: skip
    study.write("links_decoupled", result, markdown, always=("steps", "rate"))
    return 0


if __name__ == "__main__":
    command.run(main)
