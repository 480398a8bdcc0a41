"""Device mesh, logical-axis sharding rules, and multi-process start.

Parameters and activations name their dimensions with *logical* axes ("batch", "embed", "heads", "mlp", ...).
The config's `mesh.rules` maps each logical axis to zero, one or several *mesh* axes ("site", "data", "expert",
"model"); `logical_to_spec` turns a tuple of logical names into a `PartitionSpec`. The model never names a mesh
axis, so the same model runs data-parallel, tensor-parallel or expert-parallel by changing the config only.

A multi-process run starts with `initialize_distributed`: every process is given `mesh.num_processes`, its own
`mesh.process_id` and process 0's `mesh.coordinator_address`, or runs the same command with `mesh.num_processes = -1`
under a cluster's launcher (`srun`, `mpirun`, ...), which gives all three (`resolve_processes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from core import jax_compat, mesh_config
from core.fields import ConfigError

if TYPE_CHECKING:  # annotations only: the configuration library is core.schema's, not a dependency here
    import ml_collections

__all__ = [
    "CLUSTER_ENVIRONMENTS",
    "Rules",
    "Sharder",
    "initialize_distributed",
    "logical_to_spec",
    "make_mesh",
    "param_shardings",
    "put_global",
    "resolve_processes",
]

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


def make_mesh(config: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the mesh of `config.mesh` over `devices` (default: all devices of all processes).

    Axes are ("site", "data", "expert", "model"), outermost first, all `AxisType.Auto` so that sharding
    annotations (not explicit types) drive the partitioner. Size-1 axes are kept so every rule stays valid.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_config.mesh_shape(config, len(devices))
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
        targets = mesh_config.mesh_axes(table.get(name) if name is not None else None)
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


def put_global(tree, shardings):
    """`jax.device_put(tree, shardings)` for a value every process holds in full (the same on each): each process
    builds only its own devices' shards from its copy, so nothing crosses processes (jax.device_put onto devices of
    several processes sends every process's whole copy to the others; tests/test_links.py checks this function
    sends almost nothing). `shardings`: one Sharding, or a tree of them with `tree`'s structure."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)

    def one(x, sharding):
        return jax.make_array_from_callback(np.shape(x), sharding, lambda index: np.asarray(x[index]))

    return jax.tree.map(one, tree, shardings)


HEARTBEAT_TIMEOUT_SECONDS = 20
"""A process that stops answering the coordination service's heartbeats for this long (it died, or its host did)
brings the others down with an error instead of leaving them blocked in a collective. Under experiments.launch the
launcher gives another value (`HEARTBEAT_TIMEOUT_ENV`)."""

HEARTBEAT_TIMEOUT_ENV = "MESH_HEARTBEAT_TIMEOUT_SECONDS"
"""Whole seconds (set by `experiments.launch`) replacing HEARTBEAT_TIMEOUT_SECONDS: the launcher waits for a paused
process up to its `--site-timeout`, so jax.distributed must not give up on it first."""

ALIVE_ENV = "MESH_ALIVE_FD"
"""A pipe's write end (set by `experiments.launch`) on which this process shows that it runs: one byte every
`ALIVE_BEAT_SECONDS` from a daemon thread, from the start of `initialize_distributed`. The launcher ends the run when
a process stays silent (and uses no CPU time) for longer than its `--site-timeout`; see `_beat`."""

ALIVE_BEAT_SECONDS = 1.0
"""How often a process writes on the `ALIVE_ENV` pipe."""

EXTERNAL_SERVICE_ENV = "MESH_EXTERNAL_COORDINATION_SERVICE"
"""Set to 1 (by `experiments.launch`) when jax.distributed's coordination service runs outside the processes, at
`mesh.coordinator_address`: process 0 then only connects to it, as every other process does. If nothing serves that
address, every process waits for it and fails after jax.distributed's initialization timeout (300 s)."""

PEER_LOST_NOTICE_ENV = "MESH_PEER_LOST_NOTICE_FD"
"""A file descriptor (set by `experiments.launch`) on which the launcher writes one line when another process has
failed, e.g. `process 0 was killed by signal SIGKILL`; see `_exit_on_peer_lost_notice`."""


