"""Low-bit synchronisation: core.codec's wire formats against ml_dtypes casts and exact NumPy quantisers (block maxima
at powers of two, tiny and huge exponents, zero and non-finite blocks, stochastic rounding's mean), the quantised mean
of moe.lowbit_sync against the algorithm written plainly in NumPy (error feedback included), and a compiled round's
cross-site bytes against moe.system_model's formula for every format."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from core.codec import WireFormat
from moe import federation, lowbit_sync, rounds
from moe.placement import fixed_placement
from moe.stepper import round_bytes
from optim import diloco_outer

from helpers import tiny_federation

SITES = 4
QMAX = {"int8": 127.0, "fp4": 6.0, "int4": 7.0}


def _ue8m0_exponent(amax: np.ndarray, qmax: float) -> np.ndarray:
    """The smallest e with amax <= qmax 2^e (float64, exact: frexp), clamped to UE8M0's [-127, 127]."""
    mantissa, exponent = np.frexp(amax / qmax)  # amax / qmax = mantissa 2^exponent, mantissa in [0.5, 1)
    e = np.where(mantissa == 0.5, exponent - 1, exponent)
    return np.clip(np.where(amax > 0, e, -127), -127, 127)


def _round_half_even_grid(y: np.ndarray, name: str) -> np.ndarray:
    if name == "fp4":
        return np.asarray(y, np.float32).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    top = QMAX[name]
    return np.clip(np.round(y), -top, top)  # np.round: half to even


def _reference(x: np.ndarray, fmt: WireFormat) -> np.ndarray:
    """decode(encode(x)) for nearest rounding, in float64 from the definitions: ml_dtypes' bfloat16 and E2M1 casts,
    NumPy's round-half-even on the uniform grids, scales amax / q_max (fp32) or the power of two of
    `_ue8m0_exponent`."""
    if fmt.name == "float32":
        return x.astype(np.float64)
    if fmt.name == "bf16":
        return x.astype(ml_dtypes.bfloat16).astype(np.float64)
    blocks = x.astype(np.float64).reshape(x.shape[0], -1, fmt.block)
    amax = np.abs(blocks).max(-1, keepdims=True)
    if fmt.scale == "ue8m0":
        scale = np.ldexp(1.0, _ue8m0_exponent(amax, QMAX[fmt.name]))
    else:
        scale = np.asarray(amax / QMAX[fmt.name], np.float32).astype(np.float64)
    safe = np.where(scale > 0, scale, 1.0)
    return (_round_half_even_grid(blocks / safe, fmt.name) * scale).reshape(x.shape)


def _edge_rows(rng, block: int) -> np.ndarray:
    """Rows of blocks: random values at exponents -100..100, blocks whose max is exactly 2^k, a zero block, a block
    of one non-zero value."""
    rows = []
    for k in (-100, -20, 0, 7, 40, 100):
        b = rng.normal(size=(4, block)) * 2.0**k
        b[1] = b[1] / np.abs(b[1]).max() * 2.0**k  # max exactly a power of two
        b[2] = 0.0
        b[3] = 0.0
        b[3, 3] = -(2.0**k) * 1.5
        rows.append(b.reshape(-1))
    return np.asarray(rows, np.float32)


@pytest.mark.parametrize(
    "name, scale",
    [
        ("bf16", "fp32"),
        ("int8", "fp32"),
        ("int8", "ue8m0"),
        ("fp4", "ue8m0"),
        ("fp4", "fp32"),
        ("int4", "ue8m0"),
        ("int4", "fp32"),
    ],
)
def test_nearest_codecs_equal_the_definitions_at_every_edge(name, scale):
    fmt = WireFormat(name, 16, scale)
    x = _edge_rows(np.random.default_rng(0), fmt.block)
    encoded = jax.jit(fmt.encode)(jnp.asarray(x))
    got = np.asarray(jax.jit(fmt.decode)(encoded), np.float64)
    want = _reference(x, fmt)
    if scale == "fp32":  # (the float32 scale amax / q_max is itself a rounded quotient; its product too)
        np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)
    else:
        np.testing.assert_array_equal(got, want)
    nbytes = sum(a.nbytes for a in encoded)
    assert nbytes == x.size * fmt.bytes_per_value  # the arrays that travel are exactly the formula's bytes


