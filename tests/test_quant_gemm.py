"""quant.make_dot_general and quant.make_grouped_matmul: exact when quantisation is off, the right operands quantised
along the right axes in each of the three GEMMs, every 4-bit recipe's three GEMMs against a float64 reference built from
`quantize`, stochastic rounding keyed, RHT signs from the run's seed, sharding, dtypes, errors."""

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from quant import recipes
from quant.gemm import SALT_DGRAD, SALT_OPERANDS, SALT_WGRAD, make_dot_general
from quant.grouped import make_grouped_matmul
from quant.hadamard import random_signs, rht, run_signs
from quant.precision import QuantPrecision
from quant.quantize import DEFAULT_BLOCK, quantize, quantize_tiles
from quant.recipes import Gemm, Recipe

KEY = jax.random.key(3)
CASES = [  # lhs shape, rhs shape, dimension numbers
    ((4, 6, 40), (40, 3, 12), (((2,), (0,)), ((), ()))),  # x [B, T, D] . w [D, H, E]: contract D
    ((2, 40, 7), (2, 40, 9), (((1,), (1,)), ((0,), (0,)))),  # batched, contraction not last
    ((37, 5), (37, 11), (((0,), (0,)), ((), ()))),  # x^T w, ragged lengths
]


def identity(x, fmt, **kw):
    return x


def _grads(f, lhs, rhs, dims, c):
    return jax.jit(jax.value_and_grad(lambda a, b: jnp.sum(c * f(a, b, dims)), argnums=(0, 1)))(lhs, rhs)


