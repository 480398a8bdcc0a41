"""FoMoE losing a site over real links: a site's link cut (or its process killed) mid-run, and the federation going on
without it by itself (`experiments.launch --elastic --links`), against the same run uninterrupted.

    python -m experiments.reproduce.links_elastic [--out runs/fomoe_links] [--rate 10] [--steps 128] [--lose-after 8]
        [--how cut|kill] [--method fomoe_o2_fp4_ef_local]

Needs root (experiments.links). Both runs train the links reproduction's model (experiments.reproduce.links_methods)
with `--method` at M = 4 sites, one process per site, each in its own network namespace behind a link of `--rate`
Mbit/s each way. The uninterrupted run is the links reproduction's own (`<out>/runs/<rate>/<method>`, reused). The
elastic one writes a checkpoint every round; once round `--lose-after`'s is written, site 1 is lost: with `cut` its
link goes down at the hub's end (`ip link set ... down`: nothing reaches it, nothing tells the others; the
coordination service misses its heartbeats), with `kill` its process gets SIGKILL. The survivors stop, the launcher
finds the lost site (`experiments.launch.lost_sites`: for a cut, the site no TCP connection from the hub reaches),
regroups that checkpoint onto 3 sites (O_e 2 -> 3) and starts them again in their own namespaces, and the run
finishes on 3 sites over the same links.

Reported (links_elastic.md, links_elastic.json): both final held-out losses and their difference; the rounds on 4 and
on 3 sites and their mean wall-clock; the seconds from the loss until the processes stopped, until the regrouping was
done and until the first round on 3 sites; what the launcher printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence

from experiments import command, harness
from experiments.cluster import links
from experiments.reproduce import fomoe_elastic, links_methods
from experiments.reproduce import links as reproduction

SITES, LOST = 4, 1


def cut(net, site: int):
    """A `lose` for fomoe_elastic.elastic_run: site `site`'s link down at the hub's end."""

    def lose(launcher: int) -> str:
        device = net.sites[site].hub_device
        subprocess.run(["ip", "-n", net.hub.netns, "link", "set", device, "down"], check=True, timeout=30)
        return f"cut site {site}'s link ({device} down)"

    return lose


def _stamp(output: str, needle: str, after: float) -> float | None:
    """The seconds stamped on the first output line after `after` that holds `needle`, or None."""
    for stamp, text in fomoe_elastic.stamped(output):
        if stamp is not None and stamp > after and needle in text:
            return stamp
    return None


def timeline(run: dict) -> dict[str, float | None]:
    """Seconds from the loss until every process had stopped (the launcher's first exit-code line), until the
    checkpoint was regrouped and until the first round on the survivors."""
    output, at = run["output"], run["lost_at"]
    stopped = _stamp(output, "launch: exit codes", at)
    regrouped = _stamp(output, "launch: --elastic: starting the", at)
    first = _stamp(output, "train loss", regrouped) if regrouped is not None else None
    return {
        "stopped": None if stopped is None else stopped - at,
        "regrouped": None if regrouped is None else regrouped - at,
        "first_round_after": None if first is None else first - at,
    }


def rounds(workdir: str) -> dict[str, list[float]]:
    """The rounds' wall-clock in the elastic run's metrics, on 4 and on 3 sites (the rows kept past the resume)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(workdir, "summary.json")) as f:
        resumed = json.load(f)["resumed_from"]
    timed = [r for r in rows if "seconds/round" in r]
    return {
        "4": [r["seconds/round"] for r in timed if r["step"] <= resumed][1:],
        "3": [r["seconds/round"] for r in timed if r["step"] > resumed][1:],
    }


