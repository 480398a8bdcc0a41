"""experiments.launch: its arguments, exit codes, stop signals, processes bound to it, a lost coordinator and a
paused site.

The launcher runs in a subprocess (the tests send it signals) and starts this file as its processes' program
(`main(module="test_launch")`): a stand-in for experiments.run that prints its pid and then does what `--then` says
for its process_id. Most tests cost a second or two; those of a lost coordinator and a paused site start two
jax.distributed processes.
(The end-to-end multi-process runs of experiments.run, a lost site and its resume: tests/test_cli.py.)
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
import types
from typing import cast

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


# --- the processes' program -----------------------------------------------------------------------------------------


def _stand_in(argv):
    """What process i does, by the i-th entry of `--then=a,b,...`: `sleep` (until stopped), `ignore-term` (sleeps
    with SIGTERM ignored), `exit:N`, `kill:SIGNAME` (sends itself that signal), `barrier` or `rounds:N` (below),
    `beat-stop` (one beat on the launcher's alive pipe, as core.mesh writes them, then SIGSTOP to itself), or
    `checkpoint:S` (makes the directory <--workdir>/checkpoints/S, as a finished checkpoint is, then sleeps)."""
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
    elif action.startswith("rounds:"):
        _rounds(flags, int(action[7:]))
        sys.exit(0)
    elif action.startswith("checkpoint:"):
        os.makedirs(os.path.join(flags["workdir"], "checkpoints", action[11:]), exist_ok=True)
    elif action == "beat-stop":
        from experiments.cluster import supervisor

        os.write(int(os.environ[supervisor.ALIVE_ENV]), b".")
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action not in ("sleep", "ignore-term") and not action.startswith("checkpoint:"):
        sys.exit(f"error: unknown --then action {action!r}")
    time.sleep(600)


def _start_distributed(flags):
    """jax.distributed through core.mesh.initialize_distributed, from the launcher's --config.mesh.* flags."""
    import ml_collections

    from core import mesh as mesh_lib

    mesh = {k: flags[f"config.mesh.{k}"] for k in ("num_processes", "process_id", "coordinator_address")}
    mesh["num_processes"], mesh["process_id"] = int(mesh["num_processes"]), int(mesh["process_id"])
    mesh_lib.initialize_distributed(ml_collections.ConfigDict({"mesh": mesh}))
    return mesh["process_id"]


def _rounds(flags, count):
    """jax.distributed as experiments.run starts it (the launcher's beats and heartbeat timeout included), then
    `count` rounds (0: until stopped) of a cross-process all-gather (gloo), as a federation's rounds do: process 0
    prints `round k` after each, and at the end `result <the float32 sum of everything gathered, hex>`."""
    import numpy as np
    from jax.experimental import multihost_utils

    index = _start_distributed(flags)
    total = np.float32(0)
    k = 0
    while count == 0 or k < count:
        k += 1
        gathered = multihost_utils.process_allgather(np.array([index + k / 7], np.float32))
        total = np.float32(total + np.asarray(gathered, np.float32).sum(dtype=np.float32))
        if index == 0:
            print(f"round {k}", flush=True)
        time.sleep(0.05)
    if index == 0:
        print(f"result {float(total).hex()}", flush=True)


def _expected_result(count):
    """`_rounds`' result for 2 processes that each did every round: its sum, computed the same way here."""
    import numpy as np

    total = np.float32(0)
    for k in range(1, count + 1):
        total = np.float32(total + np.array([0 + k / 7, 1 + k / 7], np.float32).sum(dtype=np.float32))
    return f"result {float(total).hex()}"


def _collective_then_barrier(flags):
    """jax.distributed through core.mesh.initialize_distributed, one cross-process collective (gloo), then: process 0
    sleeps, the others wait at a coordination-service barrier that process 0 never reaches (as a checkpoint's
    barrier waits for a process that died). Any exception ends the process with its traceback."""
    import numpy as np
    from jax.experimental import multihost_utils

    from core import jax_compat

    index = _start_distributed(flags)
    gathered = multihost_utils.process_allgather(np.array([index]))
    print(f"gathered {gathered.ravel().tolist()}", flush=True)
    if index > 0:
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
        (["--processes", "2", "--site-timeout", "0", "--", "--workdir=x"], "--site-timeout=0: must be 1..50"),
        (["--processes", "2", "--site-timeout", "90", "--", "--workdir=x"], "unanswered for 60 s"),
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
        ("exit:1,sleep,kill:SIGKILL", "site 2 was lost: its process was killed by SIGKILL ("),
        ("sleep,beat-stop,sleep", "site 1 was lost: it gave no sign of life for longer than --site-timeout ("),
    ],
    ids=["aborted-alike", "one-killed", "one-silent"],
)  # fmt: skip
def test_an_elastic_launch_names_the_lost_site_only_when_it_can(cleanup, tmp_path, then, said):
    """--elastic: every process aborted alike (as jaxlib aborts them all when the coordination service misses one
    site's heartbeats) names no lost site (it once regrouped without site 0); one process killed by a signal names
    it, not the one the launcher terminated itself after the grace (SIGTERM); one that stopped after its first beat
    is killed by the launcher after --site-timeout and named (those that never beat are not judged)."""
    own = ("--elastic", "--site-timeout", "1")
    launcher = _Launcher(then, 3, own=own, run=(f"--workdir={tmp_path}",), GRACE_SECONDS=1)
    cleanup.append(launcher)
    code, out = launcher.finish()
    assert f"launch: --elastic: {said}" in out, out
    assert "site 0 was lost" not in out and code != 0, out


