"""Expert parallelism's exact-size exchanges (moe.dispatch.expert_parallel): the plan of the ragged all-to-all
against a NumPy queue, its fixed-size CPU emulation against the op's documented semantics, the capped dispatch
against float64 and its dropped count against a NumPy count, and the accelerator path lowered for CUDA and TPU
with receive buffers of O(tokens per shard) whatever the number of shards.

XLA:CPU has no ragged all-to-all, so the op itself is only lowered here (tests/conftest.py gives 8 CPU devices);
everything around it (the plan, the buffers, the sorts, the return trip) runs on the CPU through the emulation."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from core import mesh as mesh_lib
from core.fields import ConfigError
from core.model import split_params
from experiments import schema, schema_moe
from moe import MoEConfig
from moe import dispatch as dispatch_lib
from moe.grouped_matmul import GroupedMatmulFn
from moe.layer import MoE

RNG = np.random.default_rng(11)


def expert_sharder(devices: int) -> mesh_lib.Sharder:
    """A mesh of the first `devices` CPU devices, all on the expert axis."""
    c = schema.default_config()
    c.mesh.data, c.mesh.expert = 1, devices
    return mesh_lib.Sharder(mesh_lib.make_mesh(c, jax.devices()[:devices]), tuple(tuple(r) for r in c.mesh.rules))


def routing(p, n, k, local, ghosts=True):
    """Random expert ids [P, n, k] (distinct per token; with `ghosts`, some are the ghost id P E_l) skewed so that
    some shards are over-subscribed."""
    e = p * local
    weights = RNG.dirichlet(np.full(e + ghosts, 0.5))
    ids = np.stack([[RNG.choice(e + ghosts, size=k, replace=False, p=weights) for _ in range(n)] for _ in range(p)])
    return ids.astype(np.int32)


def counts_of(ids, local, k):
    """counts[s, d, r]: shard s's assignments of rank r bound for shard d (ghosts excluded)."""
    p = ids.shape[0]
    counts = np.zeros((p, p, k), np.int64)
    for s in range(p):
        for r in range(k):
            for e in ids[s, :, r]:
                if e < p * local:
                    counts[s, e // local, r] += 1
    return counts


def numpy_kept(counts, rows):
    """kept[s, d]: each receiver admits assignments one at a time, rank by rank and source by source in order, while
    it has fewer than `rows`."""
    p, _, k = counts.shape
    kept = np.zeros((p, p), np.int64)
    for d in range(p):
        filled = 0
        for r in range(k):
            for s in range(p):
                for _ in range(counts[s, d, r]):
                    if filled < rows:
                        kept[s, d] += 1
                        filled += 1
    return kept


def simulate_ragged(operands, outputs, plans):
    """jax.lax.ragged_all_to_all's documented semantics over P shards, in NumPy (a slice outside the buffers or two
    slices writing the same row fail)."""
    p = len(operands)
    results = [o.copy() for o in outputs]
    written = [np.zeros(len(o), bool) for o in outputs]
    for s in range(p):
        off, size, out = (np.asarray(v) for v in (plans[s].input_offsets, plans[s].send_sizes, plans[s].output_offsets))
        for d in range(p):
            assert int(np.asarray(plans[d].recv_sizes)[s]) == size[d]
            assert off[d] + size[d] <= len(operands[s]) and out[d] + size[d] <= len(outputs[d])
            assert not written[d][out[d] : out[d] + size[d]].any()
            written[d][out[d] : out[d] + size[d]] = True
            results[d][out[d] : out[d] + size[d]] = operands[s][off[d] : off[d] + size[d]]
    return results


@pytest.mark.parametrize("p, n, k, local, factor", [(2, 7, 2, 2, None), (4, 5, 3, 1, 1.0), (8, 6, 2, 2, 1.5)])
def test_plan_matches_a_numpy_queue_and_moves_exactly_the_kept_rows(p, n, k, local, factor):
    ids = routing(p, n, k, local)
    counts = counts_of(ids, local, k)
    rows = dispatch_lib.buffer_rows(n * k, p, factor)
    assert rows == (p * n * k if factor is None else min(p * n * k, math.ceil(factor * n * k)))
    kept = numpy_kept(counts, rows)
    totals = counts.sum(-1)
    plan = jax.jit(dispatch_lib.exchange_plan, static_argnums=2)  # one program for every shard
    plans = [plan(jnp.asarray(counts), i, rows) for i in range(p)]
    for i, (forward, back) in enumerate(plans):
        in_off = np.cumsum(totals[i]) - totals[i]
        out_off = np.cumsum(kept[:, i]) - kept[:, i]  # receiver i's rows, by source
        np.testing.assert_array_equal(forward.input_offsets, in_off)
        np.testing.assert_array_equal(forward.send_sizes, kept[i])
        np.testing.assert_array_equal(forward.recv_sizes, kept[:, i])
        np.testing.assert_array_equal(back.input_offsets, out_off)
        np.testing.assert_array_equal(back.recv_sizes, kept[i])
    if factor is not None:
        assert kept.sum() < totals.sum()  # the skewed routing overflows some buffer: the cap is exercised
    # Rows labelled (sender, position) travel to the right receiver and come back to the rows they left.
    operands = [np.arange(n * k) + 1000 * s for s in range(p)]
    received = simulate_ragged(operands, [np.full(rows, -1) for _ in range(p)], [f for f, _ in plans])
    for d in range(p):
        expect = [
            1000 * s + np.cumsum(totals[s])[d] - totals[s, d] + np.arange(kept[s, d]) for s in range(p)
        ]  # the first kept rows of each sender's block for d, in source order
        np.testing.assert_array_equal(received[d][: kept[:, d].sum()], np.concatenate(expect))
    returned = simulate_ragged(received, [np.full(n * k, -1) for _ in range(p)], [b for _, b in plans])
    for s in range(p):
        sent = np.concatenate([np.arange(kept[s, d]) + totals[s, :d].sum() for d in range(p)]).astype(int)
        np.testing.assert_array_equal(returned[s][sent], operands[s][sent])
        assert (np.delete(returned[s], sent) == -1).all()


@pytest.mark.parametrize("p", [2, 8])
def test_padded_emulation_has_the_ops_semantics(p):
    """padded_ragged_all_to_all under shard_map equals the NumPy simulation of the documented op, trailing dims kept."""
    n, k, local, rows = 5, 2, 1, 7
    ids = routing(p, n, k, local, ghosts=False)
    counts = jnp.asarray(counts_of(ids, local, k))
    operand = RNG.normal(size=(p, n * k, 3)).astype(np.float32)
    output = RNG.normal(size=(p, rows, 3)).astype(np.float32)
    plans = [jax.jit(dispatch_lib.exchange_plan, static_argnums=2)(counts, i, rows)[0] for i in range(p)]
    expect = simulate_ragged(list(operand), list(output), plans)
    mesh = jax.sharding.Mesh(jax.devices()[:p], ("x",))

    def body(operand, output):
        plan = dispatch_lib.exchange_plan(counts, jax.lax.axis_index("x"), rows)[0]
        return dispatch_lib.padded_ragged_all_to_all(operand[0], output[0], plan, axis_name="x")[None]

    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))(operand, output)
    np.testing.assert_array_equal(np.asarray(got), np.stack(expect))


