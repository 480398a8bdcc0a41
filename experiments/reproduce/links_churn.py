"""FoMoE over real links with a site that leaves and joins again: goodput and final loss against the same run
uninterrupted.

    python -m experiments.reproduce.links_churn [--out runs/fomoe_links] [--rate 10] [--steps 128] [--lose-after 4]
        [--join-after 10] [--method fomoe_o2_fp4_ef_local]

Needs root (experiments.links). Both runs are `experiments.launch --elastic --links` of the links reproduction's
model (experiments.reproduce.links_methods) with `--method` at M = 4 sites, one process per site, each in its own
network namespace behind a link of `--rate` Mbit/s each way, a checkpoint every round. The churned run injects a
schedule: once round `--lose-after`'s checkpoint is written site 1's link is cut at the hub's end (the coordination
service misses its heartbeats; the launcher finds the site no TCP connection reaches, regroups onto 3 sites and
starts them again); as soon as the 3 sites start the link comes back up; once round `--join-after`'s checkpoint is
written the launcher pauses the run and regroups it onto 4 sites (`--join-at`: the joining site receives its experts
with their optimizer state and the dense state, what a synchronisation gives every site), the joining site running
in site 1's namespace, and the run finishes on 4 sites. The uninterrupted run is the same launch without a schedule.

Reported (links_churn.md, links_churn.json): both final held-out losses and their relative difference; goodput,
useful tokens (each step of the final model's history counted once, at the rows of the sites that trained it:
`useful_tokens`) per second of the launch's wall-clock (compilation, lost work and restarts included), for both;
the events with their seconds; what the launcher printed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Sequence

from experiments import command, harness
from experiments.cluster import links
from experiments.reproduce import fomoe_elastic, links_methods
from experiments.reproduce import links as reproduction
from experiments.reproduce.links_elastic import cut

SITES, LOST = 4, 1


def restore(net, site: int):
    """A `then` for fomoe_elastic.elastic_run: site `site`'s link up again once the survivors have been started."""
    done: list[str] = []

    def then(line: str) -> str | None:
        if done or "launch: --elastic: starting the" not in line:
            return None
        device = net.sites[site].hub_device
        subprocess.run(["ip", "-n", net.hub.netns, "link", "set", device, "up"], check=True, timeout=30)
        done.append(device)
        return f"site {site}'s link is back ({device} up)"

    return then


REGROUPED = re.compile(r"regrouped the checkpoint of step (\d+): (\d+) -> (\d+) sites")


def useful_tokens(steps: int, launcher_lines: list[str], tokens_per_site: int) -> int:
    """Tokens of the steps that made the final model, each step's batch once: the sites' rows at that step (the
    launcher's "regrouped the checkpoint of step S: M -> M' sites" lines say from which step M' sites trained; the
    steps run after that checkpoint before the regrouping are lost work, not counted)."""
    segments = [(0, SITES)]
    for line in launcher_lines:
        match = REGROUPED.search(line)
        if match:
            segments.append((int(match[1]), int(match[3])))
    bounds = [s for s, _ in segments[1:]] + [steps]
    return sum((end - start) * sites * tokens_per_site for (start, sites), end in zip(segments, bounds))


def markdown(r: dict) -> str:
    """links_churn.md: both runs' losses and goodput, the events, what the launcher printed."""
    u, c = r["uninterrupted"], r["churned"]
    lines = [
        "# FoMoE over real links: a site leaves and joins again",
        "",
        f"`{r['command']}` (root): {links_methods.METHODS[r['method']][0]} at M = {SITES} sites, K = "
        f"{links_methods.K}, {r['steps']} steps, one process per site behind links of {r['rate']:g} Mbit/s each way, "
        f"a checkpoint every round. Churned: site {LOST}'s link cut after round {r['lose_after']}, back up when the "
        f"3 survivors restarted, a site joining after round {r['join_after']} (`experiments.launch --elastic --links "
        f"--join-at {r['join_after'] * links_methods.K}`). Goodput: useful tokens (each step's batch once) per second "
        "of the launch, compilation and restarts included.",
        "",
        "| run | held-out loss | difference | useful tokens | wall s | goodput tokens/s | goodput vs uninterrupted |",
        "|---|---|---|---|---|---|---|",
        f"| uninterrupted | {u['val_loss']:.4f} | - | {u['tokens']:,} | {u['seconds']:.1f} | "
        f"{u['goodput']:,.0f} | 100% |",
        f"| site {LOST} lost and joining again | {c['val_loss']:.4f} | {100 * r['relative_difference']:+.2f}% | "
        f"{c['tokens']:,} | {c['seconds']:.1f} | {c['goodput']:,.0f} | {100 * c['goodput'] / u['goodput']:.0f}% |",
        "",
        "Events (seconds since the churned launch started):",
        "",
        *[f"- {e}" for e in r["events"]],
        "",
        *fomoe_elastic.printed(r["launcher_lines"]),
    ]
    return "\n".join(lines) + "\n"