@pytest.mark.parametrize("lhs_shape, rhs_shape, dims", CASES)
def test_off_or_identity_quantiser_equals_dot_general(lhs_shape, rhs_shape, dims):
    """NONE is lax.dot_general; UFP4 with a quantiser that returns its input leaves only RHT and padding, which
    cancel in every GEMM: values and gradients equal the unquantised ones."""
    rng = np.random.default_rng(len(lhs_shape))
    lhs, rhs = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in (lhs_shape, rhs_shape))
    out = jax.lax.dot_general(lhs, rhs, dims)
    c = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    want = _grads(jax.lax.dot_general, lhs, rhs, dims, c)
    for f in (make_dot_general(recipes.NONE), make_dot_general(recipes.UFP4, key=KEY, quantizer=identity)):
        got = _grads(f, lhs, rhs, dims, c)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_grouped_off_or_identity_quantiser_equals_ragged_dot():
    rng = np.random.default_rng(0)
    x, w = jnp.asarray(rng.normal(size=(45, 24)), jnp.float32), jnp.asarray(rng.normal(size=(4, 24, 20)), jnp.float32)
    sizes = jnp.asarray([7, 0, 21, 14], jnp.int32)  # sum 42 < 45 rows; an empty group; no group a block multiple
    c = jnp.asarray(rng.normal(size=(45, 20)), jnp.float32)

    def loss(f):
        return jax.jit(jax.value_and_grad(lambda a, b: jnp.sum(c * f(a, b, sizes)), argnums=(0, 1)))(x, w)

    want = loss(jax.lax.ragged_dot)
    for f in (make_grouped_matmul(recipes.NONE), make_grouped_matmul(recipes.UFP4, key=KEY, quantizer=identity)):
        for a, b in zip(jax.tree.leaves(loss(f)), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def _recorded(make, *args):
    calls = []

    def record(x, fmt, *, axis, block_size, rounding, key, scale, select):
        calls.append((tuple(x.shape), axis % x.ndim, rounding))
        return x

    jax.jit(jax.grad(lambda *a: jnp.sum(make(record)(*a)), argnums=(0, 1)))(*args)  # recorded while tracing
    return calls


def test_each_gemm_quantises_the_right_operands_along_the_right_axes():
    """Tokens M = 32, K = 48, N = 64 (all block multiples): in [B, M, K] / [B, K, N] layout, fprop quantises x along
    K and w along K; dgrad dy along N (stochastic) and w along N; wgrad x along M and dy along M (stochastic)."""
    x, w = jnp.ones((32, 48)), jnp.ones((48, 64))
    dims = (((1,), (0,)), ((), ()))
    calls = _recorded(lambda q: lambda a, b: make_dot_general(recipes.UFP4, key=KEY, quantizer=q)(a, b, dims), x, w)
    assert calls == [
        ((1, 32, 48), 2, "nearest"),
        ((1, 48, 64), 1, "nearest"),  # fprop: x, w along K
        ((1, 32, 64), 2, "stochastic"),
        ((1, 48, 64), 2, "nearest"),  # dgrad: dy, w along N
        ((1, 32, 48), 1, "nearest"),
        ((1, 32, 64), 1, "stochastic"),
    ]  # wgrad: x, dy along M
    # the E2M1 baseline: the same operands and axes (its RHT is on wgrad only, which a recorder cannot see)
    calls_e2m1 = _recorded(
        lambda q: lambda a, b: make_dot_general(recipes.E2M1_BASELINE, key=KEY, quantizer=q)(a, b, dims), x, w
    )
    assert calls_e2m1 == calls
    # grouped: tokens [m, k], experts [g, k, n]; wgrad on the group-aligned layout (3 groups, 16-row blocks)
    sizes = jnp.asarray([10, 0, 22], jnp.int32)
    calls = _recorded(
        lambda q: lambda a, b: make_grouped_matmul(recipes.UFP4, key=KEY, quantizer=q)(a, b, sizes),
        jnp.ones((32, 48)),
        jnp.ones((3, 48, 64)),
    )
    assert calls == [
        ((32, 48), 1, "nearest"),
        ((3, 48, 64), 1, "nearest"),
        ((32, 64), 1, "stochastic"),
        ((3, 48, 64), 2, "nearest"),
        ((80, 48), 0, "nearest"),
        ((80, 64), 0, "stochastic"),
    ]


def _reference_operand(a, axis, gemm, recipe, *, key=None, weight=False, seed=0):
    """One GEMM operand as the recipe prescribes, built independently of prepare_operands: zero-padded along the
    contraction axis to whole blocks (and RHT blocks), rotated by the run's RHT signs (or by the plain Hadamard),
    quantised with `quantize` (stochastic with `key` if given; the GEMM's scale and selection) or, for weights in
    2-D tiles, with `quantize_tiles`; float64 NumPy."""
    block = gemm.block_size or DEFAULT_BLOCK[gemm.fmt]
    multiple = math.lcm(block, gemm.rht_block) if gemm.rht else block
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, -a.shape[axis] % multiple)
    a = jnp.pad(a, widths)
    if gemm.rht:
        signs = random_signs(jax.random.key(seed), gemm.rht_block)
        signs = signs if gemm.rht_signs == "random" else jnp.ones_like(signs)  # the deterministic Hadamard
        a = rht(a, axis=axis, block_size=gemm.rht_block, signs=signs)
    knobs = {"scale": gemm.scale, "select": gemm.select}
    if weight and gemm.weight_2d:
        return quantize_tiles(a, gemm.fmt, tile=block, **knobs)
    rounding = "nearest" if key is None else "stochastic"
    return quantize(a, gemm.fmt, axis=axis, block_size=block, rounding=rounding, key=key, **knobs)


def _reference_gemms(recipe, x, w, dy, key, seed=0):
    """(y, dx, dw) of y = x w (x [M, K], w [K, N]) in float64 from operands quantised as in the module docstring:
    fprop Q(x)_K Q(w)_K, dgrad Q(dy)_N Q(w)_N^T, wgrad Q(x)_M^T Q(dy)_M, dy stochastic with the keys derived by the
    named salts."""
    k, n = w.shape
    f, d, g = recipe.fprop, recipe.dgrad, recipe.wgrad
    k_d, k_w = jax.random.fold_in(key, SALT_DGRAD), jax.random.fold_in(key, SALT_WGRAD)
    sr_d = jax.random.fold_in(k_d, SALT_OPERANDS[0]) if d.stochastic_dy else None
    sr_w = jax.random.fold_in(k_w, SALT_OPERANDS[1]) if g.stochastic_dy else None

    @jax.jit
    def operands(x, w, dy):
        return (
            _reference_operand(x, 1, f, recipe, seed=seed),
            _reference_operand(w, 0, f, recipe, weight=True, seed=seed),
            _reference_operand(dy, 1, d, recipe, key=sr_d, seed=seed),
            _reference_operand(w, 1, d, recipe, weight=True, seed=seed),
            _reference_operand(x, 0, g, recipe, seed=seed),
            _reference_operand(dy, 0, g, recipe, key=sr_w, seed=seed),
        )

    qx_f, qw_f, qdy_d, qw_d, qx_w, qdy_w = (np.asarray(q, np.float64) for q in operands(x, w, dy))
    return (qx_f @ qw_f)[:, :n], (qdy_d @ qw_d.T)[:, :k], (qx_w.T @ qdy_w)[:k, :n]


