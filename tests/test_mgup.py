"""MGUP optax transforms against an independent float64 NumPy transcription of the spec's updates (50 steps on a
pytree of mixed shapes, including a tensor with k = 0), plus the mask's edge cases."""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import optim
from optim import select

SHAPES = {"vec": (7,), "mat": (5, 3), "cube": (2, 3, 4), "one": (1,)}  # "one": k = int(0.5 * 1) = 0 -> all gamma
STEPS = 50


def _np_mask(u, g, tau, alpha, gamma):
    s = (u * g).ravel()
    k = int(tau * s.size)
    phi = np.full(s.shape, gamma)
    if k:
        phi[np.argsort(-s, kind="stable")[:k]] = alpha
    return phi.reshape(u.shape)


class NumpyMGUPAdamW:
    """The spec's MGUP-AdamW (and, with cautious=True, Cautious-MGUP; with c_adamw=True, C-AdamW), float64."""

    def __init__(self, lr, b1, b2, eps, wd, tau, alpha, gamma, mode="mgup"):
        self.lr, self.b1, self.b2, self.eps, self.wd, self.mode = lr, b1, b2, eps, wd, mode
        self.tau, self.alpha, self.gamma = tau, alpha, gamma
        self.t, self.m, self.v = 0, None, None

    def step(self, p, g):
        if self.m is None:
            self.m, self.v = np.zeros_like(p), np.zeros_like(p)
        self.t += 1
        lr = self.lr(self.t - 1) if callable(self.lr) else self.lr
        if self.wd > 0:
            p = p - lr * self.wd * p
        self.m = self.b1 * self.m + (1 - self.b1) * g
        self.v = self.b2 * self.v + (1 - self.b2) * g * g
        u = self.m / (np.sqrt(self.v) + self.eps)
        step = lr * np.sqrt(1 - self.b2**self.t) / (1 - self.b1**self.t)
        if self.mode == "mgup":
            phi = _np_mask(u, g, self.tau, self.alpha, self.gamma)
        elif self.mode == "cautious_mgup":
            phi = np.where(u * g >= 0, self.alpha, self.gamma)
        else:  # C-AdamW
            keep = (u * g > 0).astype(np.float64)
            phi = keep / max(keep.mean(), 1e-3)
        return p - step * u * phi


class NumpyMGUPLion:
    def __init__(self, lr, b1, b2, wd, tau, alpha, gamma):
        self.lr, self.b1, self.b2, self.wd, self.tau, self.alpha, self.gamma = lr, b1, b2, wd, tau, alpha, gamma
        self.m = None

    def step(self, p, g):
        if self.m is None:
            self.m = np.zeros_like(p)
        p = p - self.lr * self.wd * p
        c = np.sign(self.b1 * self.m + (1 - self.b1) * g)
        p = p - self.lr * c * _np_mask(c, g, self.tau, self.alpha, self.gamma)
        self.m = self.b2 * self.m + (1 - self.b2) * g
        return p


def _run(tx, references, seed, dtype=jnp.float64):
    rng = np.random.default_rng(seed)
    params = {k: rng.normal(size=s) for k, s in SHAPES.items()}
    ref = {k: v.copy() for k, v in params.items()}
    p = {k: jnp.asarray(v, dtype) for k, v in params.items()}
    state = tx.init(p)
    update = jax.jit(tx.update)
    for _ in range(STEPS):
        grads = {k: rng.normal(size=s) for k, s in SHAPES.items()}
        updates, state = update({k: jnp.asarray(v, dtype) for k, v in grads.items()}, state, p)
        p = optax.apply_updates(p, updates)
        ref = {k: references[k].step(ref[k], grads[k]) for k in SHAPES}
    return p, ref, state


