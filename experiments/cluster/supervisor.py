"""The launcher's supervisor: a multi-process run on this machine, one process per site (or per host), on 127.0.0.1.

    code = supervisor.launch(4, 1, ["--config", "experiments/configs/fomoe.py", "--workdir", "runs/fomoe"])
    # what `python -m experiments.launch --processes 4 -- --config ... --workdir ...` runs

Every process runs `python -m experiments.run <args> --config.mesh.num_processes=N --config.mesh.process_id=i
--config.mesh.coordinator_address=127.0.0.1:<free port>` with `--devices-per-process` CPU devices, and its output
lines are prefixed with `[i]`. If a process fails, the others stop by themselves (a federated run stops when a site
is lost; see below), and those still running 60 s later are terminated. On a cluster, run the same experiments.run
command on every host with its own process_id and the coordinator's address instead (or `num_processes = -1` under
srun / mpirun: README "On a cluster").

Over real slow links (experiments.links; root):

    python -m experiments.links run --sites 2 --rate-mbit 100 --in-hub -- \
        python -m experiments.launch --processes 2 --links -- --config ... --workdir ...

`--links` (`launch`'s `netns` and `host`, from `site_network()`) runs process i inside site i's network namespace
(`ip netns exec`) and serves the coordination service on the hub's address, so the processes reach each other only
over the rate-limited links.

The launcher hosts jax.distributed's coordination service itself (`core.mesh.EXTERNAL_SERVICE_ENV`), so that every
process, process 0 included, is a peer the others can lose: they then stop with experiments.run's `error: ...
another process has probably died ... rerun the same command on every process to resume from it` (exit status 1).
With the service inside process 0 (on a cluster, or where jaxlib cannot be imported here), process 0's death makes
the others abort (SIGABRT and a C++ stack trace from jaxlib). And as the launcher sees a process die at once, it tells
the others still running `NOTICE_SECONDS` later (`core.mesh.PEER_LOST_NOTICE_ENV`), which stop with an `error:` line
and status 1: one waiting at a coordination barrier (a checkpoint's) would otherwise be aborted by jaxlib when the
heartbeats time out.

A paused process (SIGSTOP, a suspended VM, a debugger) is waited for up to `site_timeout` seconds (the launcher's
--site-timeout, default SITE_TIMEOUT_SECONDS = 50): the others wait in their collective, and when it continues in time
the run goes on and ends as it would have without the pause. A process that, once it has started jax.distributed,
gives no sign of life for longer (no beat on its `core.mesh.ALIVE_ENV` pipe and no CPU time used) is ended: the
launcher prints one line naming it, e.g. `launch: error: process 1 (site 1) has given no sign of life for 50 s (it is
stopped, e.g. by SIGSTOP; --site-timeout=50): ending the run with exit status 75; rerun the same command to resume
from the last checkpoint`, tells the others (each stops with an `error:` line, status 1), kills it (SIGKILL) and exits
with SITE_TIMEOUT_EXIT_CODE = 75. The checkpoints are those of a run killed at that point: rerunning the same command
resumes from the last one. jax.distributed's heartbeat timeout is raised to match (`heartbeat_timeout()`), so that
jaxlib does not abort every process first (with its default, 10-20 s into a pause: SIGABRT and a C++ stack trace).
`site_timeout` is at most MAX_SITE_TIMEOUT_SECONDS = 50: the coordination service (gRPC) closes the connection of a
process that leaves one of its pings unanswered for GRPC_PING_TIMEOUT_SECONDS = 60, and such a process cannot rejoin
(jaxlib aborts it when it continues).

Stopping: SIGTERM, SIGINT (Ctrl-C) or SIGHUP to the launcher is passed on to every process as SIGTERM, and those
still running `STOP_GRACE_SECONDS` later (or at a second such signal) are killed. The processes run in their own
sessions, so a terminal's Ctrl-C reaches them only this way, and they are bound to the launcher: if it dies, even by
SIGKILL, they receive SIGTERM (Linux: prctl(PR_SET_PDEATHSIG); elsewhere each polls its parent once a second).

Exit code: 0 if every process succeeded; SITE_TIMEOUT_EXIT_CODE (75) if the launcher ended the run because a process
gave no sign of life for longer than `site_timeout` (watched until a first failure); else the first failure's: the
process's exit code, or 128+N for a process killed by signal N (the shell's convention: 137 for SIGKILL); 128+N when
the launcher itself is stopped by signal N.
The last line, `launch: exit codes [0, 1, SIGKILL]`, lists every process's code (a signal's name where one killed it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

__all__ = [
    "ALIVE_ENV",
    "EXTERNAL_SERVICE_ENV",
    "GRACE_SECONDS",
    "GRPC_PING_TIMEOUT_SECONDS",
    "HEARTBEAT_TIMEOUT_ENV",
    "HEARTBEAT_TIMEOUT_SECONDS",
    "MAX_SITE_TIMEOUT_SECONDS",
    "NOTICE_SECONDS",
    "PEER_LOST_NOTICE_ENV",
    "SITE_TIMEOUT_EXIT_CODE",
    "SITE_TIMEOUT_SECONDS",
    "STOP_GRACE_SECONDS",
    "free_port",
    "heartbeat_timeout",
    "launch",
    "site_network",
    "site_timeout_error",
    "unreachable",
]

from core import jax_compat
from experiments.cluster import process

GRACE_SECONDS = 60
"""After a process fails, the others are given this long to stop by themselves before they are terminated."""
STOP_GRACE_SECONDS = 10
"""After the launcher sends SIGTERM to the processes, those still running this long afterwards are killed."""
HEARTBEAT_TIMEOUT_SECONDS = 20
"""core.mesh.HEARTBEAT_TIMEOUT_SECONDS, jax.distributed's heartbeat timeout outside the launcher (not imported from
there, which would import jax into the launcher; a test checks they agree); the launcher's: `heartbeat_timeout()`."""
SITE_TIMEOUT_SECONDS = 50
"""How long a process that gives no sign of life (paused, hung) is waited for by default (`launch`'s
`site_timeout`, the launcher's --site-timeout)."""
GRPC_PING_TIMEOUT_SECONDS = 60
"""gRPC's ping timeout (its `grpc.http2.ping_timeout_ms`, which jaxlib 0.10 leaves at its default and offers no way to
set): the coordination service closes the connection of a process that has left one of its pings unanswered this
long, as a stopped process does when the service pinged it just before (measured: a process stopped right after a
checkpoint for 90 s, with heartbeats far longer, aborted in jaxlib when continued; one stopped for 70 s at another
moment went on)."""
MAX_SITE_TIMEOUT_SECONDS = 50
"""The longest `site_timeout`: a paused process must continue before GRPC_PING_TIMEOUT_SECONDS have passed, whatever
the moment it was paused at (10 s of margin for the beats, the launcher's polling and a loaded machine)."""
SITE_TIMEOUT_EXIT_CODE = 75
"""The launcher's exit code when it ended the run because a process gave no sign of life for longer than
`site_timeout` (EX_TEMPFAIL of sysexits.h: a temporary failure; rerunning the same command resumes the run)."""
KILL_GRACE_SECONDS = 0.5
"""How long a process the launcher ends for its silence is left stopped after the others were told (`_end_silent`):
told first, they stop with their `error:` line; killed first, a collective waiting on it could fail on the broken
connection with a traceback before the notice was read."""
NOTICE_SECONDS = 2
"""After a process fails, the others still running this long afterwards are told so (`core.mesh`'s peer-lost notice:
an `error:` line, exit status 1). One in a collective has stopped by itself by then, naming its last checkpoint; one
waiting at a coordination barrier would otherwise learn it only from the heartbeat timeout (10-20 s), at which jaxlib
aborts it. Well under HEARTBEAT_TIMEOUT_SECONDS / 2."""
EXTERNAL_SERVICE_ENV = "MESH_EXTERNAL_COORDINATION_SERVICE"
"""core.mesh.EXTERNAL_SERVICE_ENV (same reason)."""
PEER_LOST_NOTICE_ENV = "MESH_PEER_LOST_NOTICE_FD"
"""core.mesh.PEER_LOST_NOTICE_ENV (same reason)."""
ALIVE_ENV = "MESH_ALIVE_FD"
"""core.mesh.ALIVE_ENV (same reason): the pipe on which a process shows that it runs."""
HEARTBEAT_TIMEOUT_ENV = "MESH_HEARTBEAT_TIMEOUT_SECONDS"
"""core.mesh.HEARTBEAT_TIMEOUT_ENV (same reason): the processes' heartbeat timeout, `heartbeat_timeout()`."""
PROBE_SECONDS = 3.0
"""`unreachable`: a site whose TCP connection to the hub is not made within this long is cut off."""
_PROBE = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), float(sys.argv[3])).close()"

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_HAS_PDEATHSIG = process.HAS_PDEATHSIG  # (tests force the fallback)
_WATCH_LAUNCHER = """\
import os, runpy, signal, sys, threading, time
launcher = int(sys.argv[1])
def watch():
    while os.getppid() == launcher:
        time.sleep(1)
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=watch, daemon=True).start()
del sys.argv[:2]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""
"""Where prctl is not available: the child's program, `python -c _WATCH_LAUNCHER <launcher pid> <module> <args>`,
sends itself SIGTERM once its parent is no longer the launcher, and runs `<module>` as `python -m` would."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def site_network(processes: int) -> tuple[list[str], str]:
    """(each process's network namespace, the coordinator's host) from the environment `python -m experiments.links
    run --in-hub` gives its command (LINKS_NETNS, LINKS_HUB_ADDRESS); ValueError saying what is missing or wrong."""
    netns = [n for n in os.environ.get("LINKS_NETNS", "").split(",") if n]
    hub = os.environ.get("LINKS_HUB_ADDRESS", "")
    if not netns or not hub:
        raise ValueError(
            "--links needs the network of `python -m experiments.links run --in-hub -- <this command>` (LINKS_NETNS "
            "and LINKS_HUB_ADDRESS are not set)"
        )
    if len(netns) != processes:
        raise ValueError(f"--links: the network has {len(netns)} sites but --processes={processes}; they must match")
    return netns, hub


