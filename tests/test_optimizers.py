"""The optimizer wiring of experiments/build.py (every optimizer of experiments.optimizers) against optimizers built
directly
from optim/optax with the values docs/configuration.md documents; per-family defaults; optax.inject_hyperparams
equivalence; MGUP's state metric."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optim
from core import train as train_lib
from core.fields import ConfigError
from experiments import build, optimizers, schema

# matrices, a vector and an embedding (ragged sizes); BIG adds a matrix of more than 2 APPROX_SAMPLE entries, which
# "approx" and "sign" treat by sampling
SHAPES = {"embedding": (11, 6), "layer": {"w1": (6, 10), "w2": (10, 7), "norm": (10,)}}
BIG = {"embedding": (11, 6), "layer": {"w1": (6, 10), "w2": (48, 50), "norm": (10,)}}
DECAY = {"embedding": False, "layer": {"w1": True, "w2": True, "norm": False}}  # matrices, not the embedding
MUON_LEAVES = ("w1", "w2")  # 2-D and not named embedding/head: Muon; the rest go to the AdamW backup
STEPS = 3

ADAMW = dict(b1=0.9, b2=0.95, eps=1e-8)  # the documented family defaults (docs/configuration.md)
LION = dict(b1=0.9, b2=0.99)
MUON = dict(adam_b1=0.95, adam_b2=0.95, adam_eps=1e-8, momentum=0.95)
MGUP = dict(mask_ratio=0.5, alpha=2.0, gamma=0.1)


def _direct(name: str, lr, wd: float, **override) -> optax.GradientTransformation | None:
    """The optimizer `name` with the documented defaults (and `override`), built without experiments/build.py or
    experiments.optimizers; None for a registered optimizer this independent table does not know."""
    adamw, lion, muon, mgup = (
        dict(d, **{k: v for k, v in override.items() if k in d}) for d in (ADAMW, LION, MUON, MGUP)
    )
    table = {
        "adamw": lambda: optax.adamw(lr, **adamw, weight_decay=wd, mask=DECAY),
        "cautious_adamw": lambda: optim.cautious_adamw(lr, **adamw, weight_decay=wd, weight_decay_mask=DECAY),
        "mgup_adamw": lambda: optim.mgup_adamw(lr, **adamw, **mgup, weight_decay=wd, weight_decay_mask=DECAY),
        "cautious_mgup_adamw": lambda: optim.cautious_mgup_adamw(
            lr, **adamw, alpha=mgup["alpha"], gamma=mgup["gamma"], weight_decay=wd, weight_decay_mask=DECAY
        ),
        "lion": lambda: optax.lion(lr, **lion, weight_decay=wd, mask=DECAY),
        "mgup_lion": lambda: optim.mgup_lion(lr, **lion, **mgup, weight_decay=wd, weight_decay_mask=DECAY),
        "muon": lambda: optim.mgup_muon(lr, **muon, weight_decay=wd, mgup=False, weight_decay_mask=DECAY),
        "mgup_muon": lambda: optim.mgup_muon(lr, **muon, **mgup, weight_decay=wd, weight_decay_mask=DECAY),
    }
    return table[name]() if name in table else None


def _params(seed: int = 0, shapes=SHAPES) -> dict:
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: jnp.asarray(rng.normal(size=s), jnp.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )


def _grads(params, seed: int, scale: float) -> list:
    rng = np.random.default_rng(seed)
    return [
        jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * scale, jnp.float32), params) for _ in range(STEPS)
    ]


_apply_updates = jax.jit(optax.apply_updates)


def _run(tx, params, grads) -> tuple[list, object]:
    """The updates of each step (parameters moved by them) and the last state."""
    state, update, out = jax.jit(tx.init)(params), jax.jit(tx.update), []
    for g in grads:
        updates, state = update(g, state, params)
        params = _apply_updates(params, updates)
        out.append(updates)
    return out, state


def _assert_identical(a: list, b: list) -> None:
    """Two lists of update trees (one per step) are equal bit for bit, leaf for leaf (chex names the leaf)."""
    chex.assert_trees_all_equal(a, b, strict=True)


def _assert_rounding_close(a, b) -> None:
    """Two update trees agree to float32 rounding: within 1e-6 of each tensor's largest entry."""
    for (path, u), v in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        atol = 1e-6 * float(jnp.abs(v).max())
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))


def _config(name: str, **optim_keys):
    config = schema.default_config()
    config.optim.update(**{"name": name, "warmup_steps": 2, **optim_keys})
    config.train.steps = 10
    schema.validate(config)
    return config


_NO_FORMULA = object()


