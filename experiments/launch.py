"""Start a multi-process run on this machine: one process per site (or per host), on 127.0.0.1.

    python -m experiments.launch --processes 4 -- --config experiments/configs/fomoe.py --workdir runs/fomoe
    python -m experiments.links run --sites 2 --rate-mbit 100 --in-hub -- \
        python -m experiments.launch --processes 2 --links -- --config ... --workdir ...

The command's arguments are parsed and checked here; the processes are started and supervised by
experiments.cluster.supervisor (what every process runs, how a failure, a stop signal or the launcher's death reaches
the others, and the exit code: its docstring, printed by --help). Exit code 2 for bad arguments.

`--site-timeout S` (default 50, at most 50): a process that stops answering, e.g. stopped by SIGSTOP or in a
suspended VM, is waited for up to S seconds, and the run goes on as if nothing happened when it continues in time;
beyond that the launcher kills it and ends the run with one line naming it and exit status 75; rerunning the same
command resumes from the last checkpoint (the supervisor's docstring, "A paused process").

`--elastic` (a federated run, one site per process): when a site is lost (its process killed by a signal, or with
--links its link cut: `lost_sites`) and the others stop, the run goes on without it by itself: its last checkpoint
is regrouped onto the surviving sites (`python -m experiments.elastic`: every expert kept; with fomoe.overlap = 1 the
lost site's experts are refused by name unless --reinitialise-lost-experts) and the survivors are started again
(each in its own site's namespace with --links) with the new mesh.site, fomoe.overlap and data.batch_size, resuming
from that checkpoint; this repeats while two sites are left. A site silent for longer than --site-timeout is lost
too. A process that exits with an error (a diverged loss, a bad config) stops the run as without --elastic.

`--join-at STEPS` (with --elastic): a site joins once the checkpoint of each of these steps is written: the launcher
pauses the run (SIGTERM to every process), regroups that checkpoint onto one site more (`python -m experiments.elastic
--sites M + 1`: the new site receives its experts with their optimizer state and the dense state, what a full
synchronisation gives every site) and starts them all again. With --links the new site runs in the namespace of a
site lost earlier whose link the hub reaches again (a cut link brought back up, or a killed site's); without one it
stops. The schedule is printed as it happens, each event with the seconds since the launch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from experiments import command
from experiments.args import integers
from experiments.cluster import process, supervisor

__all__ = ["lost_sites", "main"]


def main(argv: list[str] | None = None, *, module: str = "experiments.run") -> int:
    """Runs the launcher on `argv` (default: the command line) and returns its exit code (see
    experiments.cluster.supervisor). `module` is the program every process runs (`python -m <module>`); tests point
    it at a cheap stand-in. Call it from the main thread: it installs handlers for SIGTERM, SIGINT and SIGHUP
    (restored on return). Bad arguments exit with status 2 (argparse's SystemExit), naming the flag."""
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        split = argv.index("--")
        own, run_args = argv[:split], argv[split + 1 :]
    else:
        own, run_args = argv, []
    doc = supervisor.__doc__ or ""
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n")[0],
        epilog=doc[doc.find("A paused process") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="python -m experiments.launch --processes N [--devices-per-process D] [--site-timeout S] -- "
        "<experiments.run arguments>",
    )
    parser.add_argument("--processes", type=int, required=True, help="number of local processes")
    parser.add_argument("--devices-per-process", type=int, default=1, help="CPU devices in each process")
    parser.add_argument(
        "--site-timeout",
        type=int,
        default=supervisor.SITE_TIMEOUT_SECONDS,
        metavar="S",
        help=f"seconds a process that stops answering (stopped by SIGSTOP, a suspended VM) is waited for before the "
        f"run ends with exit status {supervisor.SITE_TIMEOUT_EXIT_CODE} (1..{supervisor.MAX_SITE_TIMEOUT_SECONDS}; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--links",
        action="store_true",
        help="run process i inside site i's network namespace of `python -m experiments.links run --in-hub -- "
        "<this command>`, with the coordination service on the hub's address: the processes talk over the "
        "rate-limited links only",
    )
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="a federated run goes on without a site whose process dies: regrouped from its last checkpoint onto "
        "the survivors and started again (see above)",
    )
    parser.add_argument(
        "--join-at",
        type=integers(1, distinct=True),
        default=[],
        metavar="STEPS",
        help="with --elastic: comma-separated steps after whose checkpoints a site joins (see above)",
    )
    parser.add_argument(
        "--reinitialise-lost-experts",
        action="store_true",
        help="with --elastic: experts that died with their site (fomoe.overlap = 1) start afresh instead of stopping",
    )
    args = parser.parse_args(own)
    if args.processes < 1:
        parser.error(f"--processes={args.processes}: must be >= 1")
    if args.devices_per_process < 1:
        parser.error(f"--devices-per-process={args.devices_per_process}: must be >= 1")
    if not 1 <= args.site_timeout <= supervisor.MAX_SITE_TIMEOUT_SECONDS:
        parser.error(supervisor.site_timeout_error(args.site_timeout))
    if not run_args:
        parser.error("give the experiments.run arguments after '--', e.g. -- --config <file> --workdir <dir>")
    for flag in ("num_processes", "process_id", "coordinator_address"):
        if any(a.startswith(f"--config.mesh.{flag}") for a in run_args):
            parser.error(f"--config.mesh.{flag} is set by the launcher; remove it from the run arguments")
    netns: list[str] = []
    host = "127.0.0.1"
    if args.links:
        try:
            netns, host = supervisor.site_network(args.processes)
        except ValueError as e:
            parser.error(str(e))
    if args.join_at and not args.elastic:
        parser.error(f"--join-at={','.join(map(str, args.join_at))} needs --elastic (a join regroups the checkpoints)")
    if not args.elastic:
        return supervisor.launch(
            args.processes,
            args.devices_per_process,
            run_args,
            module=module,
            netns=netns,
            host=host,
            site_timeout=args.site_timeout,
        )
    workdir = _flag(run_args, "--workdir")
    if workdir is None:
        parser.error("--elastic regroups the run's checkpoints: give its --workdir in the run arguments")
    if args.devices_per_process != 1:
        parser.error(f"--elastic: --devices-per-process={args.devices_per_process}; one site per process (1)")
    return _elastic(
        args.processes,
        run_args,
        workdir,
        args.reinitialise_lost_experts,
        module,
        netns,
        host,
        args.site_timeout,
        sorted(args.join_at),
    )


