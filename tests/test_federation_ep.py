"""Expert parallelism inside FoMoE sites (mesh.expert = E > 1): 2 sites x 2 devices train exactly like 2 sites of one
device, their local steps' collectives stay inside each site (and do exchange tokens there), and the
synchronisation moves per site the bytes one device per site moves."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from core import hlo
from core import train as train_lib
from core.fields import ConfigError
from core.mesh_config import DEFAULT_RULES
from core.model import Transformer, TransformerConfig
from experiments import schema
from moe import MoE, MoEConfig, federation, rounds
from moe.placement import fixed_placement

SITES, OVERLAP, EXPERTS = 2, 2, 8  # full replica: every expert leaf is averaged, sharded over a site's devices


def _model(resident, shard):
    """A one-block MoE transformer (8 experts, top-2) built with the site Sharder `shard`."""
    cfg = TransformerConfig(vocab_size=264, d_model=16, num_layers=1, num_heads=2, num_kv_heads=2, d_ff=32)
    m = MoEConfig(num_experts=EXPERTS, top_k=2, expert_size=8)

    def ffn(layer, path, rngs):
        return MoE.in_transformer(cfg, m, path=path, rngs=rngs, resident=resident, shard=shard)

    return Transformer(cfg, rngs=nnx.Rngs(0), ffn_factory=ffn, shard=shard)


def _tokens(k, seed):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, size=(k, SITES, 4, 9)), jnp.int32)


@functools.cache
def _federation(expert):
    """(mesh, graphdef, initial state, the compiled LocalAdamW round) of 2 sites with `expert` devices each; the
    same initial weights for every `expert` (one global model, the same seed)."""
    placement = fixed_placement(EXPERTS, SITES, OVERLAP)
    mesh = federation.site_mesh(SITES, OVERLAP, expert=expert)
    shard = federation.site_sharder(mesh, DEFAULT_RULES)
    optimizer = optax.adamw(1e-2)
    graphdef, state = rounds.init_sites(
        _model(None, shard), _model(placement.experts[0], shard), placement, optimizer, None, mesh, seed=0
    )
    compiled = rounds.make_round(graphdef, optimizer, mesh, method="local_adamw").lower(state, _tokens(2, 0)).compile()
    return mesh, graphdef, optimizer, state, compiled


def _two_rounds(expert):
    *_, state, compiled = _federation(expert)
    state = jax.tree.map(jnp.copy, state)  # the round donates its input
    metrics = []
    for r in range(2):  # the second round starts from the first's output: its layout is the input's
        state, m = compiled(state, _tokens(2, seed=r))
        metrics.append(m)
    return jax.device_get((state, metrics))


def test_two_devices_per_site_train_like_one_device_per_site():
    one, two = _two_rounds(1), _two_rounds(2)
    flat_one = jax.tree_util.tree_flatten_with_path(one)[0]
    flat_two = jax.tree.leaves(two)
    assert len(flat_one) == len(flat_two)
    for (path, x), y in zip(flat_one, flat_two):
        a, b = np.asarray(x), np.asarray(y)
        if np.issubdtype(a.dtype, np.floating):  # parameters, both moments, metrics
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path))
        else:  # step counts, Adam's counts, keys, resident expert ids
            np.testing.assert_array_equal(b, a, err_msg=jax.tree_util.keystr(path))
    # not trivially equal: the sites trained (and differ from the start), the experts really are sharded
    start = jax.device_get(_federation(1)[3].train.params)
    assert not np.allclose(one[0].train.params["blocks"][0]["ffn"]["up"].get_value(), start["blocks"][0]["ffn"]["up"])
    up = _federation(2)[3].train.params["blocks"][0]["ffn"]["up"].get_value()
    assert up.sharding.spec[:2] == (federation.SITE_AXES, federation.EXPERT_AXIS)


def _site_of(device, expert):
    return device // expert  # site s owns mesh positions s E .. s E + E - 1


def test_local_steps_stay_inside_sites_and_the_sync_moves_one_device_per_sites_bytes():
    mesh, graphdef, optimizer, state, compiled = _federation(2)
    step = train_lib.train_step_fn(graphdef, optimizer)
    local = federation.per_site(lambda t, x: jax.lax.scan(step, t, x), mesh, (0, 1), (0, 1))
    evaluate = federation.per_site(train_lib.make_eval_step(graphdef), mesh, (0, 0, None))
    val = jnp.asarray(np.random.default_rng(3).integers(0, 256, size=(2, 9)), jnp.int32)
    for name, program in (
        ("local steps", jax.jit(local).lower(state.train, _tokens(2, 0))),
        ("evaluation", jax.jit(evaluate).lower(state.train.params, state.train.rest, val)),
    ):
        text = program.compile().as_text()
        assert text is not None
        ops = hlo.collectives(text, mesh.devices.size)
        for op in ops:  # every group of every collective lies within one site's devices
            for group in op.groups:
                assert len({_site_of(d, 2) for d in group}) == 1, (name, op)
        # ... and the site's devices do communicate: the expert-parallel dispatch's all-to-all between them
        exchanges = [op for op in ops if op.op == "all-to-all" and op.bytes_per_device > 0]
        assert exchanges and all(len(g) == 2 for op in exchanges for g in op.groups), (name, ops)

    # The round: its only cross-site collectives are the synchronisation's, per site the one-device-per-site bytes.
    one_mesh, *_, one_compiled = _federation(1)
    one_text, two_text = one_compiled.as_text(), compiled.as_text()
    assert one_text is not None and two_text is not None
    one = federation.sync_bytes_per_site(one_text, one_mesh)
    two = federation.sync_bytes_per_site(two_text, mesh)
    assert one["cross_site"] == hlo.collective_bytes(one_text)["bytes_per_device"] > 0 and one["intra_site"] == 0
    assert two["cross_site"] == one["cross_site"]
    # each device reduces half of it: its expert shards and its slice of every dense leaf
    cross = [op for op in hlo.collectives(two_text, 4) if any(len({_site_of(d, 2) for d in g}) > 1 for g in op.groups)]
    assert {op.op for op in cross} == {"all-reduce"}
    assert sum(op.bytes_per_device for op in cross) == one["cross_site"] / 2


def _config(**overrides):
    c = schema.default_config()
    c.model.update(d_model=32, num_layers=2, num_heads=2, num_kv_heads=2, d_ff=64)
    c.moe.update(every=1, num_experts=8, top_k=2)
    c.mesh.update(site=4, data=1, expert=2)
    c.fomoe.update(overlap=2, local_steps=2)
    c.data.update(seq_len=16, batch_size=8)
    c.optim.warmup_steps = 0
    c.train.steps = 4
    for key, value in overrides.items():
        section, name = key.split(".")
        c[section][name] = value
    return c


@pytest.mark.parametrize(
    "overrides, devices, needles",
    [
        # 4 sites, O_e = 1: 2 experts per site, which 4 devices per site cannot share
        (
            {"fomoe.overlap": 1, "mesh.expert": 4, "data.batch_size": 16},
            16,
            ["fomoe.overlap", "moe.num_experts", "mesh.site", "1 x 8 / 4 = 2", "'mesh.expert' = 4", "divides 2"],
        ),
        (
            {"mesh.data": 2, "data.batch_size": 16},
            16,
            ["mesh.site = 4", "mesh.data = 2", "set them to 1", "mesh.expert"],
        ),
        ({"moe.every": 0}, 8, ["'mesh.expert' = 2", "'moe.every' = 0"]),
        ({"moe.dispatch": "capacity"}, 8, ["'moe.dispatch' = 'capacity'", "'dropless'"]),
        ({"fomoe.placement": "random"}, 8, ["'fomoe.placement' = 'random'", "'fixed'", "mesh.expert = 1"]),
        (
            {"mesh.rules": (("batch", ("site", "data", "expert")), ("expert", None))},
            8,
            ["mesh.rules", "'expert'", "[]", "'mesh.expert' = 2"],
        ),
    ],
)
def test_bad_expert_parallel_sites_are_rejected_by_name(overrides, devices, needles):
    schema.validate(_config(), num_devices=8)  # the base config is valid: 4 sites x 2 devices
    with pytest.raises(ConfigError) as error:
        schema.validate(_config(**overrides), num_devices=devices)
    for needle in needles:
        assert needle in str(error.value), (needle, str(error.value))


def test_site_mesh_places_each_site_on_consecutive_devices():
    devices = jax.devices()
    mesh = federation.site_mesh(4, 2, expert=2)
    assert dict(mesh.shape) == {"replica": 2, "block": 2, "expert": 2}
    for r in range(2):
        for b in range(2):  # site s = r B + b on devices 2s, 2s + 1
            assert list(mesh.devices[r, b]) == devices[2 * (2 * r + b) : 2 * (2 * r + b) + 2]
    with pytest.raises(ValueError, match="4 sites need 12 devices, 3 per site; only 8"):
        federation.site_mesh(4, 2, expert=3)

    class Device:  # (only its process matters here)
        def __init__(self, process):
            self.process_index = process

    with pytest.raises(ValueError, match=r"site 1's 2 devices belong to processes \[0, 1\]; a process must hold"):
        federation.site_mesh(2, 1, [Device(0), Device(0), Device(0), Device(1)], expert=2)
