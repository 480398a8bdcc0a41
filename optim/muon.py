"""MGUP-Muon (reference MGUP_Muon.py, Moonlight-style Muon; docs/mgup.md, "MGUP-Muon") as an optax transform.

Muon for 2-D weight matrices (by default all except embeddings and the output head), AdamW for everything else:

    buf <- mu buf + G ;  G_hat <- G + mu buf (Nesterov) else buf
    phi <- MGUP mask of G_hat * G                     (ranked BEFORE orthogonalisation)
    O   <- NS5(G_hat)                                 (quintic Newton-Schulz, coefficients (3.4445, -4.7750, 2.0315),
                                                       input / (||.||_F + 1e-7), transposed when rows > cols)
    p   <- p (1 - lr wd) - lr 0.2 sqrt(max(rows, cols)) O phi

The AdamW branch is the reference's HF-style AdamW with the same lr and wd (betas 0.95, 0.95, eps 1e-8), without
a mask unless `adam_mgup=True`. The reference runs Newton-Schulz in bfloat16; `ns_dtype` chooses (float32 by
default here). Every argument after the learning rate is keyword-only; the numeric ones may be arrays
(optax.inject_hyperparams, see optim/transform.py). Built from optim/transform.py's pieces, as optim/alias.py's
presets are; `mgup=False` gives the base Muon with the same code.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim.alias import decay_and_learning_rate
from optim.select import Scalar, select_masks
from optim.transform import (
    MGUPState,
    check_arguments,
    leaves_like,
    refuse_complex,
    scale_by_hf_adam,
    scale_by_mgup,
    with_mgup,
)

__all__ = ["NS_COEFFICIENTS", "MuonState", "default_muon_labels", "mgup_muon", "newton_schulz", "scale_by_muon"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_NOT_MUON = re.compile(r"embed|head|lm_head|unembed", re.IGNORECASE)


def newton_schulz(g: jax.Array, steps: int | jax.Array = 5, *, dtype=None) -> jax.Array:
    """The quintic Newton-Schulz iteration of Muon on a matrix g [rows, cols]: approximately U V^T of g = U S V^T
    (singular values land in about [0.5, 1.5]). With x = g / (||g||_F + 1e-7) (transposed when rows > cols), `steps`
    times: s = x x^T, x <- a x + (b s + c s s) x, (a, b, c) = NS_COEFFICIENTS. Computed in `dtype` (default: g's, at
    least float32); returns g's dtype and shape. `steps`: a Python int (unrolled) or an int scalar array (a loop)."""
    if g.ndim != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix; got shape {g.shape}.")
    a, b, c = NS_COEFFICIENTS
    x = g.astype(dtype or jnp.promote_types(g.dtype, jnp.float32))
    tall = g.shape[0] > g.shape[1]
    if tall:
        x = x.T
    x = x / (jnp.linalg.norm(x) + 1e-7)

    def step(x):
        s = x @ x.T
        return a * x + (b * s + c * s @ s) @ x

    if isinstance(steps, int):
        for _ in range(steps):
            x = step(x)
    else:
        x = jax.lax.fori_loop(0, steps, lambda _, x: step(x), x)
    return (x.T if tall else x).astype(g.dtype)


class MuonState(NamedTuple):
    """momentum: the SGD buffer, a tree like the parameters (float32 or wider); mgup: MGUPState (the selected
    fraction over the Muon leaves) when the mask is on, else None."""

    momentum: optax.Updates
    mgup: MGUPState | None


def scale_by_muon(
    *,
    momentum: Scalar = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    mask_ratio: Scalar = 0.5,
    alpha: Scalar = 2.0,
    gamma: Scalar = 0.1,
    mgup: bool = True,
    selection: str = "exact",
    ns_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """The Muon direction (docs/mgup.md, "MGUP-Muon") of every (2-D) leaf G [rows, cols], in G's dtype:

        buf <- mu buf + G                          (mu = momentum; no dampening)
        G_hat = G + mu buf  (nesterov)  else buf
        phi   = mgup_mask(G_hat, G)                (before orthogonalisation; phi = 1 if not `mgup`)
        out   = 0.2 sqrt(max(rows, cols)) NS5(G_hat) * phi      (NS5 = newton_schulz, `ns_steps` steps)

    ns_dtype: Newton-Schulz's dtype (default float32). State: MuonState. Raises ValueError for MGUP arguments
    optim.transform.check_arguments refuses, and at init for a complex parameter (named)."""
    if mgup:
        check_arguments(mask_ratio, alpha, gamma, selection)
    ns_dtype = ns_dtype or jnp.float32

    def init(params):
        refuse_complex(params, "Muon orthogonalises real matrices" + (" and MGUP ranks u * g" if mgup else ""))
        buf = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.promote_types(p.dtype, jnp.float32)), params)
        return MuonState(buf, MGUPState(jnp.zeros((), jnp.float32)) if mgup else None)

    def update(grads, state, params=None, **extra_args):
        del params, extra_args
        buf = jax.tree.map(lambda m, g: momentum * m + g.astype(m.dtype), state.momentum, grads)
        leaves, treedef = jax.tree.flatten(buf)
        g_leaves = leaves_like(buf, grads)
        g_hat = [g.astype(m.dtype) + momentum * m if nesterov else m for m, g in zip(leaves, g_leaves)]
        if mgup:
            chosen, fraction = select_masks(g_hat, g_leaves, mask_ratio, selection)
            phis = [jnp.where(c, alpha, gamma).astype(m.dtype) for c, m in zip(chosen, leaves)]
        out = []
        for i, (m, g, h) in enumerate(zip(leaves, g_leaves, g_hat)):
            o = newton_schulz(h, ns_steps, dtype=ns_dtype).astype(m.dtype)
            if mgup:
                o = o * phis[i]
            out.append((0.2 * max(g.shape) ** 0.5 * o).astype(g.dtype))
        return jax.tree.unflatten(treedef, out), MuonState(buf, MGUPState(fraction) if mgup else None)

    return optax.GradientTransformationExtraArgs(init, update)