def _flag(run_args: list[str], name: str) -> str | None:
    """The value of `name` in the run arguments (`--name value` or `--name=value`; the last one counts)."""
    value = None
    for i, a in enumerate(run_args):
        if a == name and i + 1 < len(run_args):
            value = run_args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def _elastic(processes, run_args, workdir, reinitialise, module, netns, host, site_timeout, joins=()) -> int:
    """`supervisor.launch`, started again on the survivors after each lost site and with one site more after each
    step of `joins` (module docstring)."""
    run_args, netns, joins = list(run_args), list(netns), list(joins)
    spare: list[str] = []  # the namespaces of lost sites (a joining site's, once the hub reaches it again)
    start = time.monotonic()

    def due() -> str | None:
        if joins and os.path.isdir(os.path.join(workdir, "checkpoints", str(joins[0]))):
            return f"the checkpoint of step {joins[0]} is written and site {processes} joins"
        return None

    while True:
        report: dict = {}
        code = supervisor.launch(
            processes, 1, run_args, module=module, netns=netns, host=host, site_timeout=site_timeout, report=report,
            pause_when=due if joins else None,
        )  # fmt: skip
        elapsed = f"{time.monotonic() - start:.1f} s"
        if report.get("paused") is not None:
            joins.pop(0)
            if netns:
                cut = set(supervisor.unreachable(spare, host))
                back = [ns for i, ns in enumerate(spare) if i not in cut]
                if not back:
                    print("launch: --elastic: no lost site's namespace is reachable for the joining site; stopping")
                    return 1
                spare.remove(back[0])
                netns.append(back[0])
            print(f"launch: --elastic: a site joins ({elapsed} in); regrouping {workdir} onto {processes + 1} sites")
            flags = _regroup(workdir, processes + 1, [], reinitialise)
            if flags is None:
                return 1
            processes += 1
        else:
            if code == 0 or report.get("stopped_by") is not None or report.get("first_failed") is None:
                if code == 0 and joins:
                    print(f"launch: --elastic: the run ended before the checkpoint of step {joins[0]}: no site joined")
                return code
            lost, why = lost_sites(report, netns, host)
            if not lost:
                print(f"launch: --elastic: {why}; stopping", flush=True)
                return code
            if processes - len(lost) < 2:
                print(f"launch: --elastic: {why}; fewer than two sites left (a federation needs two), stopping")
                return code
            print(f"launch: --elastic: {why} ({elapsed} in); regrouping {workdir} onto {processes - len(lost)} sites")
            flags = _regroup(workdir, processes - len(lost), lost, reinitialise)
            if flags is None:
                return code
            processes -= len(lost)
            spare += [ns for i, ns in enumerate(netns) if i in lost]
            netns = [ns for i, ns in enumerate(netns) if i not in lost]  # new site i: the i-th survivor's namespace
        run_args += flags
        print(f"launch: --elastic: starting the {processes} sites again with {' '.join(flags)}", flush=True)