def unreachable(netns: Sequence[str], host: str, *, timeout: float = PROBE_SECONDS) -> list[int]:
    """The indices of the network namespaces (`site_network()`'s) from which no TCP connection reaches `host` (an
    address of this process's namespace: the hub's) within `timeout` seconds: the sites whose link is cut. The
    probes run at once, each a short Python process inside its namespace (`ip netns exec`); this process listens
    on a free port of `host` meanwhile (the kernel completes the connections; nothing is sent)."""
    with socket.create_server((host, 0), backlog=max(len(netns), 1)) as server:
        port = str(server.getsockname()[1])
        probes = [
            subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-c", _PROBE, host, port, str(timeout)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for ns in netns
        ]
        codes = [p.wait() for p in probes]  # (each gives up after `timeout`)
    return [i for i, code in enumerate(codes) if code != 0]


def heartbeat_timeout(site_timeout: int) -> int:
    """jax.distributed's heartbeat timeout (seconds) under the launcher, for the service it hosts and every process:
    2 * site_timeout + HEARTBEAT_TIMEOUT_SECONDS. A process sends a heartbeat every half of it, so the service, which
    gives up on one that sent none for that long, waits out a pause of `site_timeout` whenever it began, and so does a
    heartbeat the paused process had in flight (its deadline is half of it)."""
    return 2 * site_timeout + HEARTBEAT_TIMEOUT_SECONDS


