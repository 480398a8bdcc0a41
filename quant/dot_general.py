"""4-bit training GEMMs as a custom dot_general (docs/ufp4.md; recipes in quant/recipes.py).

`dot_general(recipe, key=...)` returns a function with `jax.lax.dot_general`'s signature whose forward and both
backward GEMMs quantise their operands as the recipe says. Any dimension numbers with one contracting dimension
per operand are brought to batched matrices x: [B, M, K], w: [B, K, N] (transposes and reshapes outside the
custom VJP, so JAX differentiates them), and

  fprop  y  = Q(R x) Q(R w)          along K
  dgrad  dx = Q(R dy) Q(R w)^T       along N     (dy stochastic if the recipe says so)
  wgrad  dw = Q(R x)^T Q(R dy)       along M     (tokens)

with R the GEMM's RHT (identity when off) applied to both operands along the contraction axis, so it cancels in
the product. A contraction length that the block (or RHT block) does not divide is zero-padded for the GEMM: zeros
change neither the product nor any block's scale. The randomness of stochastic rounding comes from `key`
(per step and layer: the precision slot passes `layer_key(step_key, path)`), split per GEMM and operand with the
named salts below; the RHT's fixed signs come from the run's `seed` (`quant.hadamard.run_signs`), fresh ones (the
recipe's `fresh_signs`) from `key`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from quant.hadamard import random_signs, rht, run_signs
from quant.quantize import DEFAULT_BLOCK, quantize, quantize_tiles
from quant.recipes import Gemm, Recipe
from quant.recipes import get as get_recipe

__all__ = [
    "SALT_DGRAD",
    "SALT_FRESH_SIGNS",
    "SALT_OPERANDS",
    "SALT_WGRAD",
    "GemmConfig",
    "backward_keys",
    "check_key",
    "dot_general",
    "prepare_operands",
]

# PRNG salts (jax.random.fold_in data) that derive one layer's keys from the key it receives for a step
SALT_DGRAD, SALT_WGRAD = 1, 2  # the dgrad and wgrad GEMMs' keys (fprop uses the layer key itself)
SALT_OPERANDS = (0, 1)  # within a GEMM: the stochastic rounding of its first and second operand
SALT_FRESH_SIGNS = 7  # within a GEMM: fresh RHT signs (recipe.fresh_signs)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """What the custom GEMMs close over: the recipe, the fake quantiser, and the seed of the run's fixed RHT
    signs."""

    recipe: Recipe
    quantizer: Callable
    seed: int = 0


def _pad(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def prepare_operands(
    a: jax.Array,
    b: jax.Array,
    axis_a: int,
    axis_b: int,
    gemm: Gemm,
    cfg: GemmConfig,
    *,
    key: jax.Array | None,
    stochastic: tuple[bool, bool],
    weight: int | None = None,
):
    """Both operands of one GEMM, rotated and quantised along their contraction axes (padded to whole blocks).
    `weight`: which operand (0 / 1) is the weight, for NVFP4's 2-D tiles (quantised once, along both axes)."""
    if gemm.fmt is None:
        return a, b
    block = gemm.block_size or DEFAULT_BLOCK[gemm.fmt]
    multiple = math.lcm(block, gemm.rht_block) if gemm.rht else block
    a, b = _pad(a, axis_a, multiple), _pad(b, axis_b, multiple)
    if gemm.rht:
        if not cfg.recipe.fresh_signs:
            signs = run_signs(cfg.seed, gemm.rht_block)
        elif key is None:
            raise ValueError(f"recipe {cfg.recipe.name}: fresh RHT signs need a PRNG key.")
        else:
            signs = random_signs(jax.random.fold_in(key, SALT_FRESH_SIGNS), gemm.rht_block)
        a = rht(a, axis=axis_a, block_size=gemm.rht_block, signs=signs)
        b = rht(b, axis=axis_b, block_size=gemm.rht_block, signs=signs)
    out = []
    for i, (x, axis) in enumerate(((a, axis_a), (b, axis_b))):
        sub = None
        if stochastic[i]:
            if key is None:
                raise ValueError(
                    f"recipe {cfg.recipe.name}: stochastic rounding of dy needs a PRNG key; the training "
                    "step passes one through the precision slot (a key of None is for inference)."
                )
            sub = jax.random.fold_in(key, SALT_OPERANDS[i])
        if i == weight and cfg.recipe.weight_2d_blocks and not gemm.rht:
            out.append(quantize_tiles(x, gemm.fmt, tile=block))
        else:
            out.append(
                cfg.quantizer(
                    x,
                    gemm.fmt,
                    axis=axis,
                    block_size=block,
                    rounding="stochastic" if stochastic[i] else "nearest",
                    key=sub,
                )
            )
    return tuple(out)


