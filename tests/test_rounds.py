"""FoMoE rounds on 4 virtual sites: full replication with one local step equals DDP; LocalAdamW averages
parameters and both moments over the right sites; DiLoCo's outer step follows its formula."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from core import hlo
from core import train as train_lib
from moe import federation, rounds, routing_health
from moe.placement import fixed_placement
from optim import diloco_outer

from helpers import forward, tiny_federation, tiny_moe_transformer

SITES = 4
OPTIMIZER_NAMES = (
    "adamw",
    "cautious_adamw",
    "mgup_adamw",
    "cautious_mgup_adamw",
    "lion",
    "mgup_lion",
    "muon",
    "mgup_muon",
)


def _setup(overlap, optimizer, outer=None, precision=None):
    """4 sites of a one-block MoE transformer (8 experts, O_e = `overlap`) on the site mesh."""
    return tiny_federation(SITES, overlap, optimizer, outer=outer, precision=precision)


def _tokens(k, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, size=(k, SITES, 2, 9)), jnp.int32)


def _group_mean(x, placement):
    """NumPy: replace each site's value by the mean over its replica group."""
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    for g in placement.replica_groups():
        out[g] = x[g].mean(0)
    return out


_take = jax.jit(lambda tree, s: jax.tree.map(lambda x: x[s], tree))  # site s of a [sites, ...] tree
_stack = jax.jit(lambda trees: jax.tree.map(lambda *x: jnp.stack(x), *trees))


def _local_only(graphdef, optimizer, train, tokens):
    """The K local steps of each site, one site after the other, without any synchronisation (the reference's
    starting point). Plain steps, not vmapped over sites: an independent reference, and far cheaper to compile."""
    step = jax.jit(train_lib.train_step_fn(graphdef, optimizer))
    sites = []
    for s in range(SITES):
        site = _take(train, s)
        for t in tokens:
            site, _ = step(site, t[s])
        sites.append(site)
    return _stack(sites)


def test_full_replication_one_local_step_and_plain_averaging_equal_ddp():
    lr = 0.1
    optimizer = optax.sgd(lr)
    _, mesh, graphdef, state = _setup(SITES, optimizer, diloco_outer(1.0, momentum=0.0))
    params0 = jax.tree.map(lambda x: np.asarray(x[0]), state.train.params)
    rest0 = jax.tree.map(lambda x: x[0], state.train.rest)
    tokens = _tokens(1)
    new, metrics = rounds.make_round(graphdef, optimizer, mesh, method="diloco", outer=diloco_outer(1.0, momentum=0.0))(
        state, tokens
    )

    def site_grad(tok, key):
        return jax.grad(lambda p: train_lib.lm_loss(nnx.merge(graphdef, p, rest0), tok, key=key)[0])(params0)

    keys = jax.vmap(lambda s: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(0), s), 0))(jnp.arange(SITES))
    grads = jax.jit(jax.vmap(site_grad))(tokens[0], keys)
    for a, p, g in zip(jax.tree.leaves(new.train.params), jax.tree.leaves(params0), jax.tree.leaves(grads)):
        ddp = p - lr * np.mean(np.asarray(g), axis=0)
        for s in range(SITES):
            np.testing.assert_allclose(a[s], ddp, rtol=1e-5, atol=1e-6)
    assert metrics["loss"].shape == (1, SITES) and np.isfinite(metrics["loss"]).all()
    assert new.train.step.tolist() == [1] * SITES


@pytest.mark.parametrize("overlap", [2])  # replica groups of 2 (O_e = 1's singleton groups: the byte-count tests)
def test_local_adamw_averages_parameters_and_both_moments_over_groups(overlap):
    optimizer = optax.adamw(1e-2)
    placement, mesh, graphdef, state = _setup(overlap, optimizer)
    tokens = _tokens(3, seed=overlap)
    manual = _local_only(graphdef, optimizer, state.train, tokens)
    new, _ = rounds.make_round(graphdef, optimizer, mesh, method="local_adamw")(state, tokens)
    flags = jax.tree.leaves(federation.expert_flags(manual.params))
    adam = manual.opt_state[0]
    new_adam = new.train.opt_state[0]
    # (parameters to 1e-4 of a step: Adam's first steps are about lr wherever the gradient is tiny, so float32
    # rounding that differs between the round's program and the reference's can move them by that much)
    trees = ((manual.params, new.train.params, 1e-6), (adam.mu, new_adam.mu, 1e-7), (adam.nu, new_adam.nu, 1e-7))
    for tree_before, tree_after, atol in trees:
        for before, after, expert in zip(jax.tree.leaves(tree_before), jax.tree.leaves(tree_after), flags):
            b = np.asarray(before, np.float64)
            expected = _group_mean(b, placement) if expert else np.broadcast_to(b.mean(0), b.shape)
            np.testing.assert_allclose(after, expected, rtol=1e-5, atol=atol)
    np.testing.assert_array_equal(new_adam.count, manual.opt_state[0].count)  # counts are not averaged
    # Experts stay different across blocks (O_e < M): site 0 and site 1 hold different experts.
    up = new.train.params["blocks"][0]["ffn"]["up"].get_value()
    assert not np.allclose(up[0], up[1])


