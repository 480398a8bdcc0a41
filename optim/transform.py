"""MGUP's optax transforms (Chang & Yuan, arXiv 2606.17526; docs/mgup.md): the mask, the directions it multiplies,
their composition, and the metrics their state holds. The presets built from them are in optim/alias.py.

MGUP, per parameter tensor and step (docs/mgup.md, "The idea" and "The mask"), for a direction u (what the base
optimizer would step along) and the raw stochastic gradient g:

    s   = u * g                                      (elementwise; ranked per tensor, never across tensors)
    k   = int(tau * size)                            (floor; k = 0 gives every coordinate gamma)
    phi = alpha on the k largest entries of s, gamma elsewhere      (gamma > 0; no renormalisation)
    u  <- u * phi

The semantics follow the public PyTorch reference (MaeChd/MGUP): its AdamW is the HuggingFace-style one
(`scale_by_hf_adam`: eps on the uncorrected sqrt(v), bias correction folded into the step size, the ranked quantity
u * g rather than m * g); Lion ranks sign(b1 m + (1 - b1) g) * g and updates its momentum with b2 after the step
(`scale_by_lion_direction`). Decoupled weight decay p <- p - lr wd p uses the raw learning rate and is never masked
(optim.alias.decay_and_learning_rate).

Building blocks: `mgup_mask` (phi for one tensor), `scale_by_mgup` (u <- u * phi for every tensor of any inner
direction, so MGUP composes with other optax transforms), `scale_by_cautious` (the Cautious baseline's mask),
`with_mgup` (direction, then mask, then the rest). `state_metrics(opt_state)` reads the selected fraction out of
any optimizer state. The selection itself (which coordinates get alpha) is optim/select.py's.

Hyperparameters may be Python numbers or scalar arrays, so that
`optax.inject_hyperparams(optim.mgup_adamw)(learning_rate=..., weight_decay=..., mask_ratio=..., alpha=...,
gamma=...)` works (inside jit they are traced). Python numbers are checked when the transform is built and k is
computed while tracing; arrays are checked when concrete, and k is computed on device, equal to Python's
int(float(tau) * size) (optim.select.num_selected). Scalar coefficients are cast to the moments' dtype before use
(1 - b1 is computed in it), so a hyperparameter given as a number or as an array of the moments' dtype gives
bit-identical updates. Hyperparameters are keyword-only arguments.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import optax

from optim.select import (
    APPROX_SAMPLE,
    SELECTIONS,
    Scalar,
    count_at_least,
    score_dtype,
    select_masks,
    strided_pairs,
)

__all__ = [
    "DirectionFn",
    "DirectionTransformation",
    "HFAdamState",
    "LionState",
    "MGUPChainState",
    "MGUPState",
    "check_arguments",
    "check_ratio",
    "leaves_like",
    "mgup_mask",
    "refuse_complex",
    "scale_by_cautious",
    "scale_by_hf_adam",
    "scale_by_lion_direction",
    "scale_by_mgup",
    "state_metrics",
    "with_mgup",
]


def _concrete(x: Any) -> float | None:
    """x as a Python float, or None when it is traced (inside jit, e.g. a hyperparameter of inject_hyperparams):
    values are checked whenever they are known."""
    try:
        return float(x)
    except jax.errors.ConcretizationTypeError:
        return None


def refuse_complex(params: Any, why: str) -> None:
    """Raises ValueError naming the first complex leaf of `params` (arrays or shapes): `why` says what needs real
    numbers. A tree without leaves (optax.tree_utils' placeholder) passes."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.complexfloating):
            raise ValueError(
                f"parameter {jax.tree_util.keystr(path)} is {jnp.dtype(dtype).name}: {why}, which needs real "
                "parameters (optimise a complex parameter as its real and imaginary parts, or use optax's own "
                "AdamW or Lion)"
            )


def check_ratio(mask_ratio: Scalar) -> None:
    """Raises ValueError naming the value unless tau = mask_ratio is in [0, 1] (a traced value is not checked)."""
    value = _concrete(mask_ratio)
    if value is not None and not 0.0 <= value <= 1.0:
        raise ValueError(f"mask_ratio = {value} must be in [0, 1].")


def check_arguments(mask_ratio: Scalar, alpha: Scalar, gamma: Scalar, selection: str) -> None:
    """Raises ValueError naming the value unless mask_ratio is in [0, 1], alpha > 0, gamma > 0 (MGUP never drops a
    coordinate) and `selection` is one of SELECTIONS. Traced values are not checked; known arrays are."""
    check_ratio(mask_ratio)
    a, g = _concrete(alpha), _concrete(gamma)
    if (a is not None and not a > 0) or (g is not None and not g > 0):
        raise ValueError(
            f"alpha = {alpha} and gamma = {gamma} must be > 0 (gamma = 0 would drop the misaligned "
            "coordinates, which MGUP never does)."
        )
    if selection not in SELECTIONS:
        raise ValueError(f"selection = {selection!r}; allowed: {list(SELECTIONS)}.")


def mgup_mask(
    update: jax.Array,
    grad: jax.Array,
    *,
    mask_ratio: Scalar = 0.5,
    alpha: Scalar = 2.0,
    gamma: Scalar = 0.1,
    selection: str = "exact",
) -> jax.Array:
    """phi for one tensor (docs/mgup.md, "The mask"): alpha on the top k = int(mask_ratio * size) coordinates of
    update * grad, gamma elsewhere.

    update, grad: arrays of one shape (any float dtype). selection: "exact" (top-k), "approx" (threshold from a
    sample) or "sign" (alpha where update * grad >= 0: Cautious-MGUP; `mask_ratio` unused). Returns phi in float32
    (float64 for float64 updates), update's shape. Raises ValueError for arguments `check_arguments` refuses.
    """
    check_arguments(mask_ratio, alpha, gamma, selection)
    (chosen,), _ = select_masks([update], [grad], mask_ratio, selection)
    return jnp.where(chosen, alpha, gamma).astype(score_dtype(update))


def leaves_like(reference: Any, tree: Any) -> list:
    """The leaves of `tree`, which has `reference`'s structure (checked), in `reference`'s leaf order."""
    return jax.tree.leaves(jax.tree.map(lambda _, x: x, reference, tree))


def _apply(u: jax.Array, chosen: jax.Array, alpha: Scalar, gamma: Scalar) -> jax.Array:
    """u * phi with phi = alpha where chosen else gamma, computed in u's dtype widened to float32, returned in u's."""
    return (u * jnp.where(chosen, alpha, gamma).astype(score_dtype(u))).astype(u.dtype)


class MGUPState(NamedTuple):
    """selected_fraction: the share of all coordinates that got alpha at the last step (float32 scalar):
    sum int(tau n) / sum n with "exact"; with "approx" and "sign", counted on tensors of at most 2 APPROX_SAMPLE
    entries and estimated on larger ones from a strided sample (for "approx" disjoint from the one that set the
    threshold; unbiased, standard error at most 0.5 / sqrt(APPROX_SAMPLE) per tensor). 0 before the first step."""

    selected_fraction: jax.Array


def scale_by_mgup(
    *, mask_ratio: Scalar = 0.5, alpha: Scalar = 2.0, gamma: Scalar = 0.1, selection: str = "exact"
) -> optax.GradientTransformationExtraArgs:
    """MGUP's mask on every tensor u of the incoming direction, ranked against the raw gradient g:

        u <- u * phi,   phi = mgup_mask(u, g; mask_ratio, alpha, gamma, selection)

    (u's dtype; phi computed in float32 or wider). State: MGUPState.

    The gradient reaches it through the extra argument `grad=` (pass it from a wrapper, or use `with_mgup`), so
    it composes after any scaler: `optax.chain(scale_by_hf_adam(), ...)` is not enough on its own because a
    chain's later links only see the previous link's output. The optional `samples=` gives "approx" and "sign"
    their two strided samples of (direction, gradient), computed elsewhere (see `with_mgup`): a pair of trees like
    the direction whose leaves are optim.select.strided_pairs of its leaves and of the gradient's. Raises ValueError for
    arguments `check_arguments` refuses, and at update time when `grad=` is missing.
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
        if samples is not None:  # (direction, grad) trees of strided_pairs
            per_leaf = list(zip(leaves_like(updates, samples[0]), leaves_like(updates, samples[1])))
        chosen, fraction = select_masks(leaves, grads, mask_ratio, selection, per_leaf)
        out = [_apply(u, c, alpha, gamma) for u, c in zip(leaves, chosen)]
        return jax.tree.unflatten(treedef, out), MGUPState(fraction)

    return optax.GradientTransformationExtraArgs(init, update)


class DirectionFn(Protocol):
    """`direction(new_state, grads) -> updates`: a transformation's output recomputed from its updated state and
    the gradient, elementwise, so that it also applies to strided samples of both (each leaf [m, 2]: strided_pairs).
    """

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
    chain of the transforms after the mask). Leaves in that order."""

    inner: optax.OptState
    mask: optax.OptState
    tail: optax.OptState


def with_mgup(
    inner: optax.GradientTransformation | DirectionTransformation,
    mask: optax.GradientTransformationExtraArgs,
    *after: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
    """MGUP around a direction (docs/mgup.md, "The idea"): per step, with g the raw gradient,

        d = inner(g)  ;  d <- mask(d, grad=g)  ;  out = chain(*after)(d)

    e.g. mask = scale_by_mgup(...) and after = (weight decay, learning rate). State: MGUPChainState. Extra keyword
    arguments of `update` (optax.GradientTransformationExtraArgs) reach `inner` and `after`. Raises ValueError at
    init for a complex parameter, naming it (the ranking of u * g needs real numbers).

    If `inner` is a DirectionTransformation (HF-style Adam), the samples that "approx" and "sign" take of the
    direction are computed from strided samples of its updated state and the gradient, not sliced from the full
    direction: the full direction then has a single consumer, and XLA fuses it into the parameter update instead of
    writing it to memory and reading it back. The updated state is read, not the old one: reading a donated old
    state beside its in-place update makes XLA copy it whole. The exact selection ignores the samples (and jit
    drops them).
    """
    tail = optax.chain(*after) if after else optax.with_extra_args_support(optax.identity())
    direction_of = inner.direction if isinstance(inner, DirectionTransformation) else None
    inner_update = optax.with_extra_args_support(inner).update

    def init(params):
        refuse_complex(params, "MGUP and Cautious rank u * g")
        return MGUPChainState(inner.init(params), mask.init(params), tail.init(params))

    def sampled(direction: DirectionFn, grads, inner_state):
        take = lambda x: strided_pairs(x, APPROX_SAMPLE)  # noqa: E731
        g = jax.tree.map(take, grads)
        state = optax.tree_utils.tree_map_params(inner, take, inner_state, transform_non_params=lambda x: x)
        return direction(state, g), g

    def update(grads, state, params=None, **extra_args):
        direction, inner_state = inner_update(grads, state.inner, params, **extra_args)
        samples = None if direction_of is None else sampled(direction_of, grads, inner_state)
        masked, mask_state = mask.update(direction, state.mask, params, grad=grads, samples=samples)
        out, tail_state = tail.update(masked, state.tail, params, **extra_args)
        return out, MGUPChainState(inner_state, mask_state, tail_state)

    return optax.GradientTransformationExtraArgs(init, update)


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
    """The reference's AdamW direction (docs/mgup.md, "MGUP-AdamW"), per leaf, t counted from 1:

        m <- b1 m + (1 - b1) g ;  v <- b2 v + (1 - b2) g^2
        u  = sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)

    eps is on the uncorrected sqrt(v) (optax.scale_by_adam puts it on sqrt(v_hat), which changes the values and the
    ranking). Moments in float32, or the parameters' dtype if wider; b1, b2, eps cast to it first; the output in
    the gradient's dtype. State: HFAdamState. A DirectionTransformation (see `with_mgup`)."""

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

    def update(grads, state, params=None, **extra_args):
        del params, extra_args

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


def scale_by_lion_direction(*, b1: Scalar = 0.9, b2: Scalar = 0.99) -> optax.GradientTransformationExtraArgs:
    """Lion's direction (docs/mgup.md, "MGUP-Lion"), per leaf, no step counter:

        c  = sign(b1 m + (1 - b1) g)        (sign(0) = 0; in the gradient's dtype)
        m <- b2 m + (1 - b2) g              (after c; float32 or wider, b1 and b2 cast to it first)

    State: LionState."""

    def init(params):
        return LionState(jax.tree.map(lambda p: jnp.zeros_like(p, jnp.promote_types(p.dtype, jnp.float32)), params))

    def update(grads, state, params=None, **extra_args):
        del params, extra_args

        def interpolate(beta, m, g):
            b = _as(beta, m.dtype)
            return b * m + (1 - b) * g.astype(m.dtype)

        out = jax.tree.map(lambda m, g: jnp.sign(interpolate(b1, m, g)).astype(g.dtype), state.mu, grads)
        mu = jax.tree.map(lambda m, g: interpolate(b2, m, g), state.mu, grads)
        return out, LionState(mu)

    return optax.GradientTransformationExtraArgs(init, update)


def scale_by_cautious() -> optax.GradientTransformationExtraArgs:
    """The Cautious optimizers' mask (Liang et al., arXiv 2411.16085; docs/mgup.md, "Related: Cautious optimizers"),
    per tensor u of the direction, ranked against the raw gradient g:

        u <- u * 1[u g > 0] / max(mean(1[u g > 0]), 1e-3)

    (in float32, returned in u's dtype); misaligned coordinates get no step. (For Adam, u and m have the same
    sign.) Needs `grad=` (see `with_mgup`; raises ValueError without it). Stateless."""

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