@pytest.mark.parametrize("wd, schedule", [(0.0, False), (0.1, True)])
@pytest.mark.parametrize("mode", ["mgup", "cautious_mgup", "c_adamw"])
def test_adamw_family_matches_float64_reference(mode, wd, schedule):
    hp: dict[str, Any] = dict(b1=0.9, b2=0.999, eps=1e-6)
    lr = optax.linear_schedule(1e-2, 1e-3, STEPS) if schedule else 1e-2
    np_lr = (lambda t: 1e-2 + (1e-3 - 1e-2) * min(t, STEPS) / STEPS) if schedule else 1e-2
    tau, alpha, gamma = 0.3, 2.5, 0.2
    with jax.enable_x64(True):
        if mode == "mgup":
            tx = optim.mgup_adamw(lr, weight_decay=wd, mask_ratio=tau, alpha=alpha, gamma=gamma, **hp)
        elif mode == "cautious_mgup":
            tx = optim.cautious_mgup_adamw(lr, weight_decay=wd, alpha=alpha, gamma=gamma, **hp)
        else:
            tx = optim.cautious_adamw(lr, weight_decay=wd, **hp)
        refs = {k: NumpyMGUPAdamW(np_lr, hp["b1"], hp["b2"], hp["eps"], wd, tau, alpha, gamma, mode) for k in SHAPES}
        p, ref, _ = _run(tx, refs, seed=len(mode) + int(schedule))
        for k in SHAPES:
            assert p[k].dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(p[k]), ref[k], rtol=1e-6, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_lion_matches_float64_reference(wd):
    tau, alpha, gamma = 0.5, 2.0, 0.1
    with jax.enable_x64(True):
        tx = optim.mgup_lion(3e-3, b1=0.9, b2=0.99, weight_decay=wd, mask_ratio=tau, alpha=alpha, gamma=gamma)
        refs = {k: NumpyMGUPLion(3e-3, 0.9, 0.99, wd, tau, alpha, gamma) for k in SHAPES}
        p, ref, state = _run(tx, refs, seed=7)
        for k in SHAPES:
            np.testing.assert_allclose(np.asarray(p[k]), ref[k], rtol=1e-6, atol=1e-12, err_msg=k)
    total = sum(int(np.prod(s)) for s in SHAPES.values())
    chosen = sum(int(tau * int(np.prod(s))) for s in SHAPES.values())
    assert float(state.mask.selected_fraction) == pytest.approx(chosen / total)


def _rosenbrock_grad(p):
    x, y = p[0], p[1]
    return np.array([-2 * (1 - x) - 400 * x * (y - x * x), 200 * (y - x * x)])


def test_lion_on_rosenbrock_stops_where_the_reference_algorithm_stops():
    """MGUP-Lion, lr 1e-2, from (0, 0) on the Rosenbrock function (one 2-entry tensor: k = 1), 10,000 steps in
    float64: our optimizer ends where the float64 NumPy reference (the authors' update order) ends, (0.715, 0.496),
    and stays there (the same point after 20,000 steps): a fixed-step sign method's iterates live on a lattice and
    cycle; plain Lion (the reference without the mask) stops too, at (0.94, 0.87). MGUP's 2x / 0.1x multipliers
    change where, not whether. (docs/mgup.md, "MGUP-Lion".)"""
    with jax.enable_x64(True):
        tx = optim.mgup_lion(1e-2)
        rosenbrock = lambda p: (1 - p[0]) ** 2 + 100 * (p[1] - p[0] ** 2) ** 2  # noqa: E731

        def step(_, carry):
            p, state = carry
            updates, state = tx.update(jax.grad(rosenbrock)(p), state, p)
            return optax.apply_updates(p, updates), state

        p0 = jnp.zeros(2, jnp.float64)
        run = jax.jit(lambda n: jax.lax.fori_loop(0, n, step, (p0, tx.init(p0)))[0])
        ours, longer = np.asarray(run(10_000)), np.asarray(run(20_000))
    ends = {}
    for multipliers in ((2.0, 0.1), (1.0, 1.0)):  # MGUP's; none (plain Lion, weight decay 0)
        ref, p = NumpyMGUPLion(1e-2, 0.9, 0.99, 0.0, 0.5, *multipliers), np.zeros(2)
        for i in range(1, 20_001):
            p = ref.step(p, _rosenbrock_grad(p))
            ends[multipliers, i] = p
    np.testing.assert_allclose(ours, ends[(2.0, 0.1), 10_000], rtol=0, atol=1e-9)
    np.testing.assert_allclose(ours, [0.715, 0.496], atol=1e-9)
    np.testing.assert_allclose(longer, ours, atol=1e-9)
    # plain Lion stops too, elsewhere on the valley
    np.testing.assert_allclose(ends[(1.0, 1.0), 10_000], [0.94, 0.87], atol=1e-9)
    np.testing.assert_allclose(ends[(1.0, 1.0), 20_000], [0.94, 0.87], atol=1e-9)