def test_a_round_of_mgup_and_ufp4_sites_equals_their_unsharded_steps_then_the_mean():
    """The composition the experiments run: sites that train with MGUP-AdamW and UFP4 GEMMs (experts included,
    through ragged_dot, the accelerators' grouped matmul) under shard_map take the same local steps as under a plain
    vmap, then LocalAdamW averages them. (The CPU's windowed grouped matmul runs this composition in test_cli's
    composed-config test.)"""
    from moe.grouped_matmul import GroupedMatmulFn
    from optim import mgup_adamw
    from quant import recipes
    from quant.precision import QuantPrecision

    optimizer = mgup_adamw(1e-2)
    precision = QuantPrecision(recipes.UFP4, num_layers=1, grouped=GroupedMatmulFn("ragged_dot"))
    placement, mesh, graphdef, state = _setup(2, optimizer, precision=precision)
    tokens = _tokens(2, seed=7)
    # UFP4 is on: site 0's forward differs from the same weights' with plain products.
    plain_graphdef = nnx.split(tiny_moe_transformer(placement.experts[0]))[0]
    site0 = jax.tree.map(lambda x: x[0], (state.train.params, state.train.rest))
    logits = [forward(nnx.merge(g, *site0), tokens[0, 0])[0] for g in (graphdef, plain_graphdef)]
    assert not np.allclose(logits[0], logits[1], atol=1e-3)
    manual = _local_only(graphdef, optimizer, state.train, tokens)
    new, metrics = rounds.make_round(graphdef, optimizer, mesh, method="local_adamw")(state, tokens)
    flags = jax.tree.leaves(federation.expert_flags(manual.params))
    for before, after, expert in zip(jax.tree.leaves(manual.params), jax.tree.leaves(new.train.params), flags):
        b = np.asarray(before, np.float64)
        expected = _group_mean(b, placement) if expert else np.broadcast_to(b.mean(0), b.shape)
        np.testing.assert_allclose(after, expected, rtol=1e-5, atol=1e-6)
    assert np.isfinite(metrics["loss"]).all()


def test_diloco_outer_step_over_two_rounds_follows_its_formula():
    lr, mu = 0.7, 0.9
    optimizer = optax.adamw(1e-2)
    placement, mesh, graphdef, state = _setup(2, optimizer, diloco_outer(lr, momentum=mu))
    round_fn = rounds.make_round(graphdef, optimizer, mesh, method="diloco", outer=diloco_outer(lr, momentum=mu))
    flags = jax.tree.leaves(federation.expert_flags(state.train.params))
    start = [np.asarray(x, np.float64) for x in jax.tree.leaves(state.train.params)]
    velocity = [np.zeros_like(x) for x in start]
    train = state.train
    for r in range(2):
        tokens = _tokens(2, seed=10 + r)
        local = _local_only(graphdef, optimizer, train, tokens)
        state, _ = round_fn(state, tokens)
        expected = []
        for i, (leaf, expert) in enumerate(zip(jax.tree.leaves(local.params), flags)):
            x = np.asarray(leaf, np.float64)
            avg = _group_mean(x, placement) if expert else np.broadcast_to(x.mean(0), x.shape)
            delta = start[i] - avg
            velocity[i] = mu * velocity[i] + delta
            expected.append(start[i] - lr * (delta + mu * velocity[i]))
        for got, want in zip(jax.tree.leaves(state.train.params), expected):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
        start, train = expected, state.train
        # the inner AdamW state stays with each site (not averaged)
        # (relative to the tensor's scale: elements near zero are cancelling sums, exact only to float rounding)
        want_mu = np.asarray(jax.tree.leaves(local.opt_state[0].mu)[0])
        np.testing.assert_allclose(
            jax.tree.leaves(state.train.opt_state[0].mu)[0], want_mu, rtol=1e-6, atol=1e-6 * np.abs(want_mu).max()
        )


def _state_copies(name, path, shape):
    """Optimizer-state tensors per parameter that LocalAdamW averages, by the optimizer's definition: Adam keeps two
    moments, Lion one momentum, Muon one momentum for 2-D matrices that are not the embedding (AdamW's two for
    the rest)."""
    if "lion" in name:
        return 1
    if "muon" in name:
        return 1 if len(shape) == 2 and "embedding" not in path else 2
    return 2