CLUSTER_ENVIRONMENTS = {
    "OmpiCluster": "Open MPI's mpirun (OMPI_MCA_orte_hnp_uri, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_RANK)",
    "SlurmCluster": "SLURM's srun (SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID)",
    "GceTpuCluster": "a Cloud TPU VM slice (its metadata server)",
    "GkeTpuCluster": "Cloud TPU on GKE (TPU_WORKER_HOSTNAMES or TPU_PROCESS_ADDRESSES)",
    "K8sCluster": "a Kubernetes Job or JobSet (KUBERNETES_SERVICE_HOST, with `pip install jax[k8s]`)",
}
"""What each of jax's cluster environments (`core.jax_compat.cluster_environments`, by class name) is detected by,
for the error of `mesh.num_processes = -1` outside any of them. One this table lacks (a newer jax's) is named by its
class."""

INITIALIZATION_TIMEOUT_SECONDS = 300
"""jax.distributed.initialize's default `initialization_timeout`, which its cluster detection also passes to the
environments that wait for the coordinator's host name to resolve (Kubernetes, Cloud TPU)."""


def resolve_processes(config: ml_collections.ConfigDict) -> None:
    """Fills in, in place, `mesh.num_processes = -1` from the cluster environment that started this process: the
    one place where the config learns the cluster's values. Does nothing when `mesh.num_processes` is given.

    The environment is the one `jax.distributed.initialize()` without arguments would detect (the first of jax's
    cluster environments present, `core.jax_compat`, in jax's order: Open MPI, SLURM, Cloud TPU, Kubernetes), read
    as jax reads it: `mesh.num_processes` <- its process count (SLURM_NTASKS, ...), `mesh.process_id` <- this process's
    index (SLURM_PROCID, ...), `mesh.coordinator_address` <- `JAX_COORDINATOR_ADDRESS` if set, else the environment's
    (SLURM: the step's first node, port 61440 + SLURM_JOB_ID mod 4096, or `JAX_COORDINATOR_PORT`). It runs before
    `jax.distributed` starts, so that whatever reads these keys sees the real values from the start (experiments.run
    takes the workdir's lock in process 0 only, and validates `data.batch_size` against the process count);
    `initialize_distributed` calls it too, then checks that jax.process_count() and jax.process_index() agree. Prints
    one line per process, e.g. `cluster: SlurmCluster: process 1 of 2, coordinator node001:62674`.

    Raises:
      ConfigError: `mesh.process_id` or `mesh.coordinator_address` is also set (see core.mesh_config.check_processes),
        no cluster environment is detected (the message lists those jax detects, by what, and what to do instead),
        or the environment's values are inconsistent.
    """
    mesh = config.mesh
    if mesh.num_processes != mesh_config.FROM_CLUSTER:
        return
    mesh_config.check_processes(mesh)
    environments = _cluster_environments()
    env = jax_compat.present_environment(environments)
    if env is None:
        known = "; ".join(
            f"{e.__name__}: {CLUSTER_ENVIRONMENTS.get(e.__name__, 'see jax')}"
            for e in jax_compat.detectable_environments(environments)
        )
        raise ConfigError(
            "config key 'mesh.num_processes' = -1 takes the processes from the cluster environment, but none is "
            f"detected here. jax {jax.__version__} detects: {known}. Start every process under one of them (e.g. "
            "`srun python -m experiments.run ... --config.mesh.num_processes=-1` in an sbatch script), or give "
            "--config.mesh.num_processes=N, --config.mesh.process_id=i (0..N-1) and "
            "--config.mesh.coordinator_address=host:port (process 0's host) on every process."
        )
    name = env.__name__
    where = f"the cluster environment ({name}: {CLUSTER_ENVIRONMENTS.get(name, 'see jax')})"
    try:
        count, index, address = jax_compat.read_environment(
            env,
            timeout_secs=INITIALIZATION_TIMEOUT_SECONDS,
            coordinator_port=os.environ.get("JAX_COORDINATOR_PORT"),
            coordinator_address=os.environ.get("JAX_COORDINATOR_ADDRESS"),
        )
    except (KeyError, ValueError) as e:
        raise ConfigError(
            f"config key 'mesh.num_processes' = -1: {where} cannot be read ({type(e).__name__}: {e}); check those "
            "variables, or give the three mesh keys by hand."
        ) from None
    if not (isinstance(count, int) and isinstance(index, int) and 0 <= index < count):
        raise ConfigError(
            f"config key 'mesh.num_processes' = -1: {where} gives process {index!r} of {count!r}; an index in "
            "0..count-1 is needed. Check those variables, or give the three mesh keys by hand."
        )
    mesh.num_processes, mesh.process_id, mesh.coordinator_address = count, index, str(address)
    print(f"cluster: {name}: process {index} of {count}, coordinator {address}", flush=True)


