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

Expert parallelism inside a site (mesh.expert = E > 1): every site owns E devices, the mesh gains a third axis
("replica", "block", "expert") and site s = r B + b owns the E consecutive devices s E .. s E + E - 1 (so with one
process per site, or per S sites, a site's devices are one process's). `per_site` is then manual over the site axes
only: inside, "expert" is an ordinary (automatic) mesh axis, and the site's model, built with `site_sharder`, shards
its experts' leading dimension and its batch over it by the usual annotations (the expert-parallel dispatch's
all-to-all and the dense gradients' all-reduce stay among the site's E devices). State leaves with a logical
"expert" axis are stored sharded over the "expert" mesh axis (`site_shardings`), everything else replicated over
it. `average` then moves per site exactly what one device per site moves: an expert leaf's shards are averaged
each with the same shard of the replica group's other sites, and a leaf replicated in the site is averaged in E
slices (one per device) that the site then all-gathers over its own devices. `sync_bytes_per_site` counts the
bytes that cross sites, summed over a site's E devices; with E = 1 it is `collective_bytes`' bytes per device,
and every program is the one-device-per-site program of before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from core import hlo
from core.mesh import Sharder
from core.mesh_config import mesh_axes
from moe.layer import Residency

__all__ = [
    "EXPERT_AXIS",
    "SITE_AXES",
    "average",
    "devices_per_site",
    "expert_flags",
    "is_expert_variable",
    "leaf_flags",
    "per_site",
    "site_mesh",
    "site_sharder",
    "site_shardings",
    "sync_bytes_per_site",
    "to_sites",
]

SITE_AXES = ("replica", "block")
EXPERT_AXIS = "expert"