# as the optimizers run it: jitted (one program per shape and setting, not one per operation)
_mask = jax.jit(optim.mgup_mask, static_argnames=("mask_ratio", "alpha", "gamma", "selection"))


def test_mask_selects_exactly_k_per_tensor_and_k_zero_gives_gamma():
    rng = np.random.default_rng(0)
    for n, tau in ((10, 0.5), (7, 0.3), (1, 0.5), (64, 0.0), (33, 1.0)):
        u, g = rng.normal(size=n), rng.normal(size=n)
        phi = np.asarray(_mask(jnp.asarray(u), jnp.asarray(g), mask_ratio=tau, alpha=2.0, gamma=0.1))
        np.testing.assert_allclose(phi, _np_mask(u, g, tau, 2.0, 0.1), rtol=1e-7)  # float32 phi
        assert (phi == 2.0).sum() == int(tau * n)
    x = jnp.asarray(rng.normal(size=(4, 5)))
    # all misaligned
    np.testing.assert_array_equal(_mask(x, -x, alpha=2.0, gamma=0.1, selection="sign"), np.float32(0.1))
    np.testing.assert_array_equal(_mask(x, 0 * x, alpha=2.0, gamma=0.1, selection="sign"), 2.0)  # >= 0


def test_approx_selection_realises_about_the_fraction():
    rng = np.random.default_rng(1)
    u, g = jnp.asarray(rng.normal(size=(300, 700)), jnp.float32), jnp.asarray(rng.normal(size=(300, 700)), jnp.float32)
    phi = _mask(u, g, mask_ratio=0.25, selection="approx")
    exact = _mask(u, g, mask_ratio=0.25)
    realised = float(jnp.mean(phi == 2.0))
    bound = 4 * (0.25 * 0.75 / select.APPROX_SAMPLE) ** 0.5 + 2 / select.APPROX_SAMPLE  # sample quantile, 4 sigma
    assert abs(realised - 0.25) < bound
    assert float(jnp.mean(phi == exact)) > 1 - bound  # it disagrees only near the threshold
    tx = optim.scale_by_mgup(mask_ratio=0.25, selection="approx")
    _, state = jax.jit(tx.update)({"w": u}, tx.init({"w": u}), grad={"w": g})
    assert abs(float(state.selected_fraction) - realised) < bound  # an estimate from a second sample
    tx = optim.scale_by_mgup(selection="sign")
    _, state = jax.jit(tx.update)({"w": u, "b": u[0]}, tx.init(None), grad={"w": g + 0.3, "b": g[0]})  # (b: counted)
    aligned = (float(jnp.sum(u * (g + 0.3) >= 0)) + float(jnp.sum(u[0] * g[0] >= 0))) / (u.size + u.shape[1])
    assert abs(float(state.selected_fraction) - aligned) < 4 * (0.25 / select.APPROX_SAMPLE) ** 0.5


def test_zero_gradients_give_no_step_in_bf16():
    params = {"w": jnp.ones((4, 6), jnp.bfloat16), "b": jnp.zeros((3,), jnp.bfloat16)}
    for tx in (optim.mgup_adamw(1e-2), optim.mgup_lion(1e-2), optim.cautious_mgup_adamw(1e-2), optim.cautious_adamw()):
        zeros = jax.tree.map(jnp.zeros_like, params)
        updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
        for u in jax.tree.leaves(updates):
            assert u.dtype == jnp.bfloat16 and not jnp.any(u)  # zero gradient, no decay: no step


BF16_ROUNDINGS = 6  # bf16 roundings of an update: direction, direction x phi, wd p, their sum, x lr; one spare


