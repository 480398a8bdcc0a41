"""Synchronising FoMoE sites (docs/fomoe.md, "Partial expert replication" and "Synchronisation").

The M sites form a mesh whose site axis is factored into ("replica", "block") = (O_e, M / O_e): device index
s = r B + b is site s, replica r of block b, which is exactly the fixed placement's layout (block b on sites
b, b + B, ...; `moe.placement`). Every site's state is stacked along a leading axis of size M sharded over both
axes, so one program runs all sites, whether they are virtual devices of one process or one process per site
(`jax.distributed`). Averaging is then a `pmean` over named axes inside `jax.shard_map`:

    dense parameters (embedding, attention, norms, shared experts, a skip-token router): over (replica, block)
    expert parameters (and their router columns with the partitioned router):          over replica only

`core.hlo.collective_bytes` reads the all-reduce ops of the compiled program (their per-device shapes and replica
groups), so the bytes a synchronisation really moves can be compared with `moe.system_model.sync_bytes`. It counts
what the program moves: XLA:CPU, for one, reduces bfloat16 arrays in float32 (twice the bytes of the formula's
bf16 count), which the comparison then shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, PartitionSpec

from moe.layer import Residency

__all__ = [
    "SITE_AXES",
    "average",
    "expert_flags",
    "is_expert_variable",
    "leaf_flags",
    "per_site",
    "site_mesh",
    "to_sites",
]

SITE_AXES = ("replica", "block")


def site_mesh(sites: int, overlap: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The (replica = O_e, block = M / O_e) mesh over the first M devices (one device per site)."""
    devices = list(jax.devices() if devices is None else devices)
    if sites > len(devices):
        raise ValueError(f"{sites} sites need {sites} devices, one per site; only {len(devices)} are available.")
    if not 1 <= overlap <= sites or sites % overlap:
        raise ValueError(f"overlap O_e = {overlap} must divide the number of sites M = {sites}.")
    return jax.make_mesh(
        (overlap, sites // overlap), SITE_AXES, axis_types=(AxisType.Auto,) * 2, devices=devices[:sites]
    )


def per_site(fn, mesh: Mesh, in_axes: Sequence[int | None], out_axes: Sequence[int] | int = 0):
    """`fn` (one site's computation) applied to every site on that site's device alone.

    `jax.vmap` over the stacked site axis alone would leave the partitioner free to communicate across sites,
    and it does: XLA:CPU's top-k gathers its operand over the vmapped axis, and a loop with a data-dependent trip
    count (the windowed grouped matmul) all-reduces its condition every iteration. Under `jax.shard_map` each
    device holds only its site's slice, so a site's local steps can move no bytes to another site.

    Args:
      in_axes / out_axes: for each argument / output, the position of its site axis (None: the same value for
        every site, e.g. evaluation tokens).
    """

    def spec(axis):
        return PartitionSpec() if axis is None else PartitionSpec(*([None] * axis), SITE_AXES)

    if isinstance(out_axes, (tuple, list)):
        local = jax.vmap(fn, in_axes=tuple(in_axes), out_axes=tuple(out_axes))
        out_specs: Any = tuple(map(spec, out_axes))
    else:
        local = jax.vmap(fn, in_axes=tuple(in_axes), out_axes=out_axes)
        out_specs = spec(out_axes)
    return jax.shard_map(local, mesh=mesh, in_specs=tuple(map(spec, in_axes)), out_specs=out_specs)


def average(tree, is_expert, mesh: Mesh):
    """Averages a stacked per-site pytree (leading axis M, sharded over the site axes).

    Args:
      tree: leaves [M, ...], site s's value at index s.
      is_expert: a pytree with `tree`'s structure (or a prefix of it) of Python bools: True for leaves averaged
        over the replica group only, False for leaves averaged over all sites; or None for leaves each site keeps
        (not averaged).
    Returns:
      the averaged tree, same shapes and sharding; integer leaves are returned unchanged.
    """
    spec = PartitionSpec(SITE_AXES)
    leaves, treedef = jax.tree.flatten(tree)
    flags = leaf_flags(is_expert, tree)

    def local(*leaves):  # integer leaves (step counts, expert ids) are never averaged
        return [
            x
            if e is None or not jnp.issubdtype(x.dtype, jnp.inexact)
            else jax.lax.pmean(x, "replica" if e else SITE_AXES)
            for x, e in zip(leaves, flags)
        ]

    out = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * len(leaves), out_specs=[spec] * len(leaves))(*leaves)
    return jax.tree.unflatten(treedef, out)


def leaf_flags(flags, tree) -> list:
    """One flag per leaf of `tree` from `flags`, a tree with `tree`'s structure or a prefix of it whose leaves may
    be None (e.g. `average`'s is_expert)."""
    full = jax.tree.broadcast(flags, tree, is_leaf=lambda x: x is None)
    return jax.tree.structure(tree).flatten_up_to(full)  # type: ignore[attr-defined] # (missing from jaxlib's stubs)


def is_expert_variable(variable) -> bool:
    """A parameter belongs to the experts (averaged over the replica group) iff its logical axes name "expert"."""
    return "expert" in (getattr(variable, "axes", None) or ())


def expert_flags(state):
    """The `is_expert` tree of an nnx.State (one bool per Variable) for `average`."""
    return jax.tree.map(is_expert_variable, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def to_sites(state, experts: np.ndarray):
    """Each site's view of a model state: expert leaves gathered to that site's experts, the rest copied.

    Args:
      state: an nnx.State of the model with all N_e experts (Variables with `axes` metadata).
      experts: [M, N_le] int, the placement's experts per site (`moe.placement.Placement.experts`).
    Returns:
      the state with a leading site axis M on every leaf; an expert leaf's "expert" dimension becomes N_le, and
      each MoE layer's `Residency` holds site s's expert ids.
    """
    sites = experts.shape[0]

    def one(v):
        x = v.get_value()
        if isinstance(v, Residency):  # which experts each site hosts
            return v.replace(jnp.asarray(experts, x.dtype))
        if not is_expert_variable(v):
            return v.replace(jnp.broadcast_to(x, (sites,) + x.shape))
        dim = v.axes.index("expert")
        return v.replace(jnp.moveaxis(jnp.take(x, jnp.asarray(experts), axis=dim), dim, 0))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
