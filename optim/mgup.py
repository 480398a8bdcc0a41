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

Selection (optim/select.py; no sort of the tensor): "exact" takes exactly k coordinates, found by counting passes
over the products' ordered integer keys (ties at the k-th value go to the first positions). "approx" takes the
products at or above the exact k-th largest of a strided sample of `APPROX_SAMPLE` products, one counting pass
cheaper per tensor than "exact" plus the search; its realised fraction is counted and reported in the state
(`MGUPState.selected_fraction`, over all coordinates).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim.select import approx_threshold, count_at_least, ordered_keys, strided_sample, top_k_mask

__all__ = [
    "APPROX_SAMPLE",
    "SELECTIONS",
    "MGUPState",
    "cautious_adamw",
    "cautious_mgup_adamw",
    "mgup_adamw",
    "mgup_lion",
    "mgup_mask",
    "paper_defaults",
    "scale_by_cautious",
    "scale_by_hf_adam",
    "scale_by_lion_direction",
    "scale_by_mgup",
    "with_mgup",
]

SELECTIONS = ("exact", "approx", "sign")
APPROX_SAMPLE = 1024  # per tensor: each sampled entry touches a cache line, so more samples cost a visible share


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
        raise ValueError(
            f"alpha = {alpha} and gamma = {gamma} must be > 0 (gamma = 0 would drop the misaligned "
            "coordinates, which MGUP never does)."
        )
    if selection not in SELECTIONS:
        raise ValueError(f"selection = {selection!r}; allowed: {list(SELECTIONS)}.")


def mgup_mask(
    update: jax.Array, grad: jax.Array, mask_ratio: float, alpha: float, gamma: float, *, selection: str = "exact"
) -> jax.Array:
    """phi for one tensor: alpha on the top int(mask_ratio * size) coordinates of update * grad, gamma elsewhere.

    selection: "exact" (top-k), "approx" (threshold from a sample) or "sign" (alpha where update * grad >= 0:
    Cautious-MGUP; `mask_ratio` unused). Returns phi in float32 (float64 for float64 updates), update's shape.
    """
    ((chosen, _),) = _select([update], [grad], mask_ratio, selection)
    return jnp.where(chosen, alpha, gamma).astype(_score_dtype(update))


def _score_dtype(update: jax.Array):
    return jnp.promote_types(update.dtype, jnp.float32)


def _product(u: jax.Array, g: jax.Array, dtype) -> jax.Array:
    return u.astype(dtype) * g.astype(dtype)


def _select(
    updates: list[jax.Array], grads: list[jax.Array], mask_ratio: float, selection: str, samples: list | None = None
) -> list[tuple[jax.Array, jax.Array]]:
    """Per tensor: (the coordinates that get alpha, bool of its shape; their fraction, exact or estimated).

    "approx": tensors of more than 2 APPROX_SAMPLE entries get the threshold of their strided sample, all such
    tensors in one batched search (per-tensor small searches would cost more on CPU than the pass over the tensor);
    smaller ones are selected exactly. "sign" on such tensors reports the fraction of its second sample, not a
    count (which would cost a pass over the tensor). `samples[i]`: ((direction, grad) at strided_sample, the same
    at the second sample) of tensor i, computed elsewhere (see `with_mgup`); by default sliced from the tensors.
    """
    _check(mask_ratio, 1.0, 1.0, selection)
    out: list = [None] * len(updates)
    sampled = []
    for i, (u, g) in enumerate(zip(updates, grads)):
        n, k = u.size, int(mask_ratio * u.size)
        if n > 2 * APPROX_SAMPLE and (selection == "sign" or (selection == "approx" and 0 < k < n)):
            sampled.append(i)
        elif selection == "sign":
            chosen = _product(u, g, _score_dtype(u)) >= 0
            out[i] = chosen, count_at_least(chosen, [jnp.bool_(True)])[0] / max(n, 1)
        else:
            # full_like: the constant carries u's mesh-axis type (a state leaf inside shard_map must)
            out[i] = top_k_mask(_product(u, g, _score_dtype(u)), k), jnp.full_like(u, k / max(n, 1), jnp.float32, ())
    if not sampled:
        return out
    dtype = functools.reduce(jnp.promote_types, [_score_dtype(updates[i]) for i in sampled])

    def pair(i, second):
        if samples is not None and samples[i] is not None:
            u, g = samples[i][int(second)]
        else:
            u, g = (strided_sample(x, APPROX_SAMPLE, second=second) for x in (updates[i], grads[i]))
        return _product(u, g, dtype)

    first, second = (jnp.stack([pair(i, b) for i in sampled]) for b in (False, True))
    if selection == "sign":
        fractions = jnp.mean(second >= 0, axis=1, dtype=jnp.float32)
        for j, i in enumerate(sampled):
            out[i] = _product(updates[i], grads[i], dtype) >= 0, fractions[j]
        return out
    thresholds, fractions = jax.vmap(lambda a, b: approx_threshold(a, b, mask_ratio))(first, second)
    for j, i in enumerate(sampled):
        out[i] = ordered_keys(_product(updates[i], grads[i], dtype)) >= thresholds[j], fractions[j]
    return out