def test_a_non_finite_block_decodes_to_nan_and_the_others_are_kept():
    x = np.random.default_rng(1).normal(size=(2, 64)).astype(np.float32)
    x[0, 5], x[1, 40] = np.nan, np.inf
    for name in ("int8", "fp4", "int4"):
        for scale in ("fp32", "ue8m0"):
            fmt = WireFormat(name, 32, scale)
            got = np.asarray(fmt.decode(fmt.encode(jnp.asarray(x))))
            assert np.isnan(got[0, :32]).all() and np.isnan(got[1, 32:]).all(), (name, scale)
            assert np.isfinite(got[0, 32:]).all() and np.isfinite(got[1, :32]).all(), (name, scale)


@pytest.mark.parametrize("name", ["bf16", "int8", "fp4", "int4"])
def test_stochastic_rounding_lands_on_a_neighbour_and_is_unbiased(name):
    """Every draw is one of the two grid values around x (those of nearest rounding's grid at the block's scale),
    and the mean over 512 draws is within 5 standard errors of x."""
    fmt = WireFormat(name, 32, "ue8m0", "stochastic")
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 64)), jnp.float32)
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(512))
    draws = np.asarray(jax.jit(jax.vmap(lambda k: fmt.decode(fmt.encode(x, k))))(keys), np.float64)
    lo, hi = draws.min(0), draws.max(0)
    assert (np.unique(draws, axis=0).shape[0] > 2) and (draws == lo).sum() + (draws == hi).sum() == draws.size
    xs = np.asarray(x, np.float64)
    assert (lo <= xs).all() and (xs <= hi).all()
    standard_error = (hi - lo) / 2 / np.sqrt(512) + 1e-30
    assert (np.abs(draws.mean(0) - xs) <= 5 * standard_error + 1e-12).all()


def _topk2_reference(x: np.ndarray, fmt: WireFormat) -> np.ndarray:
    """topk2's decode(encode(x)), nearest: per chunk the `keep` largest magnitudes (NumPy's stable sort), each
    rounded to the nearer of lo (the smallest kept magnitude) and hi (the largest), ties to lo, with its sign;
    zeros elsewhere; a chunk holding a non-finite value all NaN."""
    chunks = x.reshape(x.shape[0], -1, fmt.block)
    out = np.zeros(chunks.shape)
    for i, j in np.ndindex(chunks.shape[:2]):
        c = chunks[i, j]
        if not np.isfinite(c).all():
            out[i, j] = np.nan
            continue
        kept = np.argsort(-np.abs(c), kind="stable")[: fmt.keep]
        m = np.abs(c[kept])
        lo, hi = m.min(), m.max()
        out[i, j, kept] = np.sign(c[kept]) * np.where(m - lo > hi - m, hi, lo)
    return out.reshape(x.shape)


