"""Random placement's reshuffles on 4 virtual sites: the migration plan, the migrated state against a NumPy
reference (weights from the previous group, kept experts keep their moments, arrived experts start fresh), the
bytes the migration moves, and the arrival warm-up."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from core import hlo
from core.model import Transformer, TransformerConfig
from moe import MoE, MoEConfig, federation, reshuffle, rounds
from moe.layer import Residency
from moe.placement import fixed_placement, random_placement
from optim import diloco_outer

from helpers import by_key_path, tiny_moe_transformer

SITES, EXPERTS = 4, 8


def _swiglu_moe_transformer(resident=None):
    """helpers.tiny_moe_transformer's model with SwiGLU experts: each MoE layer also has gate [N_le, d, h]."""
    cfg = TransformerConfig(vocab_size=264, d_model=16, num_layers=1, num_heads=2, num_kv_heads=2, d_ff=32)
    m = MoEConfig(num_experts=EXPERTS, top_k=2, expert_size=8, expert_mlp="swiglu")
    return Transformer(
        cfg,
        rngs=nnx.Rngs(0),
        ffn_factory=lambda layer, path, rngs: MoE.in_transformer(cfg, m, path=path, rngs=rngs, resident=resident),
    )


MODELS = {"silu": tiny_moe_transformer, "swiglu": _swiglu_moe_transformer}


@pytest.mark.parametrize("overlap", [1, 2])
def test_plan_moves_every_expert_from_where_it_was(overlap):
    for seed in range(5):
        old = random_placement(EXPERTS, SITES, overlap, seed=(seed, 0))
        new = random_placement(EXPERTS, SITES, overlap, seed=(seed, 1))
        new.validate()
        plan = reshuffle.plan_migration(old, new)
        blocks = SITES // overlap
        for s in range(SITES):
            for j, e in enumerate(new.experts[s]):
                assert old.experts[plan.source_block[s, j], plan.source_slot[s, j]] == e
                assert plan.source_block[s, j] < blocks
                was_here = e in old.experts[s]
                assert plan.arrivals[s, j] == (not was_here)
                if was_here:
                    assert old.experts[s, plan.kept_slot[s, j]] == e
        np.testing.assert_array_equal(plan.arrivals, new.arrivals(old))
    same = reshuffle.plan_migration(old, old)
    assert not same.arrivals.any() and (same.kept_slot == np.arange(old.local_experts)).all()


def test_plan_rejects_mismatched_placements():
    with pytest.raises(ValueError, match="different shapes"):
        reshuffle.plan_migration(fixed_placement(8, 4, 2), fixed_placement(8, 4, 1))


def _moved_state(overlap, warmup, outer, model=tiny_moe_transformer):
    """A federated state after one synchronised round with random placement A, then its migration to B; `model`
    builds the one-block MoE transformer (`resident` experts, all by default)."""
    old = random_placement(EXPERTS, SITES, overlap, seed=11)
    new = random_placement(EXPERTS, SITES, overlap, seed=12)
    mesh = federation.site_mesh(SITES, overlap)
    site_model = model(old.experts[0])
    dims = reshuffle.expert_dims(nnx.state(site_model, nnx.Param))
    optimizer = optax.chain(optax.adamw(1e-2), reshuffle.arrival_warmup(dims, warmup))
    method = "diloco" if outer is not None else "local_adamw"
    graphdef, state = rounds.init_sites(model(), site_model, old, optimizer, outer, mesh, seed=0)
    tokens = jnp.asarray(np.random.default_rng(overlap).integers(0, 256, size=(2, SITES, 2, 9)), jnp.int32)
    state, _ = rounds.make_round(graphdef, optimizer, mesh, method=method, outer=outer)(state, tokens)
    before = jax.tree.map(np.asarray, state)
    plan = reshuffle.plan_migration(old, new)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(federation.SITE_AXES))
    migrate = jax.jit(lambda st, arrays: reshuffle.migrate(st, arrays, mesh, optimizer, outer))
    arrays = [jax.device_put(a, sharding) for a in plan.arrays()]
    compiled = migrate.lower(state, arrays).compile()  # once: it migrates and tells what it moves
    after = compiled(state, arrays)
    return old, new, dims, optimizer, before, jax.tree.map(np.asarray, after), compiled.as_text()


def _expert_leaves(tree, params, dims):
    """(leaf, expert axis) of every leaf of `tree` that mirrors an expert parameter (by path and shape)."""
    flags = jax.tree.leaves(by_key_path(tree, params, dims, -1))
    return [(x, d) for x, d in zip(jax.tree.leaves(tree), flags)]