class MGUPState(NamedTuple):
    """selected_fraction: the share of all coordinates that got alpha at the last step: sum int(tau n) / sum n with
    "exact"; with "approx" and "sign", counted on tensors of at most 2 APPROX_SAMPLE entries and estimated on larger
    ones from a strided sample (for "approx" disjoint from the one that set the threshold; unbiased, standard
    error at most 0.5 / sqrt(APPROX_SAMPLE) per tensor)."""

    selected_fraction: jax.Array


def scale_by_mgup(
    mask_ratio: float = 0.5, alpha: float = 2.0, gamma: float = 0.1, *, selection: str = "exact"
) -> optax.GradientTransformationExtraArgs:
    """Multiplies each tensor of the incoming direction by its MGUP mask, ranked against the raw gradient.

    The gradient reaches it through the extra argument `grad=` (pass it from a wrapper, or use `with_mgup`), so
    it composes after any scaler: `optax.chain(scale_by_hf_adam(), ...)` is not enough on its own because a
    chain's later links only see the previous link's output. Presets below wire it up. The optional `samples=`
    gives "approx" its two strided samples of (direction, gradient) computed elsewhere (see `with_mgup`).
    """
    _check(mask_ratio, alpha, gamma, selection)

    def init(params):
        del params
        return MGUPState(jnp.zeros((), jnp.float32))

    def update(updates, state, params=None, *, grad=None, samples=None, **extra):
        del params, extra
        if grad is None:
            raise ValueError("scale_by_mgup needs the raw gradient: call update(..., grad=grads) or use with_mgup.")
        leaves, treedef = jax.tree.flatten(updates)
        grads = treedef.flatten_up_to(grad)
        per_leaf = None
        if samples is not None:  # [(direction, grad) trees at strided_sample, the same at the second sample]
            (ua, ga), (ub, gb) = [(treedef.flatten_up_to(u), treedef.flatten_up_to(g)) for u, g in samples]
            per_leaf = [((a, b), (c, d)) for a, b, c, d in zip(ua, ga, ub, gb)]
        pairs = _select(leaves, grads, mask_ratio, selection, per_leaf)
        out = [
            (u * jnp.where(c, alpha, gamma).astype(_score_dtype(u))).astype(u.dtype) for u, (c, _) in zip(leaves, pairs)
        ]
        total = max(sum(u.size for u in leaves), 1)
        fraction = sum(f * (u.size / total) for u, (_, f) in zip(leaves, pairs))
        return treedef.unflatten(out), MGUPState(jnp.asarray(fraction, jnp.float32))

    return optax.GradientTransformationExtraArgs(init, update)


def with_mgup(
    inner: optax.GradientTransformation,
    mask: optax.GradientTransformationExtraArgs,
    *after: optax.GradientTransformation,
) -> optax.GradientTransformation:
    """`inner` (a direction), then `mask` given the raw gradient, then `after` (weight decay, learning rate).

    If `inner` is a DirectionTransformation (HF-style Adam), the samples that "approx" and "sign" take of the
    direction are computed from strided samples of its updated state and the gradient, not sliced from the full
    direction: the full direction then has a single consumer, and XLA fuses it into the parameter update instead of
    writing it to memory and reading it back (one pass less per tensor on CPU). The updated state is read, not the
    old one: reading a donated old state beside its in-place update makes XLA copy it whole. The exact selection
    ignores the samples (and jit drops them).
    """
    tail = optax.chain(*after)
    direction_of = getattr(inner, "direction", None)

    def init(params):
        return (inner.init(params), mask.init(params), tail.init(params))

    def sampled(grads, inner_state, second):
        take = lambda x: strided_sample(x, APPROX_SAMPLE, second=second)  # noqa: E731
        g = jax.tree.map(take, grads)
        state = optax.tree_utils.tree_map_params(inner, take, inner_state, transform_non_params=lambda x: x)
        return direction_of(state, g), g

    def update(grads, state, params=None):
        direction, inner_state = inner.update(grads, state[0], params)
        samples = None if direction_of is None else [sampled(grads, inner_state, b) for b in (False, True)]
        masked, mask_state = mask.update(direction, state[1], params, grad=grads, samples=samples)
        out, tail_state = tail.update(masked, state[2], params)
        return out, (inner_state, mask_state, tail_state)

    return optax.GradientTransformation(init, update)