def test_topk2_keeps_the_largest_magnitudes_on_two_levels_unbiased_in_exactly_its_bytes():
    """topk2 (nearest) equals the NumPy definition on random rows at exponents -100..100, a zero chunk, a chunk of
    one non-zero value and a non-finite chunk; its arrays are exactly (2 keep + 8) / G bytes per value; stochastic
    rounding lands on lo or hi of a kept value, unbiased over 512 draws (5 standard errors), and sends nothing
    else."""
    fmt = WireFormat("topk2", 16, "fp32", keep=3)
    x = _edge_rows(np.random.default_rng(5), fmt.block)
    x[0, 20] = np.nan
    encoded = jax.jit(fmt.encode)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(jax.jit(fmt.decode)(encoded)), _topk2_reference(x, fmt))
    assert sum(a.nbytes for a in encoded) == x.size * fmt.bytes_per_value == x.size * (2 * 3 + 8) / 16
    noisy = WireFormat("topk2", 16, "fp32", "stochastic", keep=4)
    y = jnp.asarray(np.random.default_rng(6).normal(size=(2, 64)), jnp.float32)
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(512))
    draws = np.asarray(jax.jit(jax.vmap(lambda k: noisy.decode(noisy.encode(y, k))))(keys), np.float64)
    ys = np.asarray(y, np.float64)
    kept = _topk2_reference(np.asarray(y), noisy) != 0
    assert (draws[:, ~kept] == 0).all() and kept.sum() == 4 * 8
    chunks = np.abs(ys).reshape(2, 4, 16)
    lo = np.sort(chunks, -1)[..., -4:][..., :1].repeat(16, -1).reshape(2, 64)
    hi = chunks.max(-1, keepdims=True).repeat(16, -1).reshape(2, 64)
    magnitude = np.abs(draws[:, kept])
    assert ((magnitude == lo[kept]) | (magnitude == hi[kept])).all()
    assert (np.sign(draws[:, kept]) == np.sign(ys[kept])).all()
    standard_error = (hi[kept] - lo[kept]) / 2 / np.sqrt(512) + 1e-30
    assert (np.abs(draws[:, kept].mean(0) - ys[kept]) <= 5 * standard_error + 1e-7).all()


def test_wire_format_refuses_bad_fields_by_name():
    for kwargs, needle in (
        ({"name": "fp8"}, "name = 'fp8'"),
        ({"scale": "e4m3"}, "scale = 'e4m3'"),
        ({"rounding": "up"}, "rounding = 'up'"),
        ({"block": 0}, "block = 0"),
        ({"name": "fp4", "block": 15}, "block = 15"),
        ({"name": "topk2", "block": 32, "scale": "fp32", "keep": 33}, "keep = 33"),
        ({"name": "topk2", "block": 32, "keep": 2}, "scale = 'ue8m0' for 'topk2'"),
        ({"name": "topk2", "block": 1 << 15, "scale": "fp32", "keep": 2}, "block = 32768"),
        ({"name": "fp4", "keep": 2}, "keep = 2 for 'fp4'"),
    ):
        with pytest.raises(ValueError, match=needle):
            WireFormat(**kwargs)


