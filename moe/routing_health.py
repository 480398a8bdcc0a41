"""Routing health across a federation's sites (docs/fomoe.md, "Routing health across sites"): every site's
routes on a fixed probe batch, reduced on the sites' devices to the agreement with the previous round's routes and
per-expert counts; on the host, the Jensen-Shannon divergence of sites that route over the same experts and the
utilisation entropy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe import federation

__all__ = [
    "make_probe",
    "make_routing_stats",
    "routing_counts",
    "routing_divergence",
    "routing_shares",
    "topk_agreement",
    "utilisation_entropy",
]


def make_probe(graphdef, mesh) -> jax.stages.Wrapped:
    """A jitted `(params, rest, tokens [B, T]) -> routes [M, L_moe, B T, k]`: every site's chosen global expert ids
    in every MoE layer on a fixed probe batch (for the routing agreement between rounds and the routing health
    across sites). The routes stay on the sites' devices: `make_routing_stats` reduces them there."""

    def one_site(params, rest, tokens):
        _, aux, _ = nnx.merge(graphdef, params, rest)(tokens, intermediates=True)
        return jnp.stack(aux["intermediates"]["routes"])

    return jax.jit(federation.per_site(one_site, mesh, (0, 0, None)))


def make_routing_stats(mesh, num_experts: int) -> jax.stages.Wrapped:
    """A jitted `(previous, current) -> {"agreement": [M], "counts": [M, L, N_e]}` of two `make_probe` outputs, each
    site on its own device: its `topk_agreement` and its `routing_counts`. What a round brings to the host is these
    M (1 + L N_e) numbers instead of every site's routes (M L B T k ids, which outweighed a 4-bit synchronisation
    on a 10 Mbit/s link)."""

    def one_site(previous, current):
        return {"agreement": topk_agreement(previous, current), "counts": routing_counts(current, num_experts)}

    return jax.jit(federation.per_site(one_site, mesh, (0, 0)))


def topk_agreement(previous: jax.typing.ArrayLike, current: jax.typing.ArrayLike) -> jax.Array:
    """Of routes [..., L, T, k]: the mean over layers, tokens and choices of |chosen now ∩ chosen before| / k
    (1 = the same experts), per leading index (a site)."""
    previous, current = jnp.asarray(previous), jnp.asarray(current)
    same = (previous[..., :, None] == current[..., None, :]).any(-1)
    return same.mean((-3, -2, -1))


def routing_counts(routes: jax.typing.ArrayLike, num_experts: int) -> jax.Array:
    """[..., L, N_e] int32: each layer's expert choices counted per expert, from routes [..., L, T, k] (global
    expert ids)."""
    routes = jnp.asarray(routes)
    rows = routes.reshape(-1, routes.shape[-2] * routes.shape[-1])  # one row per (leading index, layer)
    counts = jax.vmap(lambda ids: jnp.bincount(ids, length=num_experts))(rows)
    return counts.astype(jnp.int32).reshape(*routes.shape[:-2], num_experts)


def routing_shares(counts: jax.typing.ArrayLike) -> np.ndarray:
    """[M, L, N_e] float64: each site's and layer's share of the probe batch's expert choices per expert, from
    `routing_counts`."""
    counts = np.asarray(counts, np.float64)
    return counts / counts.sum(-1, keepdims=True)


def _entropy(p: np.ndarray) -> np.ndarray:
    return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)


def routing_divergence(histograms: np.ndarray, groups) -> float:
    """Jensen-Shannon divergence (nats) of the routing distributions of the sites of each group, the generalised form
    H(mean_s p_s) - mean_s H(p_s) (0: the sites route alike; at most ln n for n sites), averaged over groups of more
    than one site and layers; 0.0 when every group has one site. `groups`: site index arrays, e.g. the replica groups
    (sites that route over the same experts) or all sites (skip-token: every site routes over every expert)."""
    values = []
    for g in groups:
        if len(g) > 1:
            p = histograms[np.asarray(g)]  # [n, L, N_e]
            values.append(np.mean(_entropy(p.mean(0)) - _entropy(p).mean(0)))
    return float(np.mean(values)) if values else 0.0


def utilisation_entropy(histograms: np.ndarray, routed_over: int) -> float:
    """Entropy of each site's and layer's expert utilisation over ln(`routed_over`), the experts it routes over
    (1: every one of them equally used; 0: one expert takes every choice), averaged over sites and layers."""
    if routed_over < 2:
        return 1.0
    return float(np.mean(_entropy(histograms)) / np.log(routed_over))
