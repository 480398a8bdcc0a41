"""experiments.links: the namespaces and devices it makes and removes, the rate of a link, the byte counters, the
environment of `run`, and teardown after an exception and a Ctrl-C.

Tests that make networks need root and iproute2, and skip with the tool's own message without them. The checks read
the machine's state with `ip` and `tc` themselves (not through the tool). One test moves 2 MB over an 8 Mbit/s link.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from experiments import links as links_cli
from experiments.bench import link_rate
from experiments.cluster import links

from helpers import running

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNAVAILABLE = links.unavailable()
needs_root = pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or "")


def _sh(*argv):
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout


def _namespaces(prefix):
    """The named network namespaces whose names start with `prefix` (from `ip netns list`)."""
    return {line.split()[0] for line in _sh("ip", "netns", "list").splitlines() if line.startswith(prefix)}


def _devices(netns=None):
    """{device name: its qdisc} in namespace `netns` (None: this one)."""
    where = ["-n", netns] if netns else []
    return {d["ifname"]: d.get("qdisc") for d in json.loads(_sh("ip", *where, "-j", "link", "show"))}


def _links(*args, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "experiments.links", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        **kwargs,
    )


@needs_root
def test_up_makes_exactly_the_network_and_down_removes_it():
    """`up` makes a hub namespace (loopback, the bridge, one port per site) and one namespace per site (loopback, its
    veth end, its address), tbf at the rate on both ends of every link, nothing in this namespace; `down PREFIX`
    removes all of it, and the per-namespace hosts files."""
    root_devices = set(_devices())
    out = _links("up", "--sites", "2", "--rate-mbit", "8")
    assert out.returncode == 0, out.stderr
    net = json.loads(out.stdout[: out.stdout.rindex("}") + 1])
    prefix, hub, sites = net["prefix"], net["hub"], net["sites"]
    try:
        assert out.stdout.rstrip().endswith(f"python -m experiments.links down {prefix}")
        assert _namespaces(prefix) == {hub["netns"]} | {s["netns"] for s in sites}
        assert set(_devices()) == root_devices
        assert _devices(hub["netns"]) == {"lo": "noqueue", hub["bridge"]: "noqueue"} | {
            s["hub_device"]: "tbf" for s in sites
        }
        for s in sites:
            assert _devices(s["netns"]) == {"lo": "noqueue", s["device"]: "tbf"}
            addresses = json.loads(_sh("ip", "-n", s["netns"], "-j", "-4", "addr", "show", "dev", s["device"]))
            assert [a["local"] for a in addresses[0]["addr_info"]] == [s["address"]]
            for netns, dev in ((s["netns"], s["device"]), (hub["netns"], s["hub_device"])):
                qdisc = json.loads(_sh("tc", "-n", netns, "-j", "qdisc", "show", "dev", dev))[0]
                assert qdisc["kind"] == "tbf" and qdisc["options"]["rate"] == 8_000_000 / 8, qdisc  # bytes/s
            assert os.path.exists(f"/etc/netns/{s['netns']}/hosts")
        assert [s["address"] for s in sites] == ["10.211.0.2", "10.211.0.3"] and hub["address"] == "10.211.0.1"
    finally:
        gone = _links("down", prefix)
    assert gone.returncode == 0 and "removed 3 namespaces" in gone.stdout, gone.stdout + gone.stderr
    assert not _namespaces(prefix) and set(_devices()) == root_devices
    assert not any(os.path.exists(f"/etc/netns/{s['netns']}") for s in sites)


@needs_root
def test_a_transfer_between_two_sites_runs_at_the_link_rate_and_is_counted():
    """2 MB from site 0 to site 1 over 8 Mbit/s links: the receiver's payload rate (timed in its own process, from
    the first byte to the last) is the link's rate within 25% (an unshaped veth moves gigabits; full frames carry
    1448 bytes of payload in 1514: 0.956 R expected). Site 0's sent bytes and site 1's received bytes hold the
    payload: the devices' at least the payload, the shapers' at least the payload plus 54 bytes of Ethernet, IPv4
    and TCP headers for every (at most) 1460 of it, and at most 10% more than the payload; nothing was dropped."""
    payload, rate_mbit = 2_000_000, 8
    with links.Network(sites=2, rate_mbit=rate_mbit) as net:
        before = net.counters()
        got = link_rate.transfer(net, payload, timeout=60)  # (what experiments.bench.link_rate measures)
        after = net.counters()
    assert got["bytes"] == payload
    assert 0.75 <= got["payload_mbit"] / rate_mbit <= 1.25, got
    grew = {k: getattr(after[i], k) - getattr(before[i], k) for i, k in ((0, "tx_bytes"), (0, "tx_wire_bytes"))}
    grew |= {k: getattr(after[1], k) - getattr(before[1], k) for k in ("rx_bytes", "rx_wire_bytes")}
    framed = payload + 54 * -(-payload // 1460)
    assert payload <= grew["tx_bytes"] <= grew["tx_wire_bytes"] and framed <= grew["tx_wire_bytes"], grew
    assert payload <= grew["rx_bytes"] <= grew["rx_wire_bytes"] and framed <= grew["rx_wire_bytes"], grew
    assert max(grew.values()) <= 1.1 * payload, grew
    assert after[0].tx_dropped == after[1].rx_dropped == 0


@needs_root
def test_an_exception_in_the_block_leaves_nothing_behind():
    """An exception inside `with Network(...)`: the process started with `popen` and one started in a site's
    namespace behind the tool's back are stopped, the namespaces and hosts files removed, the exception raised."""
    with pytest.raises(RuntimeError, match="in the block"), links.Network(sites=1, rate_mbit=8) as net:
        prefix, netns = net.prefix, net.sites[0].netns
        tracked = net.popen(0, ["sleep", "60"])
        stray = subprocess.Popen(net.command(0, ["sleep", "60"]))
        assert _namespaces(prefix) == {net.hub.netns, netns}
        raise RuntimeError("in the block")
    assert not _namespaces(prefix) and not os.path.exists(f"/etc/netns/{netns}")
    assert tracked.poll() is not None and stray.wait(timeout=10) is not None