def _child_env(devices: int, external_service: bool, notice_fd: int, alive_fd: int, heartbeat: int) -> dict[str, str]:
    """This process's environment for a child run with `devices` CPU devices: the caller's XLA flags pass through,
    the device count is replaced, output unbuffered; `external_service` tells process 0 not to start the
    coordination service (the launcher runs it); the launcher's peer-lost notices come on `notice_fd`, the child's
    beats go to `alive_fd`, and `heartbeat` is jax.distributed's heartbeat timeout."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
    flags.append(f"{_DEVICE_COUNT_FLAG}={devices}")
    fds = {PEER_LOST_NOTICE_ENV: str(notice_fd), ALIVE_ENV: str(alive_fd), HEARTBEAT_TIMEOUT_ENV: str(heartbeat)}
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_FLAGS=" ".join(flags), **fds)
    env.pop(EXTERNAL_SERVICE_ENV, None)
    if external_service:
        env[EXTERNAL_SERVICE_ENV] = "1"
    return env


def _coordination_service_factory() -> Callable[..., Any] | None:
    """jaxlib's `get_distributed_runtime_service` (what `jax.distributed.initialize` calls in process 0), or None
    where jaxlib cannot be imported or has none: then process 0 runs the service. Only jaxlib is imported here (a
    fraction of importing jax), and its INFO log lines (the service starting and stopping) are turned off."""
    try:
        factory = jax_compat.coordination_service_factory()
    except jax_compat.JaxCompatError as e:
        print(f"launch: the coordination service runs in process 0 ({e})", flush=True)
        return None
    with contextlib.suppress(jax_compat.JaxCompatError):  # without the switch only jaxlib's INFO lines show
        jax_compat.quiet_jaxlib_logs()
    return factory


def _bound_to_launcher(module: str) -> tuple[list[str], Callable[[], None] | None]:
    """The command prefix that runs `module` and the `preexec_fn` that make a child receive SIGTERM when the
    launcher dies (by any signal, SIGKILL included).

    Linux: prctl(PR_SET_PDEATHSIG, SIGTERM) in the child (experiments.cluster.process.die_with_parent).
    Elsewhere: the child polls its parent (`_WATCH_LAUNCHER`).
    """
    if not _HAS_PDEATHSIG:
        return [sys.executable, "-c", _WATCH_LAUNCHER, str(os.getpid()), module], None
    return [sys.executable, "-m", module], process.die_with_parent()


def _forward(index: int, stream) -> None:
    """Copies a child's output lines to ours with an `[index] ` prefix, to its end (once our stdout is gone, the
    lines are dropped: the child must never block on a full pipe)."""
    for line in stream:
        try:
            sys.stdout.write(f"[{index}] {line}")
            sys.stdout.flush()
        except (OSError, ValueError):
            pass


def _shown(code: int) -> str:
    """A process's return code as the summary line shows it: the number, or the name of the signal that killed it."""
    return process.signal_name(-code) if code < 0 else str(code)


