"""The one module that touches private JAX internals: jax's cluster detection (`jax._src.clusters`) and its
coordination service (`jax._src.distributed`, `jaxlib._jax`), behind a small API.

Every private symbol used is listed once, in `PRIVATE_SYMBOLS`, and resolved through `resolve`: a JAX that lacks one
raises `JaxCompatError` naming the symbol, what it is used for and the installed jax and jaxlib versions, instead of
failing somewhere else or, worse, behaving differently. tests/test_jax_compat.py resolves every entry of the list
against the installed JAX, so a release that drops or renames one fails there first.

Importing this module imports no JAX: each function imports what it resolves when it is called (the launcher's
supervisor, experiments.cluster.supervisor, needs jaxlib's coordination service without importing jax).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

__all__ = [
    "PRIVATE_SYMBOLS",
    "JaxCompatError",
    "Symbol",
    "cluster_environments",
    "coordination_service_factory",
    "detectable_environments",
    "lookup",
    "present_environment",
    "quiet_jaxlib_logs",
    "read_environment",
    "resolve",
    "versions",
    "without_coordination_service",
]


class Symbol(NamedTuple):
    """A private JAX symbol: `attribute` (dotted: `ClusterEnv._cluster_types`) of the module `module`, and what this
    project uses it for (named in the error when it is missing)."""

    module: str
    attribute: str
    used_for: str

    def __str__(self) -> str:
        return f"{self.module}.{self.attribute}"


_CLUSTERS = "jax._src.clusters"
PRIVATE_SYMBOLS: tuple[Symbol, ...] = (
    Symbol(_CLUSTERS, "ClusterEnv._cluster_types", "the cluster environments jax.distributed detects, in its order"),
    Symbol(_CLUSTERS, "ClusterEnv.opt_in_only_method", "whether jax detects an environment by itself"),
    Symbol(_CLUSTERS, "ClusterEnv.is_env_present", "whether an environment started this process"),
    Symbol(_CLUSTERS, "ClusterEnv.get_process_count", "the number of processes an environment gives"),
    Symbol(_CLUSTERS, "ClusterEnv.get_process_id", "this process's index in an environment"),
    Symbol(_CLUSTERS, "ClusterEnv.get_coordinator_address", "the coordinator address an environment gives"),
    Symbol(
        "jax._src.distributed",
        "_jax.get_distributed_runtime_service",
        "starting jax.distributed in process 0 without its coordination service (another process serves it)",
    ),
    Symbol("jaxlib._jax", "get_distributed_runtime_service", "hosting the coordination service in the launcher"),
    Symbol("jaxlib.utils", "absl_set_min_log_level", "silencing jaxlib's INFO lines in the launcher"),
    Symbol(
        _CLUSTERS,
        "ClusterEnv.auto_detect_unset_distributed_params",
        "checking (tests/test_cluster.py) that core.mesh reads an environment as jax.distributed does",
    ),
    Symbol(
        "jax._src.distributed",
        "global_state.client",
        "the coordination-service client (tests/test_launch.py waits at a barrier no process reaches)",
    ),
)
"""Every private JAX symbol this project uses (tests/test_jax_compat.py checks each against the installed JAX)."""


class JaxCompatError(RuntimeError):
    """The installed JAX lacks a private symbol this project uses; the message names it and the versions."""


def versions() -> str:
    """The installed jax and jaxlib versions, e.g. `jax 0.10.2, jaxlib 0.10.2` (from the package metadata, without
    importing either)."""

    def one(name: str) -> str:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            return f"{name} (not installed)"

    return f"{one('jax')}, {one('jaxlib')}"


def resolve(symbol: Symbol) -> Any:
    """The object `symbol` names in the installed JAX (its module is imported). Raises JaxCompatError naming the
    symbol, its use and the installed versions when the module or an attribute is missing."""
    try:
        value: Any = importlib.import_module(symbol.module)
    except ImportError as e:
        raise _missing(symbol, f"its module does not import: {e}") from None
    for part in symbol.attribute.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise _missing(symbol, f"it has no {part!r}") from None
    return value


def _missing(symbol: Symbol, why: str) -> JaxCompatError:
    return JaxCompatError(
        f"{versions()}: the private symbol `{symbol}` ({symbol.used_for}) is missing ({why}); core/jax_compat.py "
        "needs updating for this JAX, or install a jax within pyproject.toml's bounds"
    )


def lookup(name: str) -> Any:
    """`resolve` of the symbol of PRIVATE_SYMBOLS whose dotted name is `name` (`jax._src.clusters.ClusterEnv`...).
    Raises JaxCompatError as `resolve` does, and AssertionError for a name the list lacks: every symbol used is
    listed, so that tests/test_jax_compat.py checks it."""
    symbol = next((s for s in PRIVATE_SYMBOLS if str(s) == name), None)
    if symbol is None:
        raise AssertionError(f"{name} is not listed in core.jax_compat.PRIVATE_SYMBOLS")
    return resolve(symbol)


# --------------------------------------------------------------------------- cluster detection


def cluster_environments() -> list[type]:
    """jax's cluster environments (the classes `jax.distributed.initialize()` without arguments tries), in its
    order: Open MPI, SLURM, Cloud TPU, Kubernetes, ... Raises JaxCompatError when jax has none this code knows."""
    for method in ("opt_in_only_method", "is_env_present", "get_process_count", "get_process_id"):
        lookup(f"{_CLUSTERS}.ClusterEnv.{method}")  # what the functions below call: checked before anything is read
    lookup(f"{_CLUSTERS}.ClusterEnv.get_coordinator_address")
    environments = list(lookup(f"{_CLUSTERS}.ClusterEnv._cluster_types"))
    if not environments:
        raise JaxCompatError(f"{versions()}: `{_CLUSTERS}.ClusterEnv._cluster_types` lists no cluster environment")
    return environments


def detectable_environments(environments: list[type]) -> list[type]:
    """The environments jax detects by itself: not opt-in ones (mpi4py), nor bases others derive from (jax's
    `BaseTpuCluster`, never present itself)."""
    return [
        e
        for e in environments
        if not getattr(e, "opt_in_only_method", False)
        and not any(o is not e and issubclass(o, e) for o in environments)
    ]


def present_environment(environments: list[type]) -> type | None:
    """The first of `environments` that jax detects by itself and that started this process, or None."""
    found: list[Any] = [e for e in environments if not getattr(e, "opt_in_only_method", False)]
    return next((e for e in found if e.is_env_present()), None)


def read_environment(
    environment: type, *, timeout_secs: int, coordinator_port: str | None, coordinator_address: str | None = None
) -> tuple[int, int, str]:
    """(process count, this process's index, the coordinator's address) as `environment` gives them, read as
    jax.distributed reads them. A non-empty `coordinator_address` is used as given and the environment is not
    asked for one; else `coordinator_port` overrides the environment's port and `timeout_secs` bounds the wait for
    the coordinator's host name where the environment waits. Raises what the environment raises for missing or
    malformed variables (KeyError, ValueError)."""
    env: Any = environment
    count, index = env.get_process_count(), env.get_process_id()
    address = coordinator_address or env.get_coordinator_address(
        timeout_secs=timeout_secs, override_coordinator_port=coordinator_port
    )
    return count, index, address


# --------------------------------------------------------------------------- the coordination service

_SERVICE = "get_distributed_runtime_service"


def without_coordination_service() -> contextlib.AbstractContextManager[None]:
    """A context within which `jax.distributed.initialize` in process 0 starts no coordination service (another
    process serves it) and only connects to it, like the other processes.

    `jax.distributed.initialize` has no option for this: it starts the service whenever `process_id == 0`. So for
    the duration of the block the jaxlib module `jax._src.distributed` calls (`_jax`) is bound to a proxy whose
    `get_distributed_runtime_service` returns a stand-in (its `shutdown` does nothing); every other attribute is
    jaxlib's. The symbol is resolved here, before the block: JaxCompatError when jax lacks it, rather than starting
    a second service on the other process's port.
    """
    lookup(f"jax._src.distributed._jax.{_SERVICE}")
    return _swapped(importlib.import_module("jax._src.distributed"), "_jax")


@contextlib.contextmanager
def _swapped(module: Any, name: str) -> Iterator[None]:
    lib = getattr(module, name)
    setattr(module, name, _WithoutService(lib))
    try:
        yield
    finally:
        setattr(module, name, lib)


class _WithoutService:
    """Stands for jaxlib's `_jax` module, except that `get_distributed_runtime_service` starts nothing."""

    def __init__(self, lib: Any):
        self._lib = lib

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def get_distributed_runtime_service(self, *args: Any, **kwargs: Any) -> _NoService:
        return _NoService()


class _NoService:
    """The stand-in for the service process 0 does not run: jax.distributed's shutdown calls `shutdown` on it."""

    def shutdown(self) -> None:
        pass


def coordination_service_factory() -> Callable[..., Any]:
    """jaxlib's `get_distributed_runtime_service` (what `jax.distributed.initialize` calls in process 0 to start the
    coordination service), importing jaxlib only (not jax). Raises JaxCompatError where jaxlib lacks it or does not
    import."""
    factory: Callable[..., Any] = lookup(f"jaxlib._jax.{_SERVICE}")
    return factory


def quiet_jaxlib_logs() -> None:
    """Turns jaxlib's INFO log lines (a coordination service starting and stopping) off in this process. Raises
    JaxCompatError where jaxlib lacks the switch."""
    lookup("jaxlib.utils.absl_set_min_log_level")(1)
