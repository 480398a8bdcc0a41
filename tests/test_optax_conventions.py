"""optax's conventions, the properties optax's own tests check for every optimizer, for every optimizer of
experiments.optimizers (as experiments.build makes it from a config) and for optim's public transforms: extra keyword
arguments in `update`, the same state structure under `optax.inject_hyperparams`, complex parameters refused by
name where unsupported, init from abstract shapes, `optax.MultiSteps`, state dtypes stable across updates
(bfloat16, float16, float32, float64), no recompilation on the second update, shardings kept."""

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optim
from experiments import build, optimizers, schema

SHAPES = {"w": (6, 8), "emb": {"embedding": (7, 6)}, "b": (8,)}  # a Muon matrix; an embedding and a bias: AdamW
NAMES = sorted(optimizers.OPTIMIZERS)
COMPLEX_READY = {"adamw", "lion"}  # optax's own: they support complex parameters


def _params(dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: jnp.asarray(rng.normal(size=s), dtype), SHAPES, is_leaf=lambda x: isinstance(x, tuple)
    )


def _optimizer(name: str) -> optax.GradientTransformation:
    """`name` as a run builds it: the config's defaults (warm-up schedule, clipping, weight decay 0.1)."""
    config = schema.default_config()
    config.optim.update(name=name, warmup_steps=2, weight_decay=0.1)
    config.train.steps = 10
    schema.validate(config)
    return build.build_optimizer(config)


PRESETS: dict[str, Any] = {
    "mgup_adamw": optim.mgup_adamw,
    "cautious_mgup_adamw": optim.cautious_mgup_adamw,
    "mgup_lion": optim.mgup_lion,
    "cautious_adamw": optim.cautious_adamw,
    "mgup_muon": optim.mgup_muon,
}

# The public transforms, each with what its update needs besides (updates, state, params).
TRANSFORMS: dict[str, tuple[Any, bool]] = {
    "scale_by_hf_adam": (optim.scale_by_hf_adam, False),
    "scale_by_lion_direction": (optim.scale_by_lion_direction, False),
    "scale_by_muon": (lambda: optim.scale_by_muon(mask_ratio=0.5), False),
    "scale_by_mgup": (optim.scale_by_mgup, True),
    "scale_by_cautious": (optim.scale_by_cautious, True),
    "with_mgup": (lambda: optim.with_mgup(optim.scale_by_hf_adam(), optim.scale_by_mgup()), False),
    "diloco_outer": (optim.diloco_outer, False),
}


@pytest.mark.parametrize("name", [*(f"config:{n}" for n in NAMES), *PRESETS, *TRANSFORMS])
def test_update_takes_extra_keyword_arguments_and_ignores_them(name):
    """optax.GradientTransformationExtraArgs: `update(updates, state, params, **extra_args)`; an argument the
    transform does not use changes nothing. For every optimizer a config names (as built, in its chain), every
    preset called directly, and every public transform."""
    needs_grad = False
    if name in TRANSFORMS:
        make, needs_grad = TRANSFORMS[name]
        tx = make()
    elif name in PRESETS:
        tx = PRESETS[name](1e-2, weight_decay=0.1)
    else:
        tx = _optimizer(name.removeprefix("config:"))
    params = _params()
    if name == "scale_by_muon":  # 2-D leaves only (mgup_muon labels the others 'adam')
        params = {"w": params["w"]}
    grads = jax.tree.map(lambda p: 0.1 * p + 0.01, params)
    state = tx.init(params)
    given = {"grad": grads} if needs_grad else {}
    want, _ = tx.update(grads, state, params, **given)
    got, _ = tx.update(grads, state, params, **given, some_unused_argument=jnp.ones(3))
    jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_injected_hyperparameters_keep_the_state_structure_and_the_updates(name, weight_decay):
    """optax.inject_hyperparams(preset)(...) holds the plain preset's state (the same tree structure, leaf for
    leaf), for a weight decay of zero too, and gives its updates (to float32 rounding: XLA folds constants)."""
    make = PRESETS[name]
    params = _params()
    plain, injected = (
        make(1e-2, weight_decay=weight_decay),
        optax.inject_hyperparams(make)(1e-2, weight_decay=weight_decay),
    )
    plain_state, injected_state = plain.init(params), injected.init(params)
    chex.assert_trees_all_equal_structs(injected_state.inner_state, plain_state)
    grads = jax.tree.map(lambda p: 0.1 * p + 0.01, params)
    want, _ = plain.update(grads, plain_state, params)
    got, _ = injected.update(grads, injected_state, params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8), got, want)