def _plain_quantised_mean(values, start, feedback, flags, placement, fmt):
    """The quantised mean written plainly (float64 NumPy, nearest rounding): for each group of sites and each kind
    of leaf (dense: all sites; expert: the replica group), concatenate each site's send x = value - start + e, pad to
    whole chunks, quantise (the `_reference` codec, blocks of the flat buffer), average the n copies, quantise the
    mean, add it to the start; e' = x - its quantised value."""
    out = {k: np.array(v, np.float64) for k, v in values.items()}
    new_fb = {k: np.zeros_like(v) for k, v in out.items()}
    groups = {False: [np.arange(SITES)], True: placement.replica_groups()}
    for kind in (False, True):
        keys = sorted(k for k in values if flags[k] == kind)  # (the order of the flattened tree)
        for group in groups[kind]:
            n = len(group)
            sends = [
                np.concatenate([(values[k][s] - start[k][s] + feedback[k][s]).ravel() for k in keys]) for s in group
            ]
            size = sends[0].size
            if fmt.gathered:  # each site's whole message to the group; the mean is not re-encoded
                padded = [np.pad(x, (0, -size % fmt.block))[None] for x in sends]
                quantised = [_topk2_reference(p.astype(np.float32), fmt) for p in padded]
                mean = (np.sum(np.stack(quantised), axis=0) / n).ravel()[:size]
            else:
                chunk = -(-size // (n * fmt.block)) * fmt.block
                padded = [np.pad(x, (0, n * chunk - size)).reshape(n, chunk) for x in sends]
                quantised = [_reference(p.astype(np.float32), fmt) for p in padded]
                mean = np.sum(np.stack(quantised), axis=0) / n
                mean = _reference(mean.astype(np.float32), fmt).ravel()[:size]
            for s, x, q in zip(group, sends, quantised):
                offset = 0
                for k in keys:
                    m = values[k][s].size
                    out[k][s] = start[k][s] + mean[offset : offset + m].reshape(values[k][s].shape)
                    new_fb[k][s] = (x - q.ravel()[:size])[offset : offset + m].reshape(values[k][s].shape)
                    offset += m
    return out, new_fb


@pytest.mark.parametrize("name, scale", [("fp4", "ue8m0"), ("int8", "fp32"), ("topk2", "fp32")])
def test_the_quantised_mean_and_its_error_feedback_follow_the_algorithm(name, scale):
    """Two rounds of compressed_average on 4 sites (O_e = 2; ragged leaf sizes that need padding), the second
    starting from the first's result and feedback, against the NumPy reference: means and feedback within float32
    rounding; every site of a group holds the same mean. With topk2 (never re-encoded) error feedback loses nothing:
    the means' steps plus the group's mean final feedback add up to the mean of what the sites wanted to send."""
    placement, mesh = fixed_placement(8, SITES, 2), federation.site_mesh(SITES, 2)
    fmt = WireFormat(name, 16, scale, keep=3 if name == "topk2" else 0)
    rng = np.random.default_rng(3)
    shapes = {"embed": (SITES, 7, 5), "norm": (SITES, 5), "up": (SITES, 2, 5, 3), "router": (SITES, 5, 2)}
    flags = {"embed": False, "norm": False, "up": True, "router": True}
    sharding = NamedSharding(mesh, PartitionSpec(federation.SITE_AXES))
    start = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    for k in shapes:  # the round's start is the synchronised state: equal within each group
        groups = placement.replica_groups() if flags[k] else [np.arange(SITES)]
        for g in groups:
            start[k][g] = start[k][g[0]]
    feedback = lowbit_sync.init_feedback({k: jnp.asarray(v) for k, v in start.items()}, flags, SITES, 2)
    fb_np = {k: np.zeros(s) for k, s in shapes.items()}
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(SITES))
    run = jax.jit(lambda v, s, e: lowbit_sync.compressed_average(v, s, flags, mesh, fmt, keys, e))
    first = {k: np.array(v, np.float64) for k, v in start.items()}
    wanted = {k: np.zeros(s) for k, s in shapes.items()}
    for _ in range(2):
        values = {k: (start[k] + 0.05 * rng.normal(size=s)).astype(np.float32) for k, s in shapes.items()}
        for k in shapes:
            wanted[k] += np.asarray(values[k], np.float64) - start[k]
        want, want_fb = _plain_quantised_mean(values, start, fb_np, flags, placement, fmt)
        put = lambda tree: {k: jax.device_put(jnp.asarray(v, jnp.float32), sharding) for k, v in tree.items()}  # noqa: E731
        got, feedback = run(put(values), put(start), feedback)
        for k in shapes:
            np.testing.assert_allclose(got[k], want[k], rtol=0, atol=2e-6, err_msg=k)
            np.testing.assert_allclose(feedback[k], want_fb[k], rtol=0, atol=2e-6, err_msg=k)
            groups = placement.replica_groups() if flags[k] else [np.arange(SITES)]
            assert all((np.asarray(got[k])[g] == np.asarray(got[k])[g[0]]).all() for g in groups)
        start = {k: np.asarray(v) for k, v in got.items()}
        fb_np = {k: np.asarray(v, np.float64) for k, v in feedback.items()}
    assert any(np.abs(v).max() > 0 for v in fb_np.values())  # it did drop something, and kept it
    for k in shapes if fmt.gathered else ():  # steps + feedback == what was meant (a re-encoded mean's second
        # rounding is not fed back, so this holds only for the sparse format)
        groups = placement.replica_groups() if flags[k] else [np.arange(SITES)]
        for g in groups:
            got_sum = start[k][g[0]] - first[k][g[0]] + fb_np[k][g].mean(0)
            np.testing.assert_allclose(got_sum, wanted[k][g].mean(0), rtol=0, atol=1e-5, err_msg=k)