def test_a_join_pauses_a_healthy_run_after_its_checkpoint_and_regroups_onto_one_site_more(cleanup, tmp_path):
    """--elastic --join-at 8: once a process has written the checkpoint of step 8, the launcher pauses the run
    (SIGTERM to both processes, whose deaths are no failure and name no lost site) and regroups the run onto 3
    sites (experiments.elastic, which finds no real checkpoint in the stand-in's workdir and stops the launch)."""
    launcher = _Launcher("sleep,checkpoint:8", own=("--elastic", "--join-at", "8"), run=(f"--workdir={tmp_path}",))
    cleanup.append(launcher)
    code, out = launcher.finish()
    assert "launch: pausing the run: the checkpoint of step 8 is written and site 2 joins" in out, out
    assert "launch: exit codes [SIGTERM, SIGTERM]" in out and "was lost" not in out, out
    assert re.search(r"launch: --elastic: a site joins \(\d+\.\d s in\); regrouping .* onto 3 sites", out), out
    assert "launch: --elastic: cannot go on" in out and code == 1, out


def test_join_at_needs_elastic(capsys):
    from experiments import launch

    with pytest.raises(SystemExit) as exit_:
        launch.main(["--processes", "2", "--join-at", "8", "--", "--workdir=w"])
    assert exit_.value.code == 2 and "--join-at=8 needs --elastic" in capsys.readouterr().err


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


def test_the_launcher_names_a_process_that_gives_no_sign_of_life():
    """process.Silence, what the launcher watches: a process that beat once and then neither beats nor computes is
    silent once the timeout has passed (and reported once); one that computes is not, nor one that never beat. The
    clock is the test's (`now`)."""
    from experiments.cluster import process

    ready = "import time\nprint(flush=True)\n"
    idle = subprocess.Popen([sys.executable, "-c", ready + "time.sleep(60)"], stdout=subprocess.PIPE)
    busy = subprocess.Popen([sys.executable, "-c", ready + "while True: pass"], stdout=subprocess.PIPE)
    pipes = [os.pipe() for _ in range(3)]
    try:
        for p in (idle, busy):
            assert p.stdout is not None and p.stdout.readline() == b"\n"  # started (importing uses CPU time)
        time.sleep(0.3)
        for read_end, _ in pipes:
            os.set_blocking(read_end, False)
        for _, write_end in pipes[:2]:
            os.write(write_end, b".")
        watch = process.Silence([idle.pid, busy.pid, idle.pid], [r for r, _ in pipes], timeout=5)
        assert watch.silent(100.0, [None] * 3) == []
        time.sleep(0.5)  # (the busy process uses CPU time meanwhile)
        assert watch.silent(104.0, [None] * 3) == []
        time.sleep(0.5)
        assert watch.silent(106.0, [None] * 3) == [0]  # busy computes; the third never beat
        assert watch.silent(200.0, [None, 0, None]) == []  # reported once; an exited process is not judged
    finally:
        for p in (idle, busy):
            p.kill()
            p.wait()
        for fds in pipes:
            for fd in fds:
                os.close(fd)


