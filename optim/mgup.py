"""MGUP (Chang & Yuan, arXiv 2606.17526): momentum-gradient alignment selective updates, as optax transforms.

Every step, within each parameter tensor, the coordinates are ranked by how well the update agrees with the current
gradient (the signed product update * grad); the top fraction tau (`mask_ratio`) gets its step multiplied by alpha,
every other coordinate by gamma > 0. No renormalisation. Spec: ../shared/specs/mgup.md; the semantics follow the
public PyTorch reference (MaeChd/MGUP) exactly:

  * k = int(tau * size) per tensor (floor); k = 0 gives every coordinate gamma;
  * AdamW is the HuggingFace-style one of the reference: eps on the *uncorrected* sqrt(v), bias correction folded
    into the step size lr sqrt(1 - b2^t) / (1 - b1^t), and the ranked quantity is u * g with u = m / (sqrt(v) + eps)
    (not m * g); decoupled weight decay p <- p - lr wd p uses the raw learning rate and is never masked;
  * Lion ranks sign(b1 m + (1 - b1) g) * g and updates its momentum with b2 after the step.

Building blocks: `mgup_mask` (the multipliers phi for one tensor), `scale_by_mgup` (multiplies any inner
direction by phi, so MGUP composes with other optax transforms), `scale_by_hf_adam` and `scale_by_lion_direction`
(the reference's un-masked directions). Presets: `mgup_adamw`, `cautious_mgup_adamw`, `mgup_lion`, `cautious_adamw`.
`paper_defaults(mask_ratio)` gives the paper's alpha = 1/tau, gamma = tau.

Selection: "exact" takes exactly k coordinates with `jax.lax.top_k` (ties in any order). "approx" finds a threshold
from a strided sample of at most `APPROX_SAMPLE` products (one sort of the sample instead of a top-k over the
tensor) and gives alpha to the products above it; its realised fraction is reported in the state
(`MGUPState.selected_fraction`, over all coordinates).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["SELECTIONS", "APPROX_SAMPLE", "paper_defaults", "mgup_mask", "MGUPState", "scale_by_mgup", "with_mgup",
           "scale_by_hf_adam", "scale_by_lion_direction", "scale_by_cautious", "mgup_adamw", "cautious_mgup_adamw",
           "mgup_lion", "cautious_adamw"]

SELECTIONS = ("exact", "approx", "sign")
APPROX_SAMPLE = 65_536


def paper_defaults(mask_ratio: float = 0.5) -> dict[str, float]:
    """The paper's stated choice alpha = 1 / tau, gamma = tau (mean multiplier 1 + tau - tau^2)."""
    _check_ratio(mask_ratio)
    if mask_ratio == 0:
        raise ValueError("paper_defaults: mask_ratio = 0 gives alpha = 1 / 0; use a ratio in (0, 1].")
    return {"mask_ratio": mask_ratio, "alpha": 1.0 / mask_ratio, "gamma": mask_ratio}


def _check_ratio(mask_ratio: float) -> None:
    if not 0.0 <= mask_ratio <= 1.0:
        raise ValueError(f"mask_ratio = {mask_ratio} must be in [0, 1].")


def _check(mask_ratio: float, alpha: float, gamma: float, selection: str) -> None:
    _check_ratio(mask_ratio)
    if gamma <= 0 or alpha <= 0:
        raise ValueError(f"alpha = {alpha} and gamma = {gamma} must be > 0 (gamma = 0 would drop the misaligned "
                         "coordinates, which MGUP never does).")
    if selection not in SELECTIONS:
        raise ValueError(f"selection = {selection!r}; allowed: {list(SELECTIONS)}.")


