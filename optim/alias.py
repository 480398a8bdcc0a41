"""MGUP's presets (Chang & Yuan, arXiv 2606.17526; docs/mgup.md): complete optax optimizers built from
optim/transform.py, with the public PyTorch reference's (MaeChd/MGUP) defaults.

Each preset is `with_mgup(direction, mask, *decay_and_learning_rate(...))`, i.e. per tensor

    p <- p - lr wd p - lr * u * phi,    u = the base optimizer's direction,    phi = its mask

with decoupled weight decay on the raw learning rate, never masked. `paper_defaults(tau)` gives the paper's
alpha = 1 / tau, gamma = tau. Every argument after the learning rate is keyword-only; the numeric ones may be scalar
arrays (optax.inject_hyperparams; see optim/transform.py). MGUP-Muon is optim/muon.py's.
"""

from __future__ import annotations

from typing import Any

import optax

from optim.select import Scalar
from optim.transform import (
    check_ratio,
    scale_by_cautious,
    scale_by_hf_adam,
    scale_by_lion_direction,
    scale_by_mgup,
    with_mgup,
)

__all__ = [
    "cautious_adamw",
    "cautious_mgup_adamw",
    "decay_and_learning_rate",
    "mgup_adamw",
    "mgup_lion",
    "paper_defaults",
]


def paper_defaults(mask_ratio: float = 0.5) -> dict[str, float]:
    """The paper's stated choice alpha = 1 / tau, gamma = tau (mean multiplier 1 + tau - tau^2; docs/mgup.md, "The
    idea"), as keyword arguments of the presets: `mgup_adamw(lr, **paper_defaults(0.25))`. Raises ValueError for
    tau outside (0, 1]."""
    check_ratio(mask_ratio)
    if mask_ratio == 0:
        raise ValueError("paper_defaults: mask_ratio = 0 gives alpha = 1 / 0; use a ratio in (0, 1].")
    return {"mask_ratio": mask_ratio, "alpha": 1.0 / mask_ratio, "gamma": mask_ratio}


def decay_and_learning_rate(
    learning_rate: Scalar | optax.Schedule, weight_decay: Scalar, mask=None
) -> list[optax.GradientTransformation]:
    """The transforms after the mask, d -> -lr (d + wd p): the reference's decoupled decay p <- p - lr wd p with the
    raw learning rate (on the leaves `mask` selects, as in optax.add_decayed_weights), then the learning rate. The
    decay transform is there for every weight decay, 0 included (as in optax.adamw), so that the state has one
    structure whether the value is a number or injected (optax.inject_hyperparams)."""
    return [optax.add_decayed_weights(weight_decay, mask), optax.scale_by_learning_rate(learning_rate)]


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
    """MGUP-AdamW (reference MGUP_AdamW.py; docs/mgup.md, "MGUP-AdamW"), per tensor, t counted from 1:

        m <- b1 m + (1 - b1) g ;  v <- b2 v + (1 - b2) g^2 ;  u = m / (sqrt(v) + eps)
        phi = mgup_mask(u, g)     (alpha on the top int(tau size) of u * g, gamma elsewhere)
        p  <- p - lr wd p - lr sqrt(1 - b2^t) / (1 - b1^t) * u * phi

    Defaults are the reference's. `selection`: "exact" or "approx" (optim.select). `weight_decay_mask`: which leaves
    decay (optax.add_decayed_weights' mask: a tree of bools or a callable; default all; with
    optax.inject_hyperparams, name a callable in `static_args`). Raises ValueError for a mask_ratio outside [0, 1],
    alpha or gamma <= 0, or an unknown selection."""
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
    """Cautious-MGUP-AdamW (docs/mgup.md, "Cautious-MGUP-AdamW"): MGUP-AdamW with the sign rule instead of top-k,

        phi = alpha where u * g >= 0, gamma elsewhere

    Other arguments as `mgup_adamw`'s."""
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
    """MGUP-Lion (reference MGUP_Lion.py; docs/mgup.md, "MGUP-Lion"), per tensor, no step counter:

        c   = sign(b1 m + (1 - b1) g)
        phi = mgup_mask(c, g)
        p  <- p - lr wd p - lr * c * phi
        m  <- b2 m + (1 - b2) g

    Defaults are the reference's; other arguments as `mgup_adamw`'s."""
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
    """C-AdamW, the Cautious baseline (Liang et al., arXiv 2411.16085; docs/mgup.md, "Related: Cautious
    optimizers"), on the same HF-style AdamW as MGUP-AdamW, so that the two differ by the mask only:

        p <- p - lr wd p - lr sqrt(1 - b2^t) / (1 - b1^t) * u * 1[u g > 0] / max(mean(1[u g > 0]), 1e-3)

    with u = m / (sqrt(v) + eps) as in `mgup_adamw`."""
    return with_mgup(
        scale_by_hf_adam(b1=b1, b2=b2, eps=eps),
        scale_by_cautious(),
        *decay_and_learning_rate(learning_rate, weight_decay, weight_decay_mask),
    )
