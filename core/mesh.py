"""Device mesh, logical-axis sharding rules, and multi-process start.

Parameters and activations name their dimensions with *logical* axes ("batch", "embed", "heads", "mlp", ...).
The config's `mesh.rules` maps each logical axis to zero, one or several *mesh* axes ("site", "data", "expert",
"model"); `logical_to_spec` turns a tuple of logical names into a `PartitionSpec`. The model never names a mesh
axis, so the same model runs data-parallel, tensor-parallel or expert-parallel by changing the config only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from core import config as config_lib

__all__ = ["Rules", "Sharder", "initialize_distributed", "logical_to_spec", "make_mesh", "param_shardings"]

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


def make_mesh(config: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the mesh of `config.mesh` over `devices` (default: all devices of all processes).

    Axes are ("site", "data", "expert", "model"), outermost first, all `AxisType.Auto` so that sharding
    annotations (not explicit types) drive the partitioner. Size-1 axes are kept so every rule stays valid.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = config_lib.mesh_shape(config, len(devices))
    n = int(np.prod(list(shape.values())))
    return jax.make_mesh(
        tuple(shape.values()), tuple(shape), axis_types=(AxisType.Auto,) * len(shape), devices=devices[:n]
    )


def logical_to_spec(axes: Sequence[str | None], rules: Rules, mesh: Mesh | None = None) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec by `rules`.

    A logical name absent from the rules (or None) is replicated. A mesh axis is used at most once per spec
    (the first logical axis that claims it wins); mesh axes of size 1 in `mesh` are dropped, which keeps specs
    short and valid for any dimension size.
    """
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name in axes:
        targets = config_lib.mesh_axes(table.get(name) if name is not None else None)
        keep = tuple(t for t in targets if t not in used and (mesh is None or mesh.shape[t] > 1))
        used.update(keep)
        spec.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    return PartitionSpec(*spec)


@dataclasses.dataclass(frozen=True)
class Sharder:
    """Applies logical-axis sharding constraints to activations; a no-op without a mesh.

    Hashable and static, so modules may hold one: `x = shard(x, ("batch", "seq", "embed"))`.
    """

    mesh: Mesh | None = None
    rules: Rules = ()

    def __call__(self, x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
        if self.mesh is None or self.mesh.size == 1:
            return x
        if len(axes) != x.ndim:
            raise ValueError(f"logical axes {tuple(axes)} do not match an array of rank {x.ndim}")
        return jax.lax.with_sharding_constraint(x, self.named(axes))

    def named(self, axes: Sequence[str | None]) -> NamedSharding:
        """The NamedSharding of an array whose dimensions carry the logical `axes`."""
        if self.mesh is None:
            raise ValueError("Sharder.named needs a mesh")
        return NamedSharding(self.mesh, logical_to_spec(axes, self.rules, self.mesh))


def param_shardings(state, sharder: Sharder):
    """The nnx.State of NamedShardings for a State whose Variables carry `axes` metadata (replicated where absent)."""

    def one(v: nnx.Variable):
        axes = getattr(v, "axes", None)
        return v.replace(sharder.named((None,) * np.ndim(v.get_value()) if axes is None else axes))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


HEARTBEAT_TIMEOUT_SECONDS = 20
"""A process that stops answering the coordination service's heartbeats for this long (it died, or its host did)
brings the others down with an error instead of leaving them blocked in a collective."""


def initialize_distributed(config: ml_collections.ConfigDict) -> None:
    """Starts `jax.distributed` when `mesh.num_processes > 1` (must run before any other JAX call).

    On CPU the cross-process collectives use gloo, the same engine a CPU cluster would use; on a cluster each host
    runs one process with the same `mesh.coordinator_address` and its own `mesh.process_id`.
    """
    mesh = config.mesh
    if mesh.num_processes == 1:
        return
    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    logging.info(
        "jax.distributed: process %d of %d, coordinator %s",
        mesh.process_id,
        mesh.num_processes,
        mesh.coordinator_address,
    )
    jax.distributed.initialize(
        coordinator_address=mesh.coordinator_address,
        num_processes=mesh.num_processes,
        process_id=mesh.process_id,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_SECONDS,
    )
