"""Reading a compiled XLA program: the bytes its collectives move (from `jit(f).lower(...).compile().as_text()`).

Used to check communication formulas against what a program really does: a federated round's synchronisation,
a reshuffle's migration, a data-parallel step's gradient all-reduce.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

__all__ = ["collective_bytes"]

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