UNIFORM_MX = Recipe(
    "uniform_mx",
    Gemm("e1m2", block_size=32, scale="ue8m0"),
    Gemm("int4", scale="e4m3", stochastic_dy=True, weight_2d=True),
    Gemm("e1m2", rht=True, rht_block=32, stochastic_dy=True),
)


def _gemms(f, x, w, dy):
    """(y, dx, dw) of y = f(x, w) (a dot_general contracting x's axis 1 with w's axis 0) and its VJP at dy, jitted."""
    dims = (((1,), (0,)), ((), ()))

    @jax.jit
    def run(x, w, dy):
        y, vjp = jax.vjp(lambda a, b: f(a, b, dims), x, w)
        return (y, *vjp(dy))

    return run(x, w, dy)


@pytest.mark.parametrize(
    "name, m, k, n",
    [
        ("mxfp4", 37, 40, 24),
        ("nvfp4", 37, 40, 24),
        ("nvfp4", 32, 64, 48),
        ("ufp4_int4", 37, 40, 24),
        ("e2m1_baseline", 32, 64, 48),
        ("nvfp4_4over6", 37, 40, 24),
        ("gridgames", 37, 40, 24),
        ("mxfp4_amd", 37, 72, 24),
        ("uniform_mx", 32, 64, 48),
    ],
)
def test_every_4bit_recipe_through_a_gemm_against_a_float64_reference(name, m, k, n):
    """The forward product and both backward GEMMs of each 4-bit recipe (MXFP4's 32-blocks, NVFP4's tensor scale,
    2-D weight tiles and wgrad RHT, UFP4_INT4's RHT on all GEMMs, the E2M1 baseline, 4 over 6, AMD's deterministic
    Hadamard on wgrad; and per-GEMM knobs no preset has: a uniform grid with UE8M0 32-blocks in fprop, E4M3 scales
    in dgrad and an RHT of 32 in wgrad), with ragged M, K, N padded to whole blocks, equal the products of
    independently quantised operands computed in float64 (stochastic dy with the keys the salts name), up to float32
    accumulation."""
    recipe = UNIFORM_MX if name == "uniform_mx" else recipes.get(name)
    rng = np.random.default_rng(m + k + n)
    x = jnp.asarray(rng.standard_t(4, size=(m, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(k, n)) * 0.1, jnp.float32)
    dy = jnp.asarray(rng.normal(size=(m, n)) * 1e-3, jnp.float32)  # gradient-sized
    y, dx, dw = _gemms(make_dot_general(recipe, key=KEY), x, w, dy)
    want = _reference_gemms(recipe, x, w, dy, KEY)
    for got, ref in zip((y, dx, dw), want):
        scale = np.abs(ref).max()
        assert scale > 0
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-5, atol=1e-5 * scale)
    for got, exact in zip((y, dx, dw), (x @ w, dy @ w.T, x.T @ dy)):  # and they are 4-bit products, not exact
        rel = float(jnp.linalg.norm(got - exact) / jnp.linalg.norm(exact))
        assert 0.01 < rel < 0.5, (name, rel)


