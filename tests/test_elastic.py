"""An elastic federation (moe.elastic): the state of 4 sites after a round, regrouped onto 3 (a site lost) and 5 (one
joining): every expert's parameters, moments and anchors equal its old replicas', the dense ones the old sites', the new
placement keeps every expert, and the regrouped state trains on its own site mesh; with O_e = 1 the experts of the
lost site are named and refused unless re-initialised."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from core import checkpoint
from moe import elastic, federation, rounds

from helpers import tiny_federation

EXPERTS = 8
ANCHOR = "params_and_opt_state"


def _federation(sites, overlap, optimizer, mesh=True, anchor=None):
    """(placement, graphdef, state) of `sites` tiny MoE sites, on their mesh or on the default device."""
    placement, _, graphdef, state = tiny_federation(sites, overlap, optimizer, on_mesh=mesh, seed=sites, anchor=anchor)
    return placement, graphdef, state


def _tokens(sites, seed):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, size=(2, sites, 2, 9)), jnp.int32)


@pytest.fixture(scope="module")
def trained():
    """4 sites, O_e = 2, after one LocalAdamW round: synchronised parameters and moments, differing per block, and
    the anchors of streaming low-bit synchronisation (as it holds them after a synchronisation of everything)."""
    optimizer = optax.adamw(1e-2)
    placement, graphdef, state = _federation(4, 2, optimizer, anchor=ANCHOR)
    state, _ = rounds.make_round(graphdef, optimizer, federation.site_mesh(4, 2), method="local_adamw")(
        state, _tokens(4, 0)
    )
    state = state._replace(anchor=(state.train.params, state.train.opt_state))
    return placement, optimizer, {k: np.asarray(v) for k, v in checkpoint.flatten(state).items()}


def _expert_arrays(flat, placement, key, axis):
    """{expert: its array} from the old sites hosting it, asserting its replicas agree."""
    out = {}
    for e in range(EXPERTS):
        copies = [np.take(flat[key][s], list(placement.experts[s]).index(e), axis=axis) for s in placement.hosts(e)]
        for c in copies[1:]:
            np.testing.assert_array_equal(c, copies[0])
        out[e] = copies[0]
    return out


@pytest.mark.parametrize("sites, survivors", [(3, [0, 1, 3]), (5, [0, 1, 2, 3])])
def test_a_regrouped_federation_holds_every_expert_as_it_was(trained, sites, survivors):
    before, optimizer, old = trained
    overlap = elastic.regrouped_overlap(EXPERTS, sites, before.overlap)
    assert overlap == sites  # 8 experts on 3 or 5 sites: only the full replica places them evenly
    after, graphdef, like = _federation(sites, overlap, optimizer, mesh=False, anchor=ANCHOR)
    state, report = elastic.regroup(old, like, before, after, survivors, optimizer)
    assert report["lost_experts"] == [] and report["joined"] == list(range(len(survivors), sites))
    new = {k: np.asarray(v) for k, v in checkpoint.flatten(state).items()}
    up = "train/params/blocks/0/ffn/up/value"
    moment = "train/opt_state/0/mu/blocks/0/ffn/up/value"
    assert up in new and moment in new, sorted(new)[:5]
    router = "train/params/blocks/0/ffn/router/value"  # [d_model, N_le]: the expert axis second
    for key, axis in (
        (up, 0),
        (moment, 0),
        ("train/opt_state/0/nu/blocks/0/ffn/up/value", 0),
        (router, 1),
        ("anchor/0/blocks/0/ffn/up/value", 0),
        ("anchor/1/0/mu/blocks/0/ffn/router/value", 1),
    ):
        want = _expert_arrays(old, before, key, axis)
        for s in range(sites):
            for j, e in enumerate(after.experts[s]):
                np.testing.assert_array_equal(
                    np.take(new[key][s], j, axis=axis), want[int(e)], err_msg=f"{key} site {s} expert {e}"
                )
    dense = "train/params/embedding/value"
    for s in range(sites):
        np.testing.assert_array_equal(new[dense][s], old[dense][0])  # synchronised: equal on every old site
    np.testing.assert_array_equal(new["train/step"], np.full(sites, old["train/step"][0]))
    np.testing.assert_array_equal(new["train/rest/blocks/0/ffn/resident/value"], after.experts)
    for s, src in enumerate(survivors):  # survivors keep their keys
        np.testing.assert_array_equal(new["train/key"][s], old["train/key"][src])
    # the regrouped state trains on its own site mesh
    mesh = federation.site_mesh(sites, overlap)
    placed = jax.device_put(state, federation.site_shardings(state, mesh))
    _, metrics = rounds.make_round(graphdef, optimizer, mesh, method="local_adamw")(placed, _tokens(sites, 1))
    assert np.isfinite(metrics["loss"]).all()


def test_with_one_replica_the_lost_sites_experts_are_named_and_refused():
    optimizer = optax.adamw(1e-2)
    before, _, state = _federation(4, 1, optimizer, mesh=False)
    old = {k: np.asarray(v) for k, v in checkpoint.flatten(state).items()}
    assert elastic.lost_experts(before, [2]) == {4: [2], 5: [2]}  # site 2 hosts experts 4 and 5 alone
    assert elastic.regrouped_overlap(EXPERTS, 3, 1) == 3  # 3 sites hold 8 experts evenly only as full replicas
    after, _, like = _federation(3, 3, optimizer, mesh=False)
    with pytest.raises(elastic.LostExpertsError, match=r"expert 4 \(on site 2\), expert 5 \(on site 2\)"):
        elastic.regroup(old, like, before, after, [0, 1, 3], optimizer)
    state2, report = elastic.regroup(old, like, before, after, [0, 1, 3], optimizer, reinitialise_lost=True)
    assert report["lost_experts"] == [4, 5]
    new = {k: np.asarray(v) for k, v in checkpoint.flatten(state2).items()}
    fresh = {k: np.asarray(v) for k, v in checkpoint.flatten(like).items()}
    up = "train/params/blocks/0/ffn/up/value"
    for s in range(3):
        for j, e in enumerate(after.experts[s]):
            if e in (4, 5):  # re-initialised: the fresh state's weights
                np.testing.assert_array_equal(new[up][s, j], fresh[up][s, j])
            else:
                old_site = 0 if e < 2 else 1 if e < 4 else 3
                k = list(before.experts[old_site]).index(e)
                np.testing.assert_array_equal(new[up][s, j], old[up][old_site, k])


def test_regrouped_overlap_keeps_or_raises_the_replication():
    assert elastic.valid_overlaps(12, 6) == [1, 2, 3, 6]
    assert elastic.regrouped_overlap(8, 8, 2) == 2  # allowed: kept
    assert elastic.regrouped_overlap(12, 6, 4) == 6  # not allowed: the next larger
    assert elastic.regrouped_overlap(12, 3, 2) == 3
    assert elastic.regrouped_overlap(16, 8, 3) == 4
