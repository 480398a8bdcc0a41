"""The mesh section's arithmetic and checks: the mesh axis names, the default logical-axis rules, the axis sizes
resolved against the devices, and the process keys of a multi-process run. Pure Python (no JAX): a config is
checked before anything is imported or compiled."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from core.fields import ConfigError

if TYPE_CHECKING:  # annotations only: the configuration library is core.schema's, not a dependency here
    import ml_collections

__all__ = [
    "DEFAULT_RULES",
    "FROM_CLUSTER",
    "MESH_AXES",
    "check_processes",
    "check_rules",
    "mesh_axes",
    "mesh_shape",
    "resolve_mesh_shape",
    "rule_mesh_axes",
]

# Logical axis -> mesh axes. Parameters and activations name their dimensions with the logical axes on the left;
# a rule maps each to zero, one or several mesh axes (a tuple shards the dimension over their product).
DEFAULT_RULES = (
    ("batch", ("site", "data", "expert")),
    ("seq", None),
    ("embed", None),
    ("vocab", "model"),
    ("heads", "model"),
    ("kv_heads", "model"),
    ("mlp", "model"),
    ("expert", "expert"),
)


def resolve_mesh_shape(mesh_cfg, num_devices: int | None) -> dict[str, int]:
    """The mesh section's axis sizes {axis: size}, its -1 entry resolved against `num_devices` (left -1 when
    `num_devices` is None). Raises ConfigError naming the keys for a size 0, two -1 entries, or a mesh the devices
    cannot hold."""
    sizes = {axis: int(mesh_cfg[axis]) for axis in MESH_AXES}
    for axis, size in sizes.items():
        if size == 0:
            raise ConfigError(f"config key 'mesh.{axis}' = 0; a mesh axis has size >= 1, or -1 for the rest.")
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ConfigError(
            f"config keys {', '.join('mesh.' + a for a in free)} are all -1; at most one mesh "
            "axis may take the remaining devices."
        )
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if num_devices is None:
        return sizes
    if free:
        if num_devices % fixed:
            raise ConfigError(
                f"config key 'mesh.{free[0]}' = -1 cannot take the remaining devices: the other "
                f"axes use {fixed} and {num_devices} devices are not a multiple of that."
            )
        sizes[free[0]] = num_devices // fixed
    elif fixed > num_devices:
        federated = (
            f" (mesh.site = {sizes['site']} makes it a federated run: mesh.expert devices per site; "
            "--config.mesh.site=1 trains without federation)"
            if sizes["site"] > 1
            else ""
        )
        raise ConfigError(
            f"the mesh {sizes} needs {fixed} devices but only {num_devices} are available; "
            f"lower mesh.site/data/expert/model{federated}."
        )
    return sizes


MESH_AXES = ("site", "data", "expert", "model")
"""Mesh axis names, outermost first (slow links outermost: sites, then data, expert and model parallelism)."""


def mesh_shape(config: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
    """The mesh axis sizes {axis: size} with -1 resolved against `num_devices`."""
    return resolve_mesh_shape(config.mesh, num_devices)


FROM_CLUSTER = -1
"""`mesh.num_processes = FROM_CLUSTER` (-1): the number of processes, this process's index and the coordinator's
address come from the cluster environment that started the process (`core.mesh.resolve_processes`)."""


def check_processes(mesh_cfg) -> None:
    """Checks the process keys of the mesh section (`num_processes`, `process_id`, `coordinator_address`) and raises
    ConfigError naming them.

    With `num_processes = -1` (FROM_CLUSTER) the cluster environment gives `process_id` and `coordinator_address`,
    so both must keep their defaults (0 and ''; an explicit `process_id=0` cannot be told from the default), and the
    checks that need the number of processes (`process_id` below it, `data.batch_size` divisible by it) wait until
    `core.mesh.resolve_processes` has filled in the cluster's values: validate again then (experiments.run does).
    """
    n = mesh_cfg.num_processes
    if n == 0:
        raise ConfigError(
            "config key 'mesh.num_processes' = 0; give the number of processes (>= 1), or -1 to take them from the "
            "cluster environment (srun, mpirun, ...)."
        )
    if n == FROM_CLUSTER:
        given = [
            f"'mesh.{key}' = {mesh_cfg[key]!r}"
            for key, default in (("process_id", 0), ("coordinator_address", ""))
            if mesh_cfg[key] != default
        ]
        if given:
            raise ConfigError(
                f"config key{'s' if len(given) > 1 else ''} {' and '.join(given)} set, but 'mesh.num_processes' = -1 "
                "takes this process's index and the coordinator's address from the cluster environment (e.g. "
                "SLURM_PROCID and the job's first node); remove "
                f"{'them' if len(given) > 1 else 'it'}, or give all three keys by hand with mesh.num_processes = N."
            )
        return
    if mesh_cfg.process_id >= n:
        raise ConfigError(f"config key 'mesh.process_id' = {mesh_cfg.process_id} must be < 'mesh.num_processes' = {n}.")
    if n > 1 and not mesh_cfg.coordinator_address:
        raise ConfigError(
            f"config key 'mesh.coordinator_address' is empty but 'mesh.num_processes' = {n}; give host:port of "
            "process 0 (e.g. 127.0.0.1:12355), or set mesh.num_processes = -1 under a cluster's launcher (srun, "
            "mpirun) to take all three from it."
        )


def mesh_axes(target) -> tuple[str, ...]:
    """A rule's target (or a PartitionSpec entry) as a tuple of mesh axes: None -> (), "data" -> ("data",)."""
    return () if target is None else (target,) if isinstance(target, str) else tuple(target)


def rule_mesh_axes(rules, logical: str) -> tuple[str, ...]:
    """The mesh axes `rules` map the logical axis `logical` to (() when it is replicated)."""
    return mesh_axes(dict(rules).get(logical))


def check_rules(rules: Any) -> None:
    """Raises ConfigError naming `mesh.rules` unless every rule is (logical axis name, mesh axis | tuple of mesh
    axes | None) over MESH_AXES and no logical axis is mapped twice."""
    for i, rule in enumerate(rules):
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ConfigError(
                f"config key 'mesh.rules'[{i}] = {rule!r}; each rule is (logical axis name, "
                "mesh axis | tuple of mesh axes | None)."
            )
        for t in mesh_axes(rule[1]):
            if t not in MESH_AXES:
                raise ConfigError(
                    f"config key 'mesh.rules'[{i}] = {tuple(rule)!r} names mesh axis {t!r}; "
                    f"mesh axes are {list(MESH_AXES)}."
                )
    names = [r[0] for r in rules]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ConfigError(f"config key 'mesh.rules' maps the logical axes {dups} more than once.")