def test_rht_signs_come_from_the_run_seed():
    """Fixed RHT signs are run_signs(seed) = random_signs(key(seed)): seed 0 gives the signs of key(0) that runs used
    before (so the default does not move); another seed gives other signs and another (still valid) product;
    QuantPrecision passes its seed to every GEMM, and the config's train.seed reaches it."""
    np.testing.assert_array_equal(run_signs(0), random_signs(jax.random.key(0)))
    np.testing.assert_array_equal(rht(jnp.eye(16)), rht(jnp.eye(16), signs=random_signs(jax.random.key(0))))
    assert not np.array_equal(run_signs(0), run_signs(1)) and not np.array_equal(run_signs(1), run_signs(2))
    rng = np.random.default_rng(6)
    x, w = jnp.asarray(rng.normal(size=(32, 48)), jnp.float32), jnp.asarray(rng.normal(size=(48, 16)), jnp.float32)
    dy = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
    outs = {}
    for seed in (0, 3):
        f = QuantPrecision(recipes.UFP4, num_layers=1, seed=seed).dot_general("blocks.0.attn.q", KEY)
        outs[seed] = _gemms(f, x, w, dy)
        for got, ref in zip(outs[seed], _reference_gemms(recipes.UFP4, x, w, dy, KEY, seed=seed)):
            np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    for a, b in zip(outs[0], outs[3]):
        assert not np.allclose(a, b)
    np.testing.assert_array_equal(_gemms(make_dot_general(recipes.UFP4, key=KEY), x, w, dy)[0], outs[0][0])
    # AMD's deterministic Hadamard (rht_signs "none") draws nothing from the seed, and is not the random one
    amd = [_gemms(make_dot_general(recipes.MXFP4_AMD, seed=s), x, w, dy)[2] for s in (0, 3)]
    random = dataclasses.replace(
        recipes.MXFP4_AMD, wgrad=dataclasses.replace(recipes.MXFP4_AMD.wgrad, rht_signs="random")
    )
    np.testing.assert_array_equal(amd[0], amd[1])
    assert not np.allclose(amd[0], _gemms(make_dot_general(random), x, w, dy)[2])
    with pytest.raises(ValueError, match="QuantPrecision.seed = -1"):
        QuantPrecision(recipes.UFP4, seed=-1)

    from experiments import build, schema

    c = schema.default_config()
    c.precision.recipe = "ufp4"
    c.train.seed = 7
    precision = build.build_precision(c, jax.lax.ragged_dot)
    assert isinstance(precision, QuantPrecision) and precision.seed == 7


def test_the_configs_bf16_recipe_reaches_the_model_as_bf16_gemms():
    """precision.recipe = "bf16" gives a projection bf16-rounded operands (it once built the unrounded default
    slot), "none" the float32 product; against float64 products."""
    from experiments import build, schema

    rng = np.random.default_rng(8)
    x, w = jnp.asarray(rng.normal(size=(12, 40)), jnp.float32), jnp.asarray(rng.normal(size=(40, 8)), jnp.float32)
    bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)  # noqa: E731
    c = schema.default_config()
    for name, want in (("bf16", bf16(x) @ bf16(w)), ("none", np.asarray(x, np.float64) @ np.asarray(w, np.float64))):
        c.precision.recipe = name
        gemm = build.build_precision(c, jax.lax.ragged_dot).dot_general("blocks.0.attn.q", None)
        got = np.asarray(gemm(x, w, (((1,), (0,)), ((), ()))), np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_rht_changes_the_quantised_product_only_where_the_recipe_says():
    """With a real quantiser, RHT on a GEMM changes that GEMM's result (the rotation does not commute with Q)."""
    rng = np.random.default_rng(1)
    x, w = jnp.asarray(rng.normal(size=(32, 48)), jnp.float32), jnp.asarray(rng.normal(size=(48, 16)), jnp.float32)
    dims = (((1,), (0,)), ((), ()))
    plain = Recipe("plain", fprop=Gemm("e1m2"))
    rotated = Recipe("rotated", fprop=Gemm("e1m2", rht=True))
    a, b = (jax.jit(lambda x, w, r=r: make_dot_general(r)(x, w, dims))(x, w) for r in (plain, rotated))
    exact = x @ w
    assert not np.allclose(a, b)
    for y in (a, b):  # both are 4-bit products: close to the exact one, not equal
        assert 0.01 < float(jnp.linalg.norm(y - exact) / jnp.linalg.norm(exact)) < 0.3


def test_stochastic_rounding_is_keyed_and_needs_a_key():
    rng = np.random.default_rng(2)
    x, w = jnp.asarray(rng.normal(size=(32, 48)), jnp.float32), jnp.asarray(rng.normal(size=(48, 16)), jnp.float32)
    dims = (((1,), (0,)), ((), ()))
    loss = lambda a, key: jnp.sum(make_dot_general(recipes.UFP4, key=key)(a, w, dims) ** 2)  # noqa: E731
    grad_fn = jax.jit(jax.grad(loss))
    grad = lambda key: grad_fn(x, key)  # noqa: E731
    k1, k2 = jax.random.key(1), jax.random.key(2)
    np.testing.assert_array_equal(grad(k1), grad(k1))
    assert not np.array_equal(grad(k1), grad(k2))
    jax.eval_shape(lambda: make_dot_general(recipes.UFP4)(x, w, dims))  # inference without a key is fine
    with pytest.raises(
        ValueError, match=r"quant.make_dot_general\('ufp4'\) is being differentiated without a PRNG key"
    ):
        grad(None)  # refused as the forward pass is traced for differentiation, saying what to pass
    with pytest.raises(ValueError, match="one contracting dimension"):
        make_dot_general(recipes.UFP4)(jnp.ones((2, 16, 16)), jnp.ones((2, 16, 3)), (((1, 2), (0, 1)), ((), ())))


def test_bf16_rounds_the_operands_of_all_three_gemms_to_bfloat16():
    """ "bf16": fprop, dgrad and wgrad multiply operands rounded to bfloat16 with float32 accumulation (float32 in,
    float32 out), for dot_general and grouped_matmul, against float64 products of the rounded operands; "none"
    keeps the float32 operands, so the two differ by bfloat16's rounding (relative 1e-3 here)."""
    rng = np.random.default_rng(7)
    x, w, dy = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((24, 40), (40, 16), (24, 16)))
    r = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)  # noqa: E731
    got = _gemms(make_dot_general("bf16"), x, w, dy)
    for out, ref in zip(got, (r(x) @ r(w), r(dy) @ r(w).T, r(x).T @ r(dy))):
        assert out.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    for out, exact in zip(got, _gemms(make_dot_general("none"), x, w, dy)):
        assert 1e-4 < float(jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact)) < 1e-2
    # grouped: experts [2, 40, 16], groups of 9 and 13 rows (2 rows past the groups: zeros, no gradient)
    we = jnp.asarray(rng.normal(size=(2, 40, 16)), jnp.float32)
    sizes = jnp.asarray([9, 13], jnp.int32)
    y, dx, dw = jax.jit(lambda *a: _gemms(lambda a, b, _: make_grouped_matmul("bf16")(a, b, sizes), *a))(x, we, dy)
    rows = (slice(0, 9), slice(9, 22))
    for g, rs in enumerate(rows):
        want = (r(x[rs]) @ r(we[g]), r(dy[rs]) @ r(we[g]).T, r(x[rs]).T @ r(dy[rs]))
        for out, ref in zip((y[rs], dx[rs], dw[g]), want):
            np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    assert not np.asarray(y[22:]).any() and not np.asarray(dx[22:]).any()


