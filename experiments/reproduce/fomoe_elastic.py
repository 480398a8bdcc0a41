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

from experiments import command, harness
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


def elastic_run(
    workdir: str, command: list[str], when: str, lose, *, env=None, tag: str = "elastic", then=None
) -> dict:
    """Runs the launcher's `command` (or reuses its finished run in `workdir`), calling `lose(launcher pid)` once the
    directory `when` exists (a checkpoint); `lose` makes a site lost and returns what it did, in words. Returns
    {"output" (its lines, each stamped with the seconds since the start), "summary", "seconds" (None when reused),
    "lost_at" (seconds since the start), "lost" (the words)}. `then(line)`, if given, sees every output line after
    the loss and returns what it did in words (stamped into the output) or None. `lose` None: an uninterrupted run,
    timed the same way. RuntimeError with the output's end when the run fails or finishes before the loss."""
    record = os.path.join(workdir, "launch.json")  # the finished run's output and loss, for a reuse
    if os.path.exists(os.path.join(workdir, "summary.json")) and os.path.exists(record):
        with open(record) as f:
            kept = json.load(f)
        with open(os.path.join(workdir, "summary.json")) as f:
            return {**kept, "summary": json.load(f), "seconds": None}
    if os.path.exists(workdir):
        runs.set_aside(workdir, ["an unfinished elastic run"])
    t0 = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    lost, lost_at = None, None
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(f"{time.time() - t0:8.1f} {line}")
        print(f"[{tag}] {line}", end="", flush=True)
        if lose is not None and lost is None and os.path.isdir(when):
            lost = lose(proc.pid)
            if lost is not None:
                lost_at = time.time() - t0
                lines.append(f"{lost_at:8.1f} ({lost})\n")
                print(f"[{tag}] {lost}", flush=True)
        elif lost is not None and then is not None:
            did = then(line)
            if did is not None:
                lines.append(f"{time.time() - t0:8.1f} ({did})\n")
                print(f"[{tag}] {did}", flush=True)
    proc.wait()
    output = "".join(lines)
    if proc.returncode or (lose is not None and lost is None):
        raise RuntimeError(f"the elastic run failed (exit {proc.returncode}, lost: {lost}):\n{output[-3000:]}")
    with open(record, "w") as f:
        json.dump({"output": output, "lost_at": lost_at, "lost": lost}, f)
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    return {"output": output, "summary": summary, "seconds": time.time() - t0, "lost_at": lost_at, "lost": lost}


def kill(site: int):
    """A `lose` for `elastic_run`: SIGKILL to site `site`'s process (None while it has not started)."""

    def lose(launcher: int) -> str | None:
        pid = process.descendant(launcher, f"--config.mesh.process_id={site}")
        if pid is None:
            return None
        os.kill(pid, signal.SIGKILL)
        return f"killed site {site} (pid {pid}, SIGKILL)"

    return lose


def stamped(output: str) -> list[tuple[float | None, str]]:
    """An `elastic_run` output as (the seconds its line is stamped with, or None, the line's text) pairs."""
    out: list[tuple[float | None, str]] = []
    for line in output.splitlines():
        stamp, _, text = line.strip().partition(" ")
        if stamp.replace(".", "", 1).isdigit():
            out.append((float(stamp), text.strip()))
        else:
            out.append((None, line.strip()))
    return out


def launcher_lines(output: str) -> list[str]:
    """The launcher's own lines of an `elastic_run` output, without the seconds each line is stamped with."""
    return [text for _, text in stamped(output) if text.startswith("launch:")]


def printed(lines: list[str]) -> list[str]:
    """The markdown block of what the launcher printed (`launcher_lines`)."""
    return ["What the launcher printed:", "", "```", *lines, "```"]


def markdown(r: dict) -> str:
    """elastic.md: both runs' rounds on 4 and on 3 sites and held-out losses, and what the launcher printed."""
    lines = [
        "# FoMoE losing a site mid-run",
        "",
        f"`{r['command']}`: experiments/configs/fomoe.py at M = {SITES} sites, O_e = {OVERLAP}, K = {K}, "
        f"{r['steps']} steps; the elastic run (`experiments.launch --elastic`, one process per site on 127.0.0.1) lost "
        f"site {LOST} (SIGKILL) after the checkpoint of round {r['lose_after']} and finished on 3 sites by itself.",
        "",
        "| run | rounds on 4 sites | rounds on 3 sites | held-out loss | difference |",
        "|---|---|---|---|---|",
        f"| uninterrupted | {r['steps'] // K} | 0 | {r['uninterrupted']:.4f} | - |",
        f"| lost site {LOST} | {r['lose_after']} | {r['steps'] // K - r['lose_after']} | {r['elastic']:.4f} | "
        f"{100 * r['relative_difference']:+.2f}% |",
        "",
        *printed(r["launcher_lines"]),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    study = harness.Study(__doc__, module="experiments.reproduce.fomoe_elastic", topic="fomoe")
    harness.add_steps(study.parser, default=256, multiple_of=K, why=f"whole rounds at K = {K}")
    study.parser.add_argument("--lose-after", type=harness.integer(1), default=4, help="rounds before the site is lost")
    args = study.parse(argv)
    if args.lose_after * K >= args.steps:
        study.parser.error(
            f"--lose-after {args.lose_after}: the run has {args.steps // K} rounds; lose the site before"
        )
    base = runs.run_or_reuse(
        CONFIG, study.path(os.path.join("runs", "elastic_uninterrupted")), _flags(args.steps), args.steps, devices=SITES
    )
    workdir = os.path.abspath(study.path(os.path.join("runs", "elastic_lost_site")))
    launch = [sys.executable, "-m", "experiments.launch", "--processes", str(SITES), "--elastic", "--"]
    launch += [f"--config={CONFIG}", f"--workdir={workdir}", f"--config.train.steps={args.steps}", *_flags(args.steps)]
    when = os.path.join(workdir, "checkpoints", str(args.lose_after * K))
    run = elastic_run(workdir, launch, when, kill(LOST))
    result = {
        "steps": args.steps,
        "lose_after": args.lose_after,
        "uninterrupted": base["val_loss"],
        "elastic": run["summary"]["val_loss"],
        "relative_difference": run["summary"]["val_loss"] / base["val_loss"] - 1,
        "resumed_from": run["summary"].get("resumed_from"),
        "elastic_seconds": run["seconds"],
        "launcher_lines": launcher_lines(run["output"]),
    }
    study.write("elastic", result, markdown)


if __name__ == "__main__":
    command.run(main)
