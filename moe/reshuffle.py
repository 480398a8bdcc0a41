"""Random placement's reshuffles: moving experts between sites at a round boundary (docs/fomoe.md,
"Partial expert replication", random placement).

A reshuffle happens after a round's synchronisation, when every replica of an expert holds the same weights. Each
site's expert slots are then refilled for the new placement (`moe.placement.random_placement`; a site keeps its
block, the block gets new experts):

  * an expert the site already hosted keeps its weights and its optimizer state (moved to its new slot);
  * an arrived expert gets its weights from its previous replica group and fresh optimizer state: AdamW moments
    and DiLoCo momentum zeroed, and a learning rate that ramps linearly from 1/W to 1 over its first W local steps
    (`arrival_warmup`; without it, zeroed moments under an advanced bias correction make the first updates about
    3x the usual size).

Transport (decision where the paper is silent): an `all_gather` over the `block` mesh axis gives every site one
copy of every expert (one per block), and each site picks its new experts locally. Every site then receives
N_e - N_le expert-sized buffers per reshuffle: B = M / O_e times the expected minimum, the arrivals
(1 - N_le / N_e) N_le, which the spec's migration term P counts. In exchange the communication pattern does not
depend on the placement, so the program compiles once. `MigrationPlan.arrived_bytes` gives the minimum for the
actual arrivals; the compiled program's all-gathers (`moe.hlo.collective_bytes`) give what moves.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from core import train as train_lib
from moe.federation import SITE_AXES, is_expert_variable
from moe.layer import Residency
from moe.placement import Placement

__all__ = ["ArrivalWarmupState", "MigrationPlan", "arrival_warmup", "expert_dims", "migrate", "plan_migration"]


@dataclasses.dataclass(frozen=True)
class MigrationPlan:
    """Where each site's new expert slots come from, all [M, N_le] int32.

    experts: the new placement's expert ids; source_block / source_slot: the block (and slot within it) that held
    the expert before; kept_slot: the slot this site held it in before, or -1 if it arrived.
    """

    experts: np.ndarray
    source_block: np.ndarray
    source_slot: np.ndarray
    kept_slot: np.ndarray

    @property
    def arrivals(self) -> np.ndarray:
        """[M, N_le] bool: the expert in this slot is new to the site."""
        return self.kept_slot < 0

    def arrived_bytes(self, expert_bytes: float) -> float:
        """The most expert bytes any site must receive: its arrivals x the bytes of one expert (all layers)."""
        return float(self.arrivals.sum(axis=1).max() * expert_bytes)

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.experts, self.source_block, self.source_slot, self.kept_slot


def plan_migration(previous: Placement, new: Placement) -> MigrationPlan:
    """The plan that turns `previous` into `new`; both must have the same shape and the same site -> block map."""
    if previous.experts.shape != new.experts.shape or previous.num_experts != new.num_experts:
        raise ValueError(f"placements of different shapes: {previous.experts.shape} and {new.experts.shape}.")
    if not (previous.block == new.block).all():
        raise ValueError("a reshuffle keeps each site in its block (the site mesh is fixed); got different blocks.")
    blocks = previous.sites // previous.overlap
    block_experts = previous.experts[:blocks]  # site b < B is replica 0 of block b
    where = np.full((previous.num_experts, 2), -1)
    for b in range(blocks):
        where[block_experts[b], 0], where[block_experts[b], 1] = b, np.arange(block_experts.shape[1])
    source_block, source_slot = where[new.experts, 0], where[new.experts, 1]
    kept = np.where(source_block == new.block[:, None], source_slot, -1)
    as32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return MigrationPlan(as32(new.experts), as32(source_block), as32(source_slot), as32(kept))


class ArrivalWarmupState(NamedTuple):
    """age: [N_le] int32, local steps each expert slot's expert has trained on this site (capped at the warm-up)."""

    age: jax.Array