def test_rngs_draw_a_fresh_key_per_call_and_step_inside_nnx_jit():
    """With rngs= (held by the model) every call draws the stream's next key inside nnx.jit + nnx.grad: two
    consecutive training steps of two nnx.Linear layers sharing the GEMM quantise dy with different noise, each
    step's gradients equal those of the key= GEMMs built with the next keys of nnx.Rngs(quant=seed) (in call order),
    and the same seed reproduces them; the grouped matmul draws from its Rngs the same way. key with rngs, a
    non-Rngs and a missing stream are refused; without any key the forward pass says to pass rngs= or key=."""
    from flax import nnx

    import quant

    sr = Recipe("sr_dy", dgrad=Gemm("int4", stochastic_dy=True), wgrad=Gemm("int4", stochastic_dy=True))  # cheap
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.normal(size=(24, 32)), jnp.float32)
    dims = (((1,), (0,)), ((), ()))

    class Model(nnx.Module):
        def __init__(self, seed):
            self.rngs = nnx.Rngs(quant=seed)
            dot = quant.make_dot_general(sr, rngs=self.rngs)
            self.up = nnx.Linear(32, 16, use_bias=False, dot_general=dot, rngs=nnx.Rngs(0))
            self.down = nnx.Linear(16, 8, use_bias=False, dot_general=dot, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.down(self.up(x))

    @nnx.jit
    def grads(model):
        g = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
        return g["up"]["kernel"][...], g["down"]["kernel"][...]

    model = Model(0)
    steps = [grads(model), grads(model)]  # the parameters do not change: only the noise does
    up, down = model.up.kernel[...], model.down.kernel[...]

    @jax.jit
    def reference(k_up, k_down):  # the same GEMMs with fixed keys
        def loss(a, b):
            h = quant.make_dot_general(sr, key=k_up)(x, a, dims)
            return jnp.sum(quant.make_dot_general(sr, key=k_down)(h, b, dims) ** 2)

        return jax.grad(loss, argnums=(0, 1))(up, down)

    draw = nnx.Rngs(quant=0)
    for got in steps:
        for a, b in zip(got, reference(draw.quant(), draw.quant())):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(jnp.abs(b).max()))
    for a, b in zip(*steps):
        assert not np.allclose(a, b)
    for a, b in zip(grads(Model(0)), steps[0]):
        np.testing.assert_array_equal(a, b)
    rngs = nnx.Rngs(quant=0)
    gmm = quant.make_grouped_matmul(sr, rngs=rngs)
    assert isinstance(gmm, quant.FreshKeys) and gmm.rngs is rngs
    gmm(x, jnp.ones((2, 32, 4)), jnp.asarray([10, 14], jnp.int32))  # a call draws one key
    assert int(rngs.quant.count[...]) == 1

    with pytest.raises(ValueError, match="key= and rngs= were both given"):
        quant.make_dot_general("ufp4", key=KEY, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"rngs = 3 \(int\); allowed: a flax nnx.Rngs"):
        quant.make_grouped_matmul("ufp4", rngs=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stream = 'quant', but the nnx.Rngs has neither"):
        quant.make_dot_general("ufp4", rngs=nnx.Rngs(params=0))
    quant.make_dot_general("ufp4", rngs=nnx.Rngs(0))  # a "default" stream serves any stream name
    with pytest.raises(ValueError, match=r"without a PRNG key.*rngs=self.rngs.*key="):
        jax.grad(lambda w: jnp.sum(quant.make_dot_general("ufp4")(x, w, dims)))(up)


def test_bf16_operands_and_sharded_weights_on_8_devices():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(8, 16, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(64, 32)), jnp.bfloat16)
    dims = (((2,), (0,)), ((), ()))
    f = make_dot_general(recipes.NVFP4, key=KEY)
    loss = jax.jit(
        jax.value_and_grad(lambda a, b: jnp.sum(f(a, b, dims, preferred_element_type=jnp.float32) ** 2), argnums=(0, 1))
    )
    value, (gx, gw) = loss(x, w)
    assert gx.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16 and value.dtype == jnp.float32
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)  # as core.mesh
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
    value_s, (gx_s, gw_s) = loss(xs, ws)
    np.testing.assert_allclose(float(value_s), float(value), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gx_s, np.float32), np.asarray(gx, np.float32), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(gw_s, np.float32), np.asarray(gw, np.float32), rtol=1e-2, atol=1e-2)