def test_the_processes_take_the_launchers_heartbeat_timeout(monkeypatch):
    """Under the launcher jax.distributed's heartbeat timeout is the launcher's (supervisor.heartbeat_timeout of its
    --site-timeout), so that jaxlib does not give up on a paused process before the launcher does; elsewhere
    core.mesh's. (jax.distributed.initialize is replaced: nothing starts.)"""
    import jax
    import ml_collections

    from core import mesh as mesh_lib

    assert supervisor.ALIVE_ENV == mesh_lib.ALIVE_ENV
    assert supervisor.HEARTBEAT_TIMEOUT_ENV == mesh_lib.HEARTBEAT_TIMEOUT_ENV
    assert supervisor.heartbeat_timeout(supervisor.MAX_SITE_TIMEOUT_SECONDS) > 2 * supervisor.MAX_SITE_TIMEOUT_SECONDS
    seen = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.append(kw["heartbeat_timeout_seconds"]))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(jax.config, "update", lambda *a: None)  # (the gloo switch stays out of this process)
    for key in (supervisor.ALIVE_ENV, supervisor.PEER_LOST_NOTICE_ENV, supervisor.EXTERNAL_SERVICE_ENV):
        monkeypatch.delenv(key, raising=False)
    mesh = {"mesh": {"num_processes": 2, "process_id": 1, "coordinator_address": "127.0.0.1:1"}}
    monkeypatch.delenv(supervisor.HEARTBEAT_TIMEOUT_ENV, raising=False)
    mesh_lib.initialize_distributed(ml_collections.ConfigDict(mesh))
    monkeypatch.setenv(supervisor.HEARTBEAT_TIMEOUT_ENV, str(supervisor.heartbeat_timeout(7)))
    mesh_lib.initialize_distributed(ml_collections.ConfigDict(mesh))
    assert seen == [mesh_lib.HEARTBEAT_TIMEOUT_SECONDS, 2 * 7 + mesh_lib.HEARTBEAT_TIMEOUT_SECONDS]


def test_a_silent_process_is_killed_only_after_the_others_were_told(monkeypatch):
    """`_end_silent` writes the peer-lost notice to the other running processes before it kills the silent one:
    killed first, a peer waiting on it in a collective could fail on the reset connection with a traceback before it
    read the notice (seen under load)."""
    events: list[tuple[str, float]] = []

    def write(fd, data):
        events.append(("notice", fd))
        return len(data)

    monkeypatch.setattr(supervisor.os, "write", write)
    monkeypatch.setattr(supervisor.os, "killpg", lambda pid, sig: events.append(("kill", pid)))
    monkeypatch.setattr(supervisor.time, "sleep", lambda s: events.append(("sleep", s)))
    monkeypatch.setattr(supervisor.process, "stopped", lambda pid: True)
    proc = cast(subprocess.Popen, types.SimpleNamespace(pid=4242))
    supervisor._end_silent(1, proc, 3.0, notices=[10, 11, 12], codes=[None, None, 0])
    assert events == [("notice", 10), ("sleep", supervisor.KILL_GRACE_SECONDS), ("kill", 4242)]


@pytest.mark.parametrize("beyond", [False, True], ids=["within", "beyond"])
def test_a_paused_site_is_waited_for_or_named_with_the_site_timeout(cleanup, beyond):
    """Two jax.distributed processes (gloo, as experiments.run; `rounds`) under --site-timeout; site 1's process is
    stopped (SIGSTOP) at round 3 and continued (SIGCONT) later. Within the timeout the run ends as without the pause
    (the same result, bit for bit). Beyond it the launcher ends the run itself: one line naming site 1, site 0 stops
    with an `error:` line, exit status 75 (supervisor.SITE_TIMEOUT_EXIT_CODE) and no jaxlib abort (with jax's own
    heartbeat timeout every process was aborted: SIGABRT and a C++ stack trace, exit 134)."""
    timeout, rounds = (3, 0) if beyond else (10, 40)
    launcher = _Launcher(f"rounds:{rounds},rounds:{rounds}", own=("--site-timeout", str(timeout)))
    cleanup.append(launcher)
    pids = launcher.pids()
    cleanup.extend(pids)
    launcher.wait_for("[0] round 3")
    os.kill(pids[1], signal.SIGSTOP)
    try:
        if beyond:
            code, out = launcher.finish(timeout=120)  # the launcher ends the run by itself
        else:
            time.sleep(3)  # a pause shorter than the timeout (the run waits for it)
    finally:
        if running(pids[1]):
            os.kill(pids[1], signal.SIGCONT)
    if not beyond:
        code, out = launcher.finish(timeout=120)
        assert code == 0 and f"[0] {_expected_result(rounds)}\n" in out, out
        assert "launch: exit codes [0, 0]" in out and "no sign of life" not in out, out
        return
    assert code == supervisor.SITE_TIMEOUT_EXIT_CODE == 75, out
    line = (
        f"launch: error: process 1 (site 1) has given no sign of life for {timeout} s (it is stopped, e.g. by "
        f"SIGSTOP; --site-timeout={timeout}): ending the run with exit status 75; rerun the same command to resume "
        "from the last checkpoint\n"
    )
    assert out.count("no sign of life") == 2 and line in out, out  # the launcher's line and site 0's
    assert f"[0] error: process 0 stops: process 1 gave no sign of life for {timeout} s and was killed" in out, out
    assert out.rstrip().endswith("launch: exit codes [1, SIGKILL]"), out
    for abort in ("Check failure", "Terminating process", "SIGABRT", "terminate called", "Traceback"):
        assert abort not in out, out
    assert not re.search(r"^\[\d\] F\d{4} ", out, re.MULTILINE), out  # no jaxlib LOG(FATAL) line