def default_muon_labels(params) -> object:
    """'muon' for 2-D leaves whose path names no embedding or head, 'adam' for the rest."""

    def label(path, leaf):
        name = jax.tree_util.keystr(path)
        return "muon" if jnp.ndim(leaf) == 2 and not _NOT_MUON.search(name) else "adam"

    return jax.tree_util.tree_map_with_path(label, params)


def mgup_muon(
    learning_rate: Scalar | optax.Schedule = 1e-3,
    *,
    weight_decay: Scalar = 0.1,
    momentum: Scalar = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    adam_b1: Scalar = 0.95,
    adam_b2: Scalar = 0.95,
    adam_eps: Scalar = 1e-8,
    mask_ratio: Scalar = 0.5,
    alpha: Scalar = 2.0,
    gamma: Scalar = 0.1,
    labels: Callable | None = None,
    adam_mgup: bool = False,
    mgup: bool = True,
    selection: str = "exact",
    ns_dtype: Any = None,
    weight_decay_mask: Any = None,
) -> optax.GradientTransformation:
    """MGUP-Muon (reference MGUP_Muon.py; docs/mgup.md, "MGUP-Muon"; defaults: the reference's); `mgup=False`
    gives plain Moonlight-style Muon (the base optimizer) with the same code. Per leaf:

        'muon':  p <- p (1 - lr wd) - lr * scale_by_muon's direction
        'adam':  p <- p (1 - lr wd) - lr * u,  u = scale_by_hf_adam(b1=adam_b1, b2=adam_b2, eps=adam_eps)'s
                 direction (times its own MGUP mask if `adam_mgup`)

    labels: params -> a tree of 'muon' / 'adam' (default `default_muon_labels`); every 'muon' leaf must be 2-D.
    weight_decay_mask: which leaves decay, in both branches (optax.add_decayed_weights' mask; default all).
    ns_dtype: Newton-Schulz's dtype (default float32). With optax.inject_hyperparams, name `labels` and a callable
    `weight_decay_mask` in `static_args`. Raises ValueError at init for a complex parameter (named).
    """
    labels = labels or default_muon_labels
    muon = optax.chain(
        scale_by_muon(
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            mask_ratio=mask_ratio,
            alpha=alpha,
            gamma=gamma,
            mgup=mgup,
            selection=selection,
            ns_dtype=ns_dtype,
        ),
        *decay_and_learning_rate(learning_rate, weight_decay, weight_decay_mask),
    )
    adam_direction = scale_by_hf_adam(b1=adam_b1, b2=adam_b2, eps=adam_eps)
    if adam_mgup and mgup:
        adam = with_mgup(
            adam_direction,
            scale_by_mgup(mask_ratio=mask_ratio, alpha=alpha, gamma=gamma, selection=selection),
            *decay_and_learning_rate(learning_rate, weight_decay, weight_decay_mask),
        )
    else:
        plain = optax.GradientTransformation(adam_direction.init, adam_direction.update)
        adam = optax.chain(plain, *decay_and_learning_rate(learning_rate, weight_decay, weight_decay_mask))

    def checked_labels(params):
        refuse_complex(params, "Muon orthogonalises real matrices and its AdamW backup squares gradients")
        tree = labels(params)
        for (path, leaf), name in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(tree)):
            if name == "muon" and jnp.ndim(leaf) != 2:
                raise ValueError(
                    f"mgup_muon: {jax.tree_util.keystr(path)} (shape {jnp.shape(leaf)}) is labelled "
                    "'muon' but Muon takes 2-D matrices only; label it 'adam'."
                )
        return tree

    return optax.multi_transform({"muon": muon, "adam": adam}, checked_labels)