def _cluster_environments() -> list[Any]:
    """jax's cluster environments (`core.jax_compat.cluster_environments`), in the order it tries them; ConfigError
    naming the missing symbol where this jax has none this code knows."""
    try:
        return jax_compat.cluster_environments()
    except jax_compat.JaxCompatError as e:
        raise ConfigError(
            f"config key 'mesh.num_processes' = -1 needs jax's cluster detection: {e}; give mesh.num_processes, "
            "mesh.process_id and mesh.coordinator_address by hand."
        ) from None


def initialize_distributed(config: ml_collections.ConfigDict) -> None:
    """Starts `jax.distributed` when `mesh.num_processes > 1` or `-1` (must run before any other JAX call).

    `mesh.num_processes = -1` is first resolved from the cluster environment (`resolve_processes`; a no-op if the
    caller already did), so the config holds this process's real index and the process count from here on; after
    the start, jax.process_count() and jax.process_index() are checked against them. A cluster of one process then
    starts nothing, as `num_processes = 1` does.

    On CPU the cross-process collectives use gloo, the same engine a CPU cluster would use; on a cluster each host
    runs one process with the same `mesh.coordinator_address` and its own `mesh.process_id`, or every process runs
    the same command with `mesh.num_processes = -1` under the cluster's launcher (srun, mpirun). `local_device_ids`
    is left to jax: where the environment gives a local rank (SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK) jax makes
    only that one GPU visible to the process (one process per GPU); `JAX_LOCAL_DEVICE_IDS=0,1,...` gives a process
    more (one process per host).

    A process learns that another one died from the collective that fails (`core.train.run` raises PeerLostError,
    naming the last checkpoint), or, waiting at a coordination barrier (a checkpoint's, jax.distributed's start),
    only from the coordination service's heartbeat timeout (`HEARTBEAT_TIMEOUT_SECONDS`), at which jaxlib aborts it
    like a lost coordinator (below). Under experiments.launch, which sees a process die at once, such a process is
    told by the launcher instead (`PEER_LOST_NOTICE_ENV`) and exits with an `error:` line and status 1.

    A process that stops answering without dying (stopped by SIGSTOP, a suspended VM) is, for jax.distributed, lost
    once it misses `HEARTBEAT_TIMEOUT_SECONDS` of heartbeats: jaxlib then aborts every process. Under
    experiments.launch the timeout is the launcher's (`HEARTBEAT_TIMEOUT_ENV`, above its `--site-timeout`) and this
    process shows the launcher that it runs (`ALIVE_ENV`): a paused process is waited for up to `--site-timeout` and
    the run goes on; beyond it the launcher ends the run with one line naming it (experiments.cluster.supervisor).

    The coordination service runs in process 0, unless `EXTERNAL_SERVICE_ENV` says another process serves it (see
    `_service_elsewhere`). Where it runs matters when process 0 dies: the others' coordination clients then lose the
    service and jaxlib aborts them at once (LOG(FATAL): SIGABRT and a C++ stack trace; jaxlib's
    `missed_heartbeat_callback` cannot replace that from Python, it aborts with std::bad_cast when called). With the
    service elsewhere, process 0 is a lost peer like any other: the survivors' next collective fails and
    `core.train.run` stops them with `PeerLostError` (exit status 1 from experiments.run).

    jax's preemption service is turned off: its notifier replaces the process's SIGTERM handler with one that only
    records a preemption notice, so a SIGTERM (from experiments.launch, a scheduler, a user) would not stop the
    process. Nothing here uses preemption sync points.

    Raises:
      ConfigError: from `resolve_processes`.
      RuntimeError: jax.distributed started with another process count or index than the config's.
    """
    resolve_processes(config)
    mesh = config.mesh
    if mesh.num_processes == 1:
        return
    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if "jax_enable_preemption_service" in jax.config.values:
        jax.config.update("jax_enable_preemption_service", False)
    notice_fd = os.environ.get(PEER_LOST_NOTICE_ENV, "")
    if notice_fd.isdigit() and _is_open(int(notice_fd)):  # (not one inherited from a launcher's process)
        _exit_on_peer_lost_notice(int(notice_fd), mesh.process_id)
    alive_fd = os.environ.get(ALIVE_ENV, "")
    if alive_fd.isdigit() and _is_open(int(alive_fd)):
        _beat(int(alive_fd))
    heartbeat = os.environ.get(HEARTBEAT_TIMEOUT_ENV, "")
    heartbeat_seconds = int(heartbeat) if heartbeat.isdigit() and int(heartbeat) > 0 else HEARTBEAT_TIMEOUT_SECONDS
    external = os.environ.get(EXTERNAL_SERVICE_ENV) == "1"
    logging.info(
        "jax.distributed: process %d of %d, coordinator %s%s",
        mesh.process_id,
        mesh.num_processes,
        mesh.coordinator_address,
        " (an external service)" if external else "",
    )
    with _service_elsewhere() if external and mesh.process_id == 0 else contextlib.nullcontext():
        jax.distributed.initialize(
            coordinator_address=mesh.coordinator_address,
            num_processes=mesh.num_processes,
            process_id=mesh.process_id,
            heartbeat_timeout_seconds=heartbeat_seconds,
        )
    started = (jax.process_count(), jax.process_index())
    if started != (mesh.num_processes, mesh.process_id):
        raise RuntimeError(
            f"jax.distributed started process {started[1]} of {started[0]}, but the config says mesh.process_id = "
            f"{mesh.process_id} of mesh.num_processes = {mesh.num_processes}"
        )


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _exit_on_peer_lost_notice(fd: int, process_id: int) -> None:
    """Starts a daemon thread that waits for the launcher's line on `fd` (it runs while the main thread is blocked
    in jaxlib), then prints `error: ...` with it to stderr and exits with status 1 (`os._exit`: a normal exit would
    wait in jax.distributed's shutdown barrier for the lost process). End of file (the launcher is gone: it then
    stops this process with SIGTERM) ends the thread quietly."""

    def wait() -> None:
        with os.fdopen(fd, "rb") as notices:
            line = notices.readline().decode(errors="replace").strip()
        if line:
            print(
                f"error: process {process_id} stops: {line} (experiments.launch): another process has probably died "
                "or failed; rerun the same command on every process to resume from the last checkpoint",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)

    threading.Thread(target=wait, name="peer-lost-notice", daemon=True).start()


