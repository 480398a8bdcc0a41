"""SPES, sparse expert synchronisation (arXiv 2602.11543; the authors' code, github.com/zjr2000/SPES): every site
holds the whole model and routes over every expert, but trains only the experts it owns, N_e / M of each layer's
(site s the experts s N_e / M .. (s + 1) N_e / M - 1); the others it uses as the last synchronisation left them.
A synchronisation (moe.rounds' method "spes")

  * averages the dense parameters, the routers included, over all sites (parameters only: each site keeps its
    optimizer state, as the authors' parameter server does);
  * gives every site each expert as its owner trained it: each site all-gathers its owned slots (the bytes a SPES
    peer downloads, (M - 1) / M of the experts per site);
  * during the expert-merging warm-up (alpha_r = alpha_0 max(0, 1 - step / steps) > 0) moves every expert towards
    its most similar experts of the same layer: theta_i += alpha_r mean_{j in top-k} (theta_j - theta_i), the k
    nearest by cosine similarity of their up-projection (the paper's w1), k = min(4, N_e - 1); the authors merge at
    every second synchronisation with alpha_0 = 0.05 over 2000 steps, here at every one.

Freezing the experts a site does not own is `owned_only`, the last transformation of its optimizer, whose state
(OwnedState, per site) `assign_owners` sets after moe.rounds.init_sites. Routers have the "expert" axis but are
dense here: SPES averages them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from moe import federation, reshuffle

__all__ = [
    "MERGE_TOPK",
    "OwnedState",
    "assign_owners",
    "broadcast_owned",
    "expert_matrices",
    "merge_alpha",
    "merge_experts",
    "owned_only",
    "owners",
]

MERGE_TOPK = 4  # the authors' top-k of similar experts


class OwnedState(NamedTuple):
    """owned [N_e] float32: 1 for the expert slots this site trains, 0 for those it only uses."""

    owned: jax.Array


def _names(path) -> tuple:
    """A key path's names (dict keys, sequence indices, attributes), nnx's trailing "value" left out."""
    names = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path)
    return names[:-1] if names and names[-1] == "value" else names


def expert_matrices(params) -> Any:
    """`moe.reshuffle.expert_dims(params)` with the routers' entries -1: the leaves SPES owns per expert (up, gate,
    down), the expert axis of each; -1 for the dense ones (routers included)."""
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    dims = jax.tree.leaves(reshuffle.expert_dims(params))
    is_router = [_names(p)[-1] == "router" for p in paths]
    return jax.tree.unflatten(jax.tree.structure(params), [-1 if r else d for d, r in zip(dims, is_router)])


def owners(num_experts: int, sites: int) -> np.ndarray:
    """[M, N_e] float32: 1 where site s owns expert e (the contiguous block s N_e / M ..). Raises ValueError unless
    M divides N_e."""
    if num_experts % sites:
        raise ValueError(f"SPES: {sites} sites must divide the {num_experts} experts (each owns N_e / M of them).")
    per = num_experts // sites
    return (np.arange(num_experts)[None, :] // per == np.arange(sites)[:, None]).astype(np.float32)


def owned_only(dims) -> optax.GradientTransformation:
    """Multiplies the updates of expert slot j of each leaf with an expert axis in `dims` (`expert_matrices`) by
    OwnedState.owned[j]; everything else passes through. Put it last in the chain (it then zeroes the whole update,
    weight decay included). A fresh state owns every slot; `assign_owners` sets each site's."""
    dim_list = jax.tree.leaves(dims)

    def init(params):
        leaves = jax.tree.leaves(params)
        sizes = {x.shape[d] for x, d in zip(leaves, dim_list) if d >= 0}
        if len(sizes) > 1:
            raise ValueError(f"owned_only: expert parameters must share one expert count; got {sorted(sizes)}.")
        return OwnedState(jnp.ones((sizes.pop() if sizes else 0,), jnp.float32))

    def update(updates, state, params=None):
        del params
        leaves, treedef = jax.tree.flatten(updates)
        scaled = [
            u if d < 0 else u * state.owned.reshape([-1 if i == d else 1 for i in range(u.ndim)]).astype(u.dtype)
            for u, d in zip(leaves, dim_list)
        ]
        return jax.tree.unflatten(treedef, scaled), state

    return optax.GradientTransformation(init, update)


