"""An elastic federation: an M-site FoMoE state regrouped onto M' sites (a site lost, or one joining), every expert
kept (docs/fomoe.md, "Elastic membership").

With partial replication (O_e >= 2) every expert lives on at least two sites, so losing a site loses no expert:
each of its experts still has a surviving replica. `regroup` builds the M'-site state from the last synchronised
(checkpointed) M-site one: each new site s' holds the experts of the new placement, each copied with its optimizer
state (moments, DiLoCo momentum) from a surviving site that hosted it (s' itself when it did, else the first
surviving host), and everything else (dense parameters, which synchronisation made equal, step counts, a site's own
statistics) from its source site: survivor i is new site i, and a joining site takes survivor 0's. What each site
holds afterwards is exactly what some site held before, so the parameters of every expert are unchanged.

The placement after regrouping is the fixed placement of M' sites with the overlap `regrouped_overlap` picks: the
same O_e when M' allows it (O_e divides M' and O_e N_e / M' is whole), else the nearest larger one (more replicas,
never fewer), else the nearest smaller one. With O_e = 1 a lost site takes its experts with it: `lost_experts` names
them, and `regroup` refuses unless told to re-initialise them (their fresh weights and state then come from the
M'-site state it is given). Low-bit synchronisation's error feedback starts again at zero (its chunks are laid out
for the old groups); streaming synchronisation's anchors are copied like the values they anchor; the sites' PRNG
keys are kept, a joining site's is its own fresh one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from core import checkpoint
from core import train as train_lib
from moe.layer import Residency
from moe.placement import Placement
from moe.reshuffle import expert_dims

__all__ = ["LostExpertsError", "lost_experts", "regroup", "regrouped_overlap", "valid_overlaps"]


class LostExpertsError(ValueError):
    """Experts that no surviving site hosts (O_e = 1): the message names them and the sites they died with."""


def valid_overlaps(num_experts: int, sites: int) -> list[int]:
    """The O_e a fixed placement of `num_experts` experts on `sites` sites allows: O_e | M and O_e N_e / M whole."""
    return [o for o in range(1, sites + 1) if sites % o == 0 and (o * num_experts) % sites == 0]


def regrouped_overlap(num_experts: int, sites: int, wanted: int) -> int:
    """The overlap of the placement on `sites` sites: `wanted` if valid, else the smallest valid one above it, else
    the largest below it (O_e = M is always valid)."""
    valid = valid_overlaps(num_experts, sites)
    above = [o for o in valid if o >= wanted]
    return above[0] if above else valid[-1]


def lost_experts(placement: Placement, lost: Sequence[int]) -> dict[int, list[int]]:
    """{expert: the lost sites that hosted it} for every expert that no surviving site hosts."""
    lost_set = set(lost)
    out = {}
    for e in range(placement.num_experts):
        hosts = placement.hosts(e).tolist()
        if all(s in lost_set for s in hosts):
            out[e] = hosts
    return out


def _marks(like, optimizer: optax.GradientTransformation, outer: optax.GradientTransformation | None) -> list:
    """One mark per leaf of the FederatedState `like` (its flattening order): the expert axis of an expert-shaped
    leaf (a parameter, an optimizer leaf mirroring one), -1 for a per-site leaf copied from the source site,
    "fresh" for one taken from `like` (Residency, a joining site's key, error feedback)."""
    train = like.train
    dims = expert_dims(train.params)
    dims_tree = jax.tree.unflatten(jax.tree.structure(train.params), jax.tree.leaves(dims))

    def mirrored(tx, tree):
        return jax.tree.leaves(train_lib.optimizer_state_like(tx, tree, train.params, dims_tree, -1))

    rest = [
        "fresh" if isinstance(v, Residency) else -1
        for v in jax.tree.leaves(train.rest, is_leaf=lambda v: isinstance(v, nnx.Variable))
        for _ in jax.tree.leaves(v)
    ]
    marks = (
        [-1] * len(jax.tree.leaves(train.step))
        + jax.tree.leaves(dims)
        + rest
        + mirrored(optimizer, train.opt_state)
        + ["key"] * len(jax.tree.leaves(train.key))
        + (mirrored(outer, like.outer) if outer is not None else [-1] * len(jax.tree.leaves(like.outer)))
        + ["fresh"] * len(jax.tree.leaves(like.feedback))
        + _anchor_marks(like.anchor, optimizer, train.params, dims)
    )
    assert len(marks) == len(jax.tree.leaves(like)), (len(marks), len(jax.tree.leaves(like)))
    return marks


def _anchor_marks(anchor, optimizer: optax.GradientTransformation, params, dims) -> list:
    """FederatedState.anchor's marks: its parameters' like the parameters, its moments' like the optimizer's."""
    if not jax.tree.leaves(anchor):
        return []
    if isinstance(anchor, tuple):  # (parameters, optimizer state): low-bit LocalAdamW
        dims_tree = jax.tree.unflatten(jax.tree.structure(params), jax.tree.leaves(dims))
        return jax.tree.leaves(dims) + jax.tree.leaves(
            train_lib.optimizer_state_like(optimizer, anchor[1], params, dims_tree, -1)
        )
    return jax.tree.leaves(dims)


def regroup(
    old: Mapping[str, np.ndarray],
    like,
    before: Placement,
    after: Placement,
    survivors: Sequence[int],
    optimizer: optax.GradientTransformation,
    outer: optax.GradientTransformation | None = None,
    *,
    reinitialise_lost: bool = False,
) -> tuple[Any, dict[str, Any]]:
    """The M'-site FederatedState holding the M-site state `old` (module docstring).

    Args:
      old: the M-site state's arrays by checkpoint key (`core.checkpoint.load_numpy`), leading site axis M.
      like: an M'-site FederatedState of the same run (`moe.rounds.init_sites` with `after`): its structure and
        shapes, and the values of what is fresh.
      before / after: the placements of the M and the M' sites (same experts per layer).
      survivors: the old sites that go on, in the order they become new sites 0, 1, ...; new sites past them join.
      optimizer / outer: the transformations whose state the FederatedState holds (which leaves mirror parameters).
      reinitialise_lost: experts no survivor hosts take `like`'s values instead of being refused.
    Returns:
      (the M'-site FederatedState as NumPy arrays, a report: "lost_experts", "sources" (new site -> old source),
      "copied" ({new site: {expert: old site}}) for experts a site did not host before, "joined" (new sites),
      "shipped_bytes" ({new site: bytes it receives}: the experts it did not host and their optimizer state; a
      joiner's whole state but its fresh key and feedback)).
    Raises:
      LostExpertsError naming the experts that died with their sites (unless `reinitialise_lost`); ValueError for
      survivors outside the old sites or a placement of other experts.
    """
    if before.num_experts != after.num_experts:
        raise ValueError(f"placements of {before.num_experts} and {after.num_experts} experts: regrouping keeps them.")
    outside = any(not 0 <= s < before.sites for s in survivors)
    if outside or len(set(survivors)) != len(survivors) or not survivors or len(survivors) > after.sites:
        raise ValueError(
            f"survivors {list(survivors)}: distinct sites of the old {before.sites}, at least one and at most the "
            f"new {after.sites}."
        )
    lost = [s for s in range(before.sites) if s not in survivors]
    dead = lost_experts(before, lost)
    if dead and not reinitialise_lost:
        raise LostExpertsError(
            "experts died with their sites (O_e = 1 hosts each expert once): "
            + ", ".join(f"expert {e} (on site {', '.join(map(str, hosts))})" for e, hosts in sorted(dead.items()))
            + "; nothing survives to copy them from. Re-initialise them (elastic --reinitialise-lost-experts), or "
            "train with fomoe.overlap >= 2 so that every expert has a replica."
        )
    sources = [survivors[s] if s < len(survivors) else survivors[0] for s in range(after.sites)]
    resident = before.resident()

    def host(site: int, expert: int) -> int | None:
        """The old site a new site copies `expert` from: its source if that hosted it, else the first survivor."""
        if resident[sources[site], expert]:
            return sources[site]
        return next((s for s in survivors if resident[s, expert]), None)

    copied: dict[int, dict[int, int]] = {}
    for s in range(after.sites):
        for e in after.experts[s]:
            src = host(s, int(e))
            if src is not None and src != sources[s]:
                copied.setdefault(s, {})[int(e)] = src
    slot = {(s, int(e)): j for s in range(before.sites) for j, e in enumerate(before.experts[s])}
    fresh_flat = checkpoint.flatten(like)
    joined = list(range(len(survivors), after.sites))
    shipped = dict.fromkeys(range(after.sites), 0)  # bytes a new site receives that it did not hold
    out = []
    for (key, value), mark in zip(fresh_flat.items(), _marks(like, optimizer, outer)):
        fresh = np.asarray(value)
        if mark == "fresh":
            out.append(fresh)
            continue
        source = np.asarray(old[key])
        if mark == "key":  # survivors keep their keys, joiners their fresh ones
            out.append(np.stack([source[sources[s]] if s < len(survivors) else fresh[s] for s in range(after.sites)]))
        elif mark == -1:
            out.append(np.stack([source[sources[s]] for s in range(after.sites)]).astype(fresh.dtype))
            for s in joined:
                shipped[s] += out[-1][s].nbytes
        else:
            sites = []
            for s in range(after.sites):
                columns = []
                for j, e in enumerate(after.experts[s]):
                    src = host(s, int(e))
                    take = fresh[s] if src is None else source[src]
                    index = j if src is None else slot[(src, int(e))]
                    columns.append(np.take(take, index, axis=mark))
                    if src is not None and (src != sources[s] or s in joined):
                        shipped[s] += columns[-1].nbytes
                sites.append(np.stack(columns, axis=mark))
            out.append(np.stack(sites).astype(fresh.dtype))
    state = jax.tree.unflatten(jax.tree.structure(like), out)
    report = {
        "lost_experts": sorted(dead),
        "sources": sources,
        "copied": copied,
        "joined": joined,
        "shipped_bytes": shipped,
    }
    return state, report