@pytest.mark.parametrize(
    # (O_e = 1 and 2; DiLoCo with SwiGLU experts: one case shows both the outer momentum and the gate matrices migrate)
    "overlap, outer, expert_mlp",
    [(1, None, "silu"), (2, "diloco", "swiglu")],
)
def test_migration_matches_a_numpy_reference(overlap, outer, expert_mlp):
    outer_tx = diloco_outer() if outer else None
    old, new, dims, optimizer, before, after, text = _moved_state(overlap, 4, outer_tx, MODELS[expert_mlp])
    dim_list = jax.tree.leaves(dims)
    ffn = before.train.params["blocks"][0]["ffn"]
    assert set(ffn) == {"router", "up", "down"} | ({"gate"} if expert_mlp == "swiglu" else set())
    if expert_mlp == "swiglu":  # the gate matrices are expert parameters found by their axes, like up and down
        assert dims["blocks"][0]["ffn"]["gate"] == 0
        assert federation.expert_flags(before.train.params)["blocks"][0]["ffn"]["gate"]
        adam = rounds.moment_flags(optimizer, before.train.opt_state, before.train.params)[0][0]
        assert adam.mu["blocks"][0]["ffn"]["gate"].get_value() and adam.nu["blocks"][0]["ffn"]["gate"].get_value()
        # each site's view (federation.to_sites, which init_sites used) holds its experts' gate matrices
        full: Any = nnx.state(_swiglu_moe_transformer(), nnx.Param)
        views = federation.to_sites(full, old.experts)
        np.testing.assert_array_equal(
            views["blocks"][0]["ffn"]["gate"].get_value(),
            np.asarray(full["blocks"][0]["ffn"]["gate"].get_value())[old.experts],
        )
    n_le = old.local_experts
    # Parameters: an expert's weights come from any site that held it (its replicas are equal after the sync).
    for x0, x1, d in zip(jax.tree.leaves(before.train.params), jax.tree.leaves(after.train.params), dim_list):
        if d < 0:
            np.testing.assert_array_equal(x1, x0)
            continue
        for s in range(SITES):
            for j, e in enumerate(new.experts[s]):
                src = np.flatnonzero((old.experts == e).any(1))
                slices = [np.take(x0[h], list(old.experts[h]).index(e), axis=d) for h in src]
                for other in slices[1:]:
                    np.testing.assert_allclose(other, slices[0], rtol=1e-6, atol=1e-7)
                np.testing.assert_array_equal(np.take(x1[s], j, axis=d), slices[0])
    # Optimizer leaves that mirror an expert parameter: kept experts move with their moments, arrivals start at 0.
    trees = [(before.train.opt_state, after.train.opt_state)] + ([(before.outer, after.outer)] if outer else [])
    checked = 0
    for tree0, tree1 in trees:
        pairs0 = _expert_leaves(tree0, before.train.params, dims)
        for (x0, d), x1 in zip(pairs0, jax.tree.leaves(tree1)):
            if d < 0 or x0.ndim < 2:
                continue
            checked += 1
            for s in range(SITES):
                for j, e in enumerate(new.experts[s]):
                    got = np.take(x1[s], j, axis=d)
                    if e in old.experts[s]:
                        np.testing.assert_array_equal(got, np.take(x0[s], list(old.experts[s]).index(e), axis=d))
                    else:
                        assert not got.any()
    assert checked >= 2 * len([d for d in dim_list if d >= 0])  # both AdamW moments of every expert leaf
    ages0 = [s.age for s in jax.tree.leaves(before.train.opt_state, is_leaf=_is_age) if _is_age(s)]
    ages1 = [s.age for s in jax.tree.leaves(after.train.opt_state, is_leaf=_is_age) if _is_age(s)]
    assert len(ages1) == 1 and ages1[0].shape == (SITES, n_le)
    for s in range(SITES):
        for j, e in enumerate(new.experts[s]):
            kept = list(old.experts[s]).index(e) if e in old.experts[s] else None
            assert ages1[0][s, j] == (0 if kept is None else ages0[0][s, kept])
    residency = [
        v
        for v in jax.tree.leaves(after.train.rest, is_leaf=lambda v: isinstance(v, Residency))
        if isinstance(v, Residency)
    ]
    assert residency and all((np.asarray(v.get_value()) == new.experts).all() for v in residency)
    # The migration's only collectives: an all-gather of the local experts over the B = M / O_e blocks.
    expert_bytes = sum(x.nbytes // SITES for x, d in zip(jax.tree.leaves(before.train.params), dim_list) if d >= 0)
    blocks = SITES // overlap
    assert hlo.collective_bytes(text)["bytes_per_device"] == pytest.approx((blocks - 1) * expert_bytes)


def _is_age(x):
    return isinstance(x, reshuffle.ArrivalWarmupState)


def test_arrival_warmup_ramps_each_slot_linearly():
    warmup = 4
    dims = {"w": 1, "b": -1}
    tx = reshuffle.arrival_warmup(dims, warmup)
    params = {"w": jnp.ones((3, 5, 2)), "b": jnp.ones((7,))}
    state = tx.init(params)
    assert state.age.tolist() == [warmup] * 5
    state = reshuffle.ArrivalWarmupState(jnp.asarray([0, 1, 2, 3, 9], jnp.int32))
    rng = np.random.default_rng(0)
    updates = {"w": jnp.asarray(rng.normal(size=(3, 5, 2)), jnp.float32), "b": jnp.asarray(rng.normal(size=7))}
    for step in range(3):
        out, state = tx.update(updates, state)
        age = np.minimum(np.asarray([0, 1, 2, 3, 9]) + step, warmup)
        factor = np.minimum(age + 1, warmup) / warmup
        np.testing.assert_allclose(out["w"], np.asarray(updates["w"]) * factor[None, :, None], rtol=1e-6)
        np.testing.assert_array_equal(out["b"], updates["b"])
        assert state.age.tolist() == np.minimum(age + 1, warmup).tolist()
    with pytest.raises(ValueError, match="steps = 0"):
        reshuffle.arrival_warmup(dims, 0)
    with pytest.raises(ValueError, match="one expert count"):
        reshuffle.arrival_warmup({"a": 0, "b": 0}, 2).init({"a": jnp.ones(3), "b": jnp.ones(4)})