@pytest.mark.parametrize(
    "case, steps",
    [("mgup_adamw_tau1", 5), ("mgup_adamw", 1), ("mgup_lion", 5), ("cautious_mgup_adamw", 5), ("c_adamw", 5)],
)
def test_bf16_updates_match_the_float64_reference(case, steps):
    """bf16 parameters and gradients against the float64 NumPy reference given the same (bf16-exact) parameters
    and gradients at every step. The moments are float32 (no visible error); the direction (gradient dtype), its
    product with phi, wd p, their sum and the learning-rate product are each rounded to bf16, unit roundoff 2^-8,
    so |update - reference| <= BF16_ROUNDINGS 2^-8 (|lr wd p| + |direction part|) entrywise. The selections are
    robust to those roundings: tau = 1 (every coordinate), tau = 0.5 at step 1 (|u| = |g| / (|g| + eps /
    sqrt(1 - b2)), monotone in |g| as its bf16 rounding is, so both rank by |g|), Lion (c = sign), the Cautious
    variants (sign(u g), which rounding keeps)."""
    lr, wd, tau, alpha, gamma = 1e-2, 0.1, 0.5, 2.0, 0.1
    hp: dict[str, Any] = dict(b1=0.9, b2=0.999, eps=1e-6)
    if case == "mgup_lion":
        tx = optim.mgup_lion(lr, weight_decay=wd, mask_ratio=tau)
        refs: dict[str, Any] = {k: NumpyMGUPLion(lr, 0.9, 0.99, wd, tau, alpha, gamma) for k in SHAPES}
    else:
        tau = 1.0 if case == "mgup_adamw_tau1" else tau
        tx = {
            "mgup_adamw_tau1": lambda: optim.mgup_adamw(lr, **hp, weight_decay=wd, mask_ratio=tau),
            "mgup_adamw": lambda: optim.mgup_adamw(lr, **hp, weight_decay=wd, mask_ratio=tau),
            "cautious_mgup_adamw": lambda: optim.cautious_mgup_adamw(lr, **hp, weight_decay=wd),
            "c_adamw": lambda: optim.cautious_adamw(lr, **hp, weight_decay=wd),
        }[case]()
        mode = {"cautious_mgup_adamw": "cautious_mgup", "c_adamw": "c_adamw"}.get(case, "mgup")
        refs = {k: NumpyMGUPAdamW(lr, hp["b1"], hp["b2"], hp["eps"], wd, tau, alpha, gamma, mode) for k in SHAPES}
    rng = np.random.default_rng(11)
    bf16 = lambda x: np.asarray(x).astype(ml_dtypes.bfloat16)  # noqa: E731
    params = {k: jnp.asarray(bf16(rng.normal(size=s))) for k, s in SHAPES.items()}
    state, update = tx.init(params), jax.jit(tx.update)
    for step in range(steps):
        grads = {k: jnp.asarray(bf16(rng.normal(size=s))) for k, s in SHAPES.items()}
        updates, state = update(grads, state, params)
        for k in SHAPES:
            p, g = np.asarray(params[k], np.float64), np.asarray(grads[k], np.float64)
            want = refs[k].step(p, g) - p
            decay = lr * wd * np.abs(p)
            bound = BF16_ROUNDINGS * 2.0**-8 * (decay + np.abs(want + lr * wd * p))
            got = np.asarray(updates[k], np.float64)
            assert updates[k].dtype == jnp.bfloat16
            assert np.all(np.abs(got - want) <= bound), (case, step, k, np.max(np.abs(got - want) / bound))
        params = optax.apply_updates(params, updates)


