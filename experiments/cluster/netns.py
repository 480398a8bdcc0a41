"""Named network namespaces of experiments.cluster.links: running `ip` / `tc`, finding a network's namespaces by
name, and removing them with every process inside.

Names: every network carries a prefix `lnk` + 6 random hex digits, e.g. `lnk3fa2c1`; its namespaces are
`<prefix>-<pid>-hub` and `<prefix>-<pid>-site<i>` (pid: the process that made it). `leftovers` and `down` recognise
a network by these patterns, and a network whose maker has exited as left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from experiments.cluster import process

__all__ = [
    "COMMAND_TIMEOUT_SECONDS",
    "ETC_NETNS",
    "PREFIX",
    "STOP_GRACE_SECONDS",
    "LinksError",
    "LinksUnavailable",
    "call",
    "down",
    "leftovers",
    "netns_names",
    "remove",
    "shapers",
    "unavailable",
]

STOP_GRACE_SECONDS = 5
"""A process sent SIGTERM at teardown (or `run`'s command, sent the tool's stop signal) is killed this long later."""
COMMAND_TIMEOUT_SECONDS = 30
"""Every `ip` and `tc` call is given this long."""
PREFIX = re.compile(r"^lnk[0-9a-f]{6}$")
"""A network's prefix."""
ETC_NETNS = "/etc/netns"
"""Where `ip netns exec` finds a namespace's own /etc files (a site's `hosts`)."""

_NAME = re.compile(r"^(lnk[0-9a-f]{6})-(\d+)-(hub|site\d+)$")


class LinksError(RuntimeError):
    """An `ip` or `tc` command failed, or a teardown left something behind; the message says which and why."""


class LinksUnavailable(LinksError):
    """This machine cannot make the networks (not Linux, not root, no `ip` or `tc`); nothing was created."""


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


def call(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    """Runs an `ip` / `tc` command (bounded by COMMAND_TIMEOUT_SECONDS); raises LinksError naming it if it fails."""
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=COMMAND_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired as e:
        raise LinksError(f"`{shlex.join(argv)}` did not finish in {COMMAND_TIMEOUT_SECONDS} s") from e
    if check and out.returncode != 0:
        raise LinksError(f"`{shlex.join(argv)}` failed (exit status {out.returncode}): {out.stderr.strip()}")
    return out


def shapers(netns: str) -> dict[str, dict[str, Any]]:
    """{device: its root tbf qdisc's statistics (`tc -s qdisc`: bytes and packets sent, drops, ...)} in `netns`."""
    qdiscs = json.loads(call(["tc", "-n", netns, "-j", "-s", "qdisc", "show"]).stdout)
    return {q["dev"]: q for q in qdiscs if q.get("kind") == "tbf" and q.get("root")}


def netns_names() -> list[str]:
    """The names `ip netns list` shows (the named network namespaces of this machine)."""
    return [line.split()[0] for line in call(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def leftovers(prefix: str | None = None) -> dict[str, list[str]]:
    """This tool's networks on this machine, as {prefix: namespace names}: network `prefix` only, or (None) every
    network whose making process has exited (left by `up`, or by a run killed with SIGKILL)."""
    found: dict[str, list[str]] = {}
    for name in netns_names():
        m = _NAME.match(name)
        if m and (m.group(1) == prefix if prefix is not None else not process.alive(int(m.group(2)))):
            found.setdefault(m.group(1), []).append(name)
    return found


def _pids_in(netns: str) -> list[int]:
    out = call(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in out.stdout.split() if p.isdigit()] if out.returncode == 0 else []


def remove(names: Sequence[str]) -> list[str]:
    """Deletes the namespaces `names` (sites before the hub) after stopping the processes inside them, and their
    /etc/netns entries; returns what could not be removed (empty: all gone)."""
    names = sorted(names, key=lambda n: n.endswith("-hub"))  # deleting a site's namespace deletes its veth pair
    pids = sorted({p for n in names for p in _pids_in(n)} - {os.getpid()})
    if pids:
        process.stop(pids, STOP_GRACE_SECONDS)
    failed = []
    for name in names:
        out = call(["ip", "netns", "delete", name], check=False)
        if out.returncode != 0:
            failed.append(f"namespace {name} ({out.stderr.strip()})")
        shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)
    with contextlib.suppress(OSError):  # only when empty; iproute2 makes it anew when needed
        os.rmdir(ETC_NETNS)
    remaining = set(netns_names()) & set(names)
    return failed + [f"namespace {n}" for n in sorted(remaining) if not any(n in f for f in failed)]


def down(prefix: str | None = None) -> list[str]:
    """Removes network `prefix` (or, None, every network of this tool whose making process has exited) with every
    process still inside it; returns the namespaces removed. Raises ValueError for a malformed prefix and LinksError
    if something could not be removed (naming it)."""
    reason = unavailable()
    if reason is not None:
        raise LinksUnavailable(reason)
    if prefix is not None and not PREFIX.match(prefix):
        raise ValueError(f"prefix={prefix!r}: not a network of experiments.links (expected lnk + 6 hex digits)")
    names = [n for group in leftovers(prefix).values() for n in group]
    failed = remove(names) if names else []
    if failed:
        raise LinksError(f"could not remove: {', '.join(failed)}")
    return sorted(names)
