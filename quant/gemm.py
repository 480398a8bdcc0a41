"""4-bit training GEMMs as a custom dot_general (docs/ufp4.md; recipes in quant/recipes.py).

`make_dot_general(recipe, key=...)` returns a function with `jax.lax.dot_general`'s signature whose forward and both
backward GEMMs quantise their operands as the recipe says. Any dimension numbers with one contracting dimension
per operand are brought to batched matrices x: [B, M, K], w: [B, K, N] (transposes and reshapes outside the
custom VJP, so JAX differentiates them), and

  fprop  y  = Q(R x) Q(R w)          along K
  dgrad  dx = Q(R dy) Q(R w)^T       along N     (dy stochastic if the recipe says so)
  wgrad  dw = Q(R x)^T Q(R dy)       along M     (tokens)

with R the GEMM's RHT (identity when off) applied to both operands along the contraction axis, so it cancels in
the product. A contraction length that the block (or RHT block) does not divide is zero-padded for the GEMM: zeros
change neither the product nor any block's scale. The randomness of stochastic rounding comes from `key`
(per step and layer: the precision slot passes `layer_key(step_key, path)`; with `rngs=`, a key drawn per call
from an nnx.Rngs the model holds, see FreshKeys), split per GEMM and operand with the named salts below; the
RHT's fixed signs come from the run's `seed` (`quant.hadamard.run_signs`), fresh ones (the recipe's `fresh_signs`)
from `key`. Recipe "bf16" casts both operands of every GEMM to bfloat16 (float32 accumulation); "none" is
jax.lax.dot_general itself.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from quant.hadamard import random_signs, rht, run_signs
from quant.quantize import DEFAULT_BLOCK, quantize, quantize_tiles
from quant.recipes import Gemm, Recipe
from quant.recipes import get as get_recipe

__all__ = [
    "SALT_DGRAD",
    "SALT_FRESH_SIGNS",
    "SALT_OPERANDS",
    "SALT_WGRAD",
    "FreshKeys",
    "GemmConfig",
    "backward_keys",
    "check_key",
    "check_rngs",
    "make_dot_general",
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
    """Both operands of one GEMM, rotated and quantised along their contraction axes (padded to whole blocks), as
    `gemm` says. `weight`: which operand (0 / 1) is the weight, for 2-D tiles (`gemm.weight_2d`: quantised once,
    along both axes). `stochastic[i]`: operand i is dy and rounds as `gemm.dy_rounding` says (else nearest). The
    quantiser is called as cfg.quantizer(x, fmt, axis=, block_size=, rounding=, key=, scale=, select=), plus
    eden_group= (lcm of block and RHT block) for rounding "ms_eden"."""
    if gemm.fmt is None:
        return _cast(a, b, dtype=cfg.recipe.gemm_dtype)
    block = gemm.block_size or DEFAULT_BLOCK[gemm.fmt]
    multiple = math.lcm(block, gemm.rht_block) if gemm.rht else block
    a, b = _pad(a, axis_a, multiple), _pad(b, axis_b, multiple)
    if gemm.rht:
        if gemm.rht_signs == "none":
            signs = jnp.ones(gemm.rht_block, jnp.float32)
        elif not cfg.recipe.fresh_signs:
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
                    f"recipe {cfg.recipe.name}: {gemm.dy_rounding} rounding of dy needs a PRNG key; the training "
                    "step passes one through the precision slot (a key of None is for inference)."
                )
            sub = jax.random.fold_in(key, SALT_OPERANDS[i])
        rounding = gemm.dy_rounding if stochastic[i] else "nearest"
        if i == weight and gemm.weight_2d:
            out.append(quantize_tiles(x, gemm.fmt, tile=block, scale=gemm.scale, select=gemm.select))
        else:
            extra = {"eden_group": multiple} if rounding == "ms_eden" else {}  # whole rotation groups and blocks
            out.append(
                cfg.quantizer(
                    x,
                    gemm.fmt,
                    axis=axis,
                    block_size=block,
                    rounding=rounding,
                    key=sub,
                    scale=gemm.scale,
                    select=gemm.select,
                    **extra,
                )
            )
    return _cast(*out, dtype=cfg.recipe.gemm_dtype)


def _cast(a: jax.Array, b: jax.Array, *, dtype: str | None) -> tuple[jax.Array, jax.Array]:
    """Both operands in the recipe's `gemm_dtype` (unchanged for None)."""
    return (a, b) if dtype is None else (a.astype(dtype), b.astype(dtype))


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
    check_key(cfg.recipe, key, "make_dot_general")  # traced when differentiating: the error comes in the forward pass
    return _matmul(cfg, x, w, key), (x, w, key)