@pytest.mark.parametrize(
    "name, overlap, method",
    [(name, 2, "local_adamw") for name in OPTIMIZER_NAMES] + [("adamw", 1, "local_adamw"), ("adamw", 4, "diloco")],
)
def test_a_rounds_collectives_are_exactly_the_formula_bytes(name, overlap, method):
    """What the compiled round program all-reduces across sites equals moe.system_model.sync_bytes, to the byte,
    for every optimizer: parameters (dense over all sites, experts over their replica group) and, with
    LocalAdamW, the optimizer state that mirrors them (counts and MGUP's selected fraction stay with each site).
    Every optimizer, as `optim.name` builds it, also trains the MoE sites: the second round's loss on the same
    batches is lower than the first's."""
    from experiments import build, schema
    from moe import system_model

    config = schema.default_config()
    config.optim.update(name=name, learning_rate=3e-3, warmup_steps=0)
    optimizer = build.build_optimizer(config)
    outer = diloco_outer() if method == "diloco" else None
    _, mesh, graphdef, state = _setup(overlap, optimizer, outer)
    compiled = (
        rounds.make_round(graphdef, optimizer, mesh, method=method, outer=outer).lower(state, _tokens(2)).compile()
    )
    text = compiled.as_text()
    assert text is not None  # the CPU backend gives the compiled program's text
    measured = hlo.collective_bytes(text)["bytes_per_device"]
    params = jax.tree_util.tree_flatten_with_path(state.train.params)[0]
    flags = jax.tree.leaves(federation.expert_flags(state.train.params))
    sizes = {False: [0, 0], True: [0, 0]}  # expert? -> [parameter bytes, state bytes] per site
    for (path, x), expert in zip(params, flags):
        per_site = x.nbytes // SITES
        sizes[expert][0] += per_site
        sizes[expert][1] += per_site * _state_copies(name, jax.tree_util.keystr(path), x.shape[1:])
    formula = system_model.sync_bytes(
        sizes[False][0],
        sizes[True][0],
        SITES,
        overlap,
        optimizer=method,
        state_bytes=(sizes[False][1], sizes[True][1]),
    )
    assert measured == formula["total"]
    losses = []
    for _ in range(2):
        state, metrics = compiled(state, _tokens(2))
        losses.append(float(np.mean(metrics["loss"])))
    assert np.isfinite(losses).all() and losses[1] < losses[0], losses


def test_local_steps_and_evaluation_move_nothing_across_sites():
    """Each site's K steps, its evaluation and its probe compile to programs without a single collective (vmap
    alone let XLA gather top-k operands across sites and all-reduce loop conditions every iteration)."""
    optimizer = optax.adamw(1e-2)
    _, mesh, graphdef, state = _setup(2, optimizer)
    step = train_lib.train_step_fn(graphdef, optimizer)
    local = federation.per_site(lambda t, x: jax.lax.scan(step, t, x), mesh, (0, 1), (0, 1))
    evaluate = federation.per_site(train_lib.make_eval_step(graphdef), mesh, (0, 0, None))
    probe = routing_health.make_probe(graphdef, mesh)
    val = jnp.zeros((2, 9), jnp.int32)
    routes = probe(state.train.params, state.train.rest, val[:, :-1])
    for program in (
        jax.jit(local).lower(state.train, _tokens(2)),
        jax.jit(evaluate).lower(state.train.params, state.train.rest, val),
        probe.lower(state.train.params, state.train.rest, val[:, :-1]),
        routing_health.make_routing_stats(mesh, 8).lower(routes, routes),
    ):
        text = program.compile().as_text()
        assert text is not None and hlo.collective_bytes(text)["ops"] == 0


def test_make_round_rejects_bad_methods():
    optimizer = optax.sgd(0.1)
    _, mesh, graphdef, _ = _setup(SITES, optimizer)
    with pytest.raises(ValueError, match="outer method = 'fedavg'"):
        rounds.make_round(graphdef, optimizer, mesh, method="fedavg")
    with pytest.raises(ValueError, match="needs its outer optimizer"):
        rounds.make_round(graphdef, optimizer, mesh, method="diloco")
    with pytest.raises(ValueError, match="cannot be split over 4 sites"):
        rounds.site_batches(np.zeros((2, 6, 9)), SITES)