def _events(output: str) -> list[str]:
    """The stamped lines of the schedule: the cut and the link's return, pauses, regroupings, restarts."""
    keys = ("(cut", "(site", "pausing the run", "regrouping", "starting the", "exit codes")
    return [
        f"{stamp:.1f} s: {text}"
        for stamp, text in fomoe_elastic.stamped(output)
        if stamp is not None and any(k in text for k in keys)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: see the module docstring, or --help. Returns 2 where links cannot be made (not root)."""
    study = harness.Study(__doc__, module="experiments.reproduce.links_churn", topic="fomoe_links")
    p = study.parser
    k = links_methods.K
    p.add_argument("--rate", type=harness.integer(1), default=10, help="the links' rate in Mbit/s, each way")
    harness.add_steps(p, default=128, multiple_of=k, why=f"whole rounds of K = {k}")
    p.add_argument("--lose-after", type=harness.integer(1), default=4, help="rounds before site 1's link is cut")
    p.add_argument("--join-after", type=harness.integer(2), default=10, help="rounds before a site joins again")
    p.add_argument("--method", choices=[m for m, v in links_methods.METHODS.items() if v[2] == 2],
                   default="fomoe_o2_fp4_ef_local", help="an O_e = 2 method of the links reproduction")  # fmt: skip
    args = study.parse(argv)
    if not args.lose_after < args.join_after < args.steps // k:
        p.error(
            f"--lose-after {args.lose_after}, --join-after {args.join_after}: need lose < join < the run's "
            f"{args.steps // k} rounds"
        )
    reason = links.unavailable()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    name = links_methods.rate_name(float(args.rate))
    flags = links_methods.flags(args.method, SITES, args.steps, args.steps)
    flags = [f for f in flags if not f.startswith("--config.checkpoint.every=")] + [f"--config.checkpoint.every={k}"]
    results = {}
    with links.Network(sites=SITES, rate_mbit=args.rate) as net:
        for run in ("uninterrupted", "churned"):
            workdir = os.path.abspath(os.path.join(args.out, "runs", name, f"{args.method}_churn_{run}"))
            launcher = [sys.executable, "-m", "experiments.launch", "--processes", str(SITES), "--links", "--elastic"]
            launcher += ["--join-at", str(args.join_after * k)] if run == "churned" else []
            launcher += ["--", f"--config={links_methods.CONFIG}", f"--workdir={workdir}"]
            launcher += [f"--config.train.steps={args.steps}", *flags]
            results[run] = fomoe_elastic.elastic_run(
                workdir,
                ["ip", "netns", "exec", net.hub.netns, *launcher],
                os.path.join(workdir, "checkpoints", str(args.lose_after * k)),
                cut(net, LOST) if run == "churned" else None,
                env=dict(os.environ, **net.environment()),
                tag=run,
                then=restore(net, LOST) if run == "churned" else None,
            )
    per_site = reproduction.MODEL["data.batch_size"] // SITES * reproduction.MODEL["data.seq_len"]
    table = {}
    for run, r in results.items():
        tokens = useful_tokens(args.steps, fomoe_elastic.launcher_lines(r["output"]), per_site)
        seconds = r["seconds"] if r["seconds"] is not None else float("nan")
        table[run] = {"val_loss": r["summary"]["val_loss"], "tokens": tokens, "seconds": seconds,
                      "goodput": tokens / seconds}  # fmt: skip
    result = {
        "method": args.method,
        "rate": float(args.rate),
        "steps": args.steps,
        "lose_after": args.lose_after,
        "join_after": args.join_after,
        **table,
        "relative_difference": table["churned"]["val_loss"] / table["uninterrupted"]["val_loss"] - 1,
        "events": _events(results["churned"]["output"]),
        "launcher_lines": fomoe_elastic.launcher_lines(results["churned"]["output"]),
    }
    study.write("links_churn", result, markdown, always=("steps", "rate"))
    return 0


if __name__ == "__main__":
    command.run(main)
