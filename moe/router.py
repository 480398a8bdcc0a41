"""Top-k routers, their auxiliary losses, and routing statistics.

Router kinds (logits = x @ W_router, [N, E], computed in float32):
  * "softmax": p = softmax(logits); the k largest p are chosen and their gates are p (divided by their sum when
    `normalize=True`, as in Mixtral).
  * "sigmoid" (sigma-MoE, FoMoE's router): s = sigmoid(logits); the k largest are chosen; gates are s, never
    renormalised, so a token may receive less than unit total weight.

Losses (both averaged over tokens, weights set in the config):
  * Switch load balance (Fedus et al. 2021, eq. 4, extended to top-k): `E * sum_e f_e * P_e`, where
    f_e = (assignments to e) / (N k) (a count, no gradient) and P_e = mean over tokens of the router's
    probability for e (softmax: p; sigmoid: s / sum_e s). Equals 1 under perfectly uniform routing.
  * router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): mean over tokens of logsumexp(logits)^2.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["ROUTERS", "Routing", "load_balance_loss", "route", "routing_stats", "z_loss"]

ROUTERS = ("softmax", "sigmoid")


class Routing(NamedTuple):
    """The routing decision for N tokens.

    experts: [N, k] int32, chosen experts, best first.  gates: [N, k] float32 weights of the chosen experts.
    probs: [N, E] float32, the router's distribution over experts (for the balance loss and statistics).
    logits: [N, E] float32.
    """

    experts: jax.Array
    gates: jax.Array
    probs: jax.Array
    logits: jax.Array


def route(logits: jax.Array, k: int, kind: str = "softmax", *, normalize: bool = False) -> Routing:
    """Chooses the top-k experts of each token (see the module docstring).

    Args:
      logits: [N, E] router logits (cast to float32).
      k: experts per token, 1 <= k <= E.
      kind: "softmax" or "sigmoid".
      normalize: softmax only: divide the k gates by their sum.
    """
    if kind not in ROUTERS:
        raise ValueError(f"router kind = {kind!r}; allowed: {list(ROUTERS)}.")
    num_experts = logits.shape[-1]
    if not 1 <= k <= num_experts:
        raise ValueError(f"top_k = {k} must be in [1, num_experts = {num_experts}].")
    if normalize and kind == "sigmoid":
        raise ValueError(
            "normalize=True is only defined for the softmax router; sigmoid gates are never renormalised (sigma-MoE)."
        )
    logits = logits.astype(jnp.float32)
    top_logits, experts = jax.lax.top_k(logits, k)
    if kind == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        gates = jnp.take_along_axis(probs, experts, axis=-1)
        if normalize:
            gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
        gates = jax.nn.sigmoid(top_logits)
    return Routing(experts.astype(jnp.int32), gates, probs, logits)


def _assignment_fraction(experts: jax.Array, num_experts: int, keep: jax.Array | None = None) -> jax.Array:
    """f_e = (assignments to e) / (N k), [E]; `keep` [N, k] bool counts only kept assignments."""
    onehot = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32)
    if keep is not None:
        onehot = onehot * keep[..., None]
    return jnp.sum(onehot, axis=(0, 1)) / experts.size


def load_balance_loss(routing: Routing) -> jax.Array:
    """Switch load-balance loss E * sum_e f_e * P_e (module docstring); f_e carries no gradient."""
    num_experts = routing.probs.shape[-1]
    f = jax.lax.stop_gradient(_assignment_fraction(routing.experts, num_experts))
    p = jnp.mean(routing.probs, axis=0)
    return num_experts * jnp.sum(f * p)


def z_loss(routing: Routing) -> jax.Array:
    """Router z-loss: mean over tokens of logsumexp(logits)^2."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(routing.logits, axis=-1)))


def routing_stats(routing: Routing, keep: jax.Array | None = None) -> dict[str, jax.Array]:
    """Statistics of one routing decision (no gradient).

    Args:
      keep: [N, k] bool, which assignments were computed (capacity dispatch drops some); None = all.
    Returns:
      load: [E] fraction of the N k assignments each expert received (sums to 1);
      load_cv: std(load) / mean(load), 0 when balanced;
      load_entropy: -sum_e load_e log load_e / log E, 1 when balanced, 0 when one expert takes everything;
      token_entropy: mean over tokens of the router distribution's entropy / log E;
      max_load: E * max_e load_e, 1 when balanced;
      dropped: fraction of assignments not computed.
    """
    routing = jax.tree.map(jax.lax.stop_gradient, routing)
    num_experts = routing.probs.shape[-1]
    load = _assignment_fraction(routing.experts, num_experts)
    log_e = jnp.log(jnp.float32(num_experts)) if num_experts > 1 else jnp.float32(1.0)
    plogp = lambda p: jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)  # noqa: E731
    kept = jnp.float32(1.0) if keep is None else jnp.mean(keep.astype(jnp.float32))
    return {
        "load": load,
        "load_cv": jnp.std(load) / jnp.mean(load),
        "load_entropy": -jnp.sum(plogp(load)) / log_e,
        "token_entropy": jnp.mean(-jnp.sum(plogp(routing.probs), axis=-1)) / log_e,
        "max_load": num_experts * jnp.max(load),
        "dropped": 1.0 - kept,
    }
