"""Sites behind real rate-limited links: one Linux network namespace per site, joined through a hub.

    python -m experiments.links run --sites 2 --rate-mbit 100 -- <command ...>   # the network for one command
    python -m experiments.links up --sites 4 --rate-mbit 1000    # makes a network, prints it (JSON), leaves it up
    python -m experiments.links down [PREFIX]                    # removes it (no PREFIX: every leftover network)

    with links.Network(sites=2, rate_mbit=8) as net:             # the same from Python (experiments.cluster.links)
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
a's uplink and b's downlink; several sites sending to one share its downlink. A TCP transfer's payload can reach at
most 1448 / 1514 of R (the payload's share of a full frame); what it reaches is measured in docs/cluster.md.

Latency is not emulated (the kernel's netem qdisc, the usual way to add delay, is not used: docs/cluster.md), so a
packet crosses a link in the time its rate and the queue ahead of it take, and nothing more; a latency must be
modelled (moe.system_model), not measured.

Byte counts (`Network.counters()`, see `Counters`): for each site, what it sent (tx) and received (rx) over its link,
read from its veth end's device statistics (`ip -s link`) and from the link's two shapers (`tc -s qdisc`: the
"wire" bytes, every frame with its Ethernet, IP and TCP headers, as a wire carries them without preamble and
checksum). The two differ by headers only: the device counts a segmentation-offload super-packet (up to 64 KiB,
which the veth passes whole when the shaper's bucket holds it, at high rates) with its headers once. Everything a
site sends is counted: ARP, the coordination service's messages, TCP acknowledgements. The links carry nothing of
their own but the hub's bridge's few IGMP and MLD reports in its first seconds: the devices have no IPv6 address.

Names: every network carries a prefix `lnk` + 6 random hex digits (`Network.prefix`), e.g. `lnk3fa2c1`; its
namespaces are `<prefix>-<pid>-hub` and `<prefix>-<pid>-site<i>` (pid: the process that made it), its devices,
which exist only inside those namespaces, `<prefix>br` (the bridge), `<prefix>s<i>` (site i's end of its veth) and
`<prefix>h<i>` (the hub's end). Two networks never share a name, and `down` recognises leftovers by these patterns.

Hostname: inside a site's namespace this machine's hostname resolves to the site's address (a `hosts` file in
/etc/netns/<namespace>/, which `ip netns exec` mounts over /etc/hosts for the commands it runs), so that a program
that binds the address of its own hostname binds its site's link, not 127.0.0.1: gloo, jax's CPU collectives,
does (jax calls jaxlib's `make_gloo_tcp_collectives` without its `hostname` or `interface` arguments, and no
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

import contextlib
import dataclasses
import ipaddress
import json
import math
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from experiments.cluster import netns, process
from experiments.cluster.netns import LinksError, LinksUnavailable, down, leftovers, unavailable

__all__ = [
    "Counters",
    "Hub",
    "LinksError",
    "LinksUnavailable",
    "Network",
    "Site",
    "down",
    "leftovers",
    "problems",
    "run_command",
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
"""Four 64 KiB segmentation-offload packets, the unit a sending TCP stack hands its device: a queue shorter than a
few of them drops parts of them at low rates (docs/cluster.md)."""


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


def problems(sites: Any, rate_mbit: Any, subnet: Any) -> list[tuple[str, Any, str]]:
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
      min_queue_bytes: the floor of each shaper's queue (`MIN_QUEUE_BYTES`; experiments.bench.link_rate measures
        what a lower one drops), an integer >= 0.
    Raises ValueError naming a bad argument; entering raises LinksUnavailable (nothing made) or LinksError (an `ip`
    or `tc` command failed: whatever was made is removed first).
    """

    def __init__(
        self,
        sites: int,
        rate_mbit: float,
        *,
        subnet: str = DEFAULT_SUBNET,
        resolve_hostname: bool = True,
        min_queue_bytes: int = MIN_QUEUE_BYTES,
    ):
        bad = problems(sites, rate_mbit, subnet)
        if isinstance(min_queue_bytes, bool) or not isinstance(min_queue_bytes, int) or min_queue_bytes < 0:
            bad.append(("min_queue_bytes", min_queue_bytes, "an integer >= 0"))
        if bad:
            raise ValueError("; ".join(f"{name}={value!r}: must be {allowed}" for name, value, allowed in bad))
        self.rate_mbit = float(rate_mbit)
        self.subnet = str(ipaddress.IPv4Network(subnet))
        self.resolve_hostname = resolve_hostname
        self.min_queue_bytes = min_queue_bytes
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
        reason = netns.unavailable()
        if reason is not None:
            raise netns.LinksUnavailable(reason)
        if self._made:
            raise netns.LinksError(f"network {self.prefix} is already up")
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
        limit = max(math.ceil(rate / 8 * QUEUE_SECONDS), self.min_queue_bytes) + burst
        return ["tbf", "rate", f"{rate}bit", "burst", str(burst), "limit", str(limit)]

    def _make(self) -> None:
        """Every device is given its qdisc before it goes up, and no IPv6 link-local address (`addrgenmode none`:
        no IPv6 neighbour discovery or multicast reports on the links), so that the counters hold only what the
        programs in the namespaces send."""
        hub = self.hub
        netns.call(["ip", "netns", "add", hub.netns])
        netns.call(["ip", "-n", hub.netns, "link", "set", "lo", "up"])
        netns.call(["ip", "-n", hub.netns, "link", "add", hub.bridge, "type", "bridge"])
        netns.call(["ip", "-n", hub.netns, "link", "set", hub.bridge, "addrgenmode", "none"])
        netns.call(["ip", "-n", hub.netns, "addr", "add", f"{hub.address}/{self._length}", "dev", hub.bridge])
        netns.call(["ip", "-n", hub.netns, "link", "set", hub.bridge, "up"])
        for site in self.sites:
            netns.call(["ip", "netns", "add", site.netns])
            if self.resolve_hostname:
                self._write_hosts(site)
            netns.call(["ip", "-n", site.netns, "link", "set", "lo", "up"])
            netns.call(
                ["ip", "-n", hub.netns, "link", "add", site.hub_device, "type", "veth"]
                + ["peer", "name", site.device, "netns", site.netns]
            )
            for space, dev in ((site.netns, site.device), (hub.netns, site.hub_device)):
                netns.call(["ip", "-n", space, "link", "set", dev, "addrgenmode", "none"])
                netns.call(["tc", "-n", space, "qdisc", "add", "dev", dev, "root", *self._tbf()])
            netns.call(["ip", "-n", hub.netns, "link", "set", site.hub_device, "master", hub.bridge, "up"])
            netns.call(["ip", "-n", site.netns, "addr", "add", f"{site.address}/{self._length}", "dev", site.device])
            netns.call(["ip", "-n", site.netns, "link", "set", site.device, "up"])

    def _write_hosts(self, site: Site) -> None:
        """/etc/netns/<site namespace>/hosts: /etc/hosts with this machine's hostname at the site's address."""
        hostname = socket.gethostname()
        try:
            with open("/etc/hosts") as f:
                lines = [line for line in f.read().splitlines() if hostname not in line.split("#")[0].split()[1:]]
        except FileNotFoundError:
            lines = ["127.0.0.1 localhost"]
        text = "\n".join([f"{site.address} {hostname}", *lines]) + "\n"
        folder = os.path.join(netns.ETC_NETNS, site.netns)
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
        with process.signals_deferred():
            try:
                running = [p for p in self._procs if p.poll() is None]
                process.stop([p.pid for p in running], netns.STOP_GRACE_SECONDS)
                for p in running:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(timeout=1)
                failed = []
                if self._made:
                    failed = netns.remove([n for group in netns.leftovers(self.prefix).values() for n in group])
            finally:
                self._made = False
                self._signals.close()
        if failed:
            raise netns.LinksError(f"network {self.prefix}: could not remove {', '.join(failed)}")

    def __enter__(self) -> Network:
        self._signals.enter_context(process.stop_signals_exit())  # SIGTERM / SIGHUP leave through __exit__ too
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
        hub = netns.shapers(self.hub.netns)
        out = []
        for site in self.sites:
            shown = netns.call(["ip", "-n", site.netns, "-j", "-s", "link", "show", "dev", site.device]).stdout
            stats = json.loads(shown)[0]["stats64"]
            up, down = netns.shapers(site.netns)[site.device], hub[site.hub_device]
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


def run_command(net: Network, cmd: Sequence[str], in_hub: bool) -> tuple[int, int | None]:
    """Runs `cmd` (in its own session, bound to this process) with the network's environment, passing one stop
    signal on to its process group; returns (its exit status as the shell shows it, the stop signal or None)."""
    argv = ["ip", "netns", "exec", net.hub.netns, *cmd] if in_hub else list(cmd)
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in process.STOP_SIGNALS}
    try:
        try:
            proc = subprocess.Popen(
                argv,
                env=dict(os.environ, **net.environment()),
                start_new_session=True,
                preexec_fn=process.die_with_parent(),  # noqa: PLW1509 (no thread of ours runs)
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
            late = stopped_at is not None and time.monotonic() - stopped_at > netns.STOP_GRACE_SECONDS
            if late or (stopped_at is not None and len(received) > 1):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):  # what the command left in its group goes with it
            os.killpg(proc.pid, signal.SIGKILL)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return process.exit_status(proc.returncode), (received[0] if received else None)
