"""experiments.launch: its arguments, exit codes, stop signals, processes bound to it, and a lost coordinator.

The launcher runs in a subprocess (the tests send it signals) and starts this file as its processes' program
(`main(module="test_launch")`): a stand-in for experiments.run that prints its pid and then does what `--then` says
for its process_id. All but the last test cost a second or two; the last starts two jax.distributed processes.
(The end-to-end multi-process runs of experiments.run, a lost site and its resume: tests/test_cli.py.)
"""

import os
import signal
import subprocess
import sys
import threading
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


# --- the processes' program -----------------------------------------------------------------------------------------


def _stand_in(argv):
    """What process i does, by the i-th entry of `--then=a,b,...`: `sleep` (until stopped), `ignore-term` (sleeps
    with SIGTERM ignored), `exit:N`, `kill:SIGNAME` (sends itself that signal), or `barrier` (below)."""
    flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    index = int(flags["config.mesh.process_id"])
    action = flags["then"].split(",")[index]
    if action == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"pid {os.getpid()}", flush=True)
    if action.startswith("exit:"):
        sys.exit(int(action[5:]))
    if action.startswith("kill:"):
        os.kill(os.getpid(), getattr(signal, action[5:]))
    elif action == "barrier":
        _collective_then_barrier(flags)
    elif action not in ("sleep", "ignore-term"):
        sys.exit(f"error: unknown --then action {action!r}")
    time.sleep(600)


def _collective_then_barrier(flags):
    """jax.distributed through core.mesh.initialize_distributed, one cross-process collective (gloo), then: process 0
    sleeps, the others wait at a coordination-service barrier that process 0 never reaches (as a checkpoint's
    barrier waits for a process that died). Any exception ends the process with its traceback."""
    import ml_collections
    import numpy as np
    from jax.experimental import multihost_utils

    from core import jax_compat
    from core import mesh as mesh_lib

    mesh = {k: flags[f"config.mesh.{k}"] for k in ("num_processes", "process_id", "coordinator_address")}
    mesh["num_processes"], mesh["process_id"] = int(mesh["num_processes"]), int(mesh["process_id"])
    mesh_lib.initialize_distributed(ml_collections.ConfigDict({"mesh": mesh}))
    gathered = multihost_utils.process_allgather(np.array([mesh["process_id"]]))
    print(f"gathered {gathered.ravel().tolist()}", flush=True)
    if mesh["process_id"] > 0:
        print("waiting at a barrier", flush=True)
        client = jax_compat.lookup("jax._src.distributed.global_state.client")
        assert client is not None
        client.wait_at_barrier("never", 300_000)


if __name__ == "__main__":  # one of the launcher's processes: the stand-in, without importing pytest (half a second)
    _stand_in(sys.argv[1:])

# --- the tests' side ------------------------------------------------------------------------------------------------

import pytest  # noqa: E402

from experiments import launch  # noqa: E402
from experiments.cluster import supervisor  # noqa: E402

from helpers import running  # noqa: E402


class _Launcher:
    """`python -m experiments.launch --processes N -- --then=<then>` running this file's stand-in, in its own
    session (as a shell runs a foreground job), its output collected line by line. `settings` override the
    supervisor module's constants (e.g. STOP_GRACE_SECONDS)."""

    def __init__(self, then, processes=2, own=(), run=(), **settings):
        code = "; ".join(
            ["import sys", "from experiments import launch", "from experiments.cluster import supervisor"]
            + [f"supervisor.{k} = {v!r}" for k, v in settings.items()]
            + ["sys.exit(launch.main(sys.argv[1:], module='test_launch'))"]
        )
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, ROOT, os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, "--processes", str(processes), *own, "--", f"--then={then}", *run],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        stdout = self.proc.stdout
        assert stdout is not None
        self._reader = threading.Thread(target=lambda: self.lines.extend(stdout), daemon=True)
        self._reader.start()

    def wait_for(self, *needles, timeout=120):
        """Waits until every needle is in some output line; returns those lines."""
        deadline = time.monotonic() + timeout
        while True:
            found = [next((line for line in list(self.lines) if n in line), None) for n in needles]
            if all(found):
                return found
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()
            time.sleep(0.05)

    def pids(self, processes=2):
        """The pids the stand-ins printed."""
        return [int(line.split()[-1]) for line in self.wait_for(*(f"[{i}] pid " for i in range(processes)))]

    def finish(self, timeout=60):
        """Waits for the launcher to exit; returns (exit code, all its output)."""
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code, self.output()

    def output(self):
        return "".join(self.lines)


