"""The sort-free top-k behind MGUP's mask (optim/select.py) against NumPy and lax.top_k."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optim import select


def test_ordered_keys_sort_like_the_floats():
    rng = np.random.default_rng(0)
    special = [-np.inf, -3e38, -1.0, -1e-45, -0.0, 0.0, 1e-45, 1e-30, 1.0, 3e38, np.inf]
    for dtype in (np.float32, np.float64):
        with jax.enable_x64(dtype == np.float64):
            x = np.concatenate([special, rng.standard_cauchy(2000) * 10.0 ** rng.integers(-30, 30, 2000)]).astype(dtype)
            keys = np.asarray(select.ordered_keys(jnp.asarray(x)))
            assert keys.dtype == {np.float32: np.uint32, np.float64: np.uint64}[dtype]
            order = np.argsort(keys, kind="stable")
            assert (np.diff(x[order]) >= 0).all()
            assert keys[x == -0.0].min() < keys[x == 0.0].max()  # -0.0 just below +0.0


def test_count_at_least_equals_numpy():
    rng = np.random.default_rng(1)
    keys = jnp.asarray(rng.integers(0, 1000, size=12_345), jnp.uint32)
    for thresholds in ([500], [0, 999, 1000], list(rng.integers(0, 1000, size=6))):
        got = jax.jit(lambda k, ts=thresholds: select.count_at_least(k, [jnp.uint32(t) for t in ts]))(keys)
        assert [int(c) for c in got] == [int(np.sum(np.asarray(keys) >= t)) for t in thresholds]


def _adversarial(n, rng):
    """Large values only where a strided sample never looks: the sample's bracket misses, the search recovers."""
    x = rng.normal(size=n) * 1e-3
    stride = max(1, n // 4096)
    off = np.ones(n, bool)
    off[::stride] = False
    x[off] += 10.0
    return x


@pytest.mark.parametrize(
    "n, tau, kind",
    [
        (200_003, 0.5, "normal"),
        (50_000, 0.1, "cauchy"),
        (4_097, 0.9, "normal"),
        (30_000, 0.5, "ties"),
        (3, 0.4, "normal"),
        (4_096, 0.3, "ties"),  # the largest size that one sort answers (4_097: the search)
        (10_000, 0.5, "constant"),
        (100_000, 0.97, "adversarial"),
        (20_000, 0.3, "float64"),
    ],
)
def test_top_k_mask_selects_exactly_the_k_largest(n, tau, kind):
    """The same set as a stable argsort (ties: the first positions), heavy tails, all-equal and adversarial inputs,
    float64 (64-bit keys)."""
    rng = np.random.default_rng(n)
    x = {
        "normal": lambda: rng.normal(size=n),
        "cauchy": lambda: rng.standard_cauchy(size=n),
        "ties": lambda: rng.integers(0, 50, size=n),
        "constant": lambda: np.ones(n),
        "adversarial": lambda: _adversarial(n, rng),
        "float64": lambda: rng.normal(size=n) * 1e-200,
    }[kind]()
    with jax.enable_x64(kind == "float64"):
        score = jnp.asarray(x, jnp.float64 if kind == "float64" else jnp.float32)
        k = int(tau * n)
        got = np.asarray(jax.jit(lambda s: select.top_k_mask(s, k))(score))
    s = np.asarray(score)
    want = np.zeros(n, bool)
    want[np.argsort(-s, kind="stable")[:k]] = True  # stable: ties at the k-th value go to the first positions
    np.testing.assert_array_equal(got, want)


def test_top_k_mask_keeps_shape_and_edge_k():
    x = jnp.asarray(np.random.default_rng(2).normal(size=(7, 5)), jnp.float32)
    assert not select.top_k_mask(x, 0).any() and select.top_k_mask(x, 35).all()
    got = np.asarray(select.top_k_mask(x, 3))
    assert got.shape == (7, 5) and set(np.asarray(x)[got]) == set(np.sort(np.asarray(x).ravel())[-3:])


def test_the_search_takes_a_handful_of_passes():
    """1.6M normal, Cauchy and Adam-like (normal x |normal|) products, k at 10%, 50%, 90%: at most 8 counting passes,
    against 32 / log2(WAYS + 1) = 12 for a plain multiway search of 32-bit keys."""
    rng = np.random.default_rng(0)
    n = 640 * 2560
    count = jax.jit(lambda keys, k: select.selection_key(keys, k)[3], static_argnums=1)
    for x in (rng.normal(size=n), rng.standard_cauchy(size=n), rng.normal(size=n) * np.abs(rng.normal(size=n))):
        keys = select.ordered_keys(jnp.asarray(x, jnp.float32))
        for k in (n // 10, n // 2, n - n // 10):
            assert 1 <= int(count(keys, k)) <= 8


@pytest.mark.parametrize("shape, kind", [((1,), "normal"), ((37,), "ties"), ((50, 101), "normal")])
def test_top_k_mask_with_a_traced_k_selects_as_with_a_python_k(shape, kind):
    """k as an int32 array (a traced hyperparameter): the same set as a stable argsort (as a Python k gives, above),
    for k inside (0, n), at the edges 0 and n, and outside (clipped: nothing, everything); one compilation."""
    rng = np.random.default_rng(len(shape))
    n = int(np.prod(shape))
    x = rng.integers(0, 5, size=shape) if kind == "ties" else rng.normal(size=shape)
    score = jnp.asarray(x, jnp.float32)
    mask = jax.jit(select.top_k_mask)
    order = np.argsort(-np.asarray(score).ravel(), kind="stable")
    for k in sorted({-2, 0, 1, n // 3, n // 2, n - 1, n, n + 5}):
        want = np.zeros(n, bool)
        want[order[: max(k, 0)]] = True
        np.testing.assert_array_equal(np.asarray(mask(score, jnp.int32(k))).ravel(), want, err_msg=f"k = {k}")


def test_approx_threshold_is_the_kth_largest_key_of_the_sample():
    """t is the k-th largest key of the sample, k = round(fraction m) (not any key the search stopped at), the same
    for a Python and an array fraction; the estimate is the share of the check sample at or above t."""
    rng = np.random.default_rng(4)
    for sample in (rng.normal(size=1024), rng.integers(0, 9, size=1024).astype(float), rng.normal(size=300)):
        check = rng.normal(size=1024)
        s, c = jnp.asarray(sample, jnp.float32), jnp.asarray(check, jnp.float32)
        keys = np.sort(np.asarray(select.ordered_keys(s)))[::-1]
        for fraction in (0.001, 0.1, 0.375, 0.5, 0.9, 1.0):
            k = max(1, min(s.size, round(fraction * s.size)))
            for given in (fraction, jnp.float32(fraction)):
                t, estimate = jax.jit(select.approx_threshold)(s, c, given)
                assert int(t) == int(keys[k - 1]), (fraction, given)
                assert float(estimate) == pytest.approx(np.mean(np.asarray(select.ordered_keys(c)) >= keys[k - 1]))


def test_top_k_mask_of_a_small_tensor_orders_signed_zeros_and_infinities():
    """At most 4096 entries (one sort of the keys): -inf < ... < -0.0 < +0.0 < ... < +inf, ties at the k-th value to
    the first positions, for every k, static and traced: the same set as NumPy's stable argsort of the keys."""
    rng = np.random.default_rng(5)
    x = rng.choice(np.array([-np.inf, -1.0, -0.0, 0.0, 1e-45, 1.0, np.inf], np.float32), size=(6, 7))
    score = jnp.asarray(x)
    order = np.argsort(~np.asarray(select.ordered_keys(score)).ravel(), kind="stable")
    traced = jax.jit(select.top_k_mask)
    for k in range(x.size + 1):
        want = np.zeros(x.size, bool)
        want[order[:k]] = True
        np.testing.assert_array_equal(np.asarray(select.top_k_mask(score, k)).ravel(), want, err_msg=f"k = {k}")
        np.testing.assert_array_equal(np.asarray(traced(score, jnp.int32(k))).ravel(), want, err_msg=f"k = {k}")


@pytest.mark.parametrize("shape", [(5,), (1024,), (1025,), (2047,), (300, 70), (7, 1111), (640, 2560)])
def test_strided_pairs_are_both_strided_samples(shape):
    x = jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape)
    pairs = np.asarray(select.strided_pairs(x, 1024))
    np.testing.assert_array_equal(pairs[:, 0], np.asarray(select.strided_sample(x, 1024)))
    np.testing.assert_array_equal(pairs[:, 1], np.asarray(select.strided_sample(x, 1024, second=True)))