@needs_root
def test_run_describes_the_network_in_the_environment_and_returns_the_status(tmp_path):
    """`run -- CMD`: CMD sees the LINKS_* variables (the site namespaces exist and hold the named devices), the
    counters go to stderr and --report, the status is CMD's, and the network is gone afterwards."""
    show = (
        "import json, os, sys; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('LINKS_')}));"
        " sys.exit(3)"
    )
    report = tmp_path / "report.json"
    out = _links("run", "--sites", "2", "--rate-mbit", "8", "--report", str(report), "--", sys.executable, "-c", show)
    assert out.returncode == 3, out.stderr
    env = json.loads(out.stdout)
    described = json.loads(env["LINKS_JSON"])
    assert env["LINKS_SITES"] == "2" and env["LINKS_RATE_MBIT"] == "8" and env["LINKS_HUB_ADDRESS"] == "10.211.0.1"
    assert env["LINKS_NETNS"].split(",") == [s["netns"] for s in described["sites"]]
    assert env["LINKS_ADDRESSES"] == "10.211.0.2,10.211.0.3"
    assert env["LINKS_DEVICES"].split(",") == [s["device"] for s in described["sites"]]
    assert "links: site 1 (10.211.0.3): sent " in out.stderr, out.stderr
    saved = json.loads(report.read_text())
    assert saved["prefix"] == env["LINKS_PREFIX"] and saved["exit_status"] == 3 and len(saved["counters"]) == 2
    assert not _namespaces(env["LINKS_PREFIX"])


