"""MoE: the grouped matmul, routers, dropless and capacity dispatch against float64 references written from the
formulas (a loop over experts), expert parallelism on 8 devices against one device, and bad configs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from core import hlo
from core import mesh as mesh_lib
from core import train as train_lib
from core.fields import ConfigError
from core.model import DefaultPrecision, TransformerConfig, split_params
from experiments import build, schema
from moe import MoE, MoEConfig, dispatch, grouped_matmul, load_balance_loss, route, routing_stats, z_loss
from moe.grouped_matmul import GroupedMatmulFn
from moe.router import Routing

from helpers import call, reference, set_params, sharder

RNG = np.random.default_rng(0)


# ----------------------------------------------------------------------------------------------- grouped matmul


def _gmm_reference(x, w, sizes):
    """float64: out rows of group g = x rows @ w[g]; rows past sum(sizes) zero. Also d/dx, d/dw of sum(out * ct)."""
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, n in enumerate(sizes):
        out[start : start + n] = x[start : start + n] @ w[g]
        start += n
    return out


@pytest.mark.parametrize("implementation", ["windowed", "ragged_dot", "batched"])
@pytest.mark.parametrize(
    "m, k, n, sizes, window",
    [
        (37, 5, 3, [10, 0, 7, 15], 4),  # an empty group, groups longer than the window, 5 rows past the total
        (37, 5, 3, [10, 0, 7, 15], 32),  # windows longer than the groups
        (64, 16, 8, [64], None),  # one group
        (50, 8, 6, [1, 1, 1, 0, 0, 20, 27], 8),  # ragged, ends exactly at M; "batched": two groups past capacity
        (60, 4, 3, [50, 2, 8], 4),  # "batched": one group 18 rows past its capacity of 32, in windows of 4
        (40, 6, 5, [3, 9, 2], 4),  # rows mostly past the total ("batched" runs "windowed")
        (9, 4, 4, [0, 0, 0], 4),  # nothing to compute
    ],
)
def test_grouped_matmul_and_gradients_equal_float64_loop(implementation, m, k, n, sizes, window):
    x = RNG.normal(size=(m, k))
    w = RNG.normal(size=(len(sizes), k, n))
    ct = RNG.normal(size=(m, n))
    gs = jnp.asarray(sizes, jnp.int32)

    def loss(x, w):
        out = grouped_matmul(x, w, gs, implementation=implementation, window=window)
        return jnp.sum(out * ct), out

    (_, out), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
    )
    ref = _gmm_reference(x, w, sizes)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    # d/dx row i = ct_i @ w[g]^T (0 past the total); d/dw[g] = x_g^T ct_g: the formulas, not autodiff.
    ref_dx = np.zeros_like(x)
    ref_dw = np.zeros_like(w)
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        ref_dx[rows] = ct[rows] @ w[g].T
        ref_dw[g] = x[rows].T @ ct[rows]
        start += size
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, ref_dw, rtol=1e-5, atol=1e-5)


def test_grouped_matmul_rejects_bad_shapes():
    x, w = jnp.ones((8, 4)), jnp.ones((2, 5, 3))
    with pytest.raises(ValueError, match="lhs\\[1\\] == rhs\\[1\\]"):
        grouped_matmul(x, w, jnp.array([4, 4]))
    with pytest.raises(ValueError, match="implementation = 'cuda'"):
        grouped_matmul(x, jnp.ones((2, 4, 3)), jnp.array([4, 4]), implementation="cuda")
    with pytest.raises(ValueError, match="integer"):
        grouped_matmul(x, jnp.ones((2, 4, 3)), jnp.array([4.0, 4.0]))


# ---------------------------------------------------------------------------------------------------- routers


@pytest.mark.parametrize("kind, normalize, k", [("softmax", False, 1), ("softmax", True, 2), ("sigmoid", False, 3)])
def test_route_matches_formulas(kind, normalize, k):
    logits = RNG.normal(size=(11, 6))
    r = route(jnp.asarray(logits, jnp.float32), k, kind, normalize=normalize)
    top = np.argsort(-logits, axis=1)[:, :k]
    np.testing.assert_array_equal(r.experts, top)
    if kind == "softmax":
        probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        gates = np.take_along_axis(probs, top, 1)
        if normalize:
            gates = gates / gates.sum(1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
        probs = scores / scores.sum(1, keepdims=True)
        gates = np.take_along_axis(scores, top, 1)  # not renormalised
    np.testing.assert_allclose(r.gates, gates, rtol=1e-6)
    np.testing.assert_allclose(r.probs, probs, rtol=1e-6)


def test_route_rejects_bad_arguments():
    logits = jnp.ones((4, 3))
    with pytest.raises(ValueError, match="top_k = 4"):
        route(logits, 4)
    with pytest.raises(ValueError, match="router kind = 'relu'"):
        route(logits, 1, "relu")
    with pytest.raises(ValueError, match="only defined for the softmax"):
        route(logits, 1, "sigmoid", normalize=True)


def test_load_balance_and_z_loss_equal_their_formulas():
    n, e, k = 40, 5, 2
    logits = RNG.normal(size=(n, e)) * 2
    r = jax.jit(route, static_argnums=(1, 2))(jnp.asarray(logits, jnp.float32), k, "softmax")
    top = np.argsort(-logits, axis=1)[:, :k]
    f = np.bincount(top.ravel(), minlength=e) / (n * k)
    p = (np.exp(logits) / np.exp(logits).sum(1, keepdims=True)).mean(0)
    balance = jax.jit(load_balance_loss)
    np.testing.assert_allclose(balance(r), e * np.sum(f * p), rtol=1e-5)
    lse = np.log(np.exp(logits).sum(1))
    np.testing.assert_allclose(jax.jit(z_loss)(r), np.mean(lse**2), rtol=1e-5)
    # Uniform routing gives exactly 1; the count f_e carries no gradient, P_e does.
    uniform = Routing(
        jnp.asarray(np.arange(n * k).reshape(n, k) % e, jnp.int32),
        jnp.ones((n, k)),
        jnp.full((n, e), 1 / e),
        jnp.zeros((n, e)),
    )
    np.testing.assert_allclose(balance(uniform), 1.0, rtol=1e-6)
    grad = jax.jit(jax.grad(lambda lg: load_balance_loss(route(lg, k, "softmax"))))(jnp.asarray(logits, jnp.float32))
    dp = e * f / n  # d loss / d probs[n, e]
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    expected = probs * (dp - (probs * dp).sum(1, keepdims=True))  # softmax Jacobian applied to dp
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-7)


def _routing(*fields) -> Routing:
    return Routing(*(jnp.asarray(f) for f in fields))


def test_routing_stats_on_hand_built_routing():
    stats = jax.jit(routing_stats)  # (hand-built from NumPy arrays: nothing runs op by op)
    e = 4
    collapsed = _routing(np.zeros((6, 1), np.int32), np.ones((6, 1)), np.eye(e)[np.zeros(6, int)], np.zeros((6, e)))
    s = stats(collapsed)
    np.testing.assert_allclose(s["load"], [1, 0, 0, 0])
    np.testing.assert_allclose(s["load_cv"], np.sqrt(e - 1), rtol=1e-6)  # std([1,0,0,0]) / 0.25
    np.testing.assert_allclose(
        [s["load_entropy"], s["token_entropy"], s["max_load"], s["dropped"]], [0, 0, e, 0], atol=1e-7
    )
    balanced = _routing(
        np.asarray([[0, 1], [2, 3], [1, 0], [3, 2]], np.int32),
        np.ones((4, 2)),
        np.full((4, e), 1 / e),
        np.zeros((4, e)),
    )
    keep = np.asarray([[True, True], [True, False], [True, True], [False, False]])
    s = stats(balanced, keep)
    np.testing.assert_allclose(
        [s["load_cv"], s["load_entropy"], s["token_entropy"], s["max_load"], s["dropped"]],
        [0, 1, 1, 1, 3 / 8],
        atol=1e-6,
    )
    skewed = _routing(
        np.asarray([[0], [0], [0], [1]], np.int32), np.ones((4, 1)), np.full((4, e), 1 / e), np.zeros((4, e))
    )
    load = np.array([0.75, 0.25, 0, 0])
    s = stats(skewed)
    np.testing.assert_allclose(s["load_cv"], load.std() / load.mean(), rtol=1e-6)
    np.testing.assert_allclose(s["load_entropy"], -(0.75 * np.log(0.75) + 0.25 * np.log(0.25)) / np.log(e), rtol=1e-6)


# ------------------------------------------------------------------------------------- the layer vs float64 loop

MOE_CASES = {
    "sigmoid-k2": MoEConfig(num_experts=6, top_k=2, expert_size=8, router="sigmoid"),
    "softmax-k1": MoEConfig(num_experts=4, top_k=1, expert_size=12, router="softmax"),
    "softmax-normalized-k3-shared": MoEConfig(
        num_experts=5, top_k=3, expert_size=8, router="softmax", normalize_gates=True, shared_expert_size=10
    ),
    "swiglu-softmax-k2-shared": MoEConfig(
        num_experts=4, top_k=2, expert_size=8, router="softmax", shared_expert_size=6, expert_mlp="swiglu"
    ),
}


class _ProductPerPath(DefaultPrecision):
    """A policy handing every path a product of its own (as quantised recipes do): SwiGLU experts then run their
    gate and up products apart instead of as one product over [gate | up]."""

    def grouped_matmul(self, path, key):
        return functools.partial(self.grouped)


def _layer_and_reference(m: MoEConfig, shape, seed=0, precision=None):
    cfg = TransformerConfig(d_model=shape[-1], num_layers=2)
    layer = MoE.in_transformer(cfg, m, path="ffn", rngs=nnx.Rngs(seed), precision=precision)
    params = set_params(layer, seed)
    x = RNG.normal(size=shape)
    return layer, params, x


@pytest.mark.parametrize(
    "name, shape, precision",
    [
        ("sigmoid-k2", (3, 5, 16), None),
        ("softmax-k1", (2, 8, 12), None),
        ("softmax-normalized-k3-shared", (2, 8, 12), None),
        ("swiglu-softmax-k2-shared", (2, 5, 12), None),  # gate and up as one product
        ("swiglu-softmax-k2-shared", (2, 5, 12), _ProductPerPath(GroupedMatmulFn())),  # apart
    ],
)
def test_dropless_layer_and_gradients_equal_float64_reference(name, shape, precision):
    m = MOE_CASES[name]
    layer, p, x = _layer_and_reference(m, shape, precision=precision)
    flat_x = x.reshape(-1, shape[-1])
    chosen = np.argsort(-(flat_x @ p["router"]), axis=1, kind="stable")[:, : m.top_k]
    _assert_layer_and_gradients_equal_reference(layer, p, x, m, chosen)


def _assert_layer_and_gradients_equal_reference(layer, p, x, m, chosen):
    """The layer's y and its gradients (every parameter and x) of sum(y * ct) for a random ct equal the float64
    reference's with the experts `chosen` [N, k] (-1: an assignment that contributes nothing). Returns the aux."""
    shape = x.shape
    ct = RNG.normal(size=shape)
    graphdef, params, rest = split_params(layer)

    def loss(params, x):
        y, aux = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y * ct), (y, aux)

    (_, (y, aux)), (g_params, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, jnp.asarray(x, jnp.float32)
    )
    flat_x = x.reshape(-1, shape[-1])
    with jax.enable_x64(True):
        ref_fn = lambda p, x: jnp.sum(reference(p, x, m, chosen) * ct.reshape(-1, shape[-1]))  # noqa: E731
        ref_y = np.asarray(reference(p, flat_x, m, chosen))
        ref_gp, ref_gx = jax.jit(jax.grad(ref_fn, argnums=(0, 1)))(p, flat_x)
        ref_gp = {k: np.asarray(v) for k, v in ref_gp.items()}
        ref_gx = np.asarray(ref_gx)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, shape[-1]), ref_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g_x).reshape(-1, shape[-1]), ref_gx, rtol=1e-4, atol=1e-5)
    assert {".".join(map(str, path)) for path, _ in nnx.to_flat_state(g_params)} == set(ref_gp)
    for path, var in nnx.to_flat_state(g_params):
        key = ".".join(map(str, path))
        np.testing.assert_allclose(var.get_value(), ref_gp[key], rtol=1e-4, atol=1e-5, err_msg=key)
    return aux


