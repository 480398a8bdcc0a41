"""What a rate-limited link of experiments.links carries: one TCP transfer between two sites per link rate.

    python -m experiments.bench.link_rate [--out runs/cluster] [--rates 8,50,1000] [--megabytes 0]
                                          [--queue-floors 262144]

Needs root (Linux network namespaces: experiments.links). For each rate R and each of the shapers' queue floors
`--queue-floors` (experiments.cluster.links.MIN_QUEUE_BYTES is the tool's), a two-site network is made with links of
R Mbit/s each way; site 0 sends `--megabytes` MB (0: 2 MB at R < 50 Mbit/s, else 100 MB) to site 1, and the
receiver times its payload from the first byte to the last (in its own process). Reported: the payload rate, its
ratio to R against 1448 / 1514 (the payload of a full Ethernet frame, with its Ethernet, IPv4 and TCP headers and
timestamps, over its size: what tbf, which counts whole frames, lets through at most), and the frames either
shaper dropped. Writes link_rate.json and link_rate.md into `--out` (`--out results/cluster` for the table
docs/cluster.md quotes).
"""

from __future__ import annotations

import json
import subprocess
import sys

from experiments import command, harness
from experiments.cluster import links

FULL_FRAME_PAYLOAD = 1448 / 1514
"""Payload share of a full 1514-byte frame (1500-byte MTU, Ethernet header; IPv4 and TCP headers with timestamps)."""

_RECEIVER = """
import json, socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
conn, _ = server.accept()
total = first = 0
start = last = None
while chunk := conn.recv(1 << 16):
    last = time.monotonic()
    if start is None:
        start, first = last, len(chunk)
    total += len(chunk)
print(json.dumps({"bytes": total, "first": first, "seconds": last - start}), flush=True)
"""
_SENDER = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30) as s:
    s.sendall(b"x" * int(sys.argv[3]))
"""


def transfer(net: links.Network, payload: int, *, timeout: float = 600) -> dict:
    """Sends `payload` bytes over TCP from site 0 to site 1 of `net`. Returns what the receiver saw: `bytes` (all
    of them), `first` (the bytes of its first read) and `seconds` (from the first read to the last), and
    `payload_mbit`: the payload after the first read over those seconds, in Mbit/s."""
    dest = [net.sites[1].address, "5001"]
    receiver = net.popen(1, [sys.executable, "-c", _RECEIVER, *dest], stdout=subprocess.PIPE, text=True)
    assert receiver.stdout is not None and receiver.stdout.readline() == "listening\n"
    net.run(0, [sys.executable, "-c", _SENDER, *dest, str(payload)], timeout=timeout, check=True)
    got = json.loads(receiver.communicate(timeout=timeout)[0])
    return got | {"payload_mbit": (got["bytes"] - got["first"]) * 8 / got["seconds"] / 1e6}


def measure(rate_mbit: float, payload: int, min_queue_bytes: int) -> dict:
    """One transfer over links of `rate_mbit` whose shapers queue at least `min_queue_bytes`: the payload rate, its
    ratio to the rate, and the dropped frames."""
    with links.Network(sites=2, rate_mbit=rate_mbit, min_queue_bytes=min_queue_bytes) as net:
        got = transfer(net, payload)
        after = net.counters()
    ratio = got["payload_mbit"] / rate_mbit
    dropped = after[0].tx_dropped + after[1].rx_dropped
    return {
        "rate_mbit": rate_mbit,
        "min_queue_bytes": min_queue_bytes,
        "payload_bytes": payload,
        **got,
        "ratio": ratio,
        "dropped_frames": dropped,
    }


def markdown(result: dict) -> str:
    """The table docs/cluster.md quotes."""
    lines = [
        "# One TCP transfer between two sites, per link rate",
        "",
        f"`{result['command']}`",
        "",
        f"Expected ratio: {FULL_FRAME_PAYLOAD:.3f} (full frames' payload).",
        "",
        "| link (Mbit/s) | queue floor (bytes) | payload (MB) | seconds | payload rate (Mbit/s) | / link rate "
        "| dropped frames |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['rate_mbit']:g} | {r['min_queue_bytes']:,} | {r['payload_bytes'] / 1e6:g} | {r['seconds']:.2f} "
            f"| {r['payload_mbit']:.2f} | {r['ratio']:.3f} | {r['dropped_frames']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    study = harness.Study(__doc__, module="experiments.bench.link_rate", topic="cluster")
    parser = study.parser
    parser.add_argument(
        "--rates",
        type=harness.integers(1, distinct=True),
        default="8,50,1000",
        help="link rates to measure, whole Mbit/s each way, comma-separated",
    )
    parser.add_argument(
        "--megabytes",
        type=harness.number(0),
        default=0.0,
        help="payload per transfer in MB (10^6 bytes), > 0; 0: 2 MB below 50 Mbit/s, else 100 MB",
    )
    parser.add_argument(
        "--queue-floors",
        type=harness.integers(0, distinct=True),
        default=str(links.MIN_QUEUE_BYTES),
        help="the shapers' queue floors to measure at every rate, bytes, comma-separated (the tool's is "
        f"{links.MIN_QUEUE_BYTES}; 0: a queue of QUEUE_SECONDS of the rate only)",
    )
    args = study.parse(argv)
    missing = links.unavailable()
    if missing is not None:
        parser.error(missing)
    rows: list[dict] = []
    n = len(args.rates) * len(args.queue_floors)
    for rate in args.rates:
        payload = int(args.megabytes * 1e6) or (2_000_000 if rate < 50 else 100_000_000)
        for floor in args.queue_floors:
            study.progress(
                len(rows) + 1, n, f"{rate:g} Mbit/s, queue floor {floor} bytes: sending {payload / 1e6:g} MB"
            )
            rows.append(measure(rate, payload, floor))
    study.write("link_rate", {"rows": rows}, markdown, always=("rates", "queue_floors"))


if __name__ == "__main__":
    command.run(main)
