"""Reading a compiled XLA program: the bytes its collectives move (from `jit(f).lower(...).compile().as_text()`).

Used to check communication formulas against what a program really does: a federated round's synchronisation,
a reshuffle's migration, a data-parallel step's gradient all-reduce.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

__all__ = ["Collective", "collective_bytes", "collectives"]

_DTYPE_BYTES = {
    "f64": 8,
    "s64": 8,
    "u64": 8,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "s8": 1,
    "u8": 1,
    "pred": 1,
}
_COLLECTIVE = re.compile(r"=\s*(?P<type>.+?)\s+(?P<op>all-reduce|all-gather)(?:-start)?\((?P<rest>.*)$")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
_GROUPS = re.compile(r"replica_groups=\{\{(?P<first>[\d,]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(?P<groups>\d+),(?P<size>\d+)\]<=")  # [groups, size]<=[devices]
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<over>[^}]*)\}")  # mesh['a'=2] {'a'}
_RING = {"all-reduce": lambda n: 2.0 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n}


def collective_bytes(hlo_text: str) -> dict[str, Any]:
    """Bytes each device sends in the all-reduce and all-gather ops of a compiled HLO module, as ring algorithms
    move them: 2 (n - 1) / n x the operand bytes for an all-reduce, (n - 1) / n x the gathered result's bytes for
    an all-gather, n the size of the op's replica groups.

    Each op is counted once, as the program text lists it: a collective inside a loop body would run once per
    iteration, so measure programs that keep their collectives outside loops (a federated round does: its local
    steps have none, see `moe.federation.per_site`).

    Returns {"bytes_per_device": ..., "ops": number of such ops, "by_group_size": {n: bytes}} (groups of one
    device move nothing and are not listed).
    """
    total, ops = 0.0, 0
    by_group: dict[int, float] = {}
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if match is None:
            continue
        n = _group_size(match["rest"])
        arrays = [
            _DTYPE_BYTES[a["dtype"]] * int(np.prod([int(d) for d in a["dims"].split(",") if d] or [1]))
            for a in _ARRAY.finditer(match["type"])
        ]
        # an async all-gather-start's type is (operand, result): the result is the last array
        size = arrays[-1] if match["op"] == "all-gather" else sum(arrays)
        ops += 1
        if n > 1:  # a group of one device moves nothing
            moved = _RING[match["op"]](n) * size
            total += moved
            by_group[n] = by_group.get(n, 0.0) + moved
    return {"bytes_per_device": total, "ops": ops, "by_group_size": by_group}


def _group_size(attributes: str) -> int:
    """Devices per replica group, from the explicit {{0,1},{2,3}}, the iota [2,2]<=[4] or the named-mesh
    mesh['a'=2,'b'=4] {'a'} form (the product of the sizes of the axes in braces)."""
    group = _GROUPS.search(attributes)
    if group is not None:
        return len(group["first"].split(",")) if group["first"] else 1
    iota = _IOTA_GROUPS.search(attributes)
    if iota is not None:
        return int(iota["size"])
    named = _MESH_GROUPS.search(attributes)
    if named is not None:
        sizes = {k.strip().strip("'\""): int(v) for k, v in (a.split("=") for a in named["axes"].split(",") if a)}
        return int(np.prod([sizes[a.strip().strip("'\"")] for a in named["over"].split(",") if a.strip()] or [1]))
    return 1


_ANY_COLLECTIVE = re.compile(
    r"=\s*(?P<type>.+?)\s+(?P<op>all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute|"
    r"collective-broadcast|ragged-all-to-all)(?:-start)?\((?P<rest>.*)$"
)
_ALL_GROUPS = re.compile(r"replica_groups=\{(?P<groups>(?:\{[\d,]*\},?)*)\}")
_IOTA_FULL = re.compile(r"replica_groups=\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{(?P<pairs>(?:\{\d+,\d+\},?)*)\}")
_SHARE = {
    "all-reduce": lambda n: 2.0 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "ragged-all-to-all": lambda n: (n - 1) / n,
    "collective-broadcast": lambda n: (n - 1) / n,
}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of a compiled program: `op` (its HLO name), `groups` (the device ids that communicate,
    one tuple per group; a collective-permute's (source, target) pairs), `bytes_per_device` (what one device sends
    as a ring algorithm moves it: `collective_bytes`' rule for all-reduce and all-gather; (n - 1) / n x the
    operand for reduce-scatter and all-to-all; the operand for collective-permute; 0 for groups of one)."""

    op: str
    groups: tuple[tuple[int, ...], ...]
    bytes_per_device: float


