"""Sites behind real rate-limited links, from the command line (experiments.cluster.links says what a network is).

    python -m experiments.links run --sites 2 --rate-mbit 100 -- <command ...>   # the network for one command
    python -m experiments.links up --sites 4 --rate-mbit 1000    # makes a network, prints it (JSON), leaves it up
    python -m experiments.links down [PREFIX]                    # removes it (no PREFIX: every leftover network)

The library (`Network`, `unavailable`, ...) is experiments.cluster.links; this module is its command line only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
from collections.abc import Sequence

from experiments import command
from experiments.cluster import links, netns, process

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    doc = links.__doc__ or ""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.links",
        description=doc.split("\n")[0],
        epilog=doc[doc.find("Topology:") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="action", required=True)
    for name, text in (
        ("up", "make a network, print it as JSON and leave it up (remove it with `down PREFIX`)"),
        ("run", "make a network, run a command with its LINKS_* variables, print the counters, remove it"),
    ):
        sub = commands.add_parser(name, help=text, description=text)
        sub.add_argument("--sites", type=int, required=True, help="number of sites M")
        sub.add_argument("--rate-mbit", type=float, required=True, help="each link's rate each way, Mbit/s")
        sub.add_argument(
            "--subnet", default=links.DEFAULT_SUBNET, help=f"private IPv4 subnet (default {links.DEFAULT_SUBNET})"
        )
        if name == "run":
            sub.add_argument("--in-hub", action="store_true", help="run the command in the hub's namespace")
            sub.add_argument("--report", help="also write the network and its counters to this JSON file")
            sub.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command and its arguments")
    sub = commands.add_parser("down", help="remove network PREFIX, or every network whose maker has exited")
    sub.add_argument("prefix", nargs="?", help="a network's prefix (lnk + 6 hex digits), as `up` printed it")
    return parser


def _report_lines(net: links.Network, counters: Sequence[links.Counters]) -> list[str]:
    return [
        f"links: site {s.index} ({s.address}): sent {c.tx_wire_bytes:,} bytes ({c.tx_bytes:,} by its device, "
        f"{c.tx_dropped:,} frames dropped), received {c.rx_wire_bytes:,} bytes ({c.rx_bytes:,} by its device, "
        f"{c.rx_dropped:,} frames dropped)"
        for s, c in zip(net.sites, counters)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit status: 2 for bad arguments or a machine that
    cannot make networks, 1 when an `ip` / `tc` command fails, else `run`'s command's status (128+N if stopped by
    signal N) or 0."""
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.action in ("up", "run"):
        problems = links.problems(args.sites, args.rate_mbit, args.subnet)
        if problems:
            parser.error("; ".join(f"--{n.replace('_', '-')}={v}: must be {allowed}" for n, v, allowed in problems))
    if args.action == "run":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            parser.error("give the command after '--', e.g. run --sites 2 --rate-mbit 8 -- env")
    if args.action == "down" and args.prefix is not None and not netns.PREFIX.match(args.prefix):
        parser.error(f"PREFIX={args.prefix!r}: not a network of experiments.links (expected lnk + 6 hex digits)")
    reason = links.unavailable()
    if reason is not None:
        print(f"links: error: {reason}", file=sys.stderr, flush=True)
        return 2
    try:
        if args.action == "down":
            removed = links.down(args.prefix)
            print(f"links: removed {len(removed)} namespaces{': ' if removed else ''}{' '.join(removed)}", flush=True)
            return 0
        net = links.Network(args.sites, args.rate_mbit, subnet=args.subnet)
        if args.action == "up":
            with process.stop_signals_exit():
                net.up()  # (removes what it made if it fails or is stopped)
            print(json.dumps(net.describe(), indent=2), flush=True)
            print(f"links: network {net.prefix} is up; remove it with: python -m experiments.links down {net.prefix}")
            return 0
        with net:
            code, stopped_by = links.run_command(net, cmd, args.in_hub)
            counters = net.counters()
            for line in _report_lines(net, counters):
                print(line, file=sys.stderr, flush=True)
            if args.report:
                report = dict(net.describe(), counters=[dataclasses.asdict(c) for c in counters], exit_status=code)
                with open(args.report, "w") as f:
                    json.dump(report, f, indent=2)
        return 128 + stopped_by if stopped_by is not None else code
    except links.LinksError as e:
        print(f"links: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while the network was being made or removed (it is removed)
        print("links: stopped by SIGINT", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    command.run(main)