def _regroup(workdir: str, sites: int, lost: list[int], reinitialise: bool) -> list[str] | None:
    """`python -m experiments.elastic` onto `sites` sites (`lost` gone); prints its description and returns the
    run flags it gives, or None (with the reason printed) when it cannot."""
    cmd = [sys.executable, "-m", "experiments.elastic", "--workdir", workdir, "--sites", str(sites), "--json"]
    cmd += ["--lost", ",".join(map(str, lost))] if lost else []
    cmd += ["--reinitialise-lost-experts"] if reinitialise else []
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        print(f"launch: --elastic: cannot go on: {(errors or out.stderr.splitlines() or ['?'])[-1]}", flush=True)
        return None
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for line in result["description"].splitlines():
        if not line.startswith("rerun with:"):  # (this launcher reruns it)
            print(f"launch: --elastic: {line}", flush=True)
    return list(result["flags"])


def lost_sites(report: dict, netns: list[str], host: str) -> tuple[list[int], str]:
    """Which sites a failed attempt lost (`supervisor.launch`'s `report`), and why, in words; ([], why not) when it
    lost none it can name. Over the links (`netns`), the sites no TCP connection from the hub reaches are cut off
    (`supervisor.unreachable`): when a link is cut, the coordination service misses that site's heartbeats and
    jaxlib aborts every process alike (SIGABRT), so the exit codes do not tell. Otherwise the one process killed by
    a signal that the launcher did not send is the lost site, when the others exited by themselves; a process that
    exited with an error (a diverged loss, a bad config) is not a lost site, and several processes killed at once
    name none. A site the launcher killed for giving no sign of life for its --site-timeout is lost."""
    silent = list(report.get("unresponsive", ()))
    if silent:
        names = ", ".join(map(str, silent))
        return silent, f"site {names} was lost: it gave no sign of life for longer than --site-timeout"
    if netns:
        cut = supervisor.unreachable(netns, host)
        if cut:
            names = ", ".join(map(str, cut))
            return cut, f"site {names} was lost: no TCP connection from the hub reaches it (its link is cut)"
    codes, first = report["codes"], report["first_failed"]
    killed = [i for i, c in enumerate(codes) if c < 0 and i not in report.get("terminated", ())]
    if len(killed) == 1:
        return killed, f"site {killed[0]} was lost: its process was killed by {process.signal_name(-codes[killed[0]])}"
    if not killed:
        return [], f"process {first} exited with status {codes[first]}, not a lost site"
    shown = ", ".join(f"{i} ({process.signal_name(-codes[i])})" for i in killed)
    return [], f"processes {shown} were killed at once: cannot tell which site was lost"


if __name__ == "__main__":
    command.run(main)
