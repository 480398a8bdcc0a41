"""SPES (moe.spes): a site trains only the experts it owns; a synchronisation averages the dense parameters (routers
too), gives every site each expert as its owner left it, in exactly the formula's bytes; the expert-merging warm-up
against a plain NumPy merge."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moe import rounds, spes
from moe.stepper import round_bytes

from helpers import tiny_federation

SITES = 4


def _tokens(k: int, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, size=(k, SITES, 2, 9)), jnp.int32)


def test_a_spes_round_trains_owned_experts_only_and_gives_every_site_the_owners_experts_in_the_formula_bytes():
    """One round on 4 sites of 8 experts (2 owned each): after the local steps a site's unowned experts are their
    start values and its owned ones moved; after the synchronisation every site holds, for expert e, what e's owner
    trained, the dense parameters and routers are the float64 mean over the sites, the optimizer state is each
    site's own; the compiled round moves exactly 2 (M - 1) / M of the dense bytes plus (M - 1) / M of the experts'."""
    probe = tiny_federation(SITES, SITES, optax.sgd(0.1), on_mesh=False)[3]
    dims = spes.expert_matrices(probe.train.params)
    optimizer = optax.chain(optax.adamw(1e-2), spes.owned_only(dims))
    _, mesh, graphdef, state = tiny_federation(SITES, SITES, optimizer)
    state = state._replace(train=state.train._replace(opt_state=spes.assign_owners(state.train.opt_state, SITES)))
    start = jax.tree.map(np.asarray, state.train.params)
    local, sync = rounds.make_round_parts(graphdef, optimizer, mesh, method="spes", donate=False)
    tokens = _tokens(2)
    trained, _ = local(state.train.params, state.train._replace(params=None), tokens)
    after = jax.tree.map(np.asarray, trained.params)
    owner = spes.owners(8, SITES)  # [M, E]
    for x0, x1, d in zip(jax.tree.leaves(start), jax.tree.leaves(after), jax.tree.leaves(dims)):
        if d < 0:
            continue
        moved = np.abs(np.moveaxis(x1 - x0, 1 + d, 1)).reshape(SITES, 8, -1).max(-1)  # [M, E]
        assert (moved[owner == 0] == 0).all() and (moved[owner == 1] > 0).all()
    synced = sync(None, state.outer, state.feedback, trained)
    for x1, synced_leaf, d in zip(jax.tree.leaves(after), jax.tree.leaves(synced.train.params), jax.tree.leaves(dims)):
        y = np.asarray(synced_leaf)
        if d < 0:
            want = np.broadcast_to(x1.astype(np.float64).mean(0), x1.shape)
            np.testing.assert_allclose(y, want, rtol=0, atol=1e-6)
        else:
            by_expert = np.moveaxis(x1, 1 + d, 1)  # [M, E, ...]
            want = by_expert[owner.argmax(0), np.arange(8)]  # expert e from its owner
            got = np.moveaxis(y, 1 + d, 1)
            assert all((got[s] == want).all() for s in range(SITES))
    for a, b in zip(jax.tree.leaves(trained.opt_state), jax.tree.leaves(synced.train.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    text = rounds.make_round(graphdef, optimizer, mesh, method="spes").lower(state, tokens).compile().as_text()
    assert text is not None
    info = round_bytes(text, None, optimizer, state.train, mesh, sites=SITES, overlap=SITES, method="spes")
    dense = sum(x.nbytes // SITES for x, d in zip(jax.tree.leaves(start), jax.tree.leaves(dims)) if d < 0)
    experts = sum(x.nbytes // SITES for x, d in zip(jax.tree.leaves(start), jax.tree.leaves(dims)) if d >= 0)
    assert info["measured"] == info["formula"] == 2 * 3 / 4 * dense + 3 / 4 * experts


def _plain_merge(layer: dict[str, np.ndarray], alpha: float, k: int) -> dict[str, np.ndarray]:
    """The warm-up's merge of one layer's experts (leaves [E, ...]) in float64: cosine similarity of the flattened
    "up" slots, each expert's k most similar others, theta_i + alpha mean_j (theta_j - theta_i)."""
    up = layer["up"].reshape(layer["up"].shape[0], -1).astype(np.float64)
    unit = up / np.linalg.norm(up, axis=1, keepdims=True)
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, -np.inf)
    out = {}
    for name, leaf in layer.items():
        x = leaf.astype(np.float64)
        rows = []
        for i in range(x.shape[0]):
            nearest = np.argsort(-similarity[i], kind="stable")[:k]
            rows.append(x[i] + alpha * (x[nearest] - x[i]).mean(0))
        out[name] = np.stack(rows)
    return out


@pytest.mark.parametrize("experts", [8, 3])
def test_the_merging_warm_up_moves_each_expert_towards_its_most_similar_ones(experts):
    """merge_experts on a layer of `experts` experts (8: the top 4 of 7 others; 3: both others) against the float64
    merge; routers and dense leaves untouched; alpha decays linearly to zero (then nothing moves)."""
    rng = np.random.default_rng(1)
    ffn = {name: rng.normal(size=(experts, 4, 6)).astype(np.float32) for name in ("up", "gate", "down")}
    ffn["router"] = rng.normal(size=(4, experts)).astype(np.float32)
    params = {"ffn": ffn, "norm": rng.normal(size=(4,)).astype(np.float32)}
    dims = {"ffn": {"up": 0, "gate": 0, "down": 0, "router": -1}, "norm": -1}
    got = jax.jit(lambda p, a: spes.merge_experts(p, dims, a))(params, 0.3)
    want = _plain_merge({n: ffn[n] for n in ("up", "gate", "down")}, 0.3, min(4, experts - 1))
    for name in ("up", "gate", "down"):
        np.testing.assert_allclose(got["ffn"][name], want[name], rtol=1e-5, atol=1e-6)
    assert (np.asarray(got["ffn"]["router"]) == ffn["router"]).all()
    assert (np.asarray(got["norm"]) == params["norm"]).all()
    assert float(spes.merge_alpha(50, 0.1, 200)) == pytest.approx(0.075)
    assert float(spes.merge_alpha(300, 0.1, 200)) == 0.0


def test_spes_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="4 sites must divide the 6 experts"):
        spes.owners(6, 4)
    _, mesh, graphdef, _ = tiny_federation(SITES, 2, optax.sgd(0.1))
    with pytest.raises(ValueError, match="alpha > 0 only for method 'spes'"):
        rounds.make_round(graphdef, optax.sgd(0.1), mesh, method="local_adamw", merge=(0.1, 10))
    with pytest.raises(ValueError, match="O_e = M"):
        spes.broadcast_owned({"x": jnp.zeros((SITES, 8))}, {"x": 0}, mesh)
