"""A MoE layer on one FoMoE site: partitioned router and skip-token over the resident experts only."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core.model import DefaultPrecision, TransformerConfig, split_params
from moe import MoE, MoEConfig
from moe.grouped_matmul import GroupedMatmulFn

from helpers import call, reference, set_params, sharder

RNG = np.random.default_rng(1)
CFG = TransformerConfig(d_model=16, num_layers=2)


@dataclasses.dataclass(frozen=True)
class CountingPrecision(DefaultPrecision):
    """Records how many rows reach the expert matmuls (sum of the group sizes) on each call, also under jit."""

    rows: list = dataclasses.field(default_factory=list, compare=False, hash=False)

    def grouped_matmul(self, path, key):
        def gmm(lhs, rhs, group_sizes, preferred_element_type=None):
            jax.debug.callback(lambda sizes: self.rows.append(int(sizes.sum())), group_sizes)
            return GroupedMatmulFn("windowed")(lhs, rhs, group_sizes, preferred_element_type)

        return gmm


@pytest.mark.parametrize(
    "resident, k, expert_mlp",
    [((1, 4, 6), 2, "silu"), ((0, 1, 2, 3), 3, "silu"), ((5,), 1, "silu"), ((1, 4, 6), 2, "swiglu")],
)
def test_skip_token_equals_the_global_moe_without_ghosts_and_computes_only_resident_rows(resident, k, expert_mlp):
    m = MoEConfig(num_experts=8, top_k=k, expert_size=8, router="sigmoid", expert_mlp=expert_mlp)
    counting = CountingPrecision()
    layer = MoE.in_transformer(
        CFG, m, path="ffn", rngs=nnx.Rngs(0), resident=resident, routing_mode="skip_token", precision=counting
    )
    p = set_params(layer, 0)
    assert p["router"].shape == (16, 8) and p["up"].shape == (len(resident), 16, 8)
    x = RNG.normal(size=(3, 7, 16))
    y, aux = call(layer, jnp.asarray(x, jnp.float32))
    flat = x.reshape(-1, 16)
    chosen = np.argsort(-(flat @ p["router"]), axis=1, kind="stable")[:, :k]
    is_resident = np.isin(chosen, resident)
    # The reference: the global top-k sigma-MoE in float64, where only resident experts contribute.
    full = {"router": p["router"]}
    for name in ("up", "down") + (("gate",) if expert_mlp == "swiglu" else ()):
        full[name] = np.zeros((8,) + p[name].shape[1:])
        full[name][list(resident)] = p[name]
    with jax.enable_x64(True):
        ref = np.asarray(reference(full, flat, m, np.where(is_resident, chosen, -1)))
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 16), ref, rtol=1e-5, atol=1e-6)
    # every projection (up, down, and a SwiGLU expert's gate) computes the resident assignments only
    assert counting.rows == [int(is_resident.sum())] * (3 if expert_mlp == "swiglu" else 2)
    np.testing.assert_allclose(aux["moe/ghost_fraction"], 1 - is_resident.mean(), rtol=1e-6)
    all_ghost = ~is_resident.any(axis=1)
    if all_ghost.any():  # tokens whose choices are all ghosts keep only the residual stream
        assert np.all(np.asarray(y).reshape(-1, 16)[all_ghost] == 0)


def test_partitioned_router_is_a_moe_over_the_resident_experts():
    """Site hosting 3 of 8 experts with k = 4: routes over its 3 (top min(k, N_le) = 3), exactly like a 3-expert
    top-3 MoE with the same weights (a second implementation of the same function)."""
    m = MoEConfig(num_experts=8, top_k=4, expert_size=8, router="softmax")
    site = MoE.in_transformer(CFG, m, path="ffn", rngs=nnx.Rngs(0), resident=(2, 5, 7), routing_mode="partitioned")
    small = MoE.in_transformer(CFG, dataclasses.replace(m, num_experts=3, top_k=3), path="ffn", rngs=nnx.Rngs(1))
    nnx.update(small, nnx.state(site, nnx.Param))
    assert site.router.get_value().shape == (16, 3)
    x = jnp.asarray(RNG.normal(size=(2, 9, 16)), jnp.float32)
    (y1, a1), (y2, a2) = call(site, x), call(small, x)
    np.testing.assert_array_equal(y1, y2)
    assert "moe/ghost_fraction" not in a1 and a1.keys() == a2.keys()


def test_full_replica_skip_token_is_the_standard_layer():
    m = MoEConfig(num_experts=4, top_k=2, expert_size=8)
    a = MoE.in_transformer(CFG, m, path="ffn", rngs=nnx.Rngs(0), routing_mode="skip_token")
    b = MoE.in_transformer(CFG, m, path="ffn", rngs=nnx.Rngs(0))
    x = jnp.asarray(RNG.normal(size=(2, 5, 16)), jnp.float32)
    np.testing.assert_array_equal(call(a, x)[0], call(b, x)[0])
    assert not a.skip_token


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_skip_token_sharded_over_experts_equals_one_device(dispatch):
    m = MoEConfig(num_experts=16, top_k=3, expert_size=8, dispatch=dispatch, capacity_factor=4.0)
    resident = (0, 3, 4, 9, 10, 11, 14, 15)
    x = jnp.asarray(RNG.normal(size=(8, 6, 16)), jnp.float32)
    ct = jnp.asarray(RNG.normal(size=x.shape), jnp.float32)
    outs = []
    for shard in (None, sharder(2, 4)):
        layer = MoE.in_transformer(
            CFG, m, path="ffn", rngs=nnx.Rngs(2), resident=resident, routing_mode="skip_token", shard=shard
        )
        graphdef, params, rest = split_params(layer)

        def loss(params, x, graphdef=graphdef, rest=rest):
            y, aux = nnx.merge(graphdef, params, rest)(x)
            return jnp.sum(y * ct), (y, aux)

        outs.append(jax.jit(jax.value_and_grad(loss, has_aux=True))(params, x))
    ((_, (y1, a1)), g1), ((_, (y8, a8)), g8) = outs
    np.testing.assert_allclose(y8, y1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a8["moe/ghost_fraction"], a1["moe/ghost_fraction"])
    for u, v in zip(jax.tree.leaves(g8), jax.tree.leaves(g1)):
        np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-6)


def test_bad_site_arguments():
    m = MoEConfig(num_experts=4, top_k=2)
    with pytest.raises(ValueError, match="routing_mode = 'ghost'"):
        MoE.in_transformer(CFG, m, path="ffn", rngs=nnx.Rngs(0), routing_mode="ghost")
    with pytest.raises(ValueError, match=r"resident experts \[1, 1\] must be distinct ids in \[0, 4\)"):
        MoE.in_transformer(CFG, m, path="ffn", rngs=nnx.Rngs(0), resident=(1, 1))
    with pytest.raises(ValueError, match="MoEConfig.num_experts = 3 is not divisible by the mesh axis 'expert' = 4"):
        MoE.in_transformer(
            CFG, MoEConfig(num_experts=8), path="ffn", rngs=nnx.Rngs(0), resident=(0, 1, 2), shard=sharder(2, 4)
        )