# ---------------------------------------------------------------------------------------------------- capacity


def _queue_positions(experts: np.ndarray, num_experts: int):
    """Pure-Python GShard queue: for each group, all rank-0 choices in token order, then rank 1, ..."""
    b, t, k = experts.shape
    pos = np.zeros_like(experts)
    for g in range(b):
        filled = [0] * num_experts
        for r in range(k):
            for i in range(t):
                pos[g, i, r] = filled[experts[g, i, r]]
                filled[experts[g, i, r]] += 1
    return pos


def test_capacity_drops_exactly_the_assignments_past_capacity_in_queue_order():
    experts = np.array([[[0, 1], [0, 1], [1, 0], [0, 1]]])  # one group, T=4, k=2, E=2
    position, keep = dispatch.capacity_assignment(jnp.asarray(experts), 2, slots=2)
    # rank 0: t0->e0 #0, t1->e0 #1, t2->e1 #0, t3->e0 #2 (dropped); rank 1: t0->e1 #1, t1->e1 #2, t2->e0 #3, t3->e1 #3
    np.testing.assert_array_equal(position, [[[0, 1], [1, 2], [0, 3], [2, 3]]])
    np.testing.assert_array_equal(keep, [[[1, 1], [1, 0], [1, 0], [0, 0]]])
    random = RNG.integers(0, 5, size=(3, 7, 3))
    position, keep = dispatch.capacity_assignment(jnp.asarray(random), 5, slots=3)
    np.testing.assert_array_equal(position, _queue_positions(random, 5))
    np.testing.assert_array_equal(keep, _queue_positions(random, 5) < 3)
    assert dispatch.capacity_per_group(256, 2, 8, 1.25) == 80
    assert dispatch.capacity_per_group(4, 2, 64, 1.0) == 1
    assert dispatch.capacity_per_group(8, 4, 2, 4.0) == 8  # never more than one slot per token