def _send(procs: Sequence[subprocess.Popen], codes: Sequence[int | None], signum: int) -> None:
    """Sends `signum` to the process group of every child still running (each leads its own session)."""
    for p, code in zip(procs, codes):
        if code is None:
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.killpg(p.pid, signum)


def launch(
    processes: int,
    devices_per_process: int,
    run_args: Sequence[str],
    *,
    module: str = "experiments.run",
    netns: Sequence[str] = (),
    host: str = "127.0.0.1",
    site_timeout: int = SITE_TIMEOUT_SECONDS,
    report: dict | None = None,
    pause_when: Callable[[], str | None] | None = None,
) -> int:
    """Runs `processes` processes of `python -m <module> <run_args> --config.mesh.*` with `devices_per_process`
    CPU devices each, supervises them and returns the launcher's exit code (module docstring). `netns`: each
    process's network namespace and `host` the coordinator's (`site_network()`; none: this namespace, 127.0.0.1).
    `site_timeout`: how many seconds a process that gives no sign of life is waited for (1..MAX_SITE_TIMEOUT_SECONDS;
    ValueError otherwise). `report`, if given, receives "first_failed" (the index of the first process seen failing,
    or None), "stopped_by" (the signal that stopped the launcher, or None), "codes" (every process's Popen return
    code), "terminated" (the indices of the processes the launcher itself stopped, GRACE_SECONDS after a failure) and
    "unresponsive" (those it killed for giving no sign of life for `site_timeout` seconds) and "paused" (below).
    `pause_when`, polled while the run is healthy, returns why to pause it (e.g. a checkpoint after which a site
    joins) or None: the processes then get SIGTERM as at a stop signal, their deaths are not failures, the reason is
    reported as "paused", and the exit code is 0; the run resumes from its last checkpoint when started again.
    `module` is the program every process runs; tests point it at a cheap stand-in. Call it from the main thread:
    it installs handlers for SIGTERM, SIGINT and SIGHUP (restored on return)."""
    if not 1 <= site_timeout <= MAX_SITE_TIMEOUT_SECONDS:
        raise ValueError(site_timeout_error(site_timeout))
    port = free_port(host)
    serve = _coordination_service_factory() if processes > 1 else None
    program, preexec_fn = _bound_to_launcher(module)
    procs: list[subprocess.Popen] = []
    codes: list[int | None] = []
    notices: list[int] = []  # the write end of each process's peer-lost notice pipe
    beats: list[int] = []  # the read end of each process's alive pipe (non-blocking)
    service = None
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in process.STOP_SIGNALS}
    try:
        for i in range(processes):  # all started before any thread: preexec_fn and threads do not mix
            cmd = [
                *(["ip", "netns", "exec", netns[i]] if netns else []),  # (ip execs the program: no process between)
                *program,
                *run_args,
                f"--config.mesh.num_processes={processes}",
                f"--config.mesh.process_id={i}",
                f"--config.mesh.coordinator_address={host}:{port}",
            ]
            read_end, write_end = os.pipe()
            notices.append(write_end)
            beat_end, alive_end = os.pipe()
            os.set_blocking(beat_end, False)
            beats.append(beat_end)
            env = _child_env(
                devices_per_process, serve is not None, read_end, alive_end, heartbeat_timeout(site_timeout)
            )
            try:
                proc = subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    errors="replace",
                    start_new_session=True,
                    pass_fds=(read_end, alive_end),
                    preexec_fn=preexec_fn,  # noqa: PLW1509 (no thread of ours runs yet)
                )
            finally:
                os.close(read_end)
                os.close(alive_end)
            procs.append(proc)
            codes.append(None)
        if serve is not None:  # after the forks: the service runs threads (the processes connect when it is up)
            try:
                service = serve(f"{host}:{port}", processes, heartbeat_timeout=heartbeat_timeout(site_timeout))
            except Exception as e:  # jaxlib's XlaRuntimeError, e.g. the port was taken meanwhile
                print(f"launch: error: cannot start the coordination service on {host}:{port}: {e}", flush=True)
                return 1  # (the processes are killed below)
        forwarders = [threading.Thread(target=_forward, args=(i, p.stdout), daemon=True) for i, p in enumerate(procs)]
        for t in forwarders:
            t.start()
        silence = process.Silence([p.pid for p in procs], beats, site_timeout)
        outcome = _supervise(procs, codes, received, notices, silence, pause_when)
        for t in forwarders:  # the children's last lines before the summary
            t.join(timeout=5)
    finally:  # on the way out of an error here (say, a process that could not start), none is left running
        _send(procs, [p.poll() for p in procs], signal.SIGKILL)
        for p in procs:
            p.wait()
        for fd in notices + beats:
            os.close(fd)
        if service is not None:
            service.shutdown()
        for s, handler in previous.items():
            signal.signal(s, handler)
    print(f"launch: exit codes [{', '.join(_shown(p.returncode) for p in procs)}]", flush=True)
    if report is not None:
        final = [p.returncode for p in procs]
        report.update(outcome._asdict(), codes=final)
    if outcome.stopped_by is not None:
        return 128 + outcome.stopped_by
    if outcome.paused is not None:
        return 0
    if outcome.unresponsive:  # (watched only until a first failure: they are the first)
        return SITE_TIMEOUT_EXIT_CODE
    return 0 if outcome.first_failed is None else process.exit_status(procs[outcome.first_failed].returncode)