def test_num_selected_on_device_equals_pythons_int_of_the_product():
    """k = num_selected(tau, n) for tau given as an array (traced: inject_hyperparams) equals int(float(tau) * n),
    the static path's and the reference's rule: float32 ratios (exact 32-bit integer arithmetic) including 0, 1,
    subnormals and the float32 neighbours of j / n where the floor changes, n up to 2^28 - 1; bfloat16 ratios
    (widened exactly); float64 ratios under x64 (Python's rounded double product: 0.7 * 10 -> 7, 0.29 * 100 -> 28)."""
    rng = np.random.default_rng(0)
    fixed = [0.0, 1.0, 0.5, 0.7, 0.29, 0.1, 1e-45, 1e-38, 1 - 2**-24, 2**-24]
    sizes = [1, 3, 10, 4097, 65_536, 65_537, 999_983, 2**24 + 1, 2**28 - 1]
    count = jax.jit(jax.vmap(optim.num_selected, in_axes=(0, None)), static_argnums=1)
    for n in sizes:
        edges = (rng.integers(0, n + 1, size=30) / n).astype(np.float32)
        r = np.concatenate([rng.random(100), fixed, edges, np.nextafter(edges, 0), np.nextafter(edges, 1)])
        r = np.clip(r.astype(np.float32), 0, 1)
        np.testing.assert_array_equal(count(jnp.asarray(r), n), [int(float(x) * n) for x in r], err_msg=str(n))
        half = jnp.asarray(r[:40], jnp.bfloat16)
        np.testing.assert_array_equal(count(half, n), [int(float(x) * n) for x in np.asarray(half)], err_msg=str(n))
    assert optim.num_selected(0.7, 10) == 7 and optim.num_selected(0.29, 100) == 28  # static: Python's product
    with jax.enable_x64(True):
        r = np.concatenate([rng.random(100), [0.7, 0.29, 0.0, 1.0]])
        for n in (10, 100, 2**31 - 1):
            np.testing.assert_array_equal(count(jnp.asarray(r), n), [int(x * n) for x in r], err_msg=str(n))


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="mask_ratio = 1.5"):
        optim.mgup_adamw(mask_ratio=1.5)
    with pytest.raises(ValueError, match="gamma = 0"):
        optim.mgup_lion(gamma=0.0)
    with pytest.raises(ValueError, match="selection = 'fast'"):
        optim.mgup_adamw(selection="fast")
    assert optim.paper_defaults(0.25) == {"mask_ratio": 0.25, "alpha": 4.0, "gamma": 0.25}
    with pytest.raises(TypeError, match="positional"):  # everything after the learning rate by keyword
        optim.mgup_adamw(1e-3, 0.9)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="mask_ratio = 1.5"):  # an array that is known is checked too
        optim.scale_by_mgup(mask_ratio=jnp.float32(1.5))
    traced = jax.jit(lambda r: optim.scale_by_mgup(mask_ratio=r).update({"a": r}, None, grad={"a": r})[0]["a"])
    assert float(traced(jnp.float32(0.5))) == pytest.approx(0.05)  # traced: not checked; k = int(0.5) = 0: gamma
    with pytest.raises(ValueError, match="needs the raw gradient"):
        tx = optim.scale_by_mgup()
        tx.update({"a": jnp.ones(3)}, tx.init({"a": jnp.ones(3)}))