def assign_owners(opt_state, sites: int):
    """The stacked per-site optimizer state with every OwnedState set to `owners` (site s: its row)."""

    def put(s):
        if not isinstance(s, OwnedState):
            return s
        mask = jnp.asarray(owners(s.owned.shape[-1], sites), s.owned.dtype)
        return OwnedState(jax.device_put(mask, s.owned.sharding) if hasattr(s.owned, "sharding") else mask)

    return jax.tree.map(put, opt_state, is_leaf=lambda s: isinstance(s, OwnedState))


def broadcast_owned(params, dims, mesh):
    """Every site's expert slots (the leaves with an axis in `dims`) replaced by their owners' values: each site
    all-gathers the N_e / M slots it owns over all sites (mesh: the site mesh with O_e = M, one device per site, site
    s at replica index s). Other leaves are returned as they are."""
    shape = dict(mesh.shape)
    if shape.get("block", 1) != 1 or federation.devices_per_site(mesh) != 1:
        raise ValueError("SPES: the site mesh holds every expert on every site (O_e = M) on one device per site.")
    sites = shape["replica"]
    leaves, treedef = jax.tree.flatten(params)
    dim_list = jax.tree.leaves(dims)
    spec = PartitionSpec(federation.SITE_AXES)

    def local(*xs):
        site = jax.lax.axis_index("replica")
        out = []
        for x, d in zip(xs, dim_list):
            if d < 0:
                out.append(x)
                continue
            per = x.shape[1 + d] // sites
            mine = jax.lax.dynamic_slice_in_dim(x, site * per, per, axis=1 + d)
            out.append(jax.lax.all_gather(mine, "replica", axis=1 + d, tiled=True))
        return out

    out = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * len(leaves), out_specs=[spec] * len(leaves))(*leaves)
    return jax.tree.unflatten(treedef, out)


def merge_alpha(step: jax.typing.ArrayLike, alpha: float, steps: int) -> jax.Array:
    """The warm-up's share at `step`: alpha max(0, 1 - step / steps) (0 when alpha is 0)."""
    return alpha * jnp.maximum(0.0, 1.0 - jnp.asarray(step, jnp.float32) / steps)


def merge_experts(params, dims, alpha: jax.typing.ArrayLike):
    """One site's parameters (no site axis) with each layer's experts merged towards their MERGE_TOPK most similar
    (module docstring): a layer is the module holding expert leaves; similarity is the cosine of the flattened
    "up" slots (the first expert leaf when there is none named so); the step uses all of the layer's expert
    leaves. alpha = 0 returns the parameters unchanged."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    dim_list = jax.tree.leaves(dims)
    layers: dict[tuple, list[int]] = {}
    for i, ((path, _), d) in enumerate(zip(flat, dim_list)):
        if d >= 0:
            layers.setdefault(_names(path)[:-1], []).append(i)
    leaves = [x for _, x in flat]
    for members in layers.values():
        names = [_names(flat[i][0])[-1] for i in members]
        probe = members[names.index("up")] if "up" in names else members[0]
        vectors = jnp.moveaxis(leaves[probe], dim_list[probe], 0)
        vectors = vectors.reshape(vectors.shape[0], -1).astype(jnp.float32)
        n = vectors.shape[0]
        unit = vectors / jnp.maximum(jnp.linalg.norm(vectors, axis=1, keepdims=True), 1e-30)
        similarity = jnp.where(jnp.eye(n, dtype=bool), -jnp.inf, unit @ unit.T)
        _, nearest = jax.lax.top_k(similarity, min(MERGE_TOPK, n - 1))  # [n, k]
        for i in members:
            x = jnp.moveaxis(leaves[i], dim_list[i], 0)
            pull = jnp.mean(x[nearest], axis=1) - x  # mean over the k of (theta_j - theta_i)
            leaves[i] = jnp.moveaxis(x + alpha * pull.astype(x.dtype), 0, dim_list[i])
    return jax.tree.unflatten(treedef, leaves)