def _expected_fraction(name: str, grads: list) -> float | object | None:
    """MGUP's selected fraction after `grads` (already clipped), from the formulas: sum int(tau n) / sum n over the
    leaves the mask covers (Muon: the Muon leaves); Cautious-MGUP: the share of u g >= 0, sign(u) = sign(m) with the
    HF-Adam moment m = (1 - b1) sum_j b1^(t-j) g_j (float64), counted on tensors of at most 2 APPROX_SAMPLE entries
    and on the second strided sample (offset stride / 2) of larger ones; None for the optimizers without MGUP;
    _NO_FORMULA for a registered optimizer this test has no formula for."""
    leaves = [[np.ravel(x).astype(np.float64) for x in jax.tree.leaves(g)] for g in grads]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(grads[0])[0]]
    sizes = [x.size for x in leaves[0]]
    if name in ("mgup_adamw", "mgup_lion"):
        return sum(int(0.5 * n) for n in sizes) / sum(sizes)
    if name == "mgup_muon":
        muon = [n for n, p in zip(sizes, paths) if any(f"'{k}'" in p for k in MUON_LEAVES)]
        return sum(int(0.5 * n) for n in muon) / sum(muon)
    if name in ("adamw", "cautious_adamw", "lion", "muon"):
        return None
    if name != "cautious_mgup_adamw":
        return _NO_FORMULA
    b1, aligned = ADAMW["b1"], 0.0
    for i, n in enumerate(sizes):
        m = sum((1 - b1) * b1 ** (len(grads) - 1 - t) * leaves[t][i] for t in range(len(grads)))
        ok = m * leaves[-1][i] >= 0
        if n > 2 * optim.select.APPROX_SAMPLE:
            stride = n // optim.select.APPROX_SAMPLE
            ok = ok[stride // 2 :: stride][: optim.select.APPROX_SAMPLE]
        aligned += float(np.mean(ok)) * n / sum(sizes)
    return aligned


@pytest.mark.parametrize("name", optimizers.NAMES)
def test_build_optimizer_is_the_documented_optimizer_bit_for_bit(name):
    """Default config: clipping at 1 (active: gradients of global norm about 2), warm-up + cosine schedule, weight
    decay 0.1 on the matrices only, the family's b1 / b2 / eps / momentum, MGUP's tau, alpha, gamma. Its state gives
    MGUP's selected fraction as a metric (optim.state_metrics, through chain and multi_transform), nothing for the
    optimizers without MGUP. A registered optimizer `_direct` does not know is compared with its registry builder
    (on the documented family defaults) and its metrics with that one's."""
    config = _config(name)
    params = _params(0, BIG if name == "cautious_mgup_adamw" else SHAPES)
    grads = _grads(params, seed=1, scale=0.2)
    schedule = train_lib.learning_rate_schedule(config.optim, config.train.steps)
    inner = _direct(name, schedule, 0.1)
    if inner is None:
        hyper = dict(optimizers.lookup(name).family.defaults)
        inner = optimizers.lookup(name).build(schedule, config.optim, hyper, DECAY)
    direct = optax.chain(optax.clip_by_global_norm(1.0), inner)
    got, state = _run(build.build_optimizer(config), params, grads)
    want_updates, want_state = _run(direct, params, grads)
    _assert_identical(got, want_updates)
    assert schema.schema()["optim"]["name"].choices == optimizers.NAMES  # the schema allows what the registry builds
    clip = jax.jit(lambda g: optax.clip_by_global_norm(1.0).update(g, optax.EmptyState())[0])
    clipped = [clip(g) for g in grads]
    want = _expected_fraction(name, clipped)
    metrics = optim.state_metrics(state)
    if want is _NO_FORMULA:
        chex.assert_trees_all_equal(metrics, optim.state_metrics(want_state), strict=True)
    elif want is None:
        assert metrics == {}
    else:
        assert list(metrics) == ["mgup/selected_fraction"]
        assert isinstance(want, float)
        assert float(metrics["mgup/selected_fraction"]) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize(
    "name, key, value, direct_key",
    [
        ("lion", "b2", 0.9, "b2"),
        ("adamw", "eps", 1e-6, "eps"),
        ("muon", "b1", 0.9, "adam_b1"),
        ("muon", "momentum", 0.9, "momentum"),
    ],
)
def test_a_family_key_set_in_the_config_replaces_the_default(name, key, value, direct_key):
    """(The MGUP variants take these keys by the same code as their bases: the test above.)"""
    config = _config(name, grad_clip_norm=0.0, schedule="constant", warmup_steps=0, **{key: value})
    params = _params()
    grads = _grads(params, seed=2, scale=1.0)
    got = _run(build.build_optimizer(config), params, grads)[0]
    _assert_identical(got, _run(_direct(name, 3e-3, 0.1, **{direct_key: value}), params, grads)[0])
    default = _run(_direct(name, 3e-3, 0.1), params, grads)[0]
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(default)))


