"""Outer optimizers of local-update training (DiLoCo, Douillard et al. 2023, arXiv 2311.08105).

After K local steps the sites' parameters are averaged. DiLoCo then treats the change as a gradient,

    outer gradient  Delta = theta_start - mean_sites(theta_site)
    v     <- mu v + Delta
    theta <- theta_start - lr (Delta + mu v)          (Nesterov momentum)

so lr = 1, mu = 0 is plain parameter averaging. `diloco_outer` returns that update rule as an optax
transformation: feed it Delta as the gradient and apply the update to theta_start.
"""

from __future__ import annotations

import optax

__all__ = ["diloco_outer"]


def diloco_outer(learning_rate: float | optax.Schedule = 0.7, *, momentum: float = 0.9) -> optax.GradientTransformation:
    """DiLoCo's outer Nesterov SGD (defaults: the paper's lr 0.7, momentum 0.9).

    Usage: `updates, state = tx.update(theta_start - theta_avg, state); theta = optax.apply_updates(theta_start,
    updates)`.
    """
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"diloco_outer: momentum = {momentum} must be in [0, 1).")
    return optax.sgd(learning_rate, momentum=momentum or None, nesterov=bool(momentum))