@needs_root
def test_ctrl_c_to_run_stops_the_command_and_removes_the_network():
    """A terminal's Ctrl-C (SIGINT to the tool's process group) while `run`'s command runs: the command gets it
    (it runs in a session of its own), the network is removed, and the tool exits 130."""
    wait = "import os, time; print(os.environ['LINKS_PREFIX'], os.getpid(), flush=True); time.sleep(60)"
    tool = subprocess.Popen(
        [sys.executable, "-m", "experiments.links", "run", "--sites", "2", "--rate-mbit", "8", "--"]
        + [sys.executable, "-c", wait],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert tool.stdout is not None
        prefix, pid = tool.stdout.readline().split()
        assert len(_namespaces(prefix)) == 3
        os.killpg(tool.pid, signal.SIGINT)
        _, err = tool.communicate(timeout=60)
    finally:
        if tool.poll() is None:
            tool.kill()
    assert tool.returncode == 128 + signal.SIGINT and "links: stopped by SIGINT" in err, err
    assert not _namespaces(prefix) and not running(int(pid))


@needs_root
def test_down_removes_what_a_killed_run_left():
    """SIGKILL to `run` (nothing it can catch) leaves its network, and a process its command started inside a site's
    namespace: `down` alone would remove that network (its maker has exited), and `down PREFIX` removes it and
    stops the process."""
    start = (
        "import os, subprocess, time;"
        " p = subprocess.Popen(['ip', 'netns', 'exec', os.environ['LINKS_NETNS'], 'sleep', '60']);"
        " print(os.environ['LINKS_PREFIX'], p.pid, flush=True); time.sleep(60)"
    )
    tool = subprocess.Popen(
        [sys.executable, "-m", "experiments.links", "run", "--sites", "1", "--rate-mbit", "8", "--"]
        + [sys.executable, "-c", start],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert tool.stdout is not None
        prefix, pid = tool.stdout.readline().split()
    finally:
        tool.kill()
        tool.wait(timeout=30)
    assert len(_namespaces(prefix)) == 2 and running(int(pid))
    assert sorted(links.leftovers()[prefix]) == sorted(_namespaces(prefix))  # what `down` alone would remove
    out = _links("down", prefix)  # (not `down` alone: it would remove another test's `up` network, racing it)
    assert out.returncode == 0 and f"{prefix}-{tool.pid}-site0" in out.stdout, out.stdout + out.stderr
    assert not _namespaces(prefix) and not running(int(pid))


def test_without_root_or_tc_it_says_what_is_missing_and_makes_nothing(monkeypatch, capsys):
    """Exit status 2 and one line naming root and `tc`, before anything is made; Network raises the same."""
    before = _namespaces("lnk") if shutil.which("ip") else None
    real_which = shutil.which
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "tc" else real_which(name, *a, **k))
    assert links_cli.main(["run", "--sites", "2", "--rate-mbit", "8", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "links: error: experiments.links needs root (this process runs as uid 1000" in err, err
    assert "`tc` (iproute2)" in err and "`ip`" not in err, err
    with pytest.raises(links.LinksUnavailable, match="needs root"), links.Network(sites=2, rate_mbit=8):
        pass
    monkeypatch.undo()
    if before is not None:
        assert _namespaces("lnk") == before


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(sites=0, rate_mbit=8), "sites=0: must be an integer >= 1"),
        (dict(sites=2, rate_mbit=float("nan")), "rate_mbit=nan"),
        (dict(sites=2, rate_mbit=8, subnet="8.8.8.0/24"), "subnet='8.8.8.0/24': must be a private IPv4"),
        (dict(sites=2, rate_mbit=8, subnet="10.0.0.0/30"), "subnet='10.0.0.0/30': must be a network with at least 3"),
        (dict(sites=2, rate_mbit=8, min_queue_bytes=-1), "min_queue_bytes=-1: must be an integer >= 0"),
    ],
)
def test_bad_arguments_are_named(kwargs, needle):
    with pytest.raises(ValueError, match="^" + re.escape(needle)):
        links.Network(**kwargs)


def test_bad_flags_are_named(capsys):
    with pytest.raises(SystemExit) as e:
        links_cli.main(["up", "--sites", "0", "--rate-mbit", "8"])
    assert e.value.code == 2 and "--sites=0: must be an integer >= 1" in capsys.readouterr().err


def test_launch_links_needs_the_links_network(monkeypatch, capsys):
    """`experiments.launch --links` outside `experiments.links run --in-hub` (or with another site count) stops with
    a usage error naming what is missing, before starting anything."""
    from experiments import launch

    monkeypatch.delenv("LINKS_NETNS", raising=False)
    monkeypatch.delenv("LINKS_HUB_ADDRESS", raising=False)
    with pytest.raises(SystemExit) as stop:
        launch.main(["--processes", "2", "--links", "--", "--workdir=x"])
    assert stop.value.code == 2 and "LINKS_NETNS and LINKS_HUB_ADDRESS are not set" in capsys.readouterr().err
    monkeypatch.setenv("LINKS_NETNS", "a,b,c")
    monkeypatch.setenv("LINKS_HUB_ADDRESS", "10.211.0.1")
    with pytest.raises(SystemExit) as stop:
        launch.main(["--processes", "2", "--links", "--", "--workdir=x"])
    assert stop.value.code == 2 and "has 3 sites but --processes=2" in capsys.readouterr().err