@pytest.mark.parametrize(
    "method, name, second_moments",
    [("local_adamw", "bf16", "sent"), ("local_adamw", "fp4", "sent"), ("local_adamw", "int8", "local"),
     ("diloco", "int8", "sent"), ("diloco", "topk2", "sent")],  # (int4: fp4's layout)
)  # fmt: skip
def test_a_low_bit_rounds_cross_site_bytes_are_exactly_the_formula(method, name, second_moments):
    """The compiled round (K local steps and the quantised synchronisation, error feedback on) moves across sites
    exactly the formula's bytes with the wire format (ragged leaves padded to whole chunks; LocalAdamW's second
    moments as bf16 under a block format, or not at all), and the state it returns carries the feedback, non-zero
    after one round; the second moments stay non-negative (a block format would round small ones below zero)."""
    optimizer = optax.adamw(1e-2)
    outer = diloco_outer() if method == "diloco" else None
    _, mesh, graphdef, state = tiny_federation(SITES, 2, optimizer, outer=outer, error_feedback=True)
    if name == "topk2":
        wire = WireFormat(name, 64, "fp32", "stochastic", keep=2)
    else:
        wire = WireFormat(name, 32, "ue8m0", "stochastic")
    round_fn = rounds.make_round(
        graphdef, optimizer, mesh, method=method, outer=outer, wire=wire, error_feedback=True,
        second_moments=second_moments,
    )  # fmt: skip
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 256, size=(2, SITES, 2, 9)), jnp.int32)
    compiled = round_fn.lower(state, tokens).compile()
    text = compiled.as_text()
    assert text is not None  # the CPU backend gives the compiled program's text
    kwargs = dict(sites=SITES, overlap=2, method=method, second_moments=second_moments)
    info = round_bytes(text, None, optimizer, state.train, mesh, wire=wire, **kwargs)
    full = round_bytes(text, None, optimizer, state.train, mesh, **kwargs)
    assert info["measured"] == info["formula"] > 0
    # every value at the wire's bytes but, under a block format, the second moments' (a third of them) at bf16's
    nu_share = 1 / 3 if method == "local_adamw" and second_moments == "sent" and wire.scaled else 0.0
    per_value = (1 - nu_share) * wire.bytes_per_value + nu_share * 2
    if wire.gathered:  # (n - 1) whole messages of 12 bytes per 64 values against 2 (n - 1) / n x 4 bytes per value
        assert 2 * 3 / 4 * 4 / (3 * 12 / 64) * 0.98 < full["formula"] / info["formula"] < 2 * 1 / 2 * 4 / (12 / 64)
    else:
        assert full["formula"] / info["formula"] == pytest.approx(4 / per_value, rel=0.02)
    new, metrics = compiled(state, tokens)
    assert np.isfinite(metrics["loss"]).all()
    assert set(new.feedback) == ({"params"} if method == "diloco" else {"params", "opt_state"})
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(new.feedback)) > 0
    if method == "local_adamw":
        nu = jax.tree.leaves(new.train.opt_state[0].nu)
        assert all(float(x.min()) >= 0 for x in nu)
        up = np.asarray(new.train.opt_state[0].nu["blocks"][0]["ffn"]["up"].get_value())
        assert (up[0] == up[2]).all() == (second_moments == "sent")  # sites 0 and 2 are one replica group