def _np_newton_schulz(g, steps):
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (np.linalg.norm(x) + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if g.shape[0] > g.shape[1] else x


class NumpyMGUPMuon:
    """The spec's Muon branch (2-D) or its AdamW backup branch, float64."""

    def __init__(self, lr, wd, mu, nesterov, steps, tau, alpha, gamma, muon, b1=0.95, b2=0.95, eps=1e-8):
        self.lr, self.wd, self.mu, self.nesterov, self.steps, self.muon = lr, wd, mu, nesterov, steps, muon
        self.tau, self.alpha, self.gamma, self.b1, self.b2, self.eps = tau, alpha, gamma, b1, b2, eps
        self.buf = self.m = self.v = None
        self.t = 0

    def step(self, p, g):
        if not self.muon:
            if self.m is None:
                self.m, self.v = np.zeros_like(p), np.zeros_like(p)
            self.t += 1
            self.m = self.b1 * self.m + (1 - self.b1) * g
            self.v = self.b2 * self.v + (1 - self.b2) * g * g
            scale = (1 - self.b1**self.t) / np.sqrt(1 - self.b2**self.t)
            return p * (1 - self.lr * self.wd) - self.lr / scale * self.m / (self.eps + np.sqrt(self.v))
        if self.buf is None:
            self.buf = np.zeros_like(p)
        self.buf = self.mu * self.buf + g
        g_hat = g + self.mu * self.buf if self.nesterov else self.buf
        phi = _np_mask(g_hat, g, self.tau, self.alpha, self.gamma)
        o = _np_newton_schulz(g_hat, self.steps)
        return p * (1 - self.lr * self.wd) - self.lr * 0.2 * np.sqrt(max(p.shape)) * o * phi


MUON_SHAPES = {"wide": (4, 9), "tall": (10, 3), "embedding": (12, 4), "bias": (5,), "lm_head": (4, 12)}


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_float64_reference(nesterov):
    from optim import muon

    lr, wd, tau, alpha, gamma = 2e-2, 0.1, 0.5, 2.0, 0.1
    rng = np.random.default_rng(int(nesterov))
    with jax.enable_x64(True):
        tx = muon.mgup_muon(
            lr, weight_decay=wd, nesterov=nesterov, mask_ratio=tau, alpha=alpha, gamma=gamma, ns_dtype=jnp.float64
        )
        params = {k: rng.normal(size=s) for k, s in MUON_SHAPES.items()}
        refs = {
            k: NumpyMGUPMuon(lr, wd, 0.95, nesterov, 5, tau, alpha, gamma, muon=k in ("wide", "tall"))
            for k in MUON_SHAPES
        }
        p = {k: jnp.asarray(v) for k, v in params.items()}
        state, update = tx.init(p), jax.jit(tx.update)
        for _ in range(STEPS):
            grads = {k: rng.normal(size=s) for k, s in MUON_SHAPES.items()}
            updates, state = update({k: jnp.asarray(v) for k, v in grads.items()}, state, p)
            p = optax.apply_updates(p, updates)
            params = {k: refs[k].step(params[k], grads[k]) for k in MUON_SHAPES}
        for k in MUON_SHAPES:
            np.testing.assert_allclose(np.asarray(p[k]), params[k], rtol=1e-6, atol=1e-12, err_msg=k)
    assert muon.default_muon_labels(params) == {
        "wide": "muon",
        "tall": "muon",
        "embedding": "adam",
        "bias": "adam",
        "lm_head": "adam",
    }


def test_newton_schulz_orthogonalises_and_muon_rejects_non_matrices():
    from optim import muon

    g = jnp.asarray(np.random.default_rng(3).normal(size=(16, 40)), jnp.float32)
    s = np.linalg.svd(np.asarray(muon.newton_schulz(g, 5)), compute_uv=False)
    assert s.min() > 0.5 and s.max() < 1.5  # the quintic's known band, not exactly 1
    tx = muon.mgup_muon(labels=lambda p: {"w": "muon"})
    with pytest.raises(ValueError, match="labelled 'muon' but Muon takes 2-D"):
        tx.init({"w": jnp.ones((2, 3, 4))})


def test_muon_labels_on_a_real_model():
    """default_muon_labels on the tiny MoE's parameter tree: Muon for the 2-D attention kernels and routers, the
    AdamW backup for the embedding, the norms and the 3-D expert weights; mgup_muon from the config initialises on
    it. (tests/test_optimizers.py checks every optimizer's wiring bit for bit.)"""
    from flax import nnx

    from experiments import build, schema
    from optim import muon

    from helpers import tiny_moe_transformer

    params = nnx.state(tiny_moe_transformer(), nnx.Param)
    labels = muon.default_muon_labels(params)
    for (path, leaf), label in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(labels)):
        name = jax.tree_util.keystr(path)
        want = "muon" if leaf.ndim == 2 and "embedding" not in name else "adam"
        assert label == want, name
    assert {"muon", "adam"} == set(jax.tree.leaves(labels))
    config = schema.default_config()
    config.optim.name = "mgup_muon"
    build.build_optimizer(config).init(params)


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.mgup_adamw(1e-2, weight_decay=0.1),
        lambda: optim.mgup_lion(1e-3),
        lambda: optim.mgup_muon(1e-2),
        lambda: optim.mgup_adamw(1e-2, selection="approx"),
    ],
)
def test_sharded_parameters_keep_their_sharding_and_match_one_device(make):
    """8 virtual devices: parameters sharded by rows / columns; the state mirrors their sharding and three steps
    give the single-device values."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))  # as core.mesh builds them
    specs = {
        "w": jax.sharding.PartitionSpec("x", None),
        "v": jax.sharding.PartitionSpec("x"),
        "u": jax.sharding.PartitionSpec(None, "x"),
    }
    rng = np.random.default_rng(5)
    host = {"w": rng.normal(size=(16, 24)), "v": rng.normal(size=(40,)), "u": rng.normal(size=(6, 32))}
    grads = [{k: rng.normal(size=v.shape) for k, v in host.items()} for _ in range(3)]
    results = []
    for sharded in (False, True):
        tx = make()
        put = (
            (lambda k, x: jax.device_put(jnp.asarray(x, jnp.float32), jax.sharding.NamedSharding(mesh, specs[k])))
            if sharded
            else (lambda k, x: jnp.asarray(x, jnp.float32))
        )
        params = {k: put(k, v) for k, v in host.items()}
        state = tx.init(params)
        if sharded:
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
                name = next((k for k in host if f"'{k}'" in jax.tree_util.keystr(path)), None)
                if name is not None and leaf.shape == host[name].shape:
                    assert leaf.sharding.is_equivalent_to(params[name].sharding, leaf.ndim), jax.tree_util.keystr(path)
        update = jax.jit(tx.update)
        for g in grads:
            updates, state = update({k: put(k, v) for k, v in g.items()}, state, params)
            params = optax.apply_updates(params, updates)
        results.append({k: np.asarray(v) for k, v in params.items()})
        if sharded:
            assert all(
                params[k].sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, specs[k]), params[k].ndim)
                for k in host
            )
    for k in host:
        np.testing.assert_allclose(results[1][k], results[0][k], rtol=2e-5, atol=1e-6, err_msg=k)


def test_approx_samples_from_the_inner_transform_equal_samples_of_the_direction():
    """with HF-Adam (a DirectionTransformation), with_mgup computes the samples from strided samples of the updated
    state and the gradient; the selection must be the one made from the same samples of the full direction."""
    rng = np.random.default_rng(3)
    params = {
        "a": jnp.asarray(rng.normal(size=(300, 70)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(9,)), jnp.float32),
    }

    def make(hook):
        adam = optim.scale_by_hf_adam()
        inner = adam if hook else optax.GradientTransformation(adam.init, adam.update)
        return optim.with_mgup(
            inner, optim.scale_by_mgup(mask_ratio=0.3, selection="approx"), optax.scale_by_learning_rate(1e-2)
        )

    fused, plain = make(True), make(False)
    s1, s2 = fused.init(params), plain.init(params)
    for step in range(3):
        g = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
        u1, s1 = jax.jit(fused.update)(g, s1, params)
        u2, s2 = jax.jit(plain.update)(g, s2, params)
        for k in params:
            np.testing.assert_allclose(np.asarray(u1[k]), np.asarray(u2[k]), rtol=1e-6, err_msg=f"{k} step {step}")
        assert float(s1.mask.selected_fraction) == pytest.approx(float(s2.mask.selected_fraction), abs=1e-6)


AUTHORS_FIXTURE = Path(__file__).resolve().parent / "fixtures" / "mgup" / "reference.npz"
AUTHORS_PRESETS: dict[str, Callable[..., optax.GradientTransformation]] = {
    "MGUP_AdamW.AdamW": optim.mgup_adamw,
    "MGUP_AdamW.CMGUP_AdamW": optim.cautious_mgup_adamw,
    "MGUP_Lion.Lion": optim.mgup_lion,
}


def _authors_optimizer(spec: dict[str, Any]) -> optax.GradientTransformation:
    """Our preset configured like the authors' class `spec["class"]` with its constructor's `spec["kwargs"]` (the
    reference's mask defaults tau 0.5, alpha 2, gamma 0.1 are ours too; its betas become b1, b2)."""
    kwargs = dict(spec["kwargs"])
    b1, b2 = kwargs.pop("betas")
    return AUTHORS_PRESETS[spec["class"]](kwargs.pop("lr"), b1=b1, b2=b2, **kwargs)


@pytest.mark.parametrize("case", ["adamw", "adamw_wd", "cautious_adamw_wd", "lion", "lion_wd"])
def test_matches_the_authors_pytorch_trajectories(case):
    """Our optimizer against the authors' PyTorch code itself (MaeChd/MGUP; tests/fixtures/mgup, made by its
    make_fixtures.py with torch): the same float64 init and 20 gradients, the parameters after every step equal
    to float64 round-off."""
    with np.load(AUTHORS_FIXTURE) as f:
        data = {k: f[k] for k in f.files}
    spec = json.loads(str(data["hparams"]))[case]
    names = sorted(k.removeprefix("init_") for k in data if k.startswith("init_"))
    steps = data[f"grads_{names[0]}"].shape[0]
    with jax.enable_x64(True):
        tx = _authors_optimizer(spec)
        p = {k: jnp.asarray(data[f"init_{k}"], jnp.float64) for k in names}
        state, update = tx.init(p), jax.jit(tx.update)
        for t in range(steps):
            updates, state = update({k: jnp.asarray(data[f"grads_{k}"][t], jnp.float64) for k in names}, state, p)
            p = optax.apply_updates(p, updates)
            for k in names:
                assert p[k].dtype == jnp.float64
                np.testing.assert_allclose(
                    np.asarray(p[k]), data[f"traj_{case}_{k}"][t], rtol=1e-12, atol=1e-14, err_msg=f"{k} step {t}"
                )