def site_mesh(sites: int, overlap: int, devices: Sequence[jax.Device] | None = None, *, expert: int = 1) -> Mesh:
    """The (replica = O_e, block = M / O_e) mesh over the first M devices (one device per site), or with
    `expert` = E > 1 the (replica, block, expert = E) mesh over the first M E devices, site s = r B + b on devices
    s E .. s E + E - 1 of `devices` (default jax.devices(): a process's devices are consecutive there)."""
    devices = list(jax.devices() if devices is None else devices)
    if expert < 1:
        raise ValueError(f"expert = {expert} devices per site; at least 1.")
    if sites * expert > len(devices):
        each = "one per site" if expert == 1 else f"{expert} per site"
        raise ValueError(f"{sites} sites need {sites * expert} devices, {each}; only {len(devices)} are available.")
    if not 1 <= overlap <= sites or sites % overlap:
        raise ValueError(f"overlap O_e = {overlap} must divide the number of sites M = {sites}.")
    if expert == 1:  # exactly the mesh (and so the programs) of one device per site
        return jax.make_mesh(
            (overlap, sites // overlap), SITE_AXES, axis_types=(AxisType.Auto,) * 2, devices=devices[:sites]
        )
    grid = np.asarray(devices[: sites * expert], dtype=object).reshape(overlap, sites // overlap, expert)
    for s, site in enumerate(grid.reshape(sites, expert)):
        processes = sorted({d.process_index for d in site})
        if len(processes) > 1:
            raise ValueError(
                f"site {s}'s {expert} devices belong to processes {processes}; a process must hold whole sites "
                f"(e.g. experiments.launch --devices-per-process {expert}, or a multiple of it)."
            )
    return Mesh(grid, SITE_AXES + (EXPERT_AXIS,), axis_types=(AxisType.Auto,) * 3)


def devices_per_site(mesh: Mesh) -> int:
    """E: the size of the site mesh's "expert" axis (1 without one)."""
    return dict(mesh.shape).get(EXPERT_AXIS, 1)


def site_sharder(mesh: Mesh | None, rules) -> Sharder:
    """The Sharder a site's model is built with: none (Sharder()) for one device per site; with E > 1 devices per
    site, the site mesh seen from inside `per_site` (its site axes manual) and `rules` (config mesh.rules) kept to
    their "expert" mesh axis, so that the model's annotations (the experts' dimension, the batch) and its
    expert-parallel dispatch act on the site's own E devices."""
    if mesh is None or devices_per_site(mesh) == 1:
        return Sharder()
    inside = mesh.abstract_mesh.update_axis_types(dict.fromkeys(SITE_AXES, AxisType.Manual))
    kept = tuple((name, EXPERT_AXIS if EXPERT_AXIS in mesh_axes(target) else None) for name, target in rules)
    return Sharder(inside, kept)


def _leaf_specs(tree, mesh: Mesh, axis: int = 0) -> list[PartitionSpec]:
    """One PartitionSpec per leaf of `tree` (a stacked per-site tree, site axis at `axis`): the site axes there and,
    with E > 1, "expert" on the dimension a Variable's `axes` metadata names "expert"."""
    ep = devices_per_site(mesh) > 1
    specs = []
    for item in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        dims: list = [None] * axis + [SITE_AXES]
        if ep and is_expert_variable(item):
            dims += [None] * len(item.axes)
            dims[axis + 1 + item.axes.index("expert")] = EXPERT_AXIS
        specs += [PartitionSpec(*dims)] * len(jax.tree.leaves(item))
    return specs


def site_shardings(tree, mesh: Mesh):
    """The shardings of a stacked per-site tree (leading site axis) on the site mesh: P(site axes) for every leaf,
    and with E > 1 devices per site also "expert" on the expert dimension of Variables that name one (parameters,
    and the optimizer moments that keep their Variables). One sharding for the whole tree when E = 1."""
    if devices_per_site(mesh) == 1:
        return NamedSharding(mesh, PartitionSpec(SITE_AXES))
    specs = [NamedSharding(mesh, s) for s in _leaf_specs(tree, mesh)]
    return jax.tree.unflatten(jax.tree.structure(tree), specs)


def sync_bytes_per_site(hlo_text: str, mesh: Mesh) -> dict[str, float]:
    """Bytes per site that a compiled synchronisation (or any site-mesh program) moves, from its collectives:
    "cross_site" counts the ops whose replica groups span several sites, summed over a site's E devices (E = 1:
    `core.hlo.collective_bytes`' bytes per device); "intra_site" the ops whose groups lie within sites (E > 1: the
    all-gather of the slices `average` reduced), summed likewise. Replica-group ids are positions in the mesh's
    device order (site s: positions s E .. s E + E - 1)."""
    e = devices_per_site(mesh)
    out = {"cross_site": 0.0, "intra_site": 0.0}
    for op in hlo.collectives(hlo_text, mesh.devices.size):
        if op.bytes_per_device:
            crosses = any(len({d // e for d in group}) > 1 for group in op.groups)
            out["cross_site" if crosses else "intra_site"] += e * op.bytes_per_device
    return out


def per_site(fn, mesh: Mesh, in_axes: Sequence[int | None], out_axes: Sequence[int] | int = 0):
    """`fn` (one site's computation) applied to every site on that site's device alone.

    `jax.vmap` over the stacked site axis alone would leave the partitioner free to communicate across sites,
    and it does: XLA:CPU's top-k gathers its operand over the vmapped axis, and a loop with a data-dependent trip
    count (the windowed grouped matmul) all-reduces its condition every iteration. Under `jax.shard_map` each
    device holds only its site's slice, so a site's local steps can move no bytes to another site.

    With E > 1 devices per site (`site_mesh(..., expert=E)`) the shard_map is manual over the site axes only: a
    site's computation runs on its E devices, partitioned over the automatic "expert" axis by the model's own
    annotations (`site_sharder`), so its collectives stay among them; the outputs are constrained to
    `site_shardings`, the layout the state starts in, so a round's output can start the next round. (check_vma is
    off there, as in the model's nested expert-parallel shard_map; nothing here is differentiated.)

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
    if devices_per_site(mesh) == 1:
        return jax.shard_map(local, mesh=mesh, in_specs=tuple(map(spec, in_axes)), out_specs=out_specs)
    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=tuple(map(spec, in_axes)),
        out_specs=out_specs,
        axis_names=frozenset(SITE_AXES),
        check_vma=False,
    )

    def run(*args):
        outs = mapped(*args)
        if isinstance(out_axes, int):
            return _constrain(outs, mesh, out_axes)
        return tuple(_constrain(o, mesh, a) for o, a in zip(outs, out_axes))

    return run


def _constrain(tree, mesh: Mesh, axis: int):
    """`tree` (site axis at `axis`) constrained to the site layout (`site_shardings`' specs)."""
    leaves, treedef = jax.tree.flatten(tree)
    specs = _leaf_specs(tree, mesh, axis)
    return jax.tree.unflatten(
        treedef, [jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)) for x, s in zip(leaves, specs)]
    )


def average(tree, is_expert, mesh: Mesh):
    """Averages a stacked per-site pytree (leading axis M, sharded over the site axes).

    Args:
      tree: leaves [M, ...], site s's value at index s.
      is_expert: a pytree with `tree`'s structure (or a prefix of it) of Python bools: True for leaves averaged
        over the replica group only, False for leaves averaged over all sites; or None for leaves each site keeps
        (not averaged).
    Returns:
      the averaged tree, same shapes and sharding; integer leaves are returned unchanged.

    With E > 1 devices per site every leaf is in its `site_shardings` layout: an expert-sharded leaf is averaged
    shard by shard (device j of a site with device j of the other sites of the group), and a leaf each of a site's
    devices holds whole is averaged in E slices, device j reducing slice j (the flattened leaf, zero-padded to a
    multiple of E), and all-gathered over the site's devices. The bytes that cross sites per site are then those of
    one device per site (plus the padding, under E elements per leaf).
    """
    spec = PartitionSpec(SITE_AXES)
    leaves, treedef = jax.tree.flatten(tree)
    flags = leaf_flags(is_expert, tree)
    e = devices_per_site(mesh)

    def local(*leaves):  # integer leaves (step counts, expert ids) are never averaged
        return [
            x
            if f is None or not jnp.issubdtype(x.dtype, jnp.inexact)
            else jax.lax.pmean(x, "replica" if f else SITE_AXES)
            for x, f in zip(leaves, flags)
        ]

    if e == 1:
        out = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * len(leaves), out_specs=[spec] * len(leaves))(*leaves)
        return jax.tree.unflatten(treedef, out)
    specs = _leaf_specs(tree, mesh)

    def sliced(*leaves):
        out = []
        for x, f, s in zip(leaves, flags, specs):
            axes = "replica" if f else SITE_AXES
            if f is None or not jnp.issubdtype(x.dtype, jnp.inexact):
                out.append(x)
            elif EXPERT_AXIS in s:  # this device's shard of an expert-sharded leaf
                out.append(jax.lax.pmean(x, axes))
            else:  # device j averages slice j, then the site gathers the slices
                flat = x.reshape(-1)
                flat = jnp.pad(flat, (0, -flat.size % e)).reshape(e, -1)
                part = jax.lax.pmean(flat[jax.lax.axis_index(EXPERT_AXIS)], axes)
                whole = jax.lax.all_gather(part, EXPERT_AXIS, tiled=True)
                out.append(whole[: x.size].reshape(x.shape))
        return out

    out = jax.shard_map(sliced, mesh=mesh, in_specs=tuple(specs), out_specs=list(specs), check_vma=False)(*leaves)
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
