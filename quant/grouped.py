"""4-bit training GEMMs for MoE experts: a custom grouped matmul with `jax.lax.ragged_dot`'s signature.

lhs [m, k] holds the tokens sorted by group (expert), group_sizes [g] how many each group has; rhs [g, k, n].
  fprop  y  = Q(R x) Q(R w_g)            along k
  dgrad  dx = Q(R dy) Q(R w_g)^T         along n      (dy stochastic if the recipe says so)
  wgrad  dw_g = sum over the group's tokens Q(R x)^T Q(R dy)   along tokens
The token blocks of wgrad must not straddle two groups (a scale or a rotation shared by two experts' tokens would
mix their products), so wgrad scatters the rows into a layout where every group starts on a block boundary (at
most g (block - 1) zero rows more). The products go through `inner` (the MoE's grouped matmul), wgrad through
its transpose.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from quant.gemm import FreshKeys, GemmConfig, backward_keys, check_key, check_rngs, prepare_operands
from quant.quantize import DEFAULT_BLOCK, quantize
from quant.recipes import Recipe
from quant.recipes import get as get_recipe

__all__ = ["group_aligned", "make_grouped_matmul"]


def group_aligned(x: jax.Array, group_sizes: jax.Array, multiple: int) -> tuple[jax.Array, jax.Array]:
    """Rows of x [m, ...] moved so that each group starts at a multiple of `multiple` (zeros between); returns the
    padded rows [m + g (multiple - 1) rounded up to `multiple`, ...] and the padded group sizes. Rows past
    sum(group_sizes) are dropped."""
    m, g = x.shape[0], group_sizes.shape[0]
    padded = (group_sizes + multiple - 1) // multiple * multiple
    rows = -(-(m + g * (multiple - 1)) // multiple) * multiple
    ends = jnp.cumsum(group_sizes)
    t = jnp.arange(m)
    group = jnp.searchsorted(ends, t, side="right")
    inside = group < g
    group = jnp.minimum(group, g - 1)
    target = (jnp.cumsum(padded) - padded)[group] + t - (ends - group_sizes)[group]
    target = jnp.where(inside, target, rows)  # out of range: dropped
    return jnp.zeros((rows, *x.shape[1:]), x.dtype).at[target].set(x, mode="drop"), padded


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _grouped(cfg: GemmConfig, inner: Callable, x, w, group_sizes, key):
    qx, qw = prepare_operands(x, w, 1, 1, cfg.recipe.fprop, cfg, key=key, stochastic=(False, False), weight=1)
    return inner(qx, qw, group_sizes, preferred_element_type=jnp.float32)


def _fwd(cfg, inner, x, w, group_sizes, key):
    # traced when differentiating: the error comes in the forward pass
    check_key(cfg.recipe, key, "make_grouped_matmul")
    return _grouped(cfg, inner, x, w, group_sizes, key), (x, w, group_sizes, key)


def _bwd(cfg, inner, residuals, dy):
    x, w, group_sizes, key = residuals
    r = cfg.recipe
    k_d, k_w = backward_keys(key)
    q_dy, q_w = prepare_operands(
        dy, w, 1, 2, r.dgrad, cfg, key=k_d, stochastic=(r.dgrad.stochastic_dy, False), weight=1
    )
    dx = inner(q_dy, jnp.swapaxes(q_w, 1, 2), group_sizes, preferred_element_type=jnp.float32)
    if r.wgrad.fmt is None:
        (xs, dys), sizes = prepare_operands(x, dy, 0, 0, r.wgrad, cfg, key=None, stochastic=(False, False)), group_sizes
    else:
        block = r.wgrad.block_size or DEFAULT_BLOCK[r.wgrad.fmt]
        multiple = math.lcm(block, r.wgrad.rht_block) if r.wgrad.rht else block
        (xs, sizes), (dys, _) = (group_aligned(a, group_sizes, multiple) for a in (x, dy))
        xs, dys = prepare_operands(xs, dys, 0, 0, r.wgrad, cfg, key=k_w, stochastic=(False, r.wgrad.stochastic_dy))
    # The product is linear in v, so any primal point gives the same transpose. w itself (its forward product is
    # dead code) keeps w's vmap batching and shard_map axis type, which a constant (zeros) would not have.
    _, transpose = jax.vjp(lambda v: inner(xs, v, sizes, preferred_element_type=jnp.float32), w.astype(jnp.float32))
    dw = transpose(dys.astype(jnp.float32))[0]
    return dx.astype(x.dtype), dw.astype(w.dtype), None, None


_grouped.defvjp(_fwd, _bwd)


def make_grouped_matmul(
    recipe: Recipe | str,
    *,
    key: jax.Array | None = None,
    rngs: nnx.Rngs | None = None,
    stream: str = "quant",
    inner: Callable = jax.lax.ragged_dot,
    quantizer: Callable = quantize,
    seed: int = 0,
) -> Callable:
    """A drop-in for `jax.lax.ragged_dot` with the three training GEMMs of `recipe` (see the module docstring):
    (lhs [m, k], rhs [g, k, n], group_sizes [g] int32, precision=None, preferred_element_type=None,
    group_offset=None, out_sharding=None) -> [m, n], in ragged_dot's order.

    recipe: a Recipe or its name (quant.recipes.RECIPES). key: this layer's and step's PRNG key (None for inference;
    differentiating a stochastic recipe without one raises ValueError in the forward pass). rngs, stream: instead of
    key, an nnx.Rngs from whose stream every call draws a fresh key (a `FreshKeys` nnx.Module is returned; hold it
    or the Rngs in the model, as for `quant.make_dot_general`); both key and rngs is a ValueError. inner: the grouped
    matmul that multiplies the quantised operands (it receives preferred_element_type, and the other arguments only
    when they are given); quantizer: the fake quantiser; seed: the run's seed, from which the fixed RHT signs are
    drawn (`quant.hadamard.run_signs`). The result has `preferred_element_type` when given, else the operands'
    result type. "none" is `inner` itself (`precision` passed on); every other recipe multiplies its quantised
    operands (bfloat16 for "bf16") with float32 accumulation in all three GEMMs and ignores `precision`;
    `group_offset` (a shard of the groups) is supported only for "none" (ValueError otherwise); `out_sharding`
    places the result."""
    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    check_rngs("make_grouped_matmul", recipe, key, rngs, stream)
    if rngs is not None:
        return FreshKeys(_keyed_grouped_matmul, (recipe, inner, quantizer, seed), rngs, stream)
    return _keyed_grouped_matmul(recipe, inner, quantizer, seed, key)


def _keyed_grouped_matmul(
    recipe: Recipe, inner: Callable, quantizer: Callable, seed: int, key: jax.Array | None
) -> Callable:
    cfg = GemmConfig(recipe, quantizer, seed)

    def call(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None, out_sharding=None):
        if not recipe.quantised:
            given = {"precision": precision, "group_offset": group_offset, "out_sharding": out_sharding}
            extra = {name: v for name, v in given.items() if v is not None}
            return inner(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type, **extra)
        if group_offset is not None:
            raise ValueError(
                f"quant.make_grouped_matmul({recipe.name!r}): group_offset is not supported when quantising"
            )
        y = _grouped(cfg, inner, lhs, rhs, group_sizes, key)
        y = y.astype(preferred_element_type or jnp.result_type(lhs, rhs))
        return y if out_sharding is None else jax.lax.with_sharding_constraint(y, out_sharding)

    return call
