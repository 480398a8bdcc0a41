"""FoMoE synchronisation on 8 virtual sites: averages over the right sites, and the bytes the compiled program
moves equal the communication formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from core import hlo
from core.model import split_params
from moe import federation, system_model
from moe.placement import fixed_placement

from helpers import tiny_moe_transformer

SITES = 8


def _stacked(mesh, rng, attn_dtype=np.float32):
    """A per-site state: dense leaves (an embedding, a norm, a matrix) and expert leaves (per-site experts)."""
    shapes = {
        "embedding": ((SITES, 11, 6), np.float32),
        "norm": ((SITES, 6), np.float32),
        "attn": ((SITES, 6, 4), attn_dtype),
        "experts_up": ((SITES, 2, 6, 3), np.float32),
        "router_cols": ((SITES, 6, 2), np.float32),
    }
    sharding = NamedSharding(mesh, PartitionSpec(federation.SITE_AXES))
    tree = {k: jax.device_put(jnp.asarray(rng.normal(size=s), dtype), sharding) for k, (s, dtype) in shapes.items()}
    is_expert = {"embedding": False, "norm": False, "attn": False, "experts_up": True, "router_cols": True}
    return tree, is_expert


@pytest.mark.parametrize("overlap", [1, 2, 4, 8])
def test_average_is_a_mean_over_all_sites_or_the_replica_group(overlap):
    mesh = federation.site_mesh(SITES, overlap)
    tree, is_expert = _stacked(mesh, np.random.default_rng(overlap), attn_dtype=jnp.bfloat16)
    out = jax.jit(lambda t: federation.average(t, is_expert, mesh))(tree)
    groups = fixed_placement(16, SITES, overlap).replica_groups()
    for name, value in tree.items():
        v = np.asarray(value, np.float64)
        got = np.asarray(out[name], np.float64)
        if is_expert[name]:
            for g in groups:  # each site gets the mean of its replica group (sites holding the same experts)
                np.testing.assert_allclose(got[g], np.broadcast_to(v[g].mean(0), v[g].shape), rtol=1e-5, atol=1e-6)
        else:
            tol = 1e-2 if value.dtype == jnp.bfloat16 else 1e-5
            np.testing.assert_allclose(got, np.broadcast_to(v.mean(0), v.shape), rtol=tol, atol=tol)
        assert out[name].sharding.is_equivalent_to(value.sharding, value.ndim)


@pytest.mark.parametrize("overlap", [1, 2, 4, 8])
def test_compiled_collectives_move_exactly_the_formula_bytes(overlap):
    mesh = federation.site_mesh(SITES, overlap)
    tree, is_expert = _stacked(mesh, np.random.default_rng(0))
    text = jax.jit(lambda t: federation.average(t, is_expert, mesh)).lower(tree).compile().as_text()
    assert text is not None  # the CPU backend gives the compiled program's text
    measured = hlo.collective_bytes(text)
    per_site = {k: v.nbytes // SITES for k, v in tree.items()}
    dense = sum(b for k, b in per_site.items() if not is_expert[k])
    experts = sum(b for k, b in per_site.items() if is_expert[k])
    formula = system_model.sync_bytes(dense, experts, SITES, overlap, optimizer="diloco")
    assert measured["bytes_per_device"] == pytest.approx(formula["total"], rel=1e-12)
    if overlap == SITES:  # full replica: experts are averaged over all sites too
        assert measured["by_group_size"] == {SITES: pytest.approx(formula["total"], rel=1e-12)}
    elif overlap > 1:
        assert measured["by_group_size"] == {
            SITES: pytest.approx(formula["dense"], rel=1e-12),
            overlap: pytest.approx(formula["sparse"], rel=1e-12),
        }
    else:  # disjoint experts: nothing to average, and nothing is sent
        assert formula["sparse"] == 0
        assert measured["by_group_size"] == {SITES: pytest.approx(formula["dense"], rel=1e-12)}


def test_site_mesh_rejects_bad_shapes():
    with pytest.raises(ValueError, match="must divide the number of sites M = 8"):
        federation.site_mesh(8, 3)
    with pytest.raises(ValueError, match="16 sites need 16 devices"):
        federation.site_mesh(16, 2)


@pytest.mark.parametrize("overlap, routing_mode", [(2, "partitioned"), (1, "skip_token"), (4, "skip_token")])
def test_site_views_gather_each_sites_experts(overlap, routing_mode):
    from flax import nnx

    placement = fixed_placement(8, 4, overlap)
    _, params, _ = split_params(tiny_moe_transformer(routing_mode=routing_mode))
    site_model = tiny_moe_transformer(resident=placement.experts[0], routing_mode=routing_mode)
    _, site_params, _ = split_params(site_model)
    sites = federation.to_sites(params, placement.experts)
    flat_global = dict(nnx.to_flat_state(params))
    for path, var in nnx.to_flat_state(sites):
        x, g = np.asarray(var.get_value()), np.asarray(flat_global[path].get_value())
        assert x.shape[1:] == dict(nnx.to_flat_state(site_params))[path].get_value().shape, path
        for s in range(4):
            if federation.is_expert_variable(var):
                dim = var.axes.index("expert")
                np.testing.assert_array_equal(x[s], np.take(g, placement.experts[s], axis=dim))
            else:
                np.testing.assert_array_equal(x[s], g)
    # partitioned: router columns go with the experts; skip-token: the router is dense
    router = dict(nnx.to_flat_state(sites))[("blocks", 0, "ffn", "router")]
    assert federation.is_expert_variable(router) == (routing_mode == "partitioned")