def test_family_defaults_and_keys_a_family_does_not_use():
    config = schema.default_config()
    resolved = {}
    for name in optimizers.NAMES:
        config.optim.name = name
        resolved[name] = optimizers.hyperparameters(config.optim)
    assert resolved["adamw"] == resolved["mgup_adamw"] == {"b1": 0.9, "b2": 0.95, "eps": 1e-8}  # the quickstart's
    assert resolved["lion"] == resolved["mgup_lion"] == {"b1": 0.9, "b2": 0.99}
    assert resolved["muon"] == resolved["mgup_muon"] == {"b1": 0.95, "b2": 0.95, "eps": 1e-8, "momentum": 0.95}
    config.optim.update(name="lion", b2=0.98)
    assert optimizers.hyperparameters(config.optim) == {"b1": 0.9, "b2": 0.98}
    config.optim.eps = 1e-6
    with pytest.raises(ConfigError, match="'optim.eps' = 1e-06 is not used by optim.name = 'lion'"):
        build.build_optimizer(config)
    config.optim.update(name="adamw", eps=None, momentum=0.9)
    with pytest.raises(ConfigError, match="'optim.momentum' = 0.9 is not used"):
        optimizers.hyperparameters(config.optim)


def test_an_unknown_optimizer_name_is_refused_with_the_allowed_names():
    refused = "'optim.name' = 'sgd' is not an optimizer; allowed: .*'adamw'"
    with pytest.raises(ConfigError, match=refused):
        optimizers.lookup("sgd")
    config = schema.default_config()
    config.optim.name = "sgd"
    with pytest.raises(ConfigError, match="'optim.name'.*'sgd'.*mgup_muon"):
        schema.validate(config)


HYPER = dict(learning_rate=3e-3, weight_decay=0.1, mask_ratio=0.375, alpha=2.5, gamma=0.25)  # float32-exact tau
APPROX = functools.partial(optim.mgup_adamw, selection="approx")


@pytest.mark.parametrize(
    "make, hyper",
    [
        (optim.mgup_adamw, HYPER),
        (APPROX, HYPER),
        (optim.mgup_lion, HYPER),
        (optim.cautious_mgup_adamw, {k: v for k, v in HYPER.items() if k != "mask_ratio"}),
        (optim.mgup_muon, HYPER),
    ],
    ids=["mgup_adamw", "mgup_adamw_approx", "mgup_lion", "cautious_mgup_adamw", "mgup_muon"],
)
def test_inject_hyperparams_gives_the_plain_optimizer(make, hyper):
    """Injected (traced) learning rate, weight decay, tau, alpha, gamma (and the defaults b1, b2, eps, ns_steps,
    which inject_hyperparams injects too) give the plain optimizer's updates; a tau changed in the state midway (also
    to 0 and to 1: no coordinate and every coordinate selected) acts like a plain optimizer built with it. They agree
    to float32 rounding, 1e-6 of each tensor's largest entry, not bit for bit: XLA folds a constant hyperparameter
    into the arithmetic around it (into Newton-Schulz's last matmul, for Muon), a traced one it cannot. (Bit for bit
    with XLA's default CPU code generator; not with the faster-compiling one conftest selects.)"""
    params = _params(3, BIG)
    grads = _grads(params, seed=4, scale=1.0)
    injected = optax.inject_hyperparams(make)(**hyper)
    for got, want in zip(_run(injected, params, grads)[0], _run(make(**hyper), params, grads)[0]):
        _assert_rounding_close(got, want)
    if make not in (APPROX, optim.mgup_muon):  # (the traced-k paths: approx's override, the exact search's)
        return
    state = injected.init(params)
    update = jax.jit(injected.update)
    for g, tau in zip(grads, (0.0, 1.0)):
        state.hyperparams["mask_ratio"] = jnp.float32(tau)
        plain = make(**dict(hyper, mask_ratio=tau))
        want, _ = jax.jit(plain.update)(g, state.inner_state, params)
        got, state = update(g, state, params)
        _assert_rounding_close(got, want)
        if tau in (0.0, 1.0):  # (also on approx's sampled tensors)
            assert float(optim.state_metrics(state)["mgup/selected_fraction"]) == tau


def test_state_metrics_through_inject_hyperparams_and_with_two_mgup_states():
    params = _params(5)
    sizes = [int(np.prod(p.shape)) for p in jax.tree.leaves(params)]
    injected = optax.inject_hyperparams(optim.mgup_adamw)(learning_rate=1e-3, mask_ratio=0.25)
    metrics = optim.state_metrics(_run(injected, params, _grads(params, seed=6, scale=1.0)[:1])[1])
    assert list(metrics) == ["mgup/selected_fraction"]
    assert float(metrics["mgup/selected_fraction"]) == pytest.approx(sum(int(0.25 * n) for n in sizes) / sum(sizes))
    two = optim.mgup_muon(1e-3, adam_mgup=True)  # one MGUP state per branch, named by it
    assert set(optim.state_metrics(two.init(params))) == {"mgup/muon/selected_fraction", "mgup/adam/selected_fraction"}
    assert optim.state_metrics(optax.adam(1e-3).init(params)) == {}
