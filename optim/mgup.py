"""MGUP (Chang & Yuan, arXiv 2606.17526): momentum-gradient alignment selective updates, as optax transforms.

Every step, within each parameter tensor, the coordinates are ranked by how well the update agrees with the current
gradient (the signed product update * grad); the top fraction tau (`mask_ratio`) gets its step multiplied by alpha,
every other coordinate by gamma > 0. No renormalisation. Algorithms and their sources: docs/mgup.md; the semantics
follow the public PyTorch reference (MaeChd/MGUP) exactly:

  * k = int(tau * size) per tensor (floor); k = 0 gives every coordinate gamma;
  * AdamW is the HuggingFace-style one of the reference: eps on the *uncorrected* sqrt(v), bias correction folded
    into the step size lr sqrt(1 - b2^t) / (1 - b1^t), and the ranked quantity is u * g with u = m / (sqrt(v) + eps)
    (not m * g); decoupled weight decay p <- p - lr wd p uses the raw learning rate and is never masked;
  * Lion ranks sign(b1 m + (1 - b1) g) * g and updates its momentum with b2 after the step.

Building blocks: `mgup_mask` (the multipliers phi for one tensor), `scale_by_mgup` (multiplies any inner
direction by phi, so MGUP composes with other optax transforms), `scale_by_hf_adam` and `scale_by_lion_direction`
(the reference's un-masked directions), `with_mgup` (direction, then mask, then the rest). Presets: `mgup_adamw`,
`cautious_mgup_adamw`, `mgup_lion`, `cautious_adamw`. `paper_defaults(mask_ratio)` gives the paper's
alpha = 1/tau, gamma = tau. `state_metrics(opt_state)` reads the selected fraction out of any optimizer state.

Every argument after the learning rate is keyword-only. Hyperparameters may be Python numbers or scalar arrays, so
`optax.inject_hyperparams(mgup_adamw)(learning_rate=..., weight_decay=..., mask_ratio=..., alpha=..., gamma=...)`
works (inside jit they are traced): Python numbers are checked when the transform is built and k is computed while
tracing; arrays are checked when concrete, and k is computed on device, equal to Python's int(float(tau) * size)
(see `num_selected`). Scalar coefficients are cast to the moments' dtype before use (1 - b1 is computed in it), so a
hyperparameter given as a number or as an array of the moments' dtype gives bit-identical updates.

Selection (optim/select.py; no sort of the tensor): "exact" takes exactly k coordinates, found by counting passes
over the products' ordered integer keys (ties at the k-th value go to the first positions). "approx" takes the
products at or above the k-th largest of a strided sample of `APPROX_SAMPLE` products, one counting pass
cheaper per tensor than "exact" plus the search; its realised fraction is counted and reported in the state
(`MGUPState.selected_fraction`, over all coordinates).
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import optax

from optim.select import approx_threshold, count_at_least, ordered_keys, strided_sample, top_k_mask

__all__ = [
    "APPROX_SAMPLE",
    "SELECTIONS",
    "DirectionFn",
    "DirectionTransformation",
    "HFAdamState",
    "LionState",
    "MGUPChainState",
    "MGUPState",
    "Scalar",
    "cautious_adamw",
    "cautious_mgup_adamw",
    "check_arguments",
    "decay_and_learning_rate",
    "leaves_like",
    "mgup_adamw",
    "mgup_lion",
    "mgup_mask",
    "num_selected",
    "paper_defaults",
    "scale_by_cautious",
    "scale_by_hf_adam",
    "scale_by_lion_direction",
    "scale_by_mgup",
    "select_masks",
    "state_metrics",
    "with_mgup",
]

SELECTIONS = ("exact", "approx", "sign")
APPROX_SAMPLE = 1024  # per tensor: each sampled entry touches a cache line, so more samples cost a visible share

Scalar = float | jax.Array
"""A hyperparameter: a Python number, or a scalar array (e.g. traced, from optax.inject_hyperparams)."""


def paper_defaults(mask_ratio: float = 0.5) -> dict[str, float]:
    """The paper's stated choice alpha = 1 / tau, gamma = tau (mean multiplier 1 + tau - tau^2), as keyword
    arguments of the presets: `mgup_adamw(lr, **paper_defaults(0.25))`."""
    _check_ratio(mask_ratio)
    if mask_ratio == 0:
        raise ValueError("paper_defaults: mask_ratio = 0 gives alpha = 1 / 0; use a ratio in (0, 1].")
    return {"mask_ratio": mask_ratio, "alpha": 1.0 / mask_ratio, "gamma": mask_ratio}


def _static(x: Any) -> bool:
    """A Python or NumPy number (not a JAX array): k is then computed while tracing."""
    return isinstance(x, numbers.Real) and not isinstance(x, jax.Array)


def _concrete(x: Any) -> float | None:
    """x as a Python float, or None when it is traced (inside jit, e.g. a hyperparameter of inject_hyperparams):
    values are checked whenever they are known."""
    try:
        return float(x)
    except jax.errors.ConcretizationTypeError:
        return None


def _check_ratio(mask_ratio: Scalar) -> None:
    value = _concrete(mask_ratio)
    if value is not None and not 0.0 <= value <= 1.0:
        raise ValueError(f"mask_ratio = {value} must be in [0, 1].")


def check_arguments(mask_ratio: Scalar, alpha: Scalar, gamma: Scalar, selection: str) -> None:
    _check_ratio(mask_ratio)
    a, g = _concrete(alpha), _concrete(gamma)
    if (a is not None and not a > 0) or (g is not None and not g > 0):
        raise ValueError(
            f"alpha = {alpha} and gamma = {gamma} must be > 0 (gamma = 0 would drop the misaligned "
            "coordinates, which MGUP never does)."
        )
    if selection not in SELECTIONS:
        raise ValueError(f"selection = {selection!r}; allowed: {list(SELECTIONS)}.")


def num_selected(mask_ratio: Scalar, size: int) -> int | jax.Array:
    """k = int(mask_ratio * size), the number of coordinates MGUP gives alpha in a tensor of `size` entries.

    A Python number gives a Python int (Python's double product, floored: the reference's rule). A scalar array
    gives an int32 scalar computed on device with the same value as int(float(mask_ratio) * size): float64 by the
    same double product; float32 (bfloat16 and float16 are widened exactly) by the exact floor of m * size / 2^s
    for mask_ratio = m 2^-s, in 32-bit integer limbs (no float64 needed; equal to the double product's floor for
    size < 2^29, where that product is exact). Values outside [0, 1] are clipped to k in [0, size].
    """
    if _static(mask_ratio):
        return int(float(mask_ratio) * size)
    r = jnp.asarray(mask_ratio)
    k = jnp.floor(r * size) if r.dtype == jnp.float64 else _floor_times(r.astype(jnp.float32), size)
    return jnp.clip(k, 0, size).astype(jnp.int32)


def _floor_times(r: jax.Array, n: int) -> jax.Array:
    """floor(r * n) exactly, for a float32 scalar r in [0, 1] and 0 <= n < 2^31 (int32; r < 0 gives 0)."""
    u32 = jnp.uint32
    bits = jax.lax.bitcast_convert_type(r, u32)
    exponent = (bits >> 23) & u32(0xFF)
    mantissa = (bits & u32(0x7FFFFF)) | jnp.where(exponent > 0, u32(1 << 23), u32(0))  # r = mantissa * 2^-shift
    shift = u32(150) - jnp.maximum(exponent, u32(1))  # >= 23 for r < 2
    # mantissa * n as hi * 2^32 + lo from 16-bit limbs (every partial product fits in 32 bits).
    a1, a0 = mantissa >> 16, mantissa & u32(0xFFFF)
    b1, b0 = u32(n >> 16), u32(n & 0xFFFF)
    low = a0 * b0
    mid = a0 * b1 + a1 * b0  # < 2^32: a0 * b1 < 2^31, a1 * b0 < 2^24
    lo = low + (mid << 16)
    hi = a1 * b1 + (mid >> 16) + (lo < low).astype(u32)
    small = jnp.minimum(shift, u32(31))  # shift < 32: the result takes bits of hi and lo
    below = (hi << (u32(32) - small)) | (lo >> small)
    big = jnp.maximum(shift, u32(32)) - u32(32)  # shift >= 32: of hi alone
    above = jnp.where(big < 32, hi >> jnp.minimum(big, u32(31)), u32(0))
    k = jnp.where(shift < 32, below, above)
    return jnp.where(r >= 1, u32(n), jnp.where(r > 0, k, u32(0))).astype(jnp.int32)


def mgup_mask(
    update: jax.Array,
    grad: jax.Array,
    *,
    mask_ratio: Scalar = 0.5,
    alpha: Scalar = 2.0,
    gamma: Scalar = 0.1,
    selection: str = "exact",
) -> jax.Array:
    """phi for one tensor: alpha on the top k = int(mask_ratio * size) coordinates of update * grad, gamma elsewhere.

    update, grad: arrays of one shape (any float dtype). selection: "exact" (top-k), "approx" (threshold from a
    sample) or "sign" (alpha where update * grad >= 0: Cautious-MGUP; `mask_ratio` unused). Returns phi in float32
    (float64 for float64 updates), update's shape.
    """
    check_arguments(mask_ratio, alpha, gamma, selection)
    ((chosen, _),) = _select([update], [grad], mask_ratio, selection)
    return jnp.where(chosen, alpha, gamma).astype(_score_dtype(update))


def _score_dtype(update: jax.Array):
    return jnp.promote_types(update.dtype, jnp.float32)


def _product(u: jax.Array, g: jax.Array, dtype) -> jax.Array:
    return u.astype(dtype) * g.astype(dtype)


def _select(
    updates: list[jax.Array],
    grads: list[jax.Array],
    mask_ratio: Scalar,
    selection: str,
    samples: list | None = None,
) -> list[tuple[jax.Array, jax.Array]]:
    """Per tensor: (the coordinates that get alpha, bool of its shape; their fraction, exact or estimated, float32).

    "approx": tensors of more than 2 APPROX_SAMPLE entries get the threshold of their strided sample, all such
    tensors in one batched search (per-tensor small searches would cost more on CPU than the pass over the tensor);
    smaller ones are selected exactly. "sign" on such tensors reports the fraction of its second sample, not a
    count (which would cost a pass over the tensor). `samples[i]`: ((direction, grad) at strided_sample, the same
    at the second sample) of tensor i, computed elsewhere (see `with_mgup`); by default sliced from the tensors.
    A traced `mask_ratio` takes the same paths with k on device; "approx" then also covers k = 0 and k = size (no
    coordinate, every coordinate) on its large tensors, as the exact path does.
    """
    static = _static(mask_ratio)
    out: list = [None] * len(updates)
    sampled = []
    for i, (u, g) in enumerate(zip(updates, grads)):
        n = u.size
        k = num_selected(mask_ratio, n) if selection != "sign" else 0
        if n > 2 * APPROX_SAMPLE and (selection == "sign" or (selection == "approx" and (not static or 0 < k < n))):
            sampled.append(i)
        elif selection == "sign":
            chosen = _product(u, g, _score_dtype(u)) >= 0
            out[i] = chosen, count_at_least(chosen, [jnp.bool_(True)])[0] / max(n, 1)
        elif static:
            # full_like: the constant carries u's mesh-axis type (a state leaf inside shard_map must)
            fraction = jnp.full_like(u, k, jnp.float32, ()) / max(n, 1)
            out[i] = top_k_mask(_product(u, g, _score_dtype(u)), k), fraction
        else:  # (the same float32 division as above)
            fraction = jnp.zeros_like(u, jnp.float32, ()) + jnp.asarray(k).astype(jnp.float32) / max(n, 1)
            out[i] = top_k_mask(_product(u, g, _score_dtype(u)), k), fraction
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
        chosen, fraction = ordered_keys(_product(updates[i], grads[i], dtype)) >= thresholds[j], fractions[j]
        if not static:
            n = updates[i].size
            k = num_selected(mask_ratio, n)
            chosen = (chosen & (k > 0)) | (k >= n)
            fraction = jnp.where(k <= 0, 0.0, jnp.where(k >= n, 1.0, fraction))
        out[i] = chosen, fraction
    return out


def select_masks(
    updates: list[jax.Array],
    grads: list[jax.Array],
    mask_ratio: Scalar,
    selection: str,
    samples: list | None = None,
) -> tuple[list[jax.Array], jax.Array]:
    """(chosen per tensor, the selected fraction over all their coordinates: sum_i f_i n_i / sum_i n_i, float32)."""
    pairs = _select(updates, grads, mask_ratio, selection, samples)
    total = max(sum(u.size for u in updates), 1)
    fraction = sum(f * (u.size / total) for u, (_, f) in zip(updates, pairs))
    return [c for c, _ in pairs], jnp.asarray(fraction, jnp.float32)


def leaves_like(reference: Any, tree: Any) -> list:
    """The leaves of `tree`, which has `reference`'s structure (checked), in `reference`'s leaf order."""
    return jax.tree.leaves(jax.tree.map(lambda _, x: x, reference, tree))


def _apply(u: jax.Array, chosen: jax.Array, alpha: Scalar, gamma: Scalar) -> jax.Array:
    """u * phi with phi = alpha where chosen else gamma, computed in u's dtype widened to float32, returned in u's."""
    return (u * jnp.where(chosen, alpha, gamma).astype(_score_dtype(u))).astype(u.dtype)


class MGUPState(NamedTuple):
    """selected_fraction: the share of all coordinates that got alpha at the last step (float32 scalar):
    sum int(tau n) / sum n with "exact"; with "approx" and "sign", counted on tensors of at most 2 APPROX_SAMPLE
    entries and estimated on larger ones from a strided sample (for "approx" disjoint from the one that set the
    threshold; unbiased, standard error at most 0.5 / sqrt(APPROX_SAMPLE) per tensor). 0 before the first step."""

    selected_fraction: jax.Array


def scale_by_mgup(
    *, mask_ratio: Scalar = 0.5, alpha: Scalar = 2.0, gamma: Scalar = 0.1, selection: str = "exact"
) -> optax.GradientTransformationExtraArgs:
    """Multiplies each tensor u of the incoming direction by its MGUP mask phi = mgup_mask(u, g), ranked against
    the raw gradient g: u <- u * phi (u's dtype; phi computed in float32 or wider). State: MGUPState.

    The gradient reaches it through the extra argument `grad=` (pass it from a wrapper, or use `with_mgup`), so
    it composes after any scaler: `optax.chain(scale_by_hf_adam(), ...)` is not enough on its own because a
    chain's later links only see the previous link's output. Presets below wire it up. The optional `samples=`
    gives "approx" its two strided samples of (direction, gradient) computed elsewhere (see `with_mgup`).
    """
    check_arguments(mask_ratio, alpha, gamma, selection)

    def init(params):
        del params
        return MGUPState(jnp.zeros((), jnp.float32))

    def update(updates, state, params=None, *, grad=None, samples=None, **extra):
        del params, extra
        if grad is None:
            raise ValueError("scale_by_mgup needs the raw gradient: call update(..., grad=grads) or use with_mgup.")
        leaves, treedef = jax.tree.flatten(updates)
        grads = leaves_like(updates, grad)
        per_leaf = None
        if samples is not None:  # [(direction, grad) trees at strided_sample, the same at the second sample]
            (ua, ga), (ub, gb) = [(leaves_like(updates, u), leaves_like(updates, g)) for u, g in samples]
            per_leaf = [((a, b), (c, d)) for a, b, c, d in zip(ua, ga, ub, gb)]
        chosen, fraction = select_masks(leaves, grads, mask_ratio, selection, per_leaf)
        out = [_apply(u, c, alpha, gamma) for u, c in zip(leaves, chosen)]
        return jax.tree.unflatten(treedef, out), MGUPState(fraction)

    return optax.GradientTransformationExtraArgs(init, update)


class DirectionFn(Protocol):
    """`direction(new_state, grads) -> updates`: a transformation's output recomputed from its updated state and
    the gradient, elementwise, so that it also applies to strided samples of both (each leaf a 1-D sample)."""

    def __call__(self, state: optax.OptState, grads: optax.Updates) -> optax.Updates: ...


class DirectionTransformation(NamedTuple):
    """An optax transformation (`init`, `update`, as optax.GradientTransformation's) whose output is an elementwise
    function of its *updated* state and the gradient, which `direction` recomputes. `with_mgup` uses it to take
    the samples of "approx" and "sign" without the full direction; optax.chain and friends accept it as a
    GradientTransformation (they read `init` and `update`)."""

    init: optax.TransformInitFn
    update: optax.TransformUpdateFn
    direction: DirectionFn


class MGUPChainState(NamedTuple):
    """The state of `with_mgup`: inner (the direction's), mask (MGUPState, or EmptyState for Cautious), tail (the
    chain of the transforms after the mask). Leaves in that order, as the tuple it replaces."""

    inner: optax.OptState
    mask: optax.OptState
    tail: optax.OptState


def with_mgup(
    inner: optax.GradientTransformation | DirectionTransformation,
    mask: optax.GradientTransformationExtraArgs,
    *after: optax.GradientTransformation,
) -> optax.GradientTransformation:
    """`inner` (a direction d), then `mask` (d -> d * phi, given the raw gradient as `grad=`), then `after` (weight
    decay, learning rate). State: MGUPChainState.

    If `inner` is a DirectionTransformation (HF-style Adam), the samples that "approx" and "sign" take of the
    direction are computed from strided samples of its updated state and the gradient, not sliced from the full
    direction: the full direction then has a single consumer, and XLA fuses it into the parameter update instead of
    writing it to memory and reading it back (one pass less per tensor on CPU). The updated state is read, not the
    old one: reading a donated old state beside its in-place update makes XLA copy it whole. The exact selection
    ignores the samples (and jit drops them).
    """
    tail = optax.chain(*after)
    direction_of = inner.direction if isinstance(inner, DirectionTransformation) else None

    def init(params):
        return MGUPChainState(inner.init(params), mask.init(params), tail.init(params))

    def sampled(direction: DirectionFn, grads, inner_state, second: bool):
        take = lambda x: strided_sample(x, APPROX_SAMPLE, second=second)  # noqa: E731
        g = jax.tree.map(take, grads)
        state = optax.tree_utils.tree_map_params(inner, take, inner_state, transform_non_params=lambda x: x)
        return direction(state, g), g

    def update(grads, state, params=None):
        direction, inner_state = inner.update(grads, state.inner, params)
        samples = None
        if direction_of is not None:
            samples = [sampled(direction_of, grads, inner_state, b) for b in (False, True)]
        masked, mask_state = mask.update(direction, state.mask, params, grad=grads, samples=samples)
        out, tail_state = tail.update(masked, state.tail, params)
        return out, MGUPChainState(inner_state, mask_state, tail_state)

    return optax.GradientTransformation(init, update)


class HFAdamState(NamedTuple):
    """count: steps taken (int32 scalar); mu, nu: first and second moments, trees like the parameters (float32, or
    the parameters' dtype if wider)."""

    count: jax.Array  # type: ignore[assignment]  # (shadows tuple.count, as optax's states do)
    mu: optax.Updates
    nu: optax.Updates


def _as(x: Scalar, dtype) -> jax.Array:
    """A scalar hyperparameter in `dtype`: numbers and arrays then give the same arithmetic (e.g. 1 - b1)."""
    return jnp.asarray(x, dtype)


def scale_by_hf_adam(*, b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-6) -> DirectionTransformation:
    """The reference's AdamW direction, per leaf (moments in float32, or the parameters' dtype if wider; output in
    the gradient's dtype), t counted from 1:

        m <- b1 m + (1 - b1) g ;  v <- b2 v + (1 - b2) g^2
        u  = sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)

    eps is on the uncorrected sqrt(v) (optax.scale_by_adam puts it on sqrt(v_hat), which changes the values and the
    ranking). b1, b2, eps are cast to the moments' dtype first. A DirectionTransformation."""

    def init(params):
        zeros = lambda p: jnp.zeros_like(p, jnp.promote_types(p.dtype, jnp.float32))  # noqa: E731 (keeps sharding)
        return HFAdamState(jnp.zeros((), jnp.int32), jax.tree.map(zeros, params), jax.tree.map(zeros, params))

    def direction(state, grads):
        def one(m, v, g):
            t = state.count.astype(m.dtype)
            beta1, beta2, epsilon = _as(b1, m.dtype), _as(b2, m.dtype), _as(eps, m.dtype)
            # m * (1 / (...)) rather than m / (...): XLA:CPU will not fuse a divide into a consumer that reads the
            # direction twice (the MGUP mask and the step), and would write the direction to memory instead.
            return (jnp.sqrt(1 - beta2**t) / (1 - beta1**t) * m * (1 / (jnp.sqrt(v) + epsilon))).astype(g.dtype)

        return jax.tree.map(one, state.mu, state.nu, grads)

    def update(grads, state, params=None):
        del params

        def moment(decay, x, g):
            d = _as(decay, x.dtype)
            return d * x + (1 - d) * g

        mu = jax.tree.map(lambda m, g: moment(b1, m, g.astype(m.dtype)), state.mu, grads)
        nu = jax.tree.map(lambda v, g: moment(b2, v, jnp.square(g.astype(v.dtype))), state.nu, grads)
        new = HFAdamState(state.count + 1, mu, nu)
        return direction(new, grads), new

    return DirectionTransformation(init, update, direction)


class LionState(NamedTuple):
    """mu: Lion's momentum, a tree like the parameters (float32, or the parameters' dtype if wider)."""

    mu: optax.Updates


def scale_by_lion_direction(*, b1: Scalar = 0.9, b2: Scalar = 0.99) -> optax.GradientTransformation:
    """Lion's direction, per leaf: c = sign(b1 m + (1 - b1) g) (sign(0) = 0; gradient's dtype), then
    m <- b2 m + (1 - b2) g (float32 or wider; b1, b2 cast to it first)."""

    def init(params):
        return LionState(jax.tree.map(lambda p: jnp.zeros_like(p, jnp.promote_types(p.dtype, jnp.float32)), params))

    def update(grads, state, params=None):
        del params

        def interpolate(beta, m, g):
            b = _as(beta, m.dtype)
            return b * m + (1 - b) * g.astype(m.dtype)

        out = jax.tree.map(lambda m, g: jnp.sign(interpolate(b1, m, g)).astype(g.dtype), state.mu, grads)
        mu = jax.tree.map(lambda m, g: interpolate(b2, m, g), state.mu, grads)
        return out, LionState(mu)

    return optax.GradientTransformation(init, update)


def scale_by_cautious() -> optax.GradientTransformationExtraArgs:
    """Cautious optimizers (Liang et al., arXiv 2411.16085), per tensor: u <- u * 1[u g > 0] / max(mean(1[u g > 0]),
    1e-3) (in float32, returned in u's dtype); misaligned coordinates get no step. (For Adam, u and m have the same
    sign.) Needs `grad=` (see `with_mgup`). Stateless."""

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


def decay_and_learning_rate(
    learning_rate: Scalar | optax.Schedule, weight_decay: Scalar, mask=None
) -> list[optax.GradientTransformation]:
    """p <- p - lr wd p - lr * direction: the reference's decoupled decay with the raw learning rate (on the
    leaves `mask` selects, as in optax.add_decayed_weights). A weight decay of Python 0 adds no transform; an array
    (e.g. injected) always adds one."""
    skip = _static(weight_decay) and weight_decay == 0
    decay = [] if skip else [optax.add_decayed_weights(weight_decay, mask)]
    return decay + [optax.scale_by_learning_rate(learning_rate)]


def mgup_adamw(
    learning_rate: Scalar | optax.Schedule = 1e-3,
    *,
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    eps: Scalar = 1e-6,
    weight_decay: Scalar = 0.0,
    mask_ratio: Scalar = 0.5,
    alpha: Scalar = 2.0,
    gamma: Scalar = 0.1,
    selection: str = "exact",
    weight_decay_mask: Any = None,
) -> optax.GradientTransformation:
    """MGUP-AdamW (reference MGUP_AdamW.py; docs/mgup.md, "MGUP-AdamW"), per tensor:

        p <- p - lr wd p - lr * u * phi,   u = scale_by_hf_adam's direction,   phi = mgup_mask(u, g)

    Defaults are the reference's. `weight_decay_mask`: which leaves decay (optax.add_decayed_weights' mask: a tree
    of bools or a callable; default all; with optax.inject_hyperparams, name a callable in `static_args`)."""
    return with_mgup(
        scale_by_hf_adam(b1=b1, b2=b2, eps=eps),
        scale_by_mgup(mask_ratio=mask_ratio, alpha=alpha, gamma=gamma, selection=selection),
        *decay_and_learning_rate(learning_rate, weight_decay, weight_decay_mask),
    )


def cautious_mgup_adamw(
    learning_rate: Scalar | optax.Schedule = 1e-3,
    *,
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    eps: Scalar = 1e-6,
    weight_decay: Scalar = 0.0,
    alpha: Scalar = 2.0,
    gamma: Scalar = 0.1,
    weight_decay_mask: Any = None,
) -> optax.GradientTransformation:
    """Cautious-MGUP-AdamW (docs/mgup.md, "Cautious-MGUP-AdamW"): MGUP-AdamW with phi = alpha where u * g >= 0,
    gamma elsewhere (no top-k)."""
    return with_mgup(
        scale_by_hf_adam(b1=b1, b2=b2, eps=eps),
        scale_by_mgup(alpha=alpha, gamma=gamma, selection="sign"),
        *decay_and_learning_rate(learning_rate, weight_decay, weight_decay_mask),
    )


def mgup_lion(
    learning_rate: Scalar | optax.Schedule = 1e-4,
    *,
    b1: Scalar = 0.9,
    b2: Scalar = 0.99,
    weight_decay: Scalar = 0.0,
    mask_ratio: Scalar = 0.5,
    alpha: Scalar = 2.0,
    gamma: Scalar = 0.1,
    selection: str = "exact",
    weight_decay_mask: Any = None,
) -> optax.GradientTransformation:
    """MGUP-Lion (reference MGUP_Lion.py; docs/mgup.md, "MGUP-Lion"), per tensor:

    p <- p - lr wd p - lr * c * phi,   c = sign(b1 m + (1 - b1) g),   phi = mgup_mask(c, g),
    then m <- b2 m + (1 - b2) g."""
    return with_mgup(
        scale_by_lion_direction(b1=b1, b2=b2),
        scale_by_mgup(mask_ratio=mask_ratio, alpha=alpha, gamma=gamma, selection=selection),
        *decay_and_learning_rate(learning_rate, weight_decay, weight_decay_mask),
    )


def cautious_adamw(
    learning_rate: Scalar | optax.Schedule = 1e-3,
    *,
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    eps: Scalar = 1e-6,
    weight_decay: Scalar = 0.0,
    weight_decay_mask: Any = None,
) -> optax.GradientTransformation:
    """C-AdamW, the Cautious baseline (docs/mgup.md, "Related: Cautious optimizers"), on the same HF-style AdamW as
    MGUP-AdamW, so the two differ by the mask: p <- p - lr wd p - lr * scale_by_cautious(u)."""
    return with_mgup(
        scale_by_hf_adam(b1=b1, b2=b2, eps=eps),
        scale_by_cautious(),
        *decay_and_learning_rate(learning_rate, weight_decay, weight_decay_mask),
    )


def state_metrics(opt_state: Any) -> dict[str, jax.Array]:
    """MGUP's training metrics read from an optimizer state: {"mgup/selected_fraction": f} (float32; shape [] or
    the leading axes of a stacked state, e.g. [sites]), the share of coordinates that got alpha at the last step
    (MGUPState.selected_fraction); {} if the state holds no MGUPState.

    The MGUP states are found anywhere in the tree (optax.chain, multi_transform, masked, inject_hyperparams
    nesting). Several (e.g. mgup_muon with adam_mgup=True) are reported separately, named by the dict keys on their
    path ("mgup/muon/selected_fraction", "mgup/adam/selected_fraction"), or by their full path if those clash.
    Each fraction is over the coordinates its own transform covers.
    """
    is_state = lambda x: isinstance(x, MGUPState)  # noqa: E731
    found = [
        (path, s) for path, s in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_state)[0] if is_state(s)
    ]
    if len(found) == 1:
        return {"mgup/selected_fraction": found[0][1].selected_fraction}

    def short(path) -> str:
        return "/".join(str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey))

    names = [short(path) for path, _ in found]
    if len(set(names)) < len(names) or not all(names):
        names = [jax.tree_util.keystr(path).strip(".") for path, _ in found]
    return {f"mgup/{name}/selected_fraction": s.selected_fraction for name, (_, s) in zip(names, found)}