def _beat(fd: int) -> None:
    """Starts a daemon thread that writes one byte on `fd` every ALIVE_BEAT_SECONDS (never blocking: a full pipe
    skips a beat) and ends quietly when nobody reads it any more (the launcher is gone). A stopped process (SIGSTOP, a
    suspended VM) writes nothing; so does one whose interpreter is held (the launcher then also sees its CPU time)."""
    os.set_blocking(fd, False)

    def beat() -> None:
        while True:
            try:
                os.write(fd, b".")
            except BlockingIOError:
                pass
            except OSError:  # EPIPE, EBADF: nobody listens
                return
            time.sleep(ALIVE_BEAT_SECONDS)

    threading.Thread(target=beat, name="alive-beat", daemon=True).start()


@contextlib.contextmanager
def _service_elsewhere() -> Iterator[None]:
    """Within the block, `jax.distributed.initialize` in process 0 does not start a coordination service (another
    process serves it) and only connects to it, like the other processes (`core.jax_compat`'s
    `without_coordination_service`). Where jax's internals differ this raises ConfigError (a clear `error:` line
    from experiments.run) rather than starting a second service on the launcher's port."""
    try:
        skipped = jax_compat.without_coordination_service()
    except jax_compat.JaxCompatError as e:
        raise ConfigError(
            f"{EXTERNAL_SERVICE_ENV}=1 asks process 0 not to start jax.distributed's coordination service "
            f"(experiments.launch serves it), but this jax offers no way to skip it: {e}"
        ) from None
    with skipped:
        yield