def site_timeout_error(value: int) -> str:
    """The error for a `site_timeout` outside 1..MAX_SITE_TIMEOUT_SECONDS: the value, what is allowed and why."""
    return (
        f"--site-timeout={value}: must be 1..{MAX_SITE_TIMEOUT_SECONDS} seconds; jax's coordination service (gRPC) "
        f"drops a process that leaves a ping unanswered for {GRPC_PING_TIMEOUT_SECONDS} s, so a site paused longer "
        "cannot rejoin the run"
    )


class _Outcome(NamedTuple):
    stopped_by: int | None  # the stop signal that stopped the launcher
    first_failed: int | None  # the first process seen failing
    terminated: list[int]  # the processes the launcher terminated GRACE_SECONDS after a failure
    unresponsive: list[int]  # the processes it killed for giving no sign of life for `site_timeout`
    paused: str | None = None  # why the launcher paused a healthy run (`pause_when`), or None


def _supervise(
    procs: Sequence[subprocess.Popen],
    codes: list[int | None],
    received: list[int],
    notices: Sequence[int],
    silence: process.Silence,
    pause_when: Callable[[], str | None] | None = None,
) -> _Outcome:
    """Waits for every child to exit, filling `codes` (Popen return codes) and reporting signal deaths as they
    happen. `NOTICE_SECONDS` after the first failure, tells the children still running which process failed and how
    (a line on their `notices` pipe). While no process has failed, a child `silence` finds silent for too long is
    killed at once (SIGKILL to its group: it may be stopped), named on one line, and the others are told at once.
    Stops the children on a stop signal (in `received`, appended by the handlers) or `GRACE_SECONDS` after the first
    failure: SIGTERM, then SIGKILL after `STOP_GRACE_SECONDS` or at a second stop signal. Returns the stop signal
    that stopped the launcher (or None), the index of the first process seen failing (or None; of several seen at
    once, one killed by a signal: the others failed because it died; a silent one first), the indices of the
    processes still running when it terminated them after a failure, and those killed for their silence. While
    the run is healthy, a reason from `pause_when` stops the children as a stop signal does, without a failure."""
    stopped_by: int | None = None
    failure: tuple[int, float] | None = None  # the first process seen failing, and when
    term_sent_at: float | None = None
    killed = noticed = False
    terminated: list[int] = []
    unresponsive: list[int] = []
    paused: str | None = None
    while True:
        now = time.monotonic()
        if pause_when is not None and paused is None and stopped_by is None and failure is None:
            paused = pause_when()
            if paused is not None:
                print(f"launch: pausing the run: {paused}: sending SIGTERM to the processes", flush=True)
                _send(procs, codes, signal.SIGTERM)
                term_sent_at = now
        if stopped_by is None and failure is None:  # (once the run fails, the failure's own course follows)
            for i in silence.silent(now, codes):
                _end_silent(i, procs[i], silence.timeout, notices, codes)
                unresponsive.append(i)
                noticed = True  # (the others were told)
            if unresponsive:
                failure = unresponsive[0], now
        failed_now = []
        for i, p in enumerate(procs):
            if codes[i] is None and p.poll() is not None:
                codes[i] = p.returncode
                if p.returncode < 0 and i not in unresponsive and paused is None:
                    print(f"launch: process {i} was killed by signal {process.signal_name(-p.returncode)}", flush=True)
                if p.returncode and paused is None:
                    failed_now.append(i)
        if failed_now and failure is None:  # seen together: one killed by a signal is what made the others fail
            failure = min(failed_now, key=lambda i: (codes[i] >= 0, i)), now  # type: ignore[operator]
        if all(c is not None for c in codes):
            return _Outcome(stopped_by, None if failure is None else failure[0], terminated, unresponsive, paused)
        if stopped_by is None and failure is not None and not noticed and now - failure[1] > NOTICE_SECONDS:
            first_failed = failure[0]
            code = procs[first_failed].returncode
            what = f"was killed by signal {process.signal_name(-code)}" if code < 0 else f"exited with status {code}"
            _notify(notices, codes, f"process {first_failed} {what}")
            noticed = True
        if received and stopped_by is None:
            stopped_by = received[0]
            print(
                f"launch: stopped by {process.signal_name(stopped_by)}: sending SIGTERM to the processes (SIGKILL to "
                f"those still running after {STOP_GRACE_SECONDS} s); exit code {128 + stopped_by}",
                flush=True,
            )
            _send(procs, codes, signal.SIGTERM)
            term_sent_at = now
        elif failure is not None and term_sent_at is None and now - failure[1] > GRACE_SECONDS:
            for i, code in enumerate(codes):
                if code is None:
                    print(f"launch: terminating process {i} ({GRACE_SECONDS} s after a failure)", flush=True)
                    terminated.append(i)
            _send(procs, codes, signal.SIGTERM)
            term_sent_at = now
        if not killed and term_sent_at is not None and (now - term_sent_at > STOP_GRACE_SECONDS or len(received) > 1):
            for i, code in enumerate(codes):
                if code is None:
                    print(f"launch: killing process {i} (still running after SIGTERM)", flush=True)
            _send(procs, codes, signal.SIGKILL)
            killed = True
        time.sleep(0.1)


