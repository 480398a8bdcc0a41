"""FoMoE rounds: K local steps on every site, then synchronisation (docs/fomoe.md,
"Synchronisation (one round)").

All sites run in one jitted program: their states are stacked along a leading site axis (sharded over the
(replica, block) site mesh of `moe.federation`), the local step is the core train step under `jax.vmap`, the K
steps are a `lax.scan`, and the synchronisation averages

  * dense parameters over all M sites and expert parameters over their O_e-site replica group, then
  * "local_adamw": also both AdamW moments (the paper's better choice; about 3x the bytes); the averaged
    parameters start the next round;
  * "diloco": outer gradient Delta = theta_start - theta_avg and an outer Nesterov step (`optim.diloco_outer`);
    the inner AdamW state stays with each site.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from core import train as train_lib
from core.mesh import put_global
from core.model import split_params
from moe import federation

__all__ = ["OUTER_METHODS", "FederatedState", "init_sites", "make_round", "make_round_parts", "site_batches"]

OUTER_METHODS = ("local_adamw", "diloco")


class FederatedState(NamedTuple):
    """train: the stacked per-site TrainState (its parameters are the synchronised ones a round starts from, its
    step counts the local steps done, K per round); outer: the outer optimizer's stacked state (DiLoCo momentum;
    empty for LocalAdamW)."""

    train: train_lib.TrainState
    outer: Any


def init_sites(
    global_model: nnx.Module,
    site_model: nnx.Module,
    placement,
    optimizer: optax.GradientTransformation,
    outer: optax.GradientTransformation | None,
    mesh,
    seed: int,
) -> tuple[Any, FederatedState]:
    """Every site's initial state from one model holding all experts, so replicas of an expert start equal.

    Args:
      global_model: the model with all N_e experts per MoE layer (its initial weights are the federation's).
      site_model: the same architecture built with `resident=placement.experts[0]` (its graph serves all sites).
      placement: a `moe.placement.Placement`.
      outer: the outer optimizer for DiLoCo, or None.
      mesh: the site mesh, or None to leave the state on the default device (e.g. to restore a checkpoint into).
    Returns:
      (site graphdef, FederatedState with every leaf's leading axis M sharded over the site mesh).
    """
    _, params, _ = split_params(global_model)
    graphdef, _, rest = split_params(site_model)
    params = federation.to_sites(params, placement.experts)
    rest = federation.to_sites(rest, placement.experts)
    sites = placement.sites
    keys = jax.vmap(lambda s: jax.random.fold_in(jax.random.PRNGKey(seed), s))(jnp.arange(sites))
    train = train_lib.TrainState(jnp.zeros((sites,), jnp.int32), params, rest, jax.vmap(optimizer.init)(params), keys)
    outer_state = jax.vmap(outer.init)(params) if outer is not None else ()
    state = FederatedState(train, outer_state)
    if mesh is None:
        return graphdef, state
    # each process places only its sites' slices: jax.device_put would send each process's whole copy to the others
    return graphdef, put_global(state, federation.site_shardings(state, mesh))


def make_round(
    graphdef,
    optimizer: optax.GradientTransformation,
    mesh,
    *,
    method: str,
    outer: optax.GradientTransformation | None = None,
    loss_fn: Callable = train_lib.lm_loss,
    state_metrics: train_lib.StateMetrics | None = None,
) -> jax.stages.Wrapped:
    """A jitted `(state, tokens [K, M, B_site, T + 1]) -> (state, metrics)`: K local steps on every site, then the
    synchronisation of `method`. Metrics are the train-step metrics of every step and site, [K, M] each (averaged
    on the host, so the program's only cross-site collectives are the synchronisation's).
    """
    local_steps, sync = _round_parts(graphdef, optimizer, mesh, method, outer, loss_fn, state_metrics)

    def round_fn(state: FederatedState, tokens: jax.Array):
        train, metrics = local_steps(state.train, tokens)
        return sync(state.train.params, state.outer, train), metrics

    return jax.jit(round_fn, donate_argnums=0)


def make_round_parts(
    graphdef,
    optimizer: optax.GradientTransformation,
    mesh,
    *,
    method: str,
    outer: optax.GradientTransformation | None = None,
    loss_fn: Callable = train_lib.lm_loss,
    state_metrics: train_lib.StateMetrics | None = None,
) -> tuple[jax.stages.Wrapped, jax.stages.Wrapped]:
    """`make_round`'s round as two jitted programs, so that a driver can time its compute and its synchronisation
    apart (experiments.federated); `sync(start, outer, *local(params, others, tokens)[:1])` is the round:

        local(params, others, tokens) -> (train, metrics)   K local steps; `others`: the TrainState, params None
        sync(start, outer, train) -> FederatedState          the synchronisation; `start`: the parameters the round
                                                             started from (DiLoCo's outer gradient), else None

    Both donate what the round no longer needs (DiLoCo's `start` is kept through the local steps)."""
    local_steps, sync = _round_parts(graphdef, optimizer, mesh, method, outer, loss_fn, state_metrics)
    local = jax.jit(
        lambda params, others, tokens: local_steps(others._replace(params=params), tokens),
        donate_argnums=(1,) if method == "diloco" else (0, 1),
    )
    return local, jax.jit(sync, donate_argnums=(0, 1, 2))


def _round_parts(graphdef, optimizer, mesh, method, outer, loss_fn, state_metrics) -> tuple[Callable, Callable]:
    """(local_steps(train, tokens) -> (train, metrics), sync(start, outer_state, train) -> FederatedState)."""
    if method not in OUTER_METHODS:
        raise ValueError(f"outer method = {method!r}; allowed: {list(OUTER_METHODS)}.")
    if (method == "diloco") != (outer is not None):
        raise ValueError("method 'diloco' needs its outer optimizer (optim.diloco_outer); 'local_adamw' takes none.")
    step = train_lib.train_step_fn(graphdef, optimizer, loss_fn, state_metrics=state_metrics)
    # one site's K steps (tokens [K, B_site, T + 1]), on its own device (federation.per_site)
    local_steps = federation.per_site(lambda train, tokens: jax.lax.scan(step, train, tokens), mesh, (0, 1), (0, 1))

    def sync(start: Any, outer_state: Any, train: train_lib.TrainState) -> FederatedState:
        flags = federation.expert_flags(train.params)
        averaged = federation.average(train.params, flags, mesh)
        if method == "local_adamw":
            opt_state = federation.average(
                train.opt_state, moment_flags(optimizer, train.opt_state, train.params), mesh
            )
            params = averaged
        else:
            assert outer is not None  # checked above: diloco has its outer optimizer
            delta = jax.tree.map(lambda s, a: s - a, start, averaged)
            updates, outer_state = jax.vmap(outer.update)(delta, outer_state, start)
            params, opt_state = optax.apply_updates(start, updates), train.opt_state
        return FederatedState(train._replace(params=params, opt_state=opt_state), outer_state)

    return local_steps, sync


def moment_flags(optimizer: optax.GradientTransformation, opt_state: Any, params: Any) -> Any:
    """LocalAdamW's averaging of `optimizer`'s state: the leaves that mirror a parameter (Adam's moments, Lion's and
    Muon's momentum; which ones is what `optimizer.init` says, core.train.optimizer_state_like) are averaged like
    that parameter (True: expert, over its replica group; False: dense, over all sites); the others (step counts,
    MGUP's selected fraction, injected hyperparameters) are each site's own (None), identical across sites or a
    per-site statistic, and cost no bytes. `opt_state` and `params` may be stacked per site ([M, ...] leaves)."""
    flags = jax.tree.unflatten(jax.tree.structure(params), jax.tree.leaves(federation.expert_flags(params)))
    return train_lib.optimizer_state_like(optimizer, opt_state, params, flags, None)


def site_batches(tokens: np.ndarray, sites: int) -> np.ndarray:
    """[K, M B_site, T + 1] global batches (each a pure function of its step) -> [K, M, B_site, T + 1]: site s
    takes rows s B_site .. (s + 1) B_site - 1 of every step's batch."""
    k, rows, length = tokens.shape
    if rows % sites:
        raise ValueError(f"a global batch of {rows} sequences cannot be split over {sites} sites.")
    return tokens.reshape(k, sites, rows // sites, length)


def make_probe(graphdef, mesh) -> jax.stages.Wrapped:
    """A jitted `(params, rest, tokens [B, T]) -> routes [M, L_moe, B T, k]`: every site's chosen global expert ids
    in every MoE layer on a fixed probe batch (for the routing agreement between rounds)."""

    def one_site(params, rest, tokens):
        _, aux, _ = nnx.merge(graphdef, params, rest)(tokens, intermediates=True)
        return jnp.stack(aux["intermediates"]["routes"])

    return jax.jit(federation.per_site(one_site, mesh, (0, 0, None)))


def topk_agreement(previous: np.ndarray, current: np.ndarray) -> float:
    """Mean over sites, layers and tokens of |chosen now ∩ chosen before| / k (1 = the same experts)."""
    previous, current = np.asarray(previous), np.asarray(current)
    same = (previous[..., :, None] == current[..., None, :]).any(-1)
    return float(same.mean())