@pytest.mark.parametrize("name", NAMES)
def test_complex_parameters_are_refused_by_name_unless_supported(name):
    """MGUP and Cautious rank u * g and Muon orthogonalises real matrices: those refuse a complex parameter at
    init, naming it; optax's AdamW and Lion support them."""
    tx = _optimizer(name)
    params = dict(_params(), b=jnp.ones(8, jnp.complex64))
    if name in COMPLEX_READY:
        tx.init(params)
        return
    with pytest.raises(ValueError, match=r"\['b'\].*complex64"):
        tx.init(params)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_abstract_init_multisteps_stable_dtypes_and_one_compilation(name, dtype):
    """In one pass: init from jax.ShapeDtypeStruct gives the concrete init's shapes and dtypes; two jitted updates
    compile once (the state comes back with the dtypes, shapes and weak types it went in with), every update in
    the parameters' dtype; and optax.MultiSteps over two micro-steps equals one update on their mean gradient."""
    with jax.enable_x64(dtype == "float64"):
        tx, params = _optimizer(name), _params(jnp.dtype(dtype))
        abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
        state = tx.init(params)
        as_shapes = lambda tree: jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)  # noqa: E731
        assert as_shapes(jax.eval_shape(tx.init, abstract)) == as_shapes(state)
        traces = []

        def update(grads, state, params):
            traces.append(1)
            return tx.update(grads, state, params)

        step = jax.jit(update)
        g1, g2 = (jax.tree.map(lambda p, s=s: (0.1 * s * p + 0.01).astype(p.dtype), params) for s in (1.0, -0.5))
        u1, s1 = step(g1, state, params)
        _, s2 = step(g2, s1, params)
        assert len(traces) == 1, "the second update recompiled: the state changed type"
        assert as_shapes(s2) == as_shapes(state)
        assert all(u.dtype == p.dtype for u, p in zip(jax.tree.leaves(u1), jax.tree.leaves(params)))
        if dtype != "float32":
            return
        multi = optax.MultiSteps(tx, every_k_schedule=2)
        m_state = multi.init(params)
        _, m_state = multi.update(g1, m_state, params)
        got, _ = multi.update(g2, m_state, params)
        want, _ = tx.update(jax.tree.map(lambda a, b: (a + b) / 2, g1, g2), state, params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got, want)


def test_every_optimizer_keeps_the_parameters_shardings():
    """On 8 devices, parameters sharded by rows or columns: the state's parameter-shaped leaves and the updates of
    a jitted step keep each parameter's sharding."""
    auto = (jax.sharding.AxisType.Auto,) * 2  # shardings by annotation, as core.mesh makes them
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=auto, devices=jax.devices()[:8])
    spec = {"w": jax.P("data", "model"), "emb": {"embedding": jax.P(None, "data")}, "b": jax.P()}
    shardings = jax.tree.map(lambda s: jax.NamedSharding(mesh, s), spec, is_leaf=lambda x: isinstance(x, jax.P))
    params = jax.device_put(_params(), shardings)
    grads = jax.device_put(jax.tree.map(lambda p: 0.1 * p + 0.01, _params(seed=1)), shardings)
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731 (a branch of multi_transform)
    for name in NAMES:
        tx = _optimizer(name)
        state = jax.jit(tx.init)(params)
        updates, state = jax.jit(tx.update)(grads, state, params)
        for u, s in zip(jax.tree.leaves(updates), jax.tree.leaves(shardings)):
            assert u.sharding.is_equivalent_to(s, u.ndim), name
        kept = optax.tree_utils.tree_map_params(
            tx,
            lambda x, s: masked(x) or x.sharding.is_equivalent_to(s, x.ndim),
            state,
            shardings,
            transform_non_params=lambda _: True,
            is_leaf=masked,
        )
        assert all(jax.tree.leaves(kept)), (name, kept)