def backward_keys(key: jax.Array | None) -> tuple[jax.Array | None, jax.Array | None]:
    """The keys of the dgrad and wgrad GEMMs of one layer's step: fold_in(key, SALT_DGRAD) and
    fold_in(key, SALT_WGRAD) (None without a key)."""
    if key is None:
        return None, None
    return jax.random.fold_in(key, SALT_DGRAD), jax.random.fold_in(key, SALT_WGRAD)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul(cfg: GemmConfig, x: jax.Array, w: jax.Array, key: jax.Array | None) -> jax.Array:
    """x [B, M, K] @ w [B, K, N] -> [B, M, N] float32, operands quantised as fprop says."""
    qx, qw = prepare_operands(x, w, 2, 1, cfg.recipe.fprop, cfg, key=key, stochastic=(False, False), weight=1)
    return jnp.einsum("bmk,bkn->bmn", qx, qw, preferred_element_type=jnp.float32)


def _fwd(cfg, x, w, key):
    check_key(cfg.recipe, key, "dot_general")  # traced when differentiating: the error comes in the forward pass
    return _matmul(cfg, x, w, key), (x, w, key)


def check_key(recipe: Recipe, key: jax.Array | None, what: str) -> None:
    """Raises ValueError, saying what to pass, when a GEMM of `recipe` is differentiated without a PRNG key."""
    if key is None and recipe.needs_key:
        raise ValueError(
            f"quant.{what}({recipe.name!r}) is being differentiated without a PRNG key: the recipe rounds dy "
            f"stochastically. Build it with key=<a fresh key per training step and layer> (e.g. "
            f"quant.{what}({recipe.name!r}, key=jax.random.fold_in(step_key, layer))); key=None is for inference."
        )


def _bwd(cfg, residuals, dy):
    x, w, key = residuals
    r = cfg.recipe
    k_d, k_w = backward_keys(key)
    q_dy, q_w = prepare_operands(
        dy, w, 2, 2, r.dgrad, cfg, key=k_d, stochastic=(r.dgrad.stochastic_dy, False), weight=1
    )
    dx = jnp.einsum("bmn,bkn->bmk", q_dy, q_w, preferred_element_type=jnp.float32)
    q_x, q_dy = prepare_operands(x, dy, 1, 1, r.wgrad, cfg, key=k_w, stochastic=(False, r.wgrad.stochastic_dy))
    dw = jnp.einsum("bmk,bmn->bkn", q_x, q_dy, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype), None


_matmul.defvjp(_fwd, _bwd)


def dot_general(
    recipe: Recipe | str, *, key: jax.Array | None = None, quantizer: Callable = quantize, seed: int = 0
) -> Callable:
    """A drop-in for `jax.lax.dot_general` whose three training GEMMs follow `recipe`, e.g.
    `nnx.Linear(..., dot_general=quant.dot_general("ufp4", key=k))`.

    recipe: a Recipe or its name (quant.recipes.RECIPES: "bf16", "ufp4", "ufp4_int4", "e2m1_baseline", "nvfp4",
      "mxfp4").
    key: PRNG key of this layer and step (stochastic rounding, fresh RHT signs); None for inference. Differentiating
      a recipe that rounds dy stochastically without one raises ValueError in the forward pass, saying what to pass.
    quantizer: the fake quantiser (default `quantize`; tests pass a recording one).
    seed: the run's seed, from which the fixed RHT signs are drawn (`run_signs(seed)`).
    The function takes `jax.lax.dot_general`'s arguments in its order: (lhs, rhs, dimension_numbers, precision=None,
    preferred_element_type=None, *, out_sharding=None). Operands: any float dtype; one contracting dimension each
    (else ValueError). The result has `preferred_element_type` when given, else the operands' result type (bf16
    inputs give bf16), accumulated in float32. `precision` is passed on for a recipe that quantises nothing and
    otherwise unused (the quantised operands are multiplied in their own dtype with float32 accumulation);
    `out_sharding` places the result (a sharding constraint on the quantised path).
    """
    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    cfg = GemmConfig(recipe, quantizer, seed)

    def call(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, out_sharding=None):
        (lc, rc), (lb, rb) = dimension_numbers
        if len(lc) != 1 or len(rc) != 1:
            raise ValueError(
                f"quant.dot_general ({recipe.name}): one contracting dimension per operand is supported; "
                f"got {lc} and {rc} (shapes {lhs.shape}, {rhs.shape})."
            )
        if not recipe.quantised:
            return jax.lax.dot_general(
                lhs,
                rhs,
                dimension_numbers,
                precision=precision,
                preferred_element_type=preferred_element_type,
                out_sharding=out_sharding,
            )
        lfree = [d for d in range(lhs.ndim) if d not in (*lc, *lb)]
        rfree = [d for d in range(rhs.ndim) if d not in (*rc, *rb)]
        batch = [lhs.shape[d] for d in lb]
        lfree_shape, rfree_shape = [lhs.shape[d] for d in lfree], [rhs.shape[d] for d in rfree]
        b, m, n = math.prod(batch), math.prod(lfree_shape), math.prod(rfree_shape)
        x = jnp.transpose(lhs, (*lb, *lfree, *lc)).reshape(b, m, lhs.shape[lc[0]])
        w = jnp.transpose(rhs, (*rb, *rc, *rfree)).reshape(b, rhs.shape[rc[0]], n)
        y = _matmul(cfg, x, w, key).reshape(*batch, *lfree_shape, *rfree_shape)
        y = y.astype(preferred_element_type or jnp.result_type(lhs, rhs))
        return y if out_sharding is None else jax.lax.with_sharding_constraint(y, out_sharding)

    return call
