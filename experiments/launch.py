"""Start a multi-process run on this machine: one process per site (or per host), on 127.0.0.1.

    python -m experiments.launch --processes 4 -- --config experiments/configs/fomoe.py --workdir runs/fomoe

Every process runs `python -m experiments.run <args> --config.mesh.num_processes=N --config.mesh.process_id=i
--config.mesh.coordinator_address=127.0.0.1:<free port>` with `--devices-per-process` CPU devices, and its output
lines are prefixed with `[i]`. If a process fails, the others are given 60 s to stop by themselves (a federated run
stops when a site is lost) and are then terminated. On a cluster, run the same experiments.run command on every
host with its own process_id and the coordinator's address instead.
Exit code: 0 if every process succeeded, else the first failure's code.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time

GRACE_SECONDS = 60
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(devices: int) -> dict[str, str]:
    """This process's environment for a child run with `devices` CPU devices: the caller's XLA flags pass through,
    the device count is replaced, output unbuffered."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
    flags.append(f"{_DEVICE_COUNT_FLAG}={devices}")
    return dict(os.environ, PYTHONUNBUFFERED="1", XLA_FLAGS=" ".join(flags))


def _forward(index: int, stream) -> None:
    for line in stream:
        sys.stdout.write(f"[{index}] {line}")
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        split = argv.index("--")
        own, run_args = argv[:split], argv[split + 1 :]
    else:
        own, run_args = argv, []
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        usage="python -m experiments.launch --processes N [--devices-per-process D] -- <experiments.run arguments>",
    )
    parser.add_argument("--processes", type=int, required=True, help="number of local processes")
    parser.add_argument("--devices-per-process", type=int, default=1, help="CPU devices in each process")
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
    address = f"127.0.0.1:{_free_port()}"
    env = _child_env(args.devices_per_process)
    procs = []
    for i in range(args.processes):
        cmd = [
            sys.executable,
            "-m",
            "experiments.run",
            *run_args,
            f"--config.mesh.num_processes={args.processes}",
            f"--config.mesh.process_id={i}",
            f"--config.mesh.coordinator_address={address}",
        ]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=_forward, args=(i, proc.stdout), daemon=True).start()
        procs.append(proc)
    first_failure, failed_at = 0, None
    while any(p.poll() is None for p in procs):
        for p in procs:
            if p.poll() not in (None, 0) and not first_failure:
                first_failure, failed_at = p.returncode, time.time()
        if failed_at is not None and time.time() - failed_at > GRACE_SECONDS:
            for p in procs:
                if p.poll() is None:
                    print(
                        f"launch: terminating process {procs.index(p)} ({GRACE_SECONDS} s after a failure)", flush=True
                    )
                    p.terminate()
        time.sleep(0.2)
    codes = [p.returncode for p in procs]
    first_failure = first_failure or next((c for c in codes if c), 0)
    print(f"launch: exit codes {codes}", flush=True)
    return first_failure


if __name__ == "__main__":
    sys.exit(main())
