"""FoMoE losing a site mid-run: the federation goes on without it (experiments.launch --elastic), every expert kept,
against the uninterrupted run.

    python -m experiments.reproduce.fomoe_elastic [--out runs/fomoe] [--steps 256] [--lose-after 4]

Both runs train experiments/configs/fomoe.py at M = 4 sites, O_e = 2, K = 32 on the same tokens, one checkpoint per
round. The uninterrupted one runs the 4 sites as virtual CPU devices of one process; the elastic one is
`experiments.launch --elastic --processes 4` (one process per site, jax.distributed over gloo on 127.0.0.1), whose
site 1 is killed (SIGKILL) once the checkpoint of round `--lose-after` is written: the survivors stop, the launcher
regroups that checkpoint onto 3 sites (O_e 2 -> 3: 8 experts on 3 sites place evenly only as full replicas) and
starts them again, and the run finishes on 3 sites (12 of the 16 rows per step: each site keeps its share). Reported
(elastic.md, elastic.json): both final held-out losses and their relative difference, what the launcher printed about
the regrouping, the rounds on 4 and on 3 sites, and the wall-clock of the elastic run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from experiments.bench import common
from experiments.cluster import process
from experiments.reproduce import runs

CONFIG = runs.config_path("fomoe")
SITES, OVERLAP, K = 4, 2, 32
LOST = 1


def _flags(steps: int) -> list[str]:
    return [
        f"--config.train.eval_every={steps}",
        f"--config.mesh.site={SITES}",
        "--config.mesh.data=1",
        f"--config.fomoe.overlap={OVERLAP}",
        f"--config.fomoe.local_steps={K}",
        f"--config.checkpoint.every={K}",
    ]


def elastic_run(workdir: str, steps: int, lose_after: int) -> dict:
    """The launcher's run with site LOST killed after round `lose_after`'s checkpoint; its output and summary."""
    if os.path.exists(os.path.join(workdir, "summary.json")) and os.path.exists(os.path.join(workdir, "launch.log")):
        with open(os.path.join(workdir, "launch.log")) as f:
            log = f.read()
        with open(os.path.join(workdir, "summary.json")) as f:
            return {"output": log, "summary": json.load(f), "seconds": None}
    if os.path.exists(workdir):
        runs.set_aside(workdir, ["an unfinished elastic run"])
    command = [sys.executable, "-m", "experiments.launch", "--processes", str(SITES), "--elastic", "--"]
    command += [f"--config={CONFIG}", f"--workdir={workdir}", f"--config.train.steps={steps}", *_flags(steps)]
    t0 = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    checkpoint = os.path.join(workdir, "checkpoints", str(lose_after * K))
    killed = False
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        print(f"[elastic] {line}", end="", flush=True)
        if not killed and os.path.isdir(checkpoint):
            pid = process.descendant(proc.pid, f"--config.mesh.process_id={LOST}")
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed = True
                print(
                    f"[elastic] killed site {LOST} (pid {pid}) after the checkpoint of round {lose_after}", flush=True
                )
    proc.wait()
    output = "".join(lines)
    if proc.returncode or not killed:
        raise RuntimeError(f"the elastic run failed (exit {proc.returncode}, killed: {killed}):\n{output[-3000:]}")
    with open(os.path.join(workdir, "launch.log"), "w") as f:
        f.write(output)
    with open(os.path.join(workdir, "summary.json")) as f:
        return {"output": output, "summary": json.load(f), "seconds": time.time() - t0}


def markdown(r: dict) -> str:
    lines = [
        "# FoMoE losing a site mid-run",
        "",
        f"`{r['command']}`: experiments/configs/fomoe.py at M = {SITES} sites, O_e = {OVERLAP}, K = {K}, "
        f"{r['steps']} steps; the elastic run (`experiments.launch --elastic`, one process per site on 127.0.0.1) lost "
        f"site {LOST} (SIGKILL) after the checkpoint of round {r['lose_after']} and finished on 3 sites by itself; "
        f"load average before {', '.join(map(str, r['load_average']))}.",
        "",
        "| run | rounds on 4 sites | rounds on 3 sites | held-out loss | difference |",
        "|---|---|---|---|---|",
        f"| uninterrupted | {r['steps'] // K} | 0 | {r['uninterrupted']:.4f} | - |",
        f"| lost site {LOST} | {r['lose_after']} | {r['steps'] // K - r['lose_after']} | {r['elastic']:.4f} | "
        f"{100 * r['relative_difference']:+.2f}% |",
        "",
        "What the launcher printed:",
        "",
        "```",
        *r["launcher_lines"],
        "```",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = common.parser(__doc__, module="experiments.reproduce.fomoe_elastic", topic="fomoe")
    common.add_steps(parser, default=256, multiple_of=K, why=f"whole rounds at K = {K}")
    parser.add_argument("--lose-after", type=common.integer(1), default=4, help="rounds before the site is lost")
    args = parser.parse_args(argv)
    if args.lose_after * K >= args.steps:
        parser.error(f"--lose-after {args.lose_after}: the run has {args.steps // K} rounds; lose the site before")
    command = common.command(parser, args)
    load = [round(x, 2) for x in os.getloadavg()]
    base = runs.run_or_reuse(
        CONFIG, os.path.join(args.out, "runs", "elastic_uninterrupted"), _flags(args.steps), args.steps, devices=SITES
    )
    run = elastic_run(os.path.abspath(os.path.join(args.out, "runs", "elastic_lost_site")), args.steps, args.lose_after)
    launcher = [line.strip() for line in run["output"].splitlines() if line.startswith("launch:")]
    result = {
        "command": command,
        "steps": args.steps,
        "lose_after": args.lose_after,
        "load_average": load,
        "uninterrupted": base["val_loss"],
        "elastic": run["summary"]["val_loss"],
        "relative_difference": run["summary"]["val_loss"] / base["val_loss"] - 1,
        "resumed_from": run["summary"].get("resumed_from"),
        "elastic_seconds": run["seconds"],
        "launcher_lines": launcher,
    }
    common.write_results(args.out, "elastic", result, markdown)


if __name__ == "__main__":
    main()