def collectives(hlo_text: str, num_devices: int) -> list[Collective]:
    """Every collective op of a compiled HLO module with its device groups (explicit {{0,1},{2,3}}, iota
    [4,2]<=[2,4]T(1,0), or none given: all `num_devices` devices in one group), e.g. to check which devices a
    program's collectives connect. Device ids are the program's partition ids: positions in its mesh's device
    order. Each op is listed once, as the program text lists it (see `collective_bytes` on loops)."""
    out = []
    for line in hlo_text.splitlines():
        match = _ANY_COLLECTIVE.search(line)
        if match is None:
            continue
        op, rest = match["op"], match["rest"]
        arrays = [
            _DTYPE_BYTES[a["dtype"]] * int(np.prod([int(d) for d in a["dims"].split(",") if d] or [1]))
            for a in _ARRAY.finditer(match["type"])
            if a["dtype"] in _DTYPE_BYTES
        ]
        if op == "collective-permute":
            pairs = _PAIRS.search(rest)
            found = re.findall(r"\{(\d+),(\d+)\}", pairs["pairs"]) if pairs else []
            pair_groups = tuple((int(a), int(b)) for a, b in found)
            out.append(Collective(op, pair_groups, float(arrays[0]) if any(a != b for a, b in pair_groups) else 0.0))
            continue
        groups = _groups(rest, num_devices)
        n = len(groups[0])
        # as `collective_bytes`: an all-gather's result (the last array of an async start's (operand, result)), the
        # operands of an all-reduce or all-to-all (a tuple of several); a reduce-scatter's operand is n x its result
        size = {"all-gather": arrays[-1], "reduce-scatter": n * arrays[-1]}.get(op, sum(arrays))
        out.append(Collective(op, groups, _SHARE[op](n) * size if n > 1 else 0.0))
    return out


def _groups(attributes: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    explicit = _ALL_GROUPS.search(attributes)
    if explicit is not None:
        groups = tuple(
            tuple(int(i) for i in g.split(",") if i) for g in re.findall(r"\{([\d,]*)\}", explicit["groups"])
        )
        return groups if groups and groups[0] else (tuple(range(num_devices)),)
    iota = _IOTA_FULL.search(attributes)
    if iota is not None:
        shape = [int(d) for d in iota["shape"].split(",")]
        dims = [int(d) for d in iota["dims"].split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if iota["perm"]:
            ids = ids.transpose([int(p) for p in iota["perm"].split(",")])
        return tuple(tuple(int(i) for i in row) for row in ids.reshape(shape))
    named = _MESH_GROUPS.search(attributes)
    if named is not None:
        axes = [(k.strip().strip("'\""), int(v)) for k, v in (a.split("=") for a in named["axes"].split(",") if a)]
        over = [a.strip().strip("'\"") for a in named["over"].split(",") if a.strip()]
        ids = np.arange(int(np.prod([n for _, n in axes]))).reshape([n for _, n in axes])
        names = [a for a, _ in axes]
        order = [i for i, a in enumerate(names) if a not in over] + [names.index(a) for a in over]
        size = int(np.prod([dict(axes)[a] for a in over] or [1]))
        return tuple(tuple(int(i) for i in row) for row in ids.transpose(order).reshape(-1, size))
    return (tuple(range(num_devices)),)