def _notify(notices: Sequence[int], codes: Sequence[int | None], line: str) -> None:
    """Writes `line` on the peer-lost notice pipe of every process still running (core.mesh: it then stops with an
    `error:` line naming it, status 1)."""
    for fd, running in zip(notices, codes):
        if running is None:
            with contextlib.suppress(OSError):  # a process that exited meanwhile (or never read it)
                os.write(fd, f"{line}\n".encode())


def _end_silent(
    index: int, proc: subprocess.Popen, timeout: float, notices: Sequence[int], codes: Sequence[int | None]
) -> None:
    """Ends the run for process `index`, silent for longer than `timeout`: one line naming it, a notice to the
    others, then after KILL_GRACE_SECONDS SIGKILL to its group (a stopped process receives it too)."""
    how = "it is stopped, e.g. by SIGSTOP" if process.stopped(proc.pid) else "it neither beats nor computes: hung"
    print(
        f"launch: error: process {index} (site {index}) has given no sign of life for {timeout:g} s ({how}; "
        f"--site-timeout={timeout:g}): ending the run with exit status {SITE_TIMEOUT_EXIT_CODE}; rerun the same "
        "command to resume from the last checkpoint",
        flush=True,
    )
    others = [c if i != index else 0 for i, c in enumerate(codes)]
    _notify(notices, others, f"process {index} gave no sign of life for {timeout:g} s and was killed")
    time.sleep(KILL_GRACE_SECONDS)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
