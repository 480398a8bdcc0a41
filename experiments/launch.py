"""Start a multi-process run on this machine: one process per site (or per host), on 127.0.0.1.

    python -m experiments.launch --processes 4 -- --config experiments/configs/fomoe.py --workdir runs/fomoe
    python -m experiments.links run --sites 2 --rate-mbit 100 --in-hub -- \
        python -m experiments.launch --processes 2 --links -- --config ... --workdir ...

The command's arguments are parsed and checked here; the processes are started and supervised by
experiments.cluster.supervisor (what every process runs, how a failure, a stop signal or the launcher's death reaches
the others, and the exit code: its docstring, printed by --help). Exit code 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import sys

from experiments.cluster import supervisor

__all__ = ["main"]


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
        epilog=doc[doc.find("Stopping:") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="python -m experiments.launch --processes N [--devices-per-process D] -- <experiments.run arguments>",
    )
    parser.add_argument("--processes", type=int, required=True, help="number of local processes")
    parser.add_argument("--devices-per-process", type=int, default=1, help="CPU devices in each process")
    parser.add_argument(
        "--links",
        action="store_true",
        help="run process i inside site i's network namespace of `python -m experiments.links run --in-hub -- "
        "<this command>`, with the coordination service on the hub's address: the processes talk over the "
        "rate-limited links only",
    )
    args = parser.parse_args(own)
    if args.processes < 1:
        parser.error(f"--processes={args.processes}: must be >= 1")
    if args.devices_per_process < 1:
        parser.error(f"--devices-per-process={args.devices_per_process}: must be >= 1")
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
    return supervisor.launch(args.processes, args.devices_per_process, run_args, module=module, netns=netns, host=host)


if __name__ == "__main__":
    sys.exit(main())