@pytest.mark.parametrize(
    "capacity_factor, expert_mlp", [(0.5, "silu"), (1.0, "silu"), (100.0, "silu"), (1.0, "swiglu")]
)
def test_capacity_layer_and_gradients_equal_reference_without_the_dropped_assignments(capacity_factor, expert_mlp):
    m = MoEConfig(
        num_experts=4,
        top_k=2,
        expert_size=8,
        router="sigmoid",
        dispatch="capacity",
        capacity_factor=capacity_factor,
        expert_mlp=expert_mlp,
    )
    shape = (3, 10, 16)
    layer, p, x = _layer_and_reference(m, shape, seed=1)
    flat_x = x.reshape(-1, shape[-1])
    chosen = np.argsort(-(flat_x @ p["router"]), axis=1, kind="stable")[:, : m.top_k]
    slots = dispatch.capacity_per_group(shape[1], m.top_k, m.num_experts, capacity_factor)
    keep = (_queue_positions(chosen.reshape(shape[0], shape[1], -1), m.num_experts) < slots).reshape(-1, m.top_k)
    dropped = np.where(keep, chosen, -1)  # expert -1 matches no expert: the assignment contributes nothing
    aux = _assert_layer_and_gradients_equal_reference(layer, p, x, m, dropped)
    np.testing.assert_allclose(aux["moe/dropped"], 1 - keep.mean(), rtol=1e-6)
    if capacity_factor == 100.0:  # capacity for every assignment: the layer drops none
        assert float(aux["moe/dropped"]) == 0.0