def test_topk_agreement_and_probe_routes():
    """By hand, then on the probe's routes of two states: each site's agreement (the ids it chose in both over k,
    counted in NumPy) and expert counts (np.bincount per site and layer), reduced on the sites' devices."""
    prev = np.array([[[[0, 1], [2, 3]]], [[[5, 5], [5, 5]]]])  # [sites, layers, tokens, k]
    cur = np.array([[[[1, 0], [2, 4]]], [[[5, 5], [5, 5]]]])
    # site 0, token 0: both kept; token 1: one of two
    np.testing.assert_allclose(routing_health.topk_agreement(prev, cur), np.array([3 / 4, 1.0]))
    placement, mesh, graphdef, state = _setup(2, optax.adamw(1e-2))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(2, 8)), jnp.int32)
    probe = routing_health.make_probe(graphdef, mesh)
    before = probe(state.train.params, state.train.rest, tokens)
    routes = np.asarray(before)
    assert routes.shape == (SITES, 1, 16, 2)  # 1 MoE layer, 16 tokens, top-2
    for s in range(SITES):  # partitioned routing: a site only ever chooses its resident experts (global ids)
        assert set(routes[s].ravel()) <= set(placement.experts[s])
    noisy = jax.tree.map(lambda p: p + 0.5 * jax.random.normal(jax.random.key(1), p.shape, p.dtype), state.train.params)
    after = np.asarray(probe(noisy, state.train.rest, tokens))
    stats = jax.device_get(routing_health.make_routing_stats(mesh, placement.num_experts)(before, after))
    kept = [np.mean([len(set(a) & set(b)) / 2 for a, b in zip(routes[s, 0], after[s, 0])]) for s in range(SITES)]
    np.testing.assert_allclose(stats["agreement"], kept, rtol=1e-6)
    assert min(kept) > 0 and max(kept) < 1  # the noise moved some choices, not all
    want = [[np.bincount(after[s, 0].ravel(), minlength=placement.num_experts)] for s in range(SITES)]
    np.testing.assert_array_equal(stats["counts"], want)


def test_routing_divergence_and_utilisation_entropy_against_scipy():
    """On random routes of 4 sites, 2 layers: each site's expert shares are its choice counts; the divergence of two
    sites is scipy's Jensen-Shannon distance squared (nats), of four the generalised form; the utilisation entropy is
    scipy's entropy over ln N; sites that route alike diverge by 0, and one expert taking every choice has entropy 0."""
    from scipy.spatial.distance import jensenshannon
    from scipy.stats import entropy

    rng = np.random.default_rng(5)
    routes = rng.integers(0, 6, size=(4, 2, 50, 2))
    shares = routing_health.routing_shares(routing_health.routing_counts(routes, 6))
    counts = np.bincount(routes[2, 1].ravel(), minlength=6)
    np.testing.assert_allclose(shares[2, 1], counts / counts.sum())
    pair = np.mean([jensenshannon(shares[0, layer], shares[1, layer]) ** 2 for layer in range(2)])
    assert routing_health.routing_divergence(shares, [np.array([0, 1]), np.array([2])]) == pytest.approx(
        pair, rel=1e-10
    )
    mixed = [entropy(shares[:, layer].mean(0)) - np.mean([entropy(p) for p in shares[:, layer]]) for layer in range(2)]
    assert routing_health.routing_divergence(shares, [np.arange(4)]) == pytest.approx(np.mean(mixed), rel=1e-10)
    assert routing_health.routing_divergence(shares[[0, 0]], [np.array([0, 1])]) == 0.0
    want = np.mean([entropy(p) for p in shares.reshape(-1, 6)]) / np.log(6)
    assert routing_health.utilisation_entropy(shares, 6) == pytest.approx(want, rel=1e-10)
    one_expert = routing_health.routing_shares(routing_health.routing_counts(np.zeros((1, 1, 9, 1), int), 6))
    assert routing_health.utilisation_entropy(one_expert, 6) == 0.0


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"method": "sgd"}, "method = 'sgd': allowed 'local_adamw', 'diloco'"),
        ({"routing": "dense"}, "routing = 'dense': allowed 'partitioned', 'skip_token'"),
        ({"local_steps": 0}, "local_steps = 0: allowed a positive integer"),
        ({"eval_batches": 0}, "eval_batches = 0: allowed a positive integer"),
        ({"reshuffle_every": -1}, "reshuffle_every = -1: allowed 0 (fixed placement) or a positive count"),
    ],
)
def test_the_federated_stepper_refuses_a_bad_argument_by_name(overrides, needle):
    """moe.stepper.FederatedStepper takes its round's settings as arguments (no config): a value outside what is
    allowed is refused, naming the argument, before anything is built or compiled."""
    from moe.stepper import FederatedStepper

    kwargs = {"placement_at": lambda r: fixed_placement(8, SITES, 1), "local_steps": 2, "total_rounds": 3, **overrides}
    with pytest.raises(ValueError, match="^" + re.escape(needle)):
        FederatedStepper(None, None, None, None, None, **kwargs)  # type: ignore[arg-type]
