"""The training state's layout: the step-0 `TrainState` built directly in its shardings, its shapes and
shardings without building it, and the optimizer state's shardings derived from the parameters'."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from core.mesh import Sharder, param_shardings
from core.model import split_params
from core.train.step import TrainState

__all__ = ["init_state", "optimizer_state_like", "state_layout"]


def init_state(
    model_fn: Callable[[nnx.Rngs], nnx.Module],
    optimizer: optax.GradientTransformation,
    seed: int,
    sharder: Sharder,
    *,
    init_params: Callable[[nnx.State, nnx.State], nnx.State] | None = None,
) -> tuple[Any, TrainState]:
    """Builds the model and optimizer state directly in their shardings: (graphdef, TrainState at step 0).

    Everything is created inside one `jax.jit` whose output shardings come from the parameters' logical `axes`
    metadata, so no device ever holds a full copy of a sharded parameter. Optimizer-state leaves that mirror a
    parameter (Adam's moments) get that parameter's sharding; the rest (step counts) are replicated
    (`optimizer_state_like`).

    Args:
      init_params: the parameters to start from instead of `model_fn`'s random ones (pretrained weights):
        `init_params(abstract params, their shardings) -> params` (an nnx.State shaped like the first, each array
        already in its sharding). The random parameters are then never computed.
    """
    graphdef, shapes, shardings = state_layout(model_fn, optimizer, seed, sharder)

    @functools.partial(jax.jit, out_shardings=shardings, donate_argnums=0)
    def make(given):
        _, params, rest = split_params(model_fn(nnx.Rngs(seed)))  # unused random parameters are dead code
        params = params if given is None else given
        return TrainState(jnp.zeros((), jnp.int32), params, rest, optimizer.init(params), jax.random.PRNGKey(seed))

    return graphdef, make(None if init_params is None else init_params(shapes.params, shardings.params))


def state_layout(
    model_fn: Callable[[nnx.Rngs], nnx.Module], optimizer: optax.GradientTransformation, seed: int, sharder: Sharder
) -> tuple[Any, TrainState, TrainState]:
    """(graphdef, the step-0 TrainState's shapes and dtypes (jax.ShapeDtypeStruct), their shardings): what
    `init_state` builds, computed without building it (also a checkpoint's restore target). Parameters are sharded
    by their logical `axes`; optimizer-state leaves that mirror a parameter get its sharding, the rest are
    replicated (`optimizer_state_like`)."""
    graphdef, params, rest = split_params(nnx.eval_shape(lambda: model_fn(nnx.Rngs(seed))))
    replicated = sharder.named(())
    params_sh = param_shardings(params, sharder)
    opt_state = jax.eval_shape(optimizer.init, params)
    step, key = jax.ShapeDtypeStruct((), jnp.int32), jax.eval_shape(lambda: jax.random.PRNGKey(seed))
    shapes = TrainState(step, params, rest, opt_state, key)  # type: ignore[arg-type] # (of shapes)
    shardings = TrainState(
        replicated,  # type: ignore[arg-type] # (of shardings)
        params_sh,
        param_shardings(rest, sharder),
        optimizer_state_like(optimizer, opt_state, params, params_sh, replicated),
        replicated,  # type: ignore[arg-type]
    )
    return graphdef, shapes, shardings


def optimizer_state_like(
    optimizer: optax.GradientTransformation, opt_state: Any, params: Any, values: Any, default: Any
) -> Any:
    """A tree shaped like `opt_state` whose leaves inside a copy of the parameter tree (Adam's moments, a
    momentum) take the matching parameter's entry of `values` (a tree shaped like `params`: shardings, flags, ...)
    and every other leaf (a step count, a scalar statistic) takes `default`.

    Which subtrees are copies of the parameters is what `optimizer.init` says (`optax.tree_utils.tree_map_params`),
    not a guess from names; a leaf there whose shape differs from its parameter's takes `default` too, and the
    empty `optax.MaskedNode` of a masked transformation stays as it is.

    Args:
      optimizer: the transformation whose `init` built `opt_state`.
      opt_state: its state (arrays or `jax.ShapeDtypeStruct`s).
      params: the parameters it was initialised from (arrays or shapes).
      values: one entry per parameter leaf, shaped like `params`.
    """

    def masked(x: Any) -> bool:
        return isinstance(x, optax.MaskedNode)

    def pick(leaf: Any, param: Any, value: Any) -> Any:
        if masked(leaf):
            return leaf
        return value if np.shape(leaf) == np.shape(param) else default

    return optax.tree_utils.tree_map_params(
        optimizer, pick, opt_state, params, values, transform_non_params=lambda _: default, is_leaf=masked
    )