# ------------------------------------------------------------------------------------------ expert parallelism


@pytest.mark.parametrize(
    "data, expert, dispatch_kind, expert_mlp",
    [
        (2, 4, "dropless", "silu"),
        (1, 8, "dropless", "silu"),
        (4, 2, "dropless", "silu"),
        (2, 4, "capacity", "silu"),
        (8, 1, "dropless", "silu"),
        (2, 4, "dropless", "swiglu"),
    ],
)
def test_sharded_layer_and_gradients_equal_single_device(data, expert, dispatch_kind, expert_mlp):
    m = MoEConfig(
        num_experts=8,
        top_k=2,
        expert_size=8,
        router="softmax",
        dispatch=dispatch_kind,
        shared_expert_size=8,
        expert_mlp=expert_mlp,
    )
    cfg = TransformerConfig(d_model=16, num_layers=2)
    shard = sharder(data, expert)
    single = MoE.in_transformer(cfg, m, path="ffn", rngs=nnx.Rngs(3))
    sharded = MoE.in_transformer(cfg, m, path="ffn", rngs=nnx.Rngs(3), shard=shard)
    assert sharded.ep_axis == ("expert" if dispatch_kind == "dropless" and expert > 1 else None)
    if expert_mlp == "swiglu":  # the gate matrices are sharded like up's, by their logical axes alone
        shardings = mesh_lib.param_shardings(nnx.state(sharded, nnx.Param), shard)
        assert shardings["gate"].get_value().spec == shardings["up"].get_value().spec == P("expert", None, None)
    x = jnp.asarray(RNG.normal(size=(8, 12, 16)), jnp.float32)
    ct = jnp.asarray(RNG.normal(size=x.shape), jnp.float32)
    results = []
    for layer in (single, sharded):
        graphdef, params, rest = split_params(layer)

        def loss(params, x, graphdef=graphdef, rest=rest):
            y, aux = nnx.merge(graphdef, params, rest)(x)
            return jnp.sum(y * ct) + aux["loss/moe_balance"] + aux["loss/moe_z"], (y, aux)

        results.append(jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x))
    ((_, (y1, aux1)), g1), ((_, (y8, aux8)), g8) = results
    np.testing.assert_allclose(y8, y1, rtol=1e-5, atol=1e-6)
    for k in aux1:
        np.testing.assert_allclose(aux8[k], aux1[k], rtol=1e-5, atol=1e-7, err_msg=k)
    for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_data_parallel_routing_and_dispatch_stay_on_each_devices_tokens():
    """data = 8, experts replicated: the top-k and the sort run on each device's tokens (no all-gather); the only
    collectives are all-reduces of weight gradients and routing statistics, far smaller than the tokens."""
    m = MoEConfig(num_experts=8, top_k=2, expert_size=8, router="sigmoid")
    cfg = TransformerConfig(d_model=16, num_layers=2)
    layer = MoE.in_transformer(cfg, m, path="ffn", rngs=nnx.Rngs(3), shard=sharder(8, 1))
    graphdef, params, rest = split_params(layer)
    x = jax.device_put(
        jnp.asarray(RNG.normal(size=(64, 64, 16)), jnp.float32), layer.shard.named(("batch", None, None))
    )

    def loss(params, x):
        y, aux = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y**2) + aux["loss/moe_balance"]

    text = jax.jit(jax.grad(loss)).lower(params, x).compile().as_text()
    assert text is not None and "all-gather" not in text
    moved = hlo.collective_bytes(text)["bytes_per_device"]
    weights = sum(v.nbytes for v in jax.tree.leaves(params))
    assert 2 * 7 / 8 * weights <= moved <= 2 * 7 / 8 * weights + 1024, moved  # gradients + a few statistics


