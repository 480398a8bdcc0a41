"""Sites behind real rate-limited links: one Linux network namespace per site, joined through a hub.

    python -m experiments.links run --sites 2 --rate-mbit 100 -- <command ...>   # the network for one command
    python -m experiments.links up --sites 4 --rate-mbit 1000    # makes a network, prints it (JSON), leaves it up
    python -m experiments.links down [PREFIX]                    # removes it (no PREFIX: every leftover network)

    with links.Network(sites=2, rate_mbit=8) as net:             # the same from Python
        receiver = net.popen(1, ["python", "receive.py", net.sites[1].address], ...)
        net.run(0, ["python", "send.py", net.sites[1].address], timeout=60)
        sent = net.counters()[0].tx_wire_bytes

Topology: a hub namespace holds a bridge (the wide-area network, not limited) with the hub's address; each site's
namespace holds one end of a veth pair (its address, its only device besides loopback), whose other end is a port
of the bridge. A site reaches every other site and the hub, and nothing else: the namespaces have no route out, and
every address exists only inside them (a private IPv4 subnet, `DEFAULT_SUBNET`; the hub is its first host, site i
the (i+2)-th, e.g. 10.211.0.1, 10.211.0.2, 10.211.0.3, ...).

Link rate: a site's link carries `rate_mbit` (10^6 bit/s, counted on whole Ethernet frames) in each direction, like a
full-duplex access link to a wide-area network: a tbf qdisc shapes the site's egress at its end of the veth (what it
sends) and another its ingress at the hub's end (what it receives), each with a burst of `BURST_SECONDS` of the rate
(at least `MIN_BURST_BYTES`) and a queue of `QUEUE_SECONDS` of it (at least `MIN_QUEUE_BYTES`). tbf charges every
frame with its headers, also inside a segmentation-offload super-packet. Traffic from site a to site b thus passes
a's uplink and b's downlink; several sites sending to one share its downlink. Measured on this machine (one TCP
transfer between two sites, payload timed by the receiver): 7.65 Mbit/s at R = 8 (2 MB; tests/test_links.py), 47.8
at 50, 962 at 1000 (100 MB), i.e. 0.956-0.962 R, the share of payload in full 1514-byte frames (1448 / 1514).

Latency is not emulated: the kernel's netem qdisc, the usual way to add delay, is not available here (`tc qdisc add
... netem` answers "Specified qdisc kind is unknown"), so a packet crosses a link in the time its rate and the queue
ahead of it take, and nothing more; a latency must be modelled (moe.system_model), not measured.

Byte counts (`Network.counters()`, see `Counters`): for each site, what it sent (tx) and received (rx) over its link,
read from its veth end's device statistics (`ip -s link`) and from the link's two shapers (`tc -s qdisc`: the
"wire" bytes, every frame with its Ethernet, IP and TCP headers, as a wire carries them without preamble and
checksum). The two differ by headers only: the device counts a segmentation-offload super-packet (up to 64 KiB,
which the veth passes whole when the shaper's bucket holds it, at high rates) with its headers once. Everything a
site sends is counted: ARP, the coordination service's messages, TCP acknowledgements. The links carry nothing of
their own but the hub's bridge's few IGMP and MLD reports (54 and 90 bytes) in its first seconds: the devices have no
IPv6 address.

Names: every network carries a prefix `lnk` + 6 random hex digits (`Network.prefix`), e.g. `lnk3fa2c1`; its
namespaces are `<prefix>-<pid>-hub` and `<prefix>-<pid>-site<i>` (pid: the process that made it), its devices,
which exist only inside those namespaces, `<prefix>br` (the bridge), `<prefix>s<i>` (site i's end of its veth) and
`<prefix>h<i>` (the hub's end). Two networks never share a name, and `down` recognises leftovers by these patterns.

Hostname: inside a site's namespace this machine's hostname resolves to the site's address (a `hosts` file in
/etc/netns/<namespace>/, which `ip netns exec` mounts over /etc/hosts for the commands it runs), so that a program
that binds the address of its own hostname binds its site's link, not 127.0.0.1: gloo, jax's CPU collectives,
does (jax 0.10 calls jaxlib's `make_gloo_tcp_collectives` without its `hostname` or `interface` arguments, and no
environment variable or jax option sets them). `Network(..., resolve_hostname=False)` leaves /etc/hosts alone.

Environment of `run`'s command (it runs in this (root) namespace, or with `--in-hub` in the hub's, where every site
is one hop away): LINKS_PREFIX, LINKS_SITES (M), LINKS_RATE_MBIT, LINKS_SUBNET, LINKS_HUB_NETNS, LINKS_HUB_ADDRESS,
LINKS_NETNS, LINKS_ADDRESSES and LINKS_DEVICES (comma-separated, in site order: each site's namespace, its address,
its veth end), and LINKS_JSON (all of it as one JSON object, `Network.describe()`). A command enters site i's
namespace with `ip netns exec <namespace> ...`. When it exits, `run` prints what every site sent and received
(`--report PATH` also writes it as JSON), removes the network and exits with the command's status (128+N when a
signal N killed it).

Teardown, always: on leaving the `with` block (normally, by an exception, by Ctrl-C's KeyboardInterrupt, or by
SIGTERM or SIGHUP, which the block turns into SystemExit(128+N) where their handlers were the default ones), and in
`run` when its command ends or the tool is stopped (SIGINT, SIGTERM or SIGHUP is passed on to the command's process
group, which is killed `STOP_GRACE_SECONDS` later if still running; the tool then exits 128+N). Teardown stops the
processes started by `Network.popen` (SIGTERM, then SIGKILL after `STOP_GRACE_SECONDS`) and every other process
still inside the network's namespaces (a namespace with a process in it would outlive its name, devices included),
then deletes the namespaces (which deletes their devices and qdiscs) and the /etc/netns entries. Signals that
arrive meanwhile wait until it is done. A run killed by SIGKILL leaves its network behind: `down` removes every
network whose maker has exited, `down PREFIX` one network whatever its state.

Needs Linux, root, and iproute2's `ip` and `tc`; without them `up` and `run` exit with status 2 and a message naming
what is missing, before creating anything (`unavailable()` says so from Python; `Network` raises LinksUnavailable).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import ipaddress
import json
import math
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = [
    "Counters",
    "Hub",
    "LinksError",
    "LinksUnavailable",
    "Network",
    "Site",
    "down",
    "leftovers",
    "main",
    "unavailable",
]

DEFAULT_SUBNET = "10.211.0.0/24"
"""Where the addresses come from (they exist only inside the network's namespaces): the hub is its first host."""
BURST_SECONDS = 0.005
"""tbf's bucket: this long at the link's rate (at least MIN_BURST_BYTES) may leave at once."""
MIN_BURST_BYTES = 2 * 1514
"""Two full Ethernet frames: tbf cannot send a frame larger than its bucket."""
QUEUE_SECONDS = 0.05
"""tbf's queue holds this long at the link's rate (at least MIN_QUEUE_BYTES); frames beyond it are dropped."""
MIN_QUEUE_BYTES = 4 * 65536
"""Four 64 KiB segmentation-offload packets: the unit a sending TCP stack hands its device. With a queue of 50 ms at
8 Mbit/s (50 kB) the shaper dropped parts of them, thousands of frames a transfer, and TCP moved 0.85-0.87 R
instead of 0.956 R (none dropped with this floor)."""
STOP_GRACE_SECONDS = 5
"""A process sent SIGTERM at teardown (or `run`'s command, sent the tool's stop signal) is killed this long later."""
COMMAND_TIMEOUT_SECONDS = 30
"""Every `ip` and `tc` call is given this long."""

_NAME = re.compile(r"^(lnk[0-9a-f]{6})-(\d+)-(hub|site\d+)$")
_PREFIX = re.compile(r"^lnk[0-9a-f]{6}$")
_ETC_NETNS = "/etc/netns"
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class LinksError(RuntimeError):
    """An `ip` or `tc` command failed, or a teardown left something behind; the message says which and why."""


class LinksUnavailable(LinksError):
    """This machine cannot make the networks (not Linux, not root, no `ip` or `tc`); nothing was created."""


@dataclasses.dataclass(frozen=True)
class Site:
    """Site `index`: its namespace, its address on its link, its end of the veth (inside `netns`) and the hub's end
    (inside the hub's namespace)."""

    index: int
    netns: str
    address: str
    device: str
    hub_device: str


@dataclasses.dataclass(frozen=True)
class Hub:
    """The hub: its namespace, the bridge that joins the sites' links and the bridge's address."""

    netns: str
    address: str
    bridge: str


@dataclasses.dataclass(frozen=True)
class Counters:
    """What a site sent (tx) and received (rx) over its link since the network was made.

    tx_bytes, rx_bytes, tx_packets, rx_packets: its veth end's device statistics (a segmentation-offload packet
      counts once, with one set of headers);
    tx_wire_bytes, rx_wire_bytes: what the link's shapers passed (its end's egress, the hub end's egress), every
      frame with its headers: the bytes the rate applies to, >= the device's;
    tx_dropped, rx_dropped: frames those shapers dropped (their queue was full).
    """

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int
    tx_wire_bytes: int
    rx_wire_bytes: int
    tx_dropped: int
    rx_dropped: int


def unavailable() -> str | None:
    """Why networks cannot be made on this machine (what is missing, in one sentence), or None if they can."""
    if not sys.platform.startswith("linux"):
        return f"experiments.links needs Linux network namespaces (this is {sys.platform})"
    missing = []
    if os.geteuid() != 0:
        missing.append(f"root (this process runs as uid {os.geteuid()}; try sudo)")
    missing += [f"`{tool}` (iproute2) on PATH" for tool in ("ip", "tc") if shutil.which(tool) is None]
    if not missing:
        return None
    return f"experiments.links needs {' and '.join(missing)}: it makes network namespaces, veth pairs and tc qdiscs"


def _problems(sites: Any, rate_mbit: Any, subnet: Any) -> list[tuple[str, Any, str]]:
    """(parameter, value, what is allowed) for each bad argument of a network."""
    out: list[tuple[str, Any, str]] = []
    if not isinstance(sites, int) or isinstance(sites, bool) or sites < 1:
        out.append(("sites", sites, "an integer >= 1"))
    if (
        not isinstance(rate_mbit, int | float)
        or isinstance(rate_mbit, bool)
        or not math.isfinite(rate_mbit)
        or rate_mbit * 1e6 < 1
    ):
        out.append(("rate_mbit", rate_mbit, "a finite number of Mbit/s (10^6 bit/s) >= 1e-6"))
    try:
        net = ipaddress.IPv4Network(subnet)
    except (ValueError, TypeError):
        out.append(("subnet", subnet, "a private IPv4 network such as 10.211.0.0/24 (host bits zero)"))
    else:
        if not net.is_private:
            out.append(("subnet", subnet, "a private IPv4 network (10/8, 172.16/12, 192.168/16)"))
        elif not out and net.num_addresses - 2 < sites + 1:
            out.append(
                ("subnet", subnet, f"a network with at least {sites + 1} host addresses (the hub and {sites} sites)")
            )
    return out


def _call(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    """Runs an `ip` / `tc` command (bounded by COMMAND_TIMEOUT_SECONDS); raises LinksError naming it if it fails."""
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=COMMAND_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired as e:
        raise LinksError(f"`{shlex.join(argv)}` did not finish in {COMMAND_TIMEOUT_SECONDS} s") from e
    if check and out.returncode != 0:
        raise LinksError(f"`{shlex.join(argv)}` failed (exit status {out.returncode}): {out.stderr.strip()}")
    return out


def _shapers(netns: str) -> dict[str, dict[str, Any]]:
    """{device: its root tbf qdisc's statistics (`tc -s qdisc`: bytes and packets sent, drops, ...)} in `netns`."""
    qdiscs = json.loads(_call(["tc", "-n", netns, "-j", "-s", "qdisc", "show"]).stdout)
    return {q["dev"]: q for q in qdiscs if q.get("kind") == "tbf" and q.get("root")}


def _netns_names() -> list[str]:
    """The names `ip netns list` shows (the named network namespaces of this machine)."""
    return [line.split()[0] for line in _call(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftovers(prefix: str | None = None) -> dict[str, list[str]]:
    """This tool's networks on this machine, as {prefix: namespace names}: network `prefix` only, or (None) every
    network whose making process has exited (left by `up`, or by a run killed with SIGKILL)."""
    found: dict[str, list[str]] = {}
    for name in _netns_names():
        m = _NAME.match(name)
        if m and (m.group(1) == prefix if prefix is not None else not _alive(int(m.group(2)))):
            found.setdefault(m.group(1), []).append(name)
    return found


def _pids_in(netns: str) -> list[int]:
    out = _call(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in out.stdout.split() if p.isdigit()] if out.returncode == 0 else []


def _stop(pids: Sequence[int], grace: float) -> None:
    """SIGTERM to `pids`, SIGKILL to those still there `grace` seconds later."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while any(_alive(p) and not _zombie(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        pids = [p for p in pids if _alive(p) and not _zombie(p)]
        if not pids:
            return


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def _remove(names: Sequence[str]) -> list[str]:
    """Deletes the namespaces `names` (sites before the hub) after stopping the processes inside them, and their
    /etc/netns entries; returns what could not be removed (empty: all gone)."""
    names = sorted(names, key=lambda n: n.endswith("-hub"))  # deleting a site's namespace deletes its veth pair
    pids = sorted({p for n in names for p in _pids_in(n)} - {os.getpid()})
    if pids:
        _stop(pids, STOP_GRACE_SECONDS)
    failed = []
    for name in names:
        out = _call(["ip", "netns", "delete", name], check=False)
        if out.returncode != 0:
            failed.append(f"namespace {name} ({out.stderr.strip()})")
        shutil.rmtree(os.path.join(_ETC_NETNS, name), ignore_errors=True)
    with contextlib.suppress(OSError):  # only when empty; iproute2 makes it anew when needed
        os.rmdir(_ETC_NETNS)
    remaining = set(_netns_names()) & set(names)
    return failed + [f"namespace {n}" for n in sorted(remaining) if not any(n in f for f in failed)]


def down(prefix: str | None = None) -> list[str]:
    """Removes network `prefix` (or, None, every network of this tool whose making process has exited) with every
    process still inside it; returns the namespaces removed. Raises ValueError for a malformed prefix and LinksError
    if something could not be removed (naming it)."""
    reason = unavailable()
    if reason is not None:
        raise LinksUnavailable(reason)
    if prefix is not None and not _PREFIX.match(prefix):
        raise ValueError(f"prefix={prefix!r}: not a network of experiments.links (expected lnk + 6 hex digits)")
    names = [n for group in leftovers(prefix).values() for n in group]
    failed = _remove(names) if names else []
    if failed:
        raise LinksError(f"could not remove: {', '.join(failed)}")
    return sorted(names)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Within the block, SIGINT, SIGTERM and SIGHUP are recorded instead of handled; after it the previous handlers
    are back and the recorded signals are raised again, in order (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in _STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for signum in dict.fromkeys(received):
            signal.raise_signal(signum)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _stop_signals_exit() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise SystemExit(128+N) (so that `finally` blocks and `__exit__` run)
    where their handlers are the default ones (which would end the process on the spot); main thread only."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(s) == signal.SIG_DFL:
                previous[s] = signal.signal(s, _exit_on_signal)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class Network:
    """M site namespaces, each behind its own link of `rate_mbit` Mbit/s each way, joined through a hub (see the
    module docstring for the topology, the names, the counters and teardown).

    Use it as a context manager (`with Network(...) as net:`): entering makes the network, leaving removes it
    whatever happens in the block. `up()` and `close()` do the same by hand (`close` is idempotent).

    Args:
      sites: M >= 1.
      rate_mbit: every link's rate in each direction, in Mbit/s (10^6 bit/s, counted on whole frames).
      subnet: a private IPv4 network with at least M + 1 host addresses (the hub, then the sites).
      resolve_hostname: inside a site's namespace, this machine's hostname resolves to the site's address.
    Raises ValueError naming a bad argument; entering raises LinksUnavailable (nothing made) or LinksError (an `ip`
    or `tc` command failed: whatever was made is removed first).
    """

    def __init__(self, sites: int, rate_mbit: float, *, subnet: str = DEFAULT_SUBNET, resolve_hostname: bool = True):
        problems = _problems(sites, rate_mbit, subnet)
        if problems:
            raise ValueError("; ".join(f"{name}={value!r}: must be {allowed}" for name, value, allowed in problems))
        self.rate_mbit = float(rate_mbit)
        self.subnet = str(ipaddress.IPv4Network(subnet))
        self.resolve_hostname = resolve_hostname
        self.prefix = f"lnk{secrets.token_hex(3)}"
        hosts = ipaddress.IPv4Network(subnet).hosts()
        length = ipaddress.IPv4Network(subnet).prefixlen
        self._length = length
        stem = f"{self.prefix}-{os.getpid()}"
        self.hub = Hub(netns=f"{stem}-hub", address=str(next(hosts)), bridge=f"{self.prefix}br")
        self.sites = tuple(
            Site(i, f"{stem}-site{i}", str(next(hosts)), f"{self.prefix}s{i}", f"{self.prefix}h{i}")
            for i in range(sites)
        )
        self._procs: list[subprocess.Popen] = []
        self._made = False
        self._signals = contextlib.ExitStack()

    # --- making and removing ---------------------------------------------------------------------------------------

    def up(self) -> Network:
        """Makes the network (see the class docstring for what it raises); returns self."""
        reason = unavailable()
        if reason is not None:
            raise LinksUnavailable(reason)
        if self._made:
            raise LinksError(f"network {self.prefix} is already up")
        self._made = True
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def _tbf(self) -> list[str]:
        rate = round(self.rate_mbit * 1e6)  # bit/s
        burst = max(math.ceil(rate / 8 * BURST_SECONDS), MIN_BURST_BYTES)
        limit = max(math.ceil(rate / 8 * QUEUE_SECONDS), MIN_QUEUE_BYTES) + burst
        return ["tbf", "rate", f"{rate}bit", "burst", str(burst), "limit", str(limit)]

    def _make(self) -> None:
        """Every device is given its qdisc before it goes up, and no IPv6 link-local address (`addrgenmode none`:
        no IPv6 neighbour discovery or multicast reports on the links), so that the counters hold only what the
        programs in the namespaces send."""
        hub = self.hub
        _call(["ip", "netns", "add", hub.netns])
        _call(["ip", "-n", hub.netns, "link", "set", "lo", "up"])
        _call(["ip", "-n", hub.netns, "link", "add", hub.bridge, "type", "bridge"])
        _call(["ip", "-n", hub.netns, "link", "set", hub.bridge, "addrgenmode", "none"])
        _call(["ip", "-n", hub.netns, "addr", "add", f"{hub.address}/{self._length}", "dev", hub.bridge])
        _call(["ip", "-n", hub.netns, "link", "set", hub.bridge, "up"])
        for site in self.sites:
            _call(["ip", "netns", "add", site.netns])
            if self.resolve_hostname:
                self._write_hosts(site)
            _call(["ip", "-n", site.netns, "link", "set", "lo", "up"])
            _call(
                ["ip", "-n", hub.netns, "link", "add", site.hub_device, "type", "veth"]
                + ["peer", "name", site.device, "netns", site.netns]
            )
            for netns, dev in ((site.netns, site.device), (hub.netns, site.hub_device)):
                _call(["ip", "-n", netns, "link", "set", dev, "addrgenmode", "none"])
                _call(["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", *self._tbf()])
            _call(["ip", "-n", hub.netns, "link", "set", site.hub_device, "master", hub.bridge, "up"])
            _call(["ip", "-n", site.netns, "addr", "add", f"{site.address}/{self._length}", "dev", site.device])
            _call(["ip", "-n", site.netns, "link", "set", site.device, "up"])

    def _write_hosts(self, site: Site) -> None:
        """/etc/netns/<site namespace>/hosts: /etc/hosts with this machine's hostname at the site's address."""
        hostname = socket.gethostname()
        try:
            with open("/etc/hosts") as f:
                lines = [line for line in f.read().splitlines() if hostname not in line.split("#")[0].split()[1:]]
        except FileNotFoundError:
            lines = ["127.0.0.1 localhost"]
        text = "\n".join([f"{site.address} {hostname}", *lines]) + "\n"
        folder = os.path.join(_ETC_NETNS, site.netns)
        for attempt in range(3):  # another network's teardown may remove an empty /etc/netns meanwhile
            try:
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, "hosts"), "w") as f:
                    f.write(text)
                return
            except FileNotFoundError:
                if attempt == 2:
                    raise

    def close(self) -> None:
        """Removes the network: stops the processes started by `popen` and any other process inside its namespaces,
        deletes the namespaces (and so their devices and qdiscs) and /etc/netns entries. Signals wait meanwhile.
        Raises LinksError naming whatever could not be removed. Idempotent."""
        with _signals_deferred():
            try:
                running = [p for p in self._procs if p.poll() is None]
                _stop([p.pid for p in running], STOP_GRACE_SECONDS)
                for p in running:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(timeout=1)
                failed = _remove([n for group in leftovers(self.prefix).values() for n in group]) if self._made else []
            finally:
                self._made = False
                self._signals.close()
        if failed:
            raise LinksError(f"network {self.prefix}: could not remove {', '.join(failed)}")

    def __enter__(self) -> Network:
        self._signals.enter_context(_stop_signals_exit())  # SIGTERM / SIGHUP leave through __exit__ too
        try:
            return self.up()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- using it -------------------------------------------------------------------------------------------------

    def command(self, site: int, argv: Sequence[str]) -> list[str]:
        """The command line that runs `argv` inside site `site`'s namespace (`ip netns exec`; the environment passes
        through)."""
        return ["ip", "netns", "exec", self._site(site).netns, *argv]

    def run(
        self, site: int, argv: Sequence[str], *, timeout: float, check: bool = False, **kwargs: Any
    ) -> subprocess.CompletedProcess:
        """`subprocess.run(argv, timeout=timeout, check=check, **kwargs)` inside site `site`'s namespace."""
        return subprocess.run(self.command(site, argv), timeout=timeout, check=check, **kwargs)

    def popen(self, site: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """`subprocess.Popen(argv, **kwargs)` inside site `site`'s namespace; stopped at teardown if still running."""
        proc = subprocess.Popen(self.command(site, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def counters(self) -> list[Counters]:
        """What every site sent and received over its link so far, in site order (see `Counters`)."""
        hub = _shapers(self.hub.netns)
        out = []
        for site in self.sites:
            shown = _call(["ip", "-n", site.netns, "-j", "-s", "link", "show", "dev", site.device]).stdout
            stats = json.loads(shown)[0]["stats64"]
            up, down = _shapers(site.netns)[site.device], hub[site.hub_device]
            out.append(
                Counters(
                    tx_bytes=stats["tx"]["bytes"],
                    rx_bytes=stats["rx"]["bytes"],
                    tx_packets=stats["tx"]["packets"],
                    rx_packets=stats["rx"]["packets"],
                    tx_wire_bytes=up["bytes"],
                    rx_wire_bytes=down["bytes"],
                    tx_dropped=up["drops"],
                    rx_dropped=down["drops"],
                )
            )
        return out

    def describe(self) -> dict[str, Any]:
        """The network as a JSON-able dict: prefix, rate_mbit, subnet, hub and sites (their fields)."""
        return {
            "prefix": self.prefix,
            "rate_mbit": self.rate_mbit,
            "subnet": self.subnet,
            "hub": dataclasses.asdict(self.hub),
            "sites": [dataclasses.asdict(s) for s in self.sites],
        }

    def environment(self) -> dict[str, str]:
        """The LINKS_* environment variables that describe the network (the module docstring lists them)."""
        return {
            "LINKS_PREFIX": self.prefix,
            "LINKS_SITES": str(len(self.sites)),
            "LINKS_RATE_MBIT": f"{self.rate_mbit:g}",
            "LINKS_SUBNET": self.subnet,
            "LINKS_HUB_NETNS": self.hub.netns,
            "LINKS_HUB_ADDRESS": self.hub.address,
            "LINKS_NETNS": ",".join(s.netns for s in self.sites),
            "LINKS_ADDRESSES": ",".join(s.address for s in self.sites),
            "LINKS_DEVICES": ",".join(s.device for s in self.sites),
            "LINKS_JSON": json.dumps(self.describe()),
        }

    def _site(self, site: int) -> Site:
        if not isinstance(site, int) or not 0 <= site < len(self.sites):
            raise ValueError(f"site={site!r}: must be an integer in [0, {len(self.sites)})")
        return self.sites[site]


# --- the command line ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    doc = __doc__ or ""
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
        sub.add_argument("--subnet", default=DEFAULT_SUBNET, help=f"private IPv4 subnet (default {DEFAULT_SUBNET})")
        if name == "run":
            sub.add_argument("--in-hub", action="store_true", help="run the command in the hub's namespace")
            sub.add_argument("--report", help="also write the network and its counters to this JSON file")
            sub.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command and its arguments")
    sub = commands.add_parser("down", help="remove network PREFIX, or every network whose maker has exited")
    sub.add_argument("prefix", nargs="?", help="a network's prefix (lnk + 6 hex digits), as `up` printed it")
    return parser


def _report_lines(net: Network, counters: Sequence[Counters]) -> list[str]:
    return [
        f"links: site {s.index} ({s.address}): sent {c.tx_wire_bytes:,} bytes ({c.tx_bytes:,} by its device, "
        f"{c.tx_dropped:,} frames dropped), received {c.rx_wire_bytes:,} bytes ({c.rx_bytes:,} by its device, "
        f"{c.rx_dropped:,} frames dropped)"
        for s, c in zip(net.sites, counters)
    ]


def _die_with_parent() -> Callable[[], None]:
    """A `preexec_fn` that makes the child receive SIGTERM when this process dies, even by SIGKILL (Linux prctl)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    parent = os.getpid()

    def preexec() -> None:
        if prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _run_command(net: Network, cmd: Sequence[str], in_hub: bool) -> tuple[int, int | None]:
    """Runs `cmd` (in its own session, bound to this process) with the network's environment, passing one stop
    signal on to its process group; returns (its exit status as the shell shows it, the stop signal or None)."""
    argv = ["ip", "netns", "exec", net.hub.netns, *cmd] if in_hub else list(cmd)
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in _STOP_SIGNALS}
    try:
        try:
            proc = subprocess.Popen(
                argv,
                env=dict(os.environ, **net.environment()),
                start_new_session=True,
                preexec_fn=_die_with_parent(),  # noqa: PLW1509 (no thread of ours runs)
            )
        except OSError as e:
            print(f"links: error: cannot run {shlex.join(cmd)}: {e}", file=sys.stderr, flush=True)
            return 127, None
        stopped_at = None
        while proc.poll() is None:
            if received and stopped_at is None:
                stopped_at = time.monotonic()
                print(f"links: stopped by {signal.Signals(received[0]).name}: passing it on", file=sys.stderr)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, received[0])
            if stopped_at is not None and (time.monotonic() - stopped_at > STOP_GRACE_SECONDS or len(received) > 1):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):  # what the command left in its group goes with it
            os.killpg(proc.pid, signal.SIGKILL)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    code = proc.returncode
    return (128 - code if code < 0 else code), (received[0] if received else None)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit status: 2 for bad arguments or a machine that
    cannot make networks, 1 when an `ip` / `tc` command fails, else `run`'s command's status (128+N if stopped by
    signal N) or 0."""
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.action in ("up", "run"):
        problems = _problems(args.sites, args.rate_mbit, args.subnet)
        if problems:
            parser.error("; ".join(f"--{n.replace('_', '-')}={v}: must be {allowed}" for n, v, allowed in problems))
    if args.action == "run":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            parser.error("give the command after '--', e.g. run --sites 2 --rate-mbit 8 -- env")
    if args.action == "down" and args.prefix is not None and not _PREFIX.match(args.prefix):
        parser.error(f"PREFIX={args.prefix!r}: not a network of experiments.links (expected lnk + 6 hex digits)")
    reason = unavailable()
    if reason is not None:
        print(f"links: error: {reason}", file=sys.stderr, flush=True)
        return 2
    try:
        if args.action == "down":
            removed = down(args.prefix)
            print(f"links: removed {len(removed)} namespaces{': ' if removed else ''}{' '.join(removed)}", flush=True)
            return 0
        net = Network(args.sites, args.rate_mbit, subnet=args.subnet)
        if args.action == "up":
            with _stop_signals_exit():
                net.up()  # (removes what it made if it fails or is stopped)
            print(json.dumps(net.describe(), indent=2), flush=True)
            print(f"links: network {net.prefix} is up; remove it with: python -m experiments.links down {net.prefix}")
            return 0
        with net:
            code, stopped_by = _run_command(net, cmd, args.in_hub)
            counters = net.counters()
            for line in _report_lines(net, counters):
                print(line, file=sys.stderr, flush=True)
            if args.report:
                report = dict(net.describe(), counters=[dataclasses.asdict(c) for c in counters], exit_status=code)
                with open(args.report, "w") as f:
                    json.dump(report, f, indent=2)
        return 128 + stopped_by if stopped_by is not None else code
    except LinksError as e:
        print(f"links: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while the network was being made or removed (it is removed)
        print("links: stopped by SIGINT", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