PLACE = """
import sys
import jax
import numpy as np
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec
from core.mesh import put_global
mesh = jax.make_mesh((2,), ("site",))
rng = np.random.default_rng(0)  # the same values on both processes, as a federation's initial state
host = {"w": rng.normal(size=(2, 700_003)).astype(np.float32), "n": rng.integers(0, 9, (2, 3, 5)).astype(np.int32)}
tree = jax.tree.map(jax.numpy.asarray, host)  # on this process's device, as a freshly initialised state is
multihost_utils.sync_global_devices("ready")
print("ready", flush=True)
sys.stdin.readline()  # the test reads the counters
placed = put_global(tree, NamedSharding(mesh, PartitionSpec("site")))
for name, x in placed.items():
    for shard in x.addressable_shards:
        assert np.array_equal(np.asarray(shard.data), host[name][shard.index]), name
print("placed", flush=True)
sys.stdin.readline()
multihost_utils.sync_global_devices("done")
"""


def _go(proc):
    """Lets `proc` go on past its next `sys.stdin.readline()`."""
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()


def _expect(proc, word):
    """Reads `proc`'s output up to the line `word` (gloo prints its connection lines there too)."""
    for line in proc.stdout:
        if line.strip() == word:
            return
    raise AssertionError(f"the process ended (status {proc.wait()}) before printing {word!r}")


@needs_root
def test_placing_a_state_every_process_holds_sends_nothing_between_sites():
    """core.mesh.put_global over two processes behind real links: each process gets its devices' slices of the value
    it holds (checked shard by shard), and the links carry only a few frames, not the 5.6 MB array (jax.device_put
    there sends each process's whole copy to the other: it made a federated run's start cost 3x the federation's
    state per site over the links)."""
    with links.Network(sites=2, rate_mbit=1000) as net:
        coordinator = f"{net.sites[0].address}:{23456 + os.getpid() % 1000}"
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")  # one device per process
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.DEVNULL, "text": True}
        script = [sys.executable, "-c", PLACE, coordinator]
        procs = [net.popen(i, [*script, str(i)], cwd=ROOT, env=env, **pipes) for i in range(2)]
        try:
            for p in procs:
                _expect(p, "ready")
            before = [c.tx_wire_bytes for c in net.counters()]
            for p in procs:
                _go(p)
            for p in procs:
                _expect(p, "placed")
            sent = [c.tx_wire_bytes - b for c, b in zip(net.counters(), before)]
            for p in procs:
                _go(p)
            assert [p.wait(timeout=60) for p in procs] == [0, 0]
        finally:
            for p in procs:
                p.kill()
    assert max(sent) < 20_000, sent  # heartbeats and acknowledgements at most; the array is 5.6 MB


@needs_root
def test_the_launcher_finds_a_site_whose_link_is_cut():
    """supervisor.unreachable (what `experiments.launch --elastic --links` asks after a failed attempt): from the
    hub's namespace, the site whose veth is down at the hub's end is the one no TCP connection reaches; before the
    cut, none."""
    probe = "import json, sys; from experiments.cluster import supervisor; print(json.dumps(supervisor.unreachable("
    probe += "sys.argv[1].split(','), sys.argv[2], timeout=2)))"
    with links.Network(sites=3, rate_mbit=100) as net:
        ask = ["ip", "netns", "exec", net.hub.netns, sys.executable, "-c", probe]
        ask += [",".join(s.netns for s in net.sites), net.hub.address]
        before = subprocess.run(ask, cwd=ROOT, capture_output=True, text=True, check=True, timeout=60).stdout
        _sh("ip", "-n", net.hub.netns, "link", "set", net.sites[1].hub_device, "down")
        after = subprocess.run(ask, cwd=ROOT, capture_output=True, text=True, check=True, timeout=60).stdout
    assert (json.loads(before), json.loads(after)) == ([], [1])