def numpy_moe(x, ids, gates, up, down, keep, num_experts):
    """float64 y[t] = sum_j keep[t, j] gates[t, j] silu(x[t] up[e]) down[e], e = ids[t, j] (ghosts contribute 0)."""
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if e < num_experts and keep[t, j]:
                h = x[t] @ up[e]
                y[t] += gates[t, j] * (h / (1 + np.exp(-h))) @ down[e]
    return y


def numpy_keep(ids, p, local, rows):
    """keep [P, n, k]: the cap's rank-major queue (every first choice, source by source, before any second)."""
    _, n, k = ids.shape
    filled = np.zeros(p, np.int64)
    keep = np.ones(ids.shape, bool)
    for r in range(k):
        for s in range(p):
            # a sender's rank-r block for d is in token order
            for t in range(n):
                e = ids[s, t, r]
                if e >= p * local:
                    continue
                keep[s, t, r] = filled[e // local] < rows
                filled[e // local] += 1
    return keep


@pytest.mark.parametrize("p, n, k, factor", [(4, 9, 2, 1.0), (8, 5, 3, None)])
def test_capped_dispatch_equals_float64_with_the_numpy_drops(p, n, k, factor):
    local, d, h = 2, 6, 5
    e = p * local
    ids = routing(p, n, k, local)
    gates = RNG.uniform(0.2, 1.0, size=ids.shape)
    x = RNG.normal(size=(p, n, d))
    up, down = RNG.normal(size=(e, d, h)) / np.sqrt(d), RNG.normal(size=(e, h, d)) / np.sqrt(h)
    rows = dispatch_lib.buffer_rows(n * k, p, factor)
    keep_ref = numpy_keep(ids, p, local, rows)
    mesh = jax.sharding.Mesh(jax.devices()[:p], ("x",))
    gmm = GroupedMatmulFn("windowed")

    def body(x, ids, gates, up, down):
        y, keep = dispatch_lib.expert_parallel(
            x[0], ids[0], gates[0], up, down, axis="x", gmm_up=gmm, gmm_down=gmm, capacity_factor=factor
        )
        return y[None], keep[None]

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=P("x"))
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    y, keep = jax.jit(fn)(f32(x), jnp.asarray(ids), f32(gates), f32(up), f32(down))
    np.testing.assert_array_equal(np.asarray(keep), keep_ref)
    assert (factor is None) == bool(keep_ref.all())
    expect = np.stack([numpy_moe(x[s], ids[s], gates[s], up, down, keep_ref[s], e) for s in range(p)])
    np.testing.assert_allclose(np.asarray(y), expect, rtol=2e-5, atol=2e-5)


def test_layer_reports_the_caps_drops_as_moe_dropped():
    """aux["moe/dropped"] of the capped layer = the NumPy queue's dropped fraction over the layer's own routes."""
    p, local, n = 4, 2, 6  # n tokens per shard
    m = MoEConfig(num_experts=p * local, top_k=2, expert_size=8, router="softmax", ep_capacity_factor=0.75)
    layer = MoE(16, m, path="ffn", rngs=nnx.Rngs(1), shard=expert_sharder(p))
    x = jnp.asarray(RNG.normal(size=(p, n, 16)) + 2.0 * RNG.normal(size=(1, 1, 16)), jnp.float32)  # skewed routes
    _, aux = nnx.jit(lambda layer, x: layer(x))(layer, x)
    ids = np.asarray(aux["routes"]).reshape(p, n, -1)
    keep = numpy_keep(ids, p, local, dispatch_lib.buffer_rows(n * m.top_k, p, 0.75))
    assert not keep.all()
    np.testing.assert_allclose(float(aux["moe/dropped"]), 1.0 - keep.mean(), rtol=1e-6)


def test_bad_exchange_arguments_are_refused():
    with pytest.raises(ValueError, match=r"ep_exchange = 'nccl'; allowed: \['auto', 'padded', 'ragged'\]"):
        MoEConfig(num_experts=2, top_k=1, expert_size=4, ep_exchange="nccl")
    with pytest.raises(ValueError, match=r"ep_capacity_factor = 0.0; allowed: None \(no cap\) or a number > 0"):
        MoEConfig(num_experts=2, top_k=1, expert_size=4, ep_capacity_factor=0.0)
    c = schema.default_config()  # the experiment config's keys reach the layer's MoEConfig
    c.moe.ep_exchange, c.moe.ep_capacity_factor = "ragged", 1.5
    moe = schema_moe.moe_config(c)
    assert (moe.ep_exchange, moe.ep_capacity_factor) == ("ragged", 1.5)
    c.moe.ep_exchange = "nccl"
    with pytest.raises(ConfigError, match=r"'moe.ep_exchange' = 'nccl'"):
        schema.validate(c)
    with pytest.raises(ValueError, match=r"exchange = 'fast'; allowed"):
        dispatch_lib.resolve_exchange("fast")
    assert dispatch_lib.resolve_exchange("auto") == "padded"  # the CPU: XLA:CPU has no ragged all-to-all


RAGGED = re.compile(r"custom_call @ragged_all_to_all\(.*?\)\s*\{.*?\}\s*:\s*\((.*?)\)\s*->\s*(tensor<[^>]*>)")


def lowered_exchanges(devices: int, platform: str, factor: float | None, n: int = 6) -> list[tuple[str, str, str]]:
    """(data operand, output buffer, result) shapes of every ragged_all_to_all in the layer's train-step program
    (forward and gradient) lowered for `platform`, with n tokens per shard."""
    m = MoEConfig(
        num_experts=8, top_k=2, expert_size=8, expert_mlp="swiglu", grouped_matmul="ragged_dot",
        ep_exchange="ragged", ep_capacity_factor=factor,
    )  # fmt: skip
    layer = MoE(16, m, path="ffn", rngs=nnx.Rngs(0), shard=expert_sharder(devices))
    graphdef, params, rest = split_params(layer)

    def loss(params, x):
        y, aux = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y**2) + aux["loss/moe_balance"]

    x = jnp.ones((devices, n, 16), jnp.float32)
    text = jax.jit(jax.grad(loss)).trace(params, x).lower(lowering_platforms=(platform,)).as_text()
    found = []
    for operands, result in RAGGED.findall(text):
        data, buffer = (t.strip() for t in operands.split(", ")[:2])
        found.append((data, buffer, result))
    return found


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_accelerator_path_lowers_to_ragged_all_to_all_with_buffers_independent_of_p(platform):
    """P = 8: forward (x, ids), back, and the gradient's transposes are ragged all-to-alls; with a cap their
    buffers are O(n k) rows whatever P (2, 4, 8 at n tokens per shard); without one, P n k."""
    n, k, factor = 6, 2, 2.0
    shapes = {p: lowered_exchanges(p, platform, factor, n) for p in (2, 4, 8)}
    assert len(shapes[8]) >= 4  # x, ids and the results back; the gradient's transposes
    assert shapes[2] == shapes[4] == shapes[8]
    rows = math.ceil(factor * n * k)
    assert {s for ops in shapes[8] for s in ops} <= {
        f"tensor<{r}{tail}>" for r in (n * k, rows) for tail in ("x16xf32", "xi32")
    }
    uncapped = lowered_exchanges(8, platform, None, n)
    assert f"tensor<{8 * n * k}x16xf32>" in {s for ops in uncapped for s in ops}  # the worst case grows with P