def test_nvfp4_weight_tiles_are_transpose_invariant():
    w = jnp.asarray(np.random.default_rng(5).standard_t(3, size=(3, 40, 24)), jnp.float32)
    tiles = jax.jit(lambda w: quantize_tiles(w, "nvfp4"))
    q = tiles(w)
    np.testing.assert_array_equal(q, jnp.swapaxes(tiles(jnp.swapaxes(w, 1, 2)), 1, 2))
    assert float(jnp.linalg.norm(q - w) / jnp.linalg.norm(w)) < 0.25


def test_precision_policy_keeps_the_right_layers():
    slot = QuantPrecision(recipes.UFP4, num_layers=4)
    for path in ("head", "blocks.1.ffn.router", "embedding"):
        assert slot.dot_general(path, KEY) is jax.lax.dot_general, path
    assert slot.dot_general("blocks.3.attn.q", KEY) is not jax.lax.dot_general
    assert slot.grouped_matmul("blocks.0.ffn.experts.up", KEY) is not jax.lax.ragged_dot
    last = QuantPrecision(dataclasses.replace(recipes.UFP4, last_blocks_high_precision=1), num_layers=4)
    assert last.dot_general("blocks.3.attn.q", KEY) is jax.lax.dot_general
    assert last.dot_general("blocks.2.attn.q", KEY) is not jax.lax.dot_general
    assert QuantPrecision(recipes.NONE).dot_general("blocks.0.attn.q", KEY) is jax.lax.dot_general
    assert QuantPrecision(recipes.NONE).grouped_matmul("blocks.0.ffn.experts.up", KEY) is jax.lax.ragged_dot
    bf16 = QuantPrecision(recipes.BF16, num_layers=4)  # rounds every GEMM but the kept paths' to bfloat16
    assert bf16.dot_general("blocks.0.attn.q", KEY) is not jax.lax.dot_general
    assert bf16.dot_general("head", KEY) is jax.lax.dot_general


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_ufp4_quantises_the_swiglu_experts_gate_projection_by_its_own_path(dispatch):
    """SwiGLU experts ask the precision slot for their gate product by its own path ("<layer>.experts.gate", beside
    "experts.up" / "experts.down", or "experts" for capacity's up and down products): with UFP4 everywhere but the
    router, up and down, the gate product alone is quantised and moves the output by about 12% (4-bit operands);
    keeping "experts.gate" in high precision as well gives the plain output exactly."""
    from flax import nnx

    from core.model import TransformerConfig
    from moe import GroupedMatmulFn, MoE, MoEConfig

    from helpers import call

    m = MoEConfig(num_experts=4, top_k=2, expert_size=16, expert_mlp="swiglu", dispatch=dispatch, capacity_factor=2.0)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 7, 16)), jnp.float32)
    keep_up_down = recipes.HIGH_PRECISION + (r"\.experts(\.up|\.down)?$",)

    def output(keep):
        precision = QuantPrecision(
            dataclasses.replace(recipes.UFP4, high_precision=keep), num_layers=1, grouped=GroupedMatmulFn("windowed")
        )
        cfg = TransformerConfig(d_model=16, num_layers=1)
        return np.asarray(
            call(MoE.in_transformer(cfg, m, path="blocks.0.ffn", rngs=nnx.Rngs(0), precision=precision), x)[0]
        )

    plain, gate_quantised = output(keep_up_down + (r"\.experts\.gate$",)), output(keep_up_down)
    assert np.linalg.norm(gate_quantised - plain) > 0.02 * np.linalg.norm(plain)


