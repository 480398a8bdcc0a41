"""Sharding by logical-axis annotation on 8 virtual devices equals the single-device computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from core import mesh as mesh_lib
from core import train as train_lib
from experiments import build, schema


def test_logical_to_spec_rules():
    rules = (("batch", ("site", "data")), ("heads", "model"), ("mlp", "model"), ("embed", None))
    assert mesh_lib.logical_to_spec(("batch", "seq", "embed"), rules) == P(("site", "data"), None, None)
    assert mesh_lib.logical_to_spec(("embed", "mlp"), rules) == P(None, "model")
    # A mesh axis is used once per spec: the second claimant is replicated.
    assert mesh_lib.logical_to_spec(("heads", "mlp"), rules) == P("model", None)
    assert mesh_lib.logical_to_spec(("unknown", None), rules) == P(None, None)


def test_size_one_mesh_axes_are_dropped():
    c = schema.default_config()
    c.mesh.data, c.mesh.model = 2, 4
    mesh = mesh_lib.make_mesh(c)
    assert dict(mesh.shape) == {"site": 1, "data": 2, "expert": 1, "model": 4}
    rules = tuple(tuple(r) for r in c.mesh.rules)
    assert mesh_lib.logical_to_spec(("batch", "seq", "embed"), rules, mesh) == P("data", None, None)


def _setup(config, data, model):
    config.mesh.data, config.mesh.model = data, model
    schema.validate(config, num_devices=jax.device_count())
    _, sharder = build.build_mesh(config)
    optimizer = build.build_optimizer(config)
    graphdef, state = train_lib.init_state(build.build_model_fn(config, sharder), optimizer, 0, sharder)
    return sharder, optimizer, graphdef, state


# data x tensor parallel to one head per device (pure data parallelism: test_moe's 8-device steps and test_cli's
# two processes)
@pytest.mark.parametrize("data, model", [(2, 4)])
def test_train_steps_on_8_devices_equal_one_device(tiny_config, data, model):
    c = tiny_config
    c.model.num_heads, c.model.num_kv_heads, c.model.d_ff = 4, 4, 64
    tokens = np.asarray(jax.random.randint(jax.random.key(0), (8, 17), 0, 259))
    results = {}
    for d, m in ((1, 1), (data, model)):
        sharder, optimizer, graphdef, state = _setup(c, d, m)
        step = train_lib.make_train_step(graphdef, optimizer)
        batch = jax.device_put(tokens, sharder.named(("batch", None)))
        losses = []
        for _ in range(3):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        results[(d, m)] = (losses, jax.device_get(state.params), state)
    (l1, p1, _), (l8, p8, state8) = results[(1, 1)], results[(data, model)]
    np.testing.assert_allclose(l8, l1, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(p8), jax.tree.leaves(p1)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
    # Parameters are sharded as their logical axes say, and Adam's moments follow them.
    q = state8.params["blocks"][0]["attn"]["q"]["kernel"].get_value()
    assert q.sharding.spec == P(None, "model")
    assert q.addressable_shards[0].data.shape == (q.shape[0], q.shape[1] // model)
    mu = state8.opt_state[1][0].mu["blocks"][0]["attn"]["q"]["kernel"].get_value()
    assert mu.sharding.is_equivalent_to(q.sharding, q.ndim)


def test_forward_with_data_and_model_sharding_equals_single_device(tiny_config):
    from flax import nnx

    c = tiny_config
    c.model.num_heads, c.model.num_kv_heads = 4, 4
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 259, size=(4, 16)), jnp.int32)
    _, _, graphdef, state1 = _setup(c, 1, 1)
    fwd = jax.jit(lambda g, p, r, t: nnx.merge(g, p, r)(t)[0], static_argnums=0)
    ref = fwd(graphdef, state1.params, state1.rest, tokens)
    sharder, _, graphdef, state = _setup(c, 2, 4)
    out = fwd(graphdef, state.params, state.rest, jax.device_put(tokens, sharder.named(("batch", None))))
    assert out.sharding.spec[0] == "data"
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    assert jnp.isfinite(out).all()