def mgup_mask(update: jax.Array, grad: jax.Array, mask_ratio: float, alpha: float, gamma: float, *,
              selection: str = "exact") -> jax.Array:
    """phi for one tensor: alpha on the top int(mask_ratio * size) coordinates of update * grad, gamma elsewhere.

    selection: "exact" (top-k), "approx" (threshold from a sample) or "sign" (alpha where update * grad >= 0:
    Cautious-MGUP; `mask_ratio` unused). Returns phi in float32 (float64 for float64 updates), update's shape.
    """
    _check(mask_ratio, alpha, gamma, selection)
    dtype = jnp.promote_types(update.dtype, jnp.float32)
    score = (update.astype(dtype) * grad.astype(dtype)).ravel()
    if selection == "sign":
        return jnp.where(score >= 0, alpha, gamma).astype(dtype).reshape(update.shape)
    k = int(mask_ratio * score.size)
    if k == 0:
        return jnp.full(update.shape, gamma, dtype)
    if selection == "exact":
        chosen = _top_k_mask(score, k)
    else:
        stride = max(1, score.size // APPROX_SAMPLE)
        sample = jnp.sort(score[::stride])
        chosen = score >= sample[min(sample.size - 1, int(round((1.0 - mask_ratio) * sample.size)))]
    phi = jnp.where(chosen, alpha, gamma).astype(dtype)
    return phi.reshape(update.shape)


_BRACKET_SAMPLE, _BISECTIONS, _BAND = 4096, 14, 256


def _top_k_mask(score: jax.Array, k: int) -> jax.Array:
    """[n] bool: exactly the k largest entries of a 1-D score (ties broken by position), without a full sort.

    XLA:CPU's top_k of half a tensor costs a full sort (0.4 s for 1.6M floats). Instead: bracket the k-th largest
    value between two quantiles of a strided sample, narrow the bracket with counting passes (value bisection, one
    fused compare-and-sum each), take the few values left in it with a small top_k, and threshold. If the bracket
    misses (it cannot on the sample's guarantees) or keeps more than `_BAND` values, a full top_k decides instead.
    """
    n = score.size
    if k >= n:
        return jnp.ones(score.shape, bool)
    stride = max(1, n // _BRACKET_SAMPLE)
    sample = jnp.sort(score[::stride])
    m, q = sample.size, 1.0 - k / n
    margin = 4.0 * (q * (1.0 - q) / m) ** 0.5 + 2.0 / m
    lo = jnp.min(score) if q - margin <= 0 else sample[int((q - margin) * m)]
    hi = jnp.nextafter(jnp.max(score), jnp.inf) if q + margin >= 1 else sample[min(m - 1, math.ceil((q + margin) * m))]
    count = lambda t: jnp.sum(score >= t)  # noqa: E731

    def narrow(_, bracket):
        lo, hi = bracket
        mid = lo + (hi - lo) / 2
        above = count(mid) >= k
        return jnp.where(above, mid, lo), jnp.where(above, hi, mid)

    ok = (count(lo) >= k) & (count(hi) < k)
    lo, hi = jax.lax.fori_loop(0, _BISECTIONS, narrow, (lo, hi))
    in_band = (score >= lo) & (score < hi)
    ok = ok & (jnp.sum(in_band) <= _BAND)

    def threshold(_):
        band = jax.lax.top_k(jnp.where(in_band, score, -jnp.inf), min(_BAND, n))[0]  # descending
        t = band[jnp.clip(k - count(hi) - 1, 0, band.size - 1)]  # the k-th largest value
        greater, equal = score > t, score == t
        need = k - jnp.sum(greater)
        return jax.lax.cond(jnp.sum(equal) == need, lambda: greater | equal,
                            lambda: greater | (equal & (jnp.cumsum(equal) <= need)))

    def full(_):
        return jnp.zeros(score.shape, bool).at[jax.lax.top_k(score, k)[1]].set(True)

    return jax.lax.cond(ok, threshold, full, None)


class MGUPState(NamedTuple):
    """selected_fraction: the share of all coordinates that got alpha at the last step (exactly
    sum int(tau n) / sum n with "exact"; what the threshold realised with "approx")."""

    selected_fraction: jax.Array


def scale_by_mgup(mask_ratio: float = 0.5, alpha: float = 2.0, gamma: float = 0.1, *,
                  selection: str = "exact") -> optax.GradientTransformationExtraArgs:
    """Multiplies each tensor of the incoming direction by its MGUP mask, ranked against the raw gradient.

    The gradient reaches it through the extra argument `grad=` (pass it from a wrapper, or use `with_mgup`), so
    it composes after any scaler: `optax.chain(scale_by_hf_adam(), ...)` is not enough on its own because a
    chain's later links only see the previous link's output. Presets below wire it up.
    """
    _check(mask_ratio, alpha, gamma, selection)

    def init(params):
        del params
        return MGUPState(jnp.zeros((), jnp.float32))

    def update(updates, state, params=None, *, grad=None, **extra):
        del params, extra
        if grad is None:
            raise ValueError("scale_by_mgup needs the raw gradient: call update(..., grad=grads) or use with_mgup.")
        phis = jax.tree.map(lambda u, g: mgup_mask(u, g, mask_ratio, alpha, gamma, selection=selection), updates,
                            grad)
        out = jax.tree.map(lambda u, phi: (u * phi).astype(u.dtype), updates, phis)
        leaves = jax.tree.leaves(phis)
        total = sum(x.size for x in leaves)
        chosen = sum(jnp.sum(x == alpha) for x in leaves) if leaves else jnp.zeros(())
        return out, MGUPState(jnp.asarray(chosen / max(total, 1), jnp.float32))

    return optax.GradientTransformationExtraArgs(init, update)


def with_mgup(inner: optax.GradientTransformation, mask: optax.GradientTransformationExtraArgs,
              *after: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` (a direction), then `mask` given the raw gradient, then `after` (weight decay, learning rate)."""
    tail = optax.chain(*after)

    def init(params):
        return (inner.init(params), mask.init(params), tail.init(params))

    def update(grads, state, params=None):
        direction, inner_state = inner.update(grads, state[0], params)
        masked, mask_state = mask.update(direction, state[1], params, grad=grads)
        out, tail_state = tail.update(masked, state[2], params)
        return out, (inner_state, mask_state, tail_state)

    return optax.GradientTransformation(init, update)


class HFAdamState(NamedTuple):
    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates


def scale_by_hf_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6) -> optax.GradientTransformation:
    """The reference's AdamW direction: sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps), t from 1 (eps on the
    uncorrected sqrt(v); optax.scale_by_adam puts it on sqrt(v_hat), which changes the values and the ranking).
    Moments are kept in float32 (or the parameters' dtype if wider)."""

    def init(params):
        zeros = lambda p: jnp.zeros_like(p, jnp.promote_types(p.dtype, jnp.float32))  # noqa: E731 (keeps sharding)
        return HFAdamState(jnp.zeros((), jnp.int32), jax.tree.map(zeros, params), jax.tree.map(zeros, params))

    def update(grads, state, params=None):
        del params
        count = state.count + 1
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g.astype(m.dtype), state.mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g.astype(v.dtype)), state.nu, grads)

        def direction(m, v, g):
            t = count.astype(m.dtype)
            return (jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t) * m / (jnp.sqrt(v) + eps)).astype(g.dtype)

        out = jax.tree.map(direction, mu, nu, grads)
        return out, HFAdamState(count, mu, nu)

    return optax.GradientTransformation(init, update)


class LionState(NamedTuple):
    mu: optax.Updates


def scale_by_lion_direction(b1: float = 0.9, b2: float = 0.99) -> optax.GradientTransformation:
    """Lion's direction c = sign(b1 m + (1 - b1) g) (sign(0) = 0); then m <- b2 m + (1 - b2) g."""

    def init(params):
        return LionState(jax.tree.map(lambda p: jnp.zeros_like(p, jnp.promote_types(p.dtype, jnp.float32)), params))

    def update(grads, state, params=None):
        del params
        out = jax.tree.map(lambda m, g: jnp.sign(b1 * m + (1 - b1) * g.astype(m.dtype)).astype(g.dtype), state.mu,
                           grads)
        mu = jax.tree.map(lambda m, g: b2 * m + (1 - b2) * g.astype(m.dtype), state.mu, grads)
        return out, LionState(mu)

    return optax.GradientTransformation(init, update)


def scale_by_cautious() -> optax.GradientTransformationExtraArgs:
    """Cautious optimizers (Liang et al., arXiv 2411.16085): phi = 1[u g > 0] / max(mean(1[u g > 0]), 1e-3) per
    tensor; misaligned coordinates get no step. (For Adam, u and m have the same sign.) Needs `grad=`."""

    def update(updates, state, params=None, *, grad=None, **extra):
        del params, extra
        if grad is None:
            raise ValueError("scale_by_cautious needs the raw gradient: call update(..., grad=grads).")

        def one(u, g):
            keep = (u.astype(jnp.float32) * g.astype(jnp.float32) > 0).astype(jnp.float32)
            return (u * keep / jnp.maximum(jnp.mean(keep), 1e-3)).astype(u.dtype)

        return jax.tree.map(one, updates, grad), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def _decay_and_lr(learning_rate, weight_decay: float, mask=None) -> list[optax.GradientTransformation]:
    """p <- p - lr wd p - lr * direction: the reference's decoupled decay with the raw learning rate (on the
    leaves `mask` selects, as in optax.add_decayed_weights)."""
    decay = [optax.add_decayed_weights(weight_decay, mask)] if weight_decay else []
    return decay + [optax.scale_by_learning_rate(learning_rate)]


def mgup_adamw(learning_rate: float | optax.Schedule = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
               weight_decay: float = 0.0, mask_ratio: float = 0.5, alpha: float = 2.0, gamma: float = 0.1, *,
               selection: str = "exact", weight_decay_mask=None) -> optax.GradientTransformation:
    """MGUP-AdamW (reference MGUP_AdamW.py): HF-style AdamW whose direction u is multiplied by the MGUP mask of
    u * g per tensor. `weight_decay_mask`: which leaves decay (optax.add_decayed_weights' mask; default all)."""
    return with_mgup(scale_by_hf_adam(b1, b2, eps), scale_by_mgup(mask_ratio, alpha, gamma, selection=selection),
                     *_decay_and_lr(learning_rate, weight_decay, weight_decay_mask))


def cautious_mgup_adamw(learning_rate: float | optax.Schedule = 1e-3, b1: float = 0.9, b2: float = 0.999,
                        eps: float = 1e-6, weight_decay: float = 0.0, alpha: float = 2.0,
                        gamma: float = 0.1, *, weight_decay_mask=None) -> optax.GradientTransformation:
    """Cautious-MGUP-AdamW: alpha where u * g >= 0, gamma elsewhere (no top-k)."""
    return with_mgup(scale_by_hf_adam(b1, b2, eps), scale_by_mgup(0.5, alpha, gamma, selection="sign"),
                     *_decay_and_lr(learning_rate, weight_decay, weight_decay_mask))


def mgup_lion(learning_rate: float | optax.Schedule = 1e-4, b1: float = 0.9, b2: float = 0.99,
              weight_decay: float = 0.0, mask_ratio: float = 0.5, alpha: float = 2.0, gamma: float = 0.1, *,
              selection: str = "exact", weight_decay_mask=None) -> optax.GradientTransformation:
    """MGUP-Lion (reference MGUP_Lion.py): Lion's sign direction c multiplied by the MGUP mask of c * g."""
    return with_mgup(scale_by_lion_direction(b1, b2), scale_by_mgup(mask_ratio, alpha, gamma, selection=selection),
                     *_decay_and_lr(learning_rate, weight_decay, weight_decay_mask))


def cautious_adamw(learning_rate: float | optax.Schedule = 1e-3, b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-6, weight_decay: float = 0.0, *, weight_decay_mask=None) -> optax.GradientTransformation:
    """C-AdamW, the Cautious baseline, on the same HF-style AdamW as MGUP-AdamW (so the two differ by the mask)."""
    return with_mgup(scale_by_hf_adam(b1, b2, eps), scale_by_cautious(),
                     *_decay_and_lr(learning_rate, weight_decay, weight_decay_mask))