def _wait_gone(pids, timeout=30):
    deadline = time.monotonic() + timeout
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if running(p)]


@pytest.fixture
def cleanup():
    """Kills whatever a failed test leaves running: launchers, and the stand-ins' pids registered in the list."""
    started: list[_Launcher | int] = []
    yield started
    for item in started:
        pids = [item.proc.pid] if isinstance(item, _Launcher) else [item]
        for pid in pids:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--processes", "2"], "after '--'"),
        (["--processes", "0", "--", "--workdir=x"], "--processes=0"),
        (["--processes", "2", "--", "--config.mesh.process_id=1"], "set by the launcher"),
    ],
)
def test_launcher_rejects_bad_arguments(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        launch.main(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_the_launcher_is_a_command():
    out = subprocess.run(
        [sys.executable, "-m", "experiments.launch", "--processes", "0", "--", "--workdir=x"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert out.returncode == 2 and "--processes=0: must be >= 1" in out.stderr, out.stderr


@pytest.mark.parametrize(
    "then, code, summary",
    [
        ("exit:3,exit:0", 3, "[3, 0]"),
        ("exit:0,kill:SIGKILL", 128 + signal.SIGKILL, "[0, SIGKILL]"),
    ],
    ids=["status", "signal"],
)
def test_exit_codes_follow_the_shell_convention_for_signals(cleanup, then, code, summary):
    """A process killed by signal N is reported by name and makes the launcher exit with 128+N (not Popen's -N,
    which the shell would have shown as 256-N)."""
    launcher = _Launcher(then)
    cleanup.append(launcher)
    got, out = launcher.finish()
    assert got == code and f"launch: exit codes {summary}\n" in out, out
    assert ("launch: process 1 was killed by signal SIGKILL" in out) == ("SIGKILL" in summary), out


@pytest.mark.parametrize(
    "then, said",
    [
        ("kill:SIGABRT,kill:SIGABRT,kill:SIGABRT", "processes 0 (SIGABRT), 1 (SIGABRT), 2 (SIGABRT) were killed at "
         "once: cannot tell which site was lost; stopping"),
        ("exit:1,sleep,kill:SIGKILL", "site 2 was lost: its process was killed by SIGKILL; regrouping"),
    ],
    ids=["aborted-alike", "one-killed"],
)  # fmt: skip
def test_an_elastic_launch_names_the_lost_site_only_when_it_can(cleanup, tmp_path, then, said):
    """--elastic: every process aborted alike (as jaxlib aborts them all when the coordination service misses one
    site's heartbeats) names no lost site (it once regrouped without site 0); one process killed by a signal names
    it, not the one the launcher terminated itself after the grace (SIGTERM)."""
    launcher = _Launcher(then, 3, own=("--elastic",), run=(f"--workdir={tmp_path}",), GRACE_SECONDS=1)
    cleanup.append(launcher)
    code, out = launcher.finish()
    assert f"launch: --elastic: {said}" in out, out
    assert "site 0 was lost" not in out and code != 0, out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_reaches_the_processes_as_sigterm(cleanup, signum):
    """SIGTERM to the launcher, or a terminal's Ctrl-C (SIGINT to its whole process group): the processes, in their
    own sessions, get exactly one SIGTERM from the launcher (no KeyboardInterrupt in them), and it exits 128+N."""
    launcher = _Launcher("sleep,sleep")
    cleanup.append(launcher)
    pids = launcher.pids()
    cleanup.extend(pids)
    if signum == signal.SIGINT:
        os.killpg(launcher.proc.pid, signum)  # what a terminal does: the launcher's group, not its processes'
    else:
        launcher.proc.send_signal(signum)
    code, out = launcher.finish()
    assert code == 128 + signum, out
    assert f"launch: stopped by {signal.Signals(signum).name}: sending SIGTERM" in out, out
    assert "launch: exit codes [SIGTERM, SIGTERM]" in out and "Traceback" not in out, out
    assert not _wait_gone(pids)


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace(cleanup):
    launcher = _Launcher("ignore-term,sleep", STOP_GRACE_SECONDS=1)
    cleanup.append(launcher)
    cleanup.extend(launcher.pids())
    launcher.proc.send_signal(signal.SIGTERM)
    code, out = launcher.finish()
    assert code == 128 + signal.SIGTERM, out
    assert "launch: killing process 0 (still running after SIGTERM)" in out, out
    assert "launch: exit codes [SIGKILL, SIGTERM]" in out, out


@pytest.mark.parametrize("pdeathsig", [True, False], ids=["prctl", "polling"])
def test_the_processes_die_with_a_killed_launcher(cleanup, pdeathsig):
    """SIGKILL to the launcher (nothing it can catch): its processes get SIGTERM all the same, from the kernel
    (Linux's PR_SET_PDEATHSIG) or from their own watch of their parent (the fallback elsewhere, forced here)."""
    launcher = _Launcher("sleep,sleep", _HAS_PDEATHSIG=pdeathsig)
    cleanup.append(launcher)
    pids = launcher.pids()
    cleanup.extend(pids)
    launcher.proc.kill()
    launcher.finish()
    assert not _wait_gone(pids), "the launcher's processes outlived it"


def test_a_lost_coordinator_stops_the_others_with_an_error(cleanup):
    """Two jax.distributed processes (gloo, as experiments.run); process 1 waits at a coordination barrier for
    process 0 (jax's coordinator), which dies. Process 1 must stop with an `error:` line and exit status 1, not
    abort (SIGABRT and a C++ stack trace): jaxlib aborts it at once when the coordination service lives in process
    0 and dies with it (the launcher serves it instead), and at the heartbeat timeout when a process it waits for is
    lost (the launcher tells it first). Process 0 is stopped by SIGTERM, which must kill a jax.distributed process
    as any other (jax's preemption notifier would swallow it) and, like SIGKILL, leaves it no last word."""
    from core import mesh as mesh_lib

    assert supervisor.HEARTBEAT_TIMEOUT_SECONDS == mesh_lib.HEARTBEAT_TIMEOUT_SECONDS
    assert supervisor.EXTERNAL_SERVICE_ENV == mesh_lib.EXTERNAL_SERVICE_ENV
    assert supervisor.PEER_LOST_NOTICE_ENV == mesh_lib.PEER_LOST_NOTICE_ENV
    launcher = _Launcher("barrier,barrier")
    cleanup.append(launcher)
    pids = launcher.pids()
    cleanup.extend(pids)
    launcher.wait_for("[0] gathered [0, 1]", "[1] waiting at a barrier")
    os.kill(pids[0], signal.SIGTERM)
    code, out = launcher.finish(timeout=120)
    assert "launch: process 0 was killed by signal SIGTERM" in out, out
    assert "[1] error: process 1 stops: process 0 was killed by signal SIGTERM (experiments.launch)" in out, out
    assert "rerun the same command on every process" in out, out
    assert "launch: exit codes [SIGTERM, 1]" in out and code == 128 + signal.SIGTERM, out
    for abort in ("Check failure", "Terminating process", "SIGABRT", "terminate called", "Traceback"):
        assert abort not in out, out