def expert_dims(params) -> Any:
    """A tree shaped like `expert_flags(params)`: the position of the "expert" axis of each expert parameter, -1
    for the others."""
    return jax.tree.map(
        lambda v: v.axes.index("expert") if is_expert_variable(v) else -1,
        params,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def _along(factor: jax.Array, dim: int, ndim: int) -> jax.Array:
    """Reshapes a [N_le] vector to broadcast along axis `dim` of an ndim-array."""
    return factor.reshape([-1 if i == dim else 1 for i in range(ndim)])


def arrival_warmup(dims, steps: int) -> optax.GradientTransformation:
    """Scales the updates of expert slot j by min(age_j + 1, W) / W (W = `steps`); everything else passes through.

    Put it last in the chain so that it scales the whole update (learning rate x direction + weight decay).
    `dims` comes from `expert_dims(params)`. A fresh state counts every slot as settled (age W); `migrate` sets the
    age of arrived slots to 0.
    """
    if steps < 1:
        raise ValueError(f"arrival_warmup: steps = {steps} must be >= 1.")
    dim_list = jax.tree.leaves(dims)

    def init(params):
        leaves = jax.tree.leaves(params)
        if not leaves:  # optax.tree_utils.tree_map_params traces `init` with a leafless placeholder for params
            return ArrivalWarmupState(jnp.full((0,), steps, jnp.int32))
        sizes = {x.shape[d] for x, d in zip(leaves, dim_list) if d >= 0}
        if len(sizes) != 1:
            raise ValueError(f"arrival_warmup: expert parameters must share one expert count; got {sorted(sizes)}.")
        return ArrivalWarmupState(jnp.full((sizes.pop(),), steps, jnp.int32))

    def update(updates, state, params=None):
        del params
        factor = (jnp.minimum(state.age + 1, steps) / steps).astype(jnp.float32)
        leaves, treedef = jax.tree.flatten(updates)
        leaves = [u if d < 0 else u * _along(factor, d, u.ndim).astype(u.dtype) for u, d in zip(leaves, dim_list)]
        return jax.tree.unflatten(treedef, leaves), ArrivalWarmupState(jnp.minimum(state.age + 1, steps))

    return optax.GradientTransformation(init, update)


def migrate(
    state,
    plan_arrays,
    mesh: Mesh,
    optimizer: optax.GradientTransformation,
    outer: optax.GradientTransformation | None = None,
):
    """Applies a reshuffle to a stacked per-site federated state (`moe.rounds.FederatedState`; jit it).

    Args:
      state: leaves [M, ...] sharded over the site mesh, the parameters synchronised.
      plan_arrays: `MigrationPlan.arrays()` as [M, N_le] device arrays sharded like the state.
      optimizer, outer: the transformations that built the state's optimizer state and its outer state (DiLoCo's;
        None when there is none): their `init` says which leaves are parameter-shaped (optax.tree_utils).
    Returns:
      the state under the new placement: expert weights gathered from their previous block, each Residency set to
      the new expert ids, expert-shaped optimizer leaves (moments, DiLoCo momentum) of kept experts moved to their
      new slot and of arrived experts zeroed, `ArrivalWarmupState.age` of arrived slots zeroed.
    """
    train, outer_state = state.train, state.outer
    if state.feedback:
        raise ValueError("a reshuffle does not move low-bit synchronisation's error feedback: use a fixed placement.")
    dims = expert_dims(train.params)
    spec = PartitionSpec(SITE_AXES)

    def local(train, outer_state, experts, source_block, source_slot, kept_slot):
        experts, source_block, source_slot, kept_slot = experts[0], source_block[0], source_slot[0], kept_slot[0]
        arrived = kept_slot < 0

        def gather(x, d):  # x [1, ...] with the expert axis at 1 + d
            if d < 0:
                return x
            blocks = jnp.moveaxis(jax.lax.all_gather(x, "block", axis=0, tiled=True), 1 + d, 1)  # [B, N_le, ...]
            return jnp.moveaxis(blocks[source_block, source_slot], 0, d)[None]

        def keep(x, d):  # an optimizer leaf mirroring a parameter: move kept slots, zero arrivals
            if d < 0:
                return x
            moved = jnp.take(x, jnp.maximum(kept_slot, 0), axis=1 + d)
            return jnp.where(_along(arrived, 1 + d, x.ndim), jnp.zeros_like(moved), moved)

        def opt(tree, tx):
            if tx is None:
                return tree
            tree = jax.tree.map(
                lambda s: (
                    ArrivalWarmupState(jnp.where(arrived, 0, s.age[0, jnp.maximum(kept_slot, 0)])[None])
                    if isinstance(s, ArrivalWarmupState)
                    else s
                ),
                tree,
                is_leaf=lambda s: isinstance(s, ArrivalWarmupState),
            )
            axes = train_lib.optimizer_state_like(tx, tree, train.params, _leaf_tree(dims, train.params), -1)
            return jax.tree.map(keep, tree, axes)

        params = jax.tree.map(gather, train.params, _leaf_tree(dims, train.params))
        rest = jax.tree.map(
            lambda v: v.replace(experts[None].astype(v.get_value().dtype)) if isinstance(v, Residency) else v,
            train.rest,
            is_leaf=lambda v: isinstance(v, Residency),
        )
        return train._replace(params=params, rest=rest, opt_state=opt(train.opt_state, optimizer)), opt(
            outer_state, outer
        )

    out = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 6, out_specs=(spec, spec))(
        train, outer_state, *plan_arrays
    )
    return state._replace(train=out[0], outer=out[1])


def _leaf_tree(dims, params):
    """`dims` with one entry per array leaf of `params` (so it maps alongside it)."""
    return jax.tree.unflatten(jax.tree.structure(params), jax.tree.leaves(dims))