class DirectionTransformation(NamedTuple):
    """An optax transformation (init, update) whose output is an elementwise function of its *updated* state and
    the gradient: `direction(new_state, grads)` recomputes it, also on strided samples of both (see `with_mgup`)."""

    init: Callable
    update: Callable
    direction: Callable


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

    def direction(state, grads):
        def one(m, v, g):
            t = state.count.astype(m.dtype)
            # m * (1 / (...)) rather than m / (...): XLA:CPU will not fuse a divide into a consumer that reads the
            # direction twice (the MGUP mask and the step), and would write the direction to memory instead.
            return (jnp.sqrt(1 - b2**t) / (1 - b1**t) * m * (1 / (jnp.sqrt(v) + eps))).astype(g.dtype)

        return jax.tree.map(one, state.mu, state.nu, grads)

    def update(grads, state, params=None):
        del params
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g.astype(m.dtype), state.mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g.astype(v.dtype)), state.nu, grads)
        new = HFAdamState(state.count + 1, mu, nu)
        return direction(new, grads), new

    return DirectionTransformation(init, update, direction)


class LionState(NamedTuple):
    mu: optax.Updates


def scale_by_lion_direction(b1: float = 0.9, b2: float = 0.99) -> optax.GradientTransformation:
    """Lion's direction c = sign(b1 m + (1 - b1) g) (sign(0) = 0); then m <- b2 m + (1 - b2) g."""

    def init(params):
        return LionState(jax.tree.map(lambda p: jnp.zeros_like(p, jnp.promote_types(p.dtype, jnp.float32)), params))

    def update(grads, state, params=None):
        del params
        out = jax.tree.map(
            lambda m, g: jnp.sign(b1 * m + (1 - b1) * g.astype(m.dtype)).astype(g.dtype), state.mu, grads
        )
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
            keep = u.astype(jnp.float32) * g.astype(jnp.float32) > 0
            share = count_at_least(keep, [jnp.bool_(True)])[0] / max(keep.size, 1)
            return (u * keep.astype(jnp.float32) / jnp.maximum(share, 1e-3)).astype(u.dtype)

        return jax.tree.map(one, updates, grad), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def _decay_and_lr(learning_rate, weight_decay: float, mask=None) -> list[optax.GradientTransformation]:
    """p <- p - lr wd p - lr * direction: the reference's decoupled decay with the raw learning rate (on the
    leaves `mask` selects, as in optax.add_decayed_weights)."""
    decay = [optax.add_decayed_weights(weight_decay, mask)] if weight_decay else []
    return decay + [optax.scale_by_learning_rate(learning_rate)]


def mgup_adamw(
    learning_rate: float | optax.Schedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    mask_ratio: float = 0.5,
    alpha: float = 2.0,
    gamma: float = 0.1,
    *,
    selection: str = "exact",
    weight_decay_mask=None,
) -> optax.GradientTransformation:
    """MGUP-AdamW (reference MGUP_AdamW.py): HF-style AdamW whose direction u is multiplied by the MGUP mask of
    u * g per tensor. `weight_decay_mask`: which leaves decay (optax.add_decayed_weights' mask; default all)."""
    return with_mgup(
        scale_by_hf_adam(b1, b2, eps),
        scale_by_mgup(mask_ratio, alpha, gamma, selection=selection),
        *_decay_and_lr(learning_rate, weight_decay, weight_decay_mask),
    )


def cautious_mgup_adamw(
    learning_rate: float | optax.Schedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    alpha: float = 2.0,
    gamma: float = 0.1,
    *,
    weight_decay_mask=None,
) -> optax.GradientTransformation:
    """Cautious-MGUP-AdamW: alpha where u * g >= 0, gamma elsewhere (no top-k)."""
    return with_mgup(
        scale_by_hf_adam(b1, b2, eps),
        scale_by_mgup(0.5, alpha, gamma, selection="sign"),
        *_decay_and_lr(learning_rate, weight_decay, weight_decay_mask),
    )


def mgup_lion(
    learning_rate: float | optax.Schedule = 1e-4,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 0.0,
    mask_ratio: float = 0.5,
    alpha: float = 2.0,
    gamma: float = 0.1,
    *,
    selection: str = "exact",
    weight_decay_mask=None,
) -> optax.GradientTransformation:
    """MGUP-Lion (reference MGUP_Lion.py): Lion's sign direction c multiplied by the MGUP mask of c * g."""
    return with_mgup(
        scale_by_lion_direction(b1, b2),
        scale_by_mgup(mask_ratio, alpha, gamma, selection=selection),
        *_decay_and_lr(learning_rate, weight_decay, weight_decay_mask),
    )


def cautious_adamw(
    learning_rate: float | optax.Schedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    *,
    weight_decay_mask=None,
) -> optax.GradientTransformation:
    """C-AdamW, the Cautious baseline, on the same HF-style AdamW as MGUP-AdamW (so the two differ by the mask)."""
    return with_mgup(
        scale_by_hf_adam(b1, b2, eps),
        scale_by_cautious(),
        *_decay_and_lr(learning_rate, weight_decay, weight_decay_mask),
    )