def test_expert_parallel_pads_token_counts_the_devices_cannot_split():
    """One decode step of one sequence (3 tokens here) on expert=4 x data=2: padded rows, same result."""
    m = MoEConfig(num_experts=8, top_k=2, expert_size=8)
    cfg = TransformerConfig(d_model=16, num_layers=2)
    x = jnp.asarray(RNG.normal(size=(1, 3, 16)), jnp.float32)
    y1, aux1 = call(MoE.in_transformer(cfg, m, path="ffn", rngs=nnx.Rngs(4)), x)

    def sharded(x):  # the layer is built under jit, as the model builds it
        return MoE.in_transformer(cfg, m, path="ffn", rngs=nnx.Rngs(4), shard=sharder(2, 4))(x)

    y8, aux8 = jax.jit(sharded)(x)
    np.testing.assert_allclose(y8, y1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(aux8["moe/load_cv"], aux1["moe/load_cv"], rtol=1e-6)


def test_moe_train_steps_on_8_devices_equal_one_device(tiny_config):
    c = tiny_config
    c.model.num_layers = 1
    c.moe.update(every=1, num_experts=8, top_k=2, expert_size=16)
    tokens = np.asarray(jax.random.randint(jax.random.key(0), (8, 17), 0, 259))
    results = {}
    for data, expert in ((1, 1), (2, 4)):
        c.mesh.data, c.mesh.expert = data, expert
        schema.validate(c, num_devices=jax.device_count())
        _, shard = build.build_mesh(c)
        optimizer = build.build_optimizer(c)
        graphdef, state = train_lib.init_state(build.build_model_fn(c, shard), optimizer, 0, shard)
        step = train_lib.make_train_step(graphdef, optimizer)
        batch = jax.device_put(tokens, shard.named(("batch", None)))
        metrics = []
        for _ in range(3):
            state, out = step(state, batch)
            metrics.append({k: float(v) for k, v in out.items()})
        results[(data, expert)] = (metrics, state)
    (m1, s1), (m8, s8) = results[(1, 1)], results[(2, 4)]
    assert {"loss/moe_balance", "loss/moe_z", "moe/load_cv", "moe/dropped"} <= set(m1[0])
    for a, b in zip(m8, m1):
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=2e-5, atol=1e-7, err_msg=k)
    # AdamW normalises each element's step to about the learning rate, so an element whose gradient is a cancelling
    # sum moves by a visibly different fraction of it when the sharded sum runs in another order (seen: 4e-3 of it);
    # a wrong shard or a lost gradient moves elements by whole learning rates.
    for a, b in zip(jax.tree.leaves(s8.params), jax.tree.leaves(s1.params)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-2 * c.optim.learning_rate)
    up = s8.params["blocks"][0]["ffn"]["up"].get_value()
    assert up.sharding.spec == P("expert")
    assert up.addressable_shards[0].data.shape == (2, 32, 16)  # 8 experts over 4 devices