@pytest.mark.parametrize("recipe", ["ufp4"])
def test_precision_recipe_from_the_config_trains_the_moe_model(recipe):
    """precision.recipe puts the recipe into every projection and expert of a model built from a config; a few
    training steps of a tiny MoE model lower the loss, and the quantised forward differs from the unquantised one
    (recipe "none", the default)."""
    import optax
    from flax import nnx

    from core import mesh as mesh_lib
    from experiments import build, schema

    from helpers import forward, train_losses

    c = schema.default_config()
    c.model.update(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, d_ff=64)
    c.moe.update(every=1, num_experts=4, top_k=2, expert_size=16, grouped_matmul="ragged_dot")
    c.precision.recipe = recipe
    schema.validate(c)
    model = build.build_model_fn(c, mesh_lib.Sharder())(nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(4, 33)), jnp.int32)
    losses = train_losses(model, optax.adam(3e-3), tokens, 5)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    c.precision.recipe = "none"
    plain = build.build_model_fn(c, mesh_lib.Sharder())(nnx.Rngs(0))
    x = tokens[:, :-1]
    assert not np.allclose(forward(model, x)[0], forward(plain, x)[0], atol=1e-3)
    with pytest.raises(Exception, match="precision.last_blocks_high_precision"):
        c.precision.last_blocks_high_precision = 3
        schema.validate(c)


def test_config_overrides_for_the_ablation():
    import ml_collections

    from experiments import schema_quant

    p = ml_collections.ConfigDict(
        {"rht": "fprop+wgrad", "stochastic_dy": "off", "last_blocks_high_precision": 1, "fresh_signs": False}
    )
    r = schema_quant.apply(recipes.UFP4, p)
    assert (r.fprop.rht, r.dgrad.rht, r.wgrad.rht) == (True, False, True)
    assert not r.dgrad.stochastic_dy and not r.wgrad.stochastic_dy and r.last_blocks_high_precision == 1
    p.update(rht="none", stochastic_dy="on")
    r = schema_quant.apply(recipes.E2M1_BASELINE, p)
    assert not any(g.rht for g in (r.fprop, r.dgrad, r.wgrad)) and r.dgrad.stochastic_dy and not r.fprop.stochastic_dy
    p.update(rht="recipe", stochastic_dy="recipe")
    assert schema_quant.apply(recipes.NVFP4, p).wgrad == recipes.NVFP4.wgrad
    # fresh_signs = False keeps a recipe's own: MS-EDEN's unbiasedness needs fresh rotations
    assert (
        schema_quant.apply(recipes.NVFP4_MS_EDEN, p).fresh_signs and not schema_quant.apply(recipes.UFP4, p).fresh_signs
    )
    p.update(fresh_signs=True)
    assert schema_quant.apply(recipes.UFP4, p).fresh_signs
    p.update(fresh_signs=False)
    for recipe, rht_scope, error in [
        (recipes.NVFP4, "all", "precision.rht = 'all' with recipe 'nvfp4': .*weight_2d = True with rht = True"),
        (recipes.NONE, "all", "precision.rht = 'all' with precision.recipe = 'none': .* no 4-bit GEMM"),
    ]:
        p.update(rht=rht_scope)
        with pytest.raises(ValueError, match=error):
            schema_quant.apply(recipe, p)


