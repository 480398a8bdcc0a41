"""DiLoCo's outer optimizer against its formula in float64 NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optim import diloco_outer


@pytest.mark.parametrize("lr, mu", [(0.7, 0.9), (1.0, 0.0), (0.3, 0.5)])
def test_diloco_outer_is_nesterov_sgd_on_the_outer_gradient(lr, mu):
    rng = np.random.default_rng(0)
    theta = {"a": rng.normal(size=(3, 4)), "b": rng.normal(size=(5,))}
    tx = diloco_outer(lr, momentum=mu)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), theta)
    state = tx.init(params)
    v = jax.tree.map(np.zeros_like, theta)
    for _ in range(5):
        averaged = jax.tree.map(lambda x: x + rng.normal(size=x.shape) * 0.1, theta)
        delta = jax.tree.map(lambda s, a: s - a, theta, averaged)
        v = jax.tree.map(lambda v, d: mu * v + d, v, delta)
        theta = jax.tree.map(lambda s, d, v: s - lr * (d + mu * v), theta, delta, v)
        outer_grad = jax.tree.map(lambda p, a: p - jnp.asarray(a, jnp.float32), params, averaged)
        updates, state = tx.update(outer_grad, state, params)
        params = optax.apply_updates(params, updates)
        for k in theta:
            np.testing.assert_allclose(params[k], theta[k], rtol=1e-5, atol=1e-6)
    if lr == 1.0 and mu == 0.0:  # plain averaging
        np.testing.assert_allclose(params["a"], np.asarray(averaged["a"], np.float32), rtol=1e-6)


def test_diloco_outer_rejects_bad_momentum():
    with pytest.raises(ValueError, match="momentum = 1.0"):
        diloco_outer(0.7, momentum=1.0)