def test_moe_every_chooses_the_layers():
    c = schema.default_config()
    c.model.update(d_model=32, num_layers=4, num_heads=4, num_kv_heads=4, d_ff=64)
    c.moe.update(every=2, num_experts=4, top_k=1, expert_size=8)
    model = build.build_model_fn(c, mesh_lib.Sharder())(nnx.Rngs(0))
    assert [type(b.ffn).__name__ for b in model.blocks] == ["MLP", "MoE", "MLP", "MoE"]


# --------------------------------------------------------------------------------------------------- bad input


def _validate(changes, num_devices=8):
    c = schema.default_config()
    for key, value in changes.items():
        section, name = key.split(".")
        c[section][name] = value
    schema.validate(c, num_devices=num_devices)


@pytest.mark.parametrize(
    "changes, needles",
    [
        ({"moe.every": 1, "moe.top_k": 9}, ["moe.top_k", "9", "moe.num_experts", "8"]),
        (
            {"moe.every": 1, "moe.num_experts": 6, "mesh.expert": 4, "mesh.data": 2},
            ["moe.num_experts", "6", "4 devices"],
        ),
        ({"moe.every": 5}, ["moe.every", "5", "model.num_layers", "4"]),
        ({"moe.every": 1, "moe.router": "sigmoid", "moe.normalize_gates": True}, ["moe.normalize_gates", "softmax"]),
        ({"moe.router": "relu"}, ["moe.router", "relu", "sigmoid"]),
        ({"moe.dispatch": "dense"}, ["moe.dispatch", "dropless", "capacity"]),
        ({"moe.capacity_factor": 0.0}, ["moe.capacity_factor", "0.0"]),
        ({"moe.num_expert": 8}, ["moe.num_expert", "moe.num_experts"]),
        ({"moe.grouped_matmul": "cuda"}, ["moe.grouped_matmul", "windowed"]),
        ({"moe.expert_mlp": "geglu"}, ["moe.expert_mlp", "geglu", "swiglu"]),
        (
            {"moe.every": 1, "mesh.expert": 4, "mesh.data": 1, "data.batch_size": 6},
            ["data.batch_size", "6", "mesh.expert"],
        ),
    ],
)
def test_bad_moe_configs_are_rejected_naming_the_key(changes, needles):
    with pytest.raises(ConfigError) as e:
        _validate(changes)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_layer_rejects_experts_not_divisible_by_the_expert_axis():
    with pytest.raises(ValueError, match="MoEConfig.num_experts = 6 is not divisible by the mesh axis 'expert' = 4"):
        MoE.in_transformer(
            TransformerConfig(d_model=16), MoEConfig(num_experts=6), path="ffn", rngs=nnx.Rngs(0), shard=sharder(2, 4)
        )