def test_gemm_knobs_are_checked_when_made():
    """Every refused Gemm / Recipe names the field, the value and what is allowed."""
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(scale="e4m3"), r"Gemm.fmt = None \(not quantised\) with \['scale'\] set"),
        (dict(fmt="e1m2", select="4over6"), "Gemm \\(fmt 'e1m2'\\): select = '4over6' .* needs the e2m1 grid"),
        (dict(fmt="int4", scale="fp8"), "scale = 'fp8'; allowed"),
        (dict(fmt="mxfp4", rht=True, rht_signs="fixed"), "Gemm.rht_signs = 'fixed'; allowed"),
        (dict(fmt="nvfp4", rht=True, weight_2d=True), "weight_2d = True with rht = True"),
        (dict(fmt="nvfp4", block_size=0), "Gemm.block_size = 0"),
    ]
    for kwargs, error in cases:
        with pytest.raises(ValueError, match=error):
            Gemm(**kwargs)
    with pytest.raises(ValueError, match="wgrad.weight_2d = True, but wgrad"):
        Recipe("r", wgrad=Gemm("nvfp4", weight_2d=True))


def test_drop_in_for_flax_and_lax_signatures():
    """quant.make_dot_general / make_grouped_matmul as drop-ins: a recipe name works like its Recipe; flax's nnx.Linear
    (which passes out_sharding) takes it; ragged_dot's positional order (precision before preferred_element_type) holds;
    the result dtype is preferred_element_type, else the operands'; with a key it differentiates, and the grouped
    matmul without one is refused in the forward pass (the dot_general's: test_stochastic_rounding_is_keyed...)."""
    from flax import nnx

    import quant
    from quant import recipes

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 48)), jnp.float32)
    key = jax.random.key(1)
    by_name, by_recipe = quant.make_dot_general("ufp4", key=key), quant.make_dot_general(recipes.UFP4, key=key)
    linear = nnx.Linear(48, 24, use_bias=False, dot_general=by_name, rngs=nnx.Rngs(0))
    kernel = linear.kernel.get_value()
    dims = (((1,), (0,)), ((), ()))
    bf16 = jnp.bfloat16

    @jax.jit  # one program for all the forward checks (compiling is cheaper than running them op by op)
    def forward(x, k):
        return (
            linear(x),
            by_recipe(x, k, dims),
            by_name(x.astype(bf16), k.astype(bf16), dims),
            by_name(x.astype(bf16), k, dims, None, jnp.float32),
            quant.make_dot_general("ufp4")(x, k, dims),  # inference needs no key
        )

    through_linear, direct, in_bf16, preferred, _ = forward(x, kernel)
    np.testing.assert_array_equal(through_linear, direct)
    assert in_bf16.dtype == jnp.bfloat16 and preferred.dtype == jnp.float32

    def loss(w, dot):
        return jnp.sum(dot(x, w, dims) ** 2)

    assert np.isfinite(np.asarray(jax.jit(jax.grad(loss), static_argnums=1)(kernel, by_name))).all()

    sizes = jnp.array([1, 3], jnp.int32)
    w = jnp.asarray(rng.normal(size=(2, 48, 24)), jnp.float32)
    gmm = quant.make_grouped_matmul("ufp4", key=key)
    positional, keyword = jax.jit(
        lambda x, w: (gmm(x, w, sizes, None, jnp.float32), gmm(x, w, sizes, preferred_element_type=jnp.float32))
    )(x, w)
    np.testing.assert_array_equal(positional, keyword)
    plain = quant.make_grouped_matmul("none")(x, w, sizes, jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(plain, jax.lax.ragged_dot(x, w, sizes, precision=jax.lax.Precision.HIGHEST))
    with pytest.raises(ValueError, match=r"quant.make_grouped_matmul\('ufp4'\) is being differentiated without"):
        jax.grad(lambda v: jnp.sum(quant.make_grouped_matmul("ufp4")(x, v, sizes)))(w)
    with pytest.raises(ValueError, match=r"recipe = 'ufp5'; allowed"):
        quant.make_dot_general("ufp5")
