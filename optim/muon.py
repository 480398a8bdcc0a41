"""MGUP-Muon (reference MGUP_Muon.py, Moonlight-style Muon) as an optax transform.

Muon for 2-D weight matrices (by default all except embeddings and the output head), AdamW for everything else:

    buf <- mu buf + G ;  G_hat <- G + mu buf (Nesterov) else buf
    phi <- MGUP mask of G_hat * G                     (ranked BEFORE orthogonalisation)
    O   <- NS5(G_hat)                                 (quintic Newton-Schulz, coefficients (3.4445, -4.7750, 2.0315),
                                                       input / (||.||_F + 1e-7), transposed when rows > cols)
    p   <- p (1 - lr wd) - lr 0.2 sqrt(max(rows, cols)) O phi

The AdamW branch is the reference's HF-style AdamW with the same lr and wd (betas 0.95, 0.95, eps 1e-8), without
a mask unless `adam_mgup=True`. The reference runs Newton-Schulz in bfloat16; `ns_dtype` chooses (float32 by
default here: XLA:CPU's bfloat16 matmuls are slow and no more faithful to the math).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim.mgup import _check as check_mgup
from optim.mgup import _decay_and_lr, mgup_mask, scale_by_hf_adam, scale_by_mgup, with_mgup

__all__ = ["NS_COEFFICIENTS", "default_muon_labels", "mgup_muon", "newton_schulz", "scale_by_muon"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_NOT_MUON = re.compile(r"embed|head|lm_head|unembed", re.IGNORECASE)


def newton_schulz(g: jax.Array, steps: int = 5, *, dtype=None) -> jax.Array:
    """The quintic Newton-Schulz iteration of Muon: approximately U V^T of g = U S V^T (singular values land in
    about [0.5, 1.5]). Computed in `dtype` (default: g's, at least float32); returns g's dtype."""
    if g.ndim != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix; got shape {g.shape}.")
    a, b, c = NS_COEFFICIENTS
    x = g.astype(dtype or jnp.promote_types(g.dtype, jnp.float32))
    tall = g.shape[0] > g.shape[1]
    if tall:
        x = x.T
    x = x / (jnp.linalg.norm(x) + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return (x.T if tall else x).astype(g.dtype)


class MuonState(NamedTuple):
    momentum: optax.Updates


def scale_by_muon(
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    *,
    mask_ratio: float = 0.5,
    alpha: float = 2.0,
    gamma: float = 0.1,
    mgup: bool = True,
    selection: str = "exact",
    ns_dtype=jnp.float32,
) -> optax.GradientTransformation:
    """The Muon direction 0.2 sqrt(max(rows, cols)) NS5(G_hat) x phi of every (2-D) leaf; phi = 1 if not `mgup`."""
    if mgup:
        check_mgup(mask_ratio, alpha, gamma, selection)

    def init(params):
        return MuonState(jax.tree.map(lambda p: jnp.zeros_like(p, jnp.promote_types(p.dtype, jnp.float32)), params))

    def update(grads, state, params=None):
        del params
        buf = jax.tree.map(lambda m, g: momentum * m + g.astype(m.dtype), state.momentum, grads)

        def one(m, g):
            g_hat = g.astype(m.dtype) + momentum * m if nesterov else m
            o = newton_schulz(g_hat, ns_steps, dtype=ns_dtype).astype(m.dtype)
            if mgup:
                o = o * mgup_mask(g_hat, g, mask_ratio, alpha, gamma, selection=selection).astype(m.dtype)
            return (0.2 * max(g.shape) ** 0.5 * o).astype(g.dtype)

        return jax.tree.map(one, buf, grads), MuonState(buf)

    return optax.GradientTransformation(init, update)


def default_muon_labels(params) -> object:
    """'muon' for 2-D leaves whose path names no embedding or head, 'adam' for the rest."""

    def label(path, leaf):
        name = jax.tree_util.keystr(path)
        return "muon" if jnp.ndim(leaf) == 2 and not _NOT_MUON.search(name) else "adam"

    return jax.tree_util.tree_map_with_path(label, params)


def mgup_muon(
    learning_rate: float | optax.Schedule = 1e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    adam_b1: float = 0.95,
    adam_b2: float = 0.95,
    adam_eps: float = 1e-8,
    mask_ratio: float = 0.5,
    alpha: float = 2.0,
    gamma: float = 0.1,
    *,
    labels: Callable | None = None,
    adam_mgup: bool = False,
    mgup: bool = True,
    selection: str = "exact",
    ns_dtype=jnp.float32,
    weight_decay_mask=None,
) -> optax.GradientTransformation:
    """MGUP-Muon; `mgup=False` gives plain Moonlight-style Muon (the base optimizer) with the same code.

    labels: params -> a tree of 'muon' / 'adam' (default `default_muon_labels`); every 'muon' leaf must be 2-D.
    weight_decay_mask: which leaves decay, in both branches (optax.add_decayed_weights' mask; default all).
    """
    labels = labels or default_muon_labels
    muon = optax.chain(
        scale_by_muon(
            momentum,
            nesterov,
            ns_steps,
            mask_ratio=mask_ratio,
            alpha=alpha,
            gamma=gamma,
            mgup=mgup,
            selection=selection,
            ns_dtype=ns_dtype,
        ),
        *_decay_and_lr(learning_rate, weight_decay, weight_decay_mask),
    )
    adam_direction = scale_by_hf_adam(adam_b1, adam_b2, adam_eps)
    if adam_mgup and mgup:
        adam = with_mgup(
            adam_direction,
            scale_by_mgup(mask_ratio, alpha, gamma, selection=selection),
            *_decay_and_lr(learning_rate, weight_decay, weight_decay_mask),
        )
    else:
        adam = optax.chain(adam_direction, *_decay_and_lr(learning_rate, weight_decay, weight_decay_mask))

    def checked_labels(params):
        tree = labels(params)
        for (path, leaf), name in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(tree)):
            if name == "muon" and jnp.ndim(leaf) != 2:
                raise ValueError(
                    f"mgup_muon: {jax.tree_util.keystr(path)} (shape {jnp.shape(leaf)}) is labelled "
                    "'muon' but Muon takes 2-D matrices only; label it 'adam'."
                )
        return tree

    return optax.multi_transform({"muon": muon, "adam": adam}, checked_labels)