def test_the_config_layer_names_the_config_keys_of_the_layers_errors():
    """MoEConfig's own error, re-raised by experiments.schema_moe with the config keys, as one line."""
    with pytest.raises(ConfigError) as e:
        _validate({"moe.every": 1, "moe.top_k": 9})
    assert str(e.value) == (
        "config key 'moe.top_k' = 9 exceeds 'moe.num_experts' = 8; a token chooses at most every expert once."
    )


def test_moe_config_errors_name_the_layers_arguments():
    """Without any experiment config, MoEConfig and the layer name their own arguments (the config layer re-raises
    these with the config keys: test_bad_moe_configs_are_rejected_naming_the_key)."""
    with pytest.raises(ValueError, match=r"^MoEConfig.router = 'relu'; allowed: \['softmax', 'sigmoid'\]"):
        MoEConfig(router="relu")
    with pytest.raises(ValueError, match=r"^MoEConfig.capacity_factor = 0.0 must be > 0"):
        MoEConfig(capacity_factor=0.0)
    too_many = MoEConfig(num_experts=2, top_k=3)  # a dense transformer's unused MoEConfig is not held to the pairs
    with pytest.raises(ValueError, match=r"^MoEConfig.top_k = 3 exceeds MoEConfig.num_experts = 2; a token"):
        MoE(16, too_many, path="ffn", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"^MoEConfig.normalize_gates = True needs MoEConfig.router = 'softmax'"):
        MoEConfig(normalize_gates=True).check()


def test_layer_and_dispatch_reject_bad_expert_forms():
    with pytest.raises(ValueError, match=r"MoEConfig.expert_mlp = 'geglu'; allowed: \['silu', 'swiglu'\]"):
        MoE.in_transformer(TransformerConfig(d_model=16), MoEConfig(expert_mlp="geglu"), path="ffn", rngs=nnx.Rngs(0))
    layer = MoE.in_transformer(TransformerConfig(d_model=16), MoEConfig(), path="ffn", rngs=nnx.Rngs(0))
    with pytest.raises(AssertionError, match=r"shape \(2, 3, 8\) but expected \(None, None, 16\).*\[batch, seq"):
        layer(jnp.ones((2, 3, 8)))
    x, experts, gates = jnp.ones((6, 4)), jnp.zeros((6, 2), jnp.int32), jnp.ones((6, 2))
    up, down = jnp.ones((3, 4, 5)), jnp.ones((3, 5, 4))
    gmm = grouped_matmul
    with pytest.raises(ValueError, match=r"gate matrices \(3, 5, 4\) must have the shape of the up matrices"):
        jax.eval_shape(lambda: dispatch.dropless(x, experts, gates, up, down, gmm_up=gmm, gmm_down=gmm, gate=down))
    with pytest.raises(ValueError, match="without their product"):
        jax.eval_shape(lambda: dispatch.dropless(x, experts, gates, up, down, gmm_up=gmm, gmm_down=gmm, gate=up))
