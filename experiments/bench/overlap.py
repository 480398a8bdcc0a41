"""Does a cross-process collective run while compute runs? Measured on this machine's runtime (XLA:CPU, gloo).

    python -m experiments.bench.overlap [--out runs/bench] [--rate-mbit 10] [--megabytes 1] [--repeats 3]

Two processes (jax.distributed over gloo, one CPU device each), each in its own network namespace behind a link of
`--rate-mbit` (experiments.links; needs root, else on 127.0.0.1 without a rate limit). Each times, side by side:

  compute      a site's own work: a chain of matmuls (no communication), about as long as the transfer
  collective   an all-reduce of `--megabytes` MB of float32 between the two processes (a synchronisation)
  sequential   compute, waited for, then the collective
  dispatched   the collective's program dispatched, then compute's, both waited for (JAX dispatch is asynchronous)
  one program  one jitted program holding both, independent of each other (XLA may schedule them concurrently)
  threads      the two programs dispatched from two Python threads

and reports each time with its overlap: (compute + collective - time) / min(compute, collective), 1 = fully
hidden, 0 = serialised. Writes overlap.json and overlap.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

from experiments import command, harness

CASES = ("compute", "collective", "sequential", "dispatched", "one program", "threads")


def _worker(index: int, coordinator: str, megabytes: float, repeats: int, matmuls: int) -> dict:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=2, process_id=index)
    mesh = jax.make_mesh((2,), ("site",))
    spec = NamedSharding(mesh, PartitionSpec("site"))
    n = int(megabytes * 1e6 / 4)

    def put(shape):
        local = jnp.ones((1, *shape), jnp.float32) * (index + 1)
        return jax.make_array_from_single_device_arrays(
            (2, *shape), spec, [jax.device_put(local, jax.local_devices()[0])]
        )

    payload, weights = put((n,)), put((384, 384))

    def compute_fn(w):  # [1, 384, 384] per process
        return jax.lax.fori_loop(0, matmuls, lambda _, x: jnp.tanh(x @ w[0]), w[0])[None]

    def collective_fn(x):
        return jax.lax.psum(x, "site")

    shard = lambda f: jax.shard_map(f, mesh=mesh, in_specs=PartitionSpec("site"), out_specs=PartitionSpec("site"))  # noqa: E731
    compute = jax.jit(shard(compute_fn))
    collective = jax.jit(shard(collective_fn))
    both = jax.jit(lambda w, x: (shard(compute_fn)(w), shard(collective_fn)(x)))
    for f, args in ((compute, (weights,)), (collective, (payload,)), (both, (weights, payload))):
        jax.block_until_ready(f(*args))  # compiled and warm

    def threads():
        t = threading.Thread(target=lambda: jax.block_until_ready(collective(payload)))
        t.start()
        jax.block_until_ready(compute(weights))
        t.join()

    runs = {
        "compute": lambda: jax.block_until_ready(compute(weights)),
        "collective": lambda: jax.block_until_ready(collective(payload)),
        "sequential": lambda: (jax.block_until_ready(compute(weights)), jax.block_until_ready(collective(payload))),
        "dispatched": lambda: jax.block_until_ready((collective(payload), compute(weights))),
        "one program": lambda: jax.block_until_ready(both(weights, payload)),
        "threads": threads,
    }
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(repeats):
        for name in CASES:
            jax.block_until_ready(collective(payload))  # both processes start each case together
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
    text = both.lower(weights, payload).compile().as_text() or ""
    return {"times": times, "async_collectives": "all-reduce-start" in text, "backend": jax.default_backend()}


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help. With the hidden `--worker` it is one of the two
    processes: it prints "RESULT " and its timings as JSON, and writes nothing."""
    study = harness.Study(__doc__, module="experiments.bench.overlap", topic="bench", repeats=3)
    parser = study.parser
    parser.add_argument(
        "--rate-mbit", type=harness.number(0, low_open=True), default=10.0, help="each link's rate (Mbit/s), > 0"
    )
    parser.add_argument(
        "--megabytes",
        type=harness.number(0, low_open=True),
        default=1.0,
        help="the all-reduce's payload (MB of float32), > 0",
    )
    parser.add_argument(
        "--matmuls", type=harness.integer(1), default=600, help="384 x 384 matmuls in compute's chain, >= 1"
    )
    parser.add_argument("--worker", type=harness.integer(0, maximum=1), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    args = study.parse(argv)
    if args.worker is not None:
        result = _worker(args.worker, args.coordinator, args.megabytes, args.repeats, args.matmuls)
        print("RESULT " + json.dumps(result), flush=True)
        return
    from experiments.cluster import links, supervisor

    own = ["-m", "experiments.bench.overlap", f"--megabytes={args.megabytes}", f"--repeats={args.repeats}"]
    own += [f"--matmuls={args.matmuls}", f"--out={args.out}"]

    def worker(i: int, coordinator: str) -> list[str]:
        return [sys.executable, *own, f"--worker={i}", f"--coordinator={coordinator}"]

    reason = links.unavailable()
    if reason is None:
        with links.Network(2, args.rate_mbit) as net:
            coordinator = f"{net.sites[0].address}:29511"  # (a fresh namespace: every port is free)
            procs = [net.popen(i, worker(i, coordinator), stdout=subprocess.PIPE, text=True) for i in range(2)]
            outs = [p.communicate(timeout=600)[0] for p in procs]
        where = f"two network namespaces behind {args.rate_mbit:g} Mbit/s links"
    else:
        coordinator = f"127.0.0.1:{supervisor.free_port()}"
        procs = [subprocess.Popen(worker(i, coordinator), stdout=subprocess.PIPE, text=True) for i in range(2)]
        outs = [p.communicate(timeout=600)[0] for p in procs]
        where = f"127.0.0.1 without a rate limit ({reason})"
    results = [json.loads(line[7:]) for out in outs for line in out.splitlines() if line.startswith("RESULT ")]
    if len(results) != 2:
        raise SystemExit("error: a worker failed:\n" + "\n".join(outs))
    median = {name: statistics.median(results[0]["times"][name]) for name in CASES}
    c, a = median["compute"], median["collective"]
    both = [name for name in CASES if name not in ("compute", "collective")]
    rows = [
        {"case": name, "seconds": median[name], "overlap": (c + a - median[name]) / min(c, a) if name in both else None}
        for name in CASES
    ]
    result = {
        "where": where,
        "megabytes": args.megabytes,
        "async_collectives_in_one_program": results[0]["async_collectives"],
        "backend": results[0]["backend"],
        "rows": rows,
    }

    def markdown(r):
        lines = [
            "# Does a collective overlap compute here?",
            "",
            f"`{r['command']}`: 2 processes ({r['backend']}, gloo) in {r['where']}, an all-reduce of "
            f"{r['megabytes']:g} MB; median of the repeats, process 0's clock. Overlap: (compute + collective - "
            "time) / min of the two (1 hidden, 0 serialised). The compiled one-program form "
            + ("has" if r["async_collectives_in_one_program"] else "has no")
            + " asynchronous all-reduce (all-reduce-start/done).",
            "",
            "| case | seconds | overlap |",
            "|---|---|---|",
        ]
        for row in r["rows"]:
            ov = "-" if row["overlap"] is None else f"{row['overlap']:+.2f}"
            lines.append(f"| {row['case']} | {row['seconds']:.3f} | {ov} |")
        return "\n".join(lines) + "\n"

    study.write("overlap", result, markdown)


if __name__ == "__main__":
    command.run(main)