def check_key(recipe: Recipe, key: jax.Array | None, what: str) -> None:
    """Raises ValueError, saying what to pass, when a GEMM of `recipe` is differentiated without a PRNG key."""
    if key is None and recipe.needs_key:
        raise ValueError(
            f"a GEMM of quant.{what}({recipe.name!r}) is being differentiated without a PRNG key: the recipe rounds dy "
            f"stochastically. Build it with rngs=<an nnx.Rngs the model holds> (a fresh key per call, e.g. "
            f"quant.{what}({recipe.name!r}, rngs=self.rngs) with self.rngs = nnx.Rngs(quant=0)), or with "
            f"key=<a fresh key per training step and layer> (e.g. quant.{what}({recipe.name!r}, "
            f"key=jax.random.fold_in(step_key, layer))); no key is for inference."
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


class FreshKeys(nnx.Module):
    """A GEMM that draws a fresh PRNG key from `rngs`' stream `stream` at every call and calls `make(*args, key)`
    with the same arguments: what `make_dot_general(recipe, rngs=...)` and `make_grouped_matmul(recipe, rngs=...)`
    return.

    It is an nnx.Module holding the Rngs, so a flax layer that stores it (nnx.Linear's `dot_general` attribute)
    makes the Rngs part of the model's graph: under nnx.jit / nnx.grad / nnx.value_and_grad the stream's counter is
    traced and advanced like any other state of the model, so every call in a step gets its own key and every step
    new ones, reproducibly from the Rngs' seed. (A plain closure over an Rngs could not do this: inside nnx.jit it
    would still point at the Rngs outside the trace, which flax refuses to mutate.) `make` and `args` are static
    and compare by value, so a model built again the same way reuses nnx.jit's compiled step."""

    def __init__(self, make: Callable[..., Callable], args: tuple, rngs: nnx.Rngs, stream: str):
        self.make = make
        self.args = args
        self.rngs = rngs
        self.stream = stream

    def __call__(self, *args, **kwargs):
        """`make(*self.args, fresh key)(*args, **kwargs)`; the draw advances the stream's counter."""
        return self.make(*self.args, getattr(self.rngs, self.stream)())(*args, **kwargs)


def check_rngs(what: str, recipe: Recipe, key: jax.Array | None, rngs: nnx.Rngs | None, stream: str) -> None:
    """Raises ValueError (naming the argument and what is allowed) when both `key` and `rngs` are given, when
    `rngs` is not an nnx.Rngs, or when it has neither the stream `stream` nor a "default" stream to draw from."""
    if rngs is None:
        return
    where = f"quant.{what}({recipe.name!r})"
    if key is not None:
        raise ValueError(f"{where}: key= and rngs= were both given; pass one (a fixed key, or an nnx.Rngs).")
    if not isinstance(rngs, nnx.Rngs):
        raise ValueError(f"{where}: rngs = {rngs!r} ({type(rngs).__name__}); allowed: a flax nnx.Rngs, or None.")
    if not isinstance(stream, str) or (stream not in rngs and "default" not in rngs):
        raise ValueError(
            f"{where}: stream = {stream!r}, but the nnx.Rngs has neither that stream nor a 'default' one; "
            f"build it with the stream (e.g. nnx.Rngs({stream}=0)) or pass stream=<one of its streams>."
        )


def make_dot_general(
    recipe: Recipe | str,
    *,
    key: jax.Array | None = None,
    rngs: nnx.Rngs | None = None,
    stream: str = "quant",
    quantizer: Callable = quantize,
    seed: int = 0,
) -> Callable:
    """A drop-in for `jax.lax.dot_general` whose three training GEMMs follow `recipe`, e.g. in a flax NNX model

        class MLP(nnx.Module):
            def __init__(self, rngs):
                self.rngs = nnx.Rngs(quant=0)  # the stochastic-rounding stream, held by the model
                dot = quant.make_dot_general("ufp4", rngs=self.rngs)
                self.up = nnx.Linear(64, 256, dot_general=dot, rngs=rngs)

    recipe: a Recipe or its name (quant.recipes.RECIPES: "none", "bf16", "ufp4", "ufp4_int4", "e2m1_baseline",
      "nvfp4", "mxfp4").
    key: a fixed PRNG key (stochastic rounding, fresh RHT signs), for code that builds the GEMM anew for every
      step and layer (jax.jit loops: key = fold_in(step_key, layer)). None without rngs: inference only;
      differentiating a recipe that rounds dy stochastically without a key raises ValueError in the forward pass,
      saying what to pass.
    rngs, stream: instead of key, an nnx.Rngs from whose stream `stream` (else its "default" stream) every call
      draws a fresh key; the function returned is then a `FreshKeys` nnx.Module. Hold the Rngs in the model (an
      attribute of it, or only through the layers that store the returned module) and the stream advances inside
      nnx.jit / nnx.value_and_grad training steps: every step and every layer quantise with new noise, and the
      same Rngs seed reproduces the run. A Rngs captured in a closure outside nnx.jit cannot be advanced (flax
      raises TraceContextError); under jax.jit use key=. Giving both key and rngs is a ValueError.
    quantizer: the fake quantiser (default `quantize`; tests pass a recording one).
    seed: the run's seed, from which the fixed RHT signs are drawn (`run_signs(seed)`).
    The function takes `jax.lax.dot_general`'s arguments in its order: (lhs, rhs, dimension_numbers, precision=None,
    preferred_element_type=None, *, out_sharding=None). Operands: any float dtype; one contracting dimension each
    (else ValueError). The result has `preferred_element_type` when given, else the operands' result type (bf16
    inputs give bf16). "none" is jax.lax.dot_general itself (`precision` passed on, the GEMM in the operands'
    dtype); every other recipe multiplies its quantised operands (cast to bfloat16 for "bf16") with float32
    accumulation in all three GEMMs, and ignores `precision`. `out_sharding` places the result (a sharding
    constraint on the quantised path).
    """
    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    check_rngs("make_dot_general", recipe, key, rngs, stream)
    if rngs is not None:
        return FreshKeys(_keyed_dot_general, (recipe, quantizer, seed), rngs, stream)
    return _keyed_dot_general(recipe, quantizer, seed, key)


def _keyed_dot_general(recipe: Recipe, quantizer: Callable, seed: int, key: jax.Array | None) -> Callable:
    cfg = GemmConfig(recipe, quantizer, seed)

    def call(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, out_sharding=None):
        (lc, rc), (lb, rb) = dimension_numbers
        if len(lc) != 1 or len(rc) != 1:
            raise ValueError(
                f"quant.make_dot_general({recipe.name!r}): one contracting dimension per operand is supported; "
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