def markdown(r: dict) -> str:
    """links_elastic.md: both runs' rounds on 4 and on 3 sites, mean rounds and held-out losses, the timeline from
    the loss, and what the launcher printed."""

    def mean(xs):
        return f"{sum(xs) / len(xs):.3f}" if xs else "-"

    t = r["timeline"]
    shown = {k: "-" if v is None else f"{v:.1f}" for k, v in t.items()}
    lines = [
        "# FoMoE losing a site over real links",
        "",
        f"`{r['command']}` (root): {links_methods.METHODS[r['method']][0]} at M = {SITES} sites, K = "
        f"{links_methods.K}, {r['steps']} steps, one process per site behind links of {r['rate']:g} Mbit/s each "
        f"way (the links reproduction's model and tokens). After round {r['lose_after']}'s checkpoint site {LOST} "
        f"was lost ({r['lost']}); `experiments.launch --elastic --links` found it, regrouped onto 3 sites and "
        "finished by itself.",
        "",
        "| run | rounds on 4 sites | rounds on 3 sites | mean round on 4 s | on 3 s | held-out loss | difference |",
        "|---|---|---|---|---|---|---|",
        f"| uninterrupted | {r['steps'] // links_methods.K} | 0 | {r['uninterrupted_round']:.3f} | - | "
        f"{r['uninterrupted']:.4f} | - |",
        f"| site {LOST} lost | {r['rounds_on_4']} | {r['rounds_on_3']} | {mean(r['rounds']['4'])} | "
        f"{mean(r['rounds']['3'])} | {r['elastic']:.4f} | {100 * r['relative_difference']:+.2f}% |",
        "",
        f"From the loss: every process stopped after {shown['stopped']} s, the checkpoint was regrouped "
        f"{shown['regrouped']} s after it, the first round on 3 sites ended {shown['first_round_after']} s after it "
        "(the restart compiles the programs again). Mean rounds exclude each attempt's first.",
        "",
        *fomoe_elastic.printed(r["launcher_lines"]),
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: see the module docstring, or --help. Returns 2 where links cannot be made (not root)."""
    study = harness.Study(__doc__, module="experiments.reproduce.links_elastic", topic="fomoe_links")
    p = study.parser
    p.add_argument("--rate", type=harness.integer(1), default=10, help="the links' rate in Mbit/s, each way")
    harness.add_steps(p, default=128, multiple_of=links_methods.K, why=f"whole rounds of K = {links_methods.K}")
    p.add_argument("--lose-after", type=harness.integer(1), default=8, help="rounds before site 1 is lost")
    p.add_argument("--how", choices=("cut", "kill"), default="cut", help="cut its link, or kill its process")
    p.add_argument("--method", choices=[m for m, v in links_methods.METHODS.items() if v[2] == 2],
                   default="fomoe_o2_fp4_ef_local", help="an O_e = 2 method of the links reproduction")  # fmt: skip
    p.add_argument("--eval-every", type=harness.integer(links_methods.K, multiple_of=links_methods.K), default=16,
                   help="steps between evaluations")  # fmt: skip
    args = study.parse(argv)
    k = links_methods.K
    if args.lose_after * k >= args.steps:
        p.error(f"--lose-after {args.lose_after}: the run has {args.steps // k} rounds; lose the site before")
    reason = links.unavailable()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    name = links_methods.rate_name(float(args.rate))
    workdir = os.path.abspath(os.path.join(args.out, "runs", name, f"{args.method}_lost_site_{args.how}"))
    flags = links_methods.flags(args.method, SITES, args.steps, args.eval_every)
    flags = [f for f in flags if not f.startswith("--config.checkpoint.every=")] + [f"--config.checkpoint.every={k}"]
    with links.Network(sites=SITES, rate_mbit=args.rate) as net:
        base = reproduction.measure(
            args.method,
            SITES,
            args.steps,
            reproduction.train(args.method, SITES, args.rate, args.steps, args.eval_every, args.out, net),
        )
        launcher = [sys.executable, "-m", "experiments.launch", "--processes", str(SITES), "--links", "--elastic"]
        launcher += ["--", f"--config={links_methods.CONFIG}", f"--workdir={workdir}"]
        launcher += [f"--config.train.steps={args.steps}", *flags]
        lose = cut(net, LOST) if args.how == "cut" else fomoe_elastic.kill(LOST)
        run = fomoe_elastic.elastic_run(
            workdir,
            ["ip", "netns", "exec", net.hub.netns, *launcher],
            os.path.join(workdir, "checkpoints", str(args.lose_after * k)),
            lose,
            env=dict(os.environ, **net.environment()),
        )
    per_round = rounds(workdir)
    resumed = run["summary"]["resumed_from"]
    result = {
        "method": args.method,
        "rate": float(args.rate),
        "steps": args.steps,
        "lose_after": args.lose_after,
        "how": args.how,
        "lost": run["lost"],
        "uninterrupted": base["val_loss"],
        "uninterrupted_round": base["seconds_round"],
        "elastic": run["summary"]["val_loss"],
        "relative_difference": run["summary"]["val_loss"] / base["val_loss"] - 1,
        "resumed_from": resumed,
        "rounds_on_4": resumed // k,
        "rounds_on_3": (args.steps - resumed) // k,
        "rounds": per_round,
        "timeline": timeline(run),
        "elastic_seconds": run["seconds"],
        "launcher_lines": fomoe_elastic.launcher_lines(run["output"]),
    }
    study.write("links_elastic", result, markdown, always=("steps", "rate", "how"))
    return 0


if __name__ == "__main__":
    command.run(main)
