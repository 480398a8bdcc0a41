"""Streaming synchronisation (moe.streaming) on 4 virtual sites (O_e = 2) of a 3-block MoE transformer: fragments
strided by layer, and three rounds of fragments F = 2 behind compute (delay 1, mixing 0.5) against the schedule
written plainly: plain per-site steps, NumPy group means of the round-start state, the delayed correction."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from core import train as train_lib
from core.codec import WireFormat
from moe import federation, streaming
from optim import diloco_outer

from helpers import tiny_federation

SITES = 4


def _setup(optimizer, layers=3):
    return tiny_federation(SITES, 2, optimizer, layers=layers)


def test_fragments_are_strided_by_layer():
    _, _, _, state = _setup(optax.adamw(1e-2))
    params = state.train.params
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    marks = [jax.tree.leaves(f) for f in streaming.fragments(params, 2)]
    for path, first, second in zip(paths, *marks):
        in_block = "'blocks'][" in path
        block = int(path.split("'blocks'][")[1].split("]")[0]) if in_block else None
        assert first == (block is None or block % 2 == 0) and second == (block == 1), path
    assert [sum(m) for m in zip(*marks)] == [1] * len(paths)  # every parameter in exactly one fragment
    with pytest.raises(ValueError, match="fragment 3 would hold no parameter"):
        streaming.fragments(params, 4)


def _group_mean(x, placement, expert):
    x = np.asarray(x, np.float64)
    if not expert:
        return np.broadcast_to(x.mean(0), x.shape)
    out = np.empty_like(x)
    for g in placement.replica_groups():
        out[g] = x[g].mean(0)
    return out


def test_delayed_fragments_follow_the_schedule_written_plainly():
    """Round r's local steps start from S_r; with r >= 1, fragment (r - 1) mod 2 of S_r is averaged behind them
    and the round ends with theta + 0.5 (mean(S_r) - S_r) on that fragment's parameters and first moments; second
    moments stay local."""
    optimizer, mixing = optax.adamw(1e-2), 0.5
    placement, mesh, graphdef, state = _setup(optimizer)
    runner = streaming.StreamingRound(
        graphdef, optimizer, mesh, state.train.params, fragments_count=2, delay=1, mixing=mixing,
        method="local_adamw", second_moments="local",
    )  # fmt: skip
    tokens = [
        jnp.asarray(np.random.default_rng(r).integers(0, 256, size=(2, SITES, 2, 9)), jnp.int32) for r in range(3)
    ]
    runner.compile(state, tokens[0])
    step = jax.jit(train_lib.train_step_fn(graphdef, optimizer))
    masks = [jax.tree.leaves(m) for m in streaming.fragments(state.train.params, 2)]
    flags = jax.tree.leaves(federation.expert_flags(state.train.params))
    reference = jax.tree.map(np.asarray, state.train)
    for r in range(3):
        state, metrics, _, seconds = runner(state, r, tokens[r])
        assert np.isfinite(metrics["loss"]).all() and seconds["sync"] >= 0
        sites = []  # the plain reference: each site's steps one after the other
        for s in range(SITES):
            site = jax.tree.map(lambda x, s=s: jnp.asarray(x[s]), reference)
            for t in tokens[r]:
                site, _ = step(site, t[s])
            sites.append(site)
        local = jax.tree.map(lambda *x: np.stack([np.asarray(v) for v in x]), *sites)
        if r >= 1:
            mask = masks[(r - 1) % 2]

            def corrected(now, before, mask=mask):
                out = []
                for x, b, m, e in zip(jax.tree.leaves(now), jax.tree.leaves(before), mask, flags):
                    out.append(x + mixing * (_group_mean(b, placement, e) - b) if m else x)
                return jax.tree.unflatten(jax.tree.structure(now), out)

            adam = local.opt_state[0]
            mu = corrected(adam.mu, reference.opt_state[0].mu)
            local = local._replace(
                params=corrected(local.params, reference.params), opt_state=(adam._replace(mu=mu), *local.opt_state[1:])
            )
        # (parameters to 1e-4, a hundredth of a step: Adam's step is about lr wherever a gradient is tiny, so float32
        # rounding that differs between the two programs moves such an element by a visible fraction of it)
        for name, want, got, atol in (
            ("params", local.params, state.train.params, 1e-4),
            ("mu", local.opt_state[0].mu, state.train.opt_state[0].mu, 1e-6),
            ("nu", local.opt_state[0].nu, state.train.opt_state[0].nu, 1e-7),
        ):
            for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=atol, err_msg=f"round {r} {name}")
        reference = jax.tree.map(np.asarray, state.train)
    # sites of a block differ (their own last round), yet fragment 0's dense leaves moved towards each other
    emb = np.asarray(state.train.params["embedding"].get_value())
    assert not np.allclose(emb[0], emb[1])


def _bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize("case", ["diloco_blocking", "bf16_feedback_delayed"])
def test_anchored_fragments_follow_the_schedule_written_plainly(case):
    """Fragments F = 2 that synchronise in their anchor's terms (the fragment's value after its last
    synchronisation), three rounds against the schedule written plainly: DiLoCo, blocking (round r's fragment
    r mod 2 takes the outer Nesterov step from its anchor, the other keeps each site's values and momentum), and
    LocalAdamW in bf16 with error feedback, one round late (fragment (r - 1) mod 2 of S_r sent as bf16(S_r - A + e),
    the mean re-rounded to bf16, the round ending with theta + 0.5 (A' - S_r)). The probe sees each site's state
    after its local steps and before any averaging (behind compute, dispatched while the synchronisation runs)."""
    optimizer, lr, mu, mixing = optax.adamw(1e-2), 0.7, 0.9, 0.5
    diloco = case == "diloco_blocking"
    outer = diloco_outer(lr, momentum=mu) if diloco else None
    method, wire = ("diloco", None) if diloco else ("local_adamw", WireFormat("bf16"))
    delay = 0 if diloco else 1
    kind = streaming.anchor_kind(method, wire, 2, delay)
    placement, mesh, graphdef, state = tiny_federation(
        SITES, 2, optimizer, outer=outer, layers=3, error_feedback=not diloco, anchor=kind
    )
    runner = streaming.StreamingRound(
        graphdef, optimizer, mesh, state.train.params, fragments_count=2, delay=delay, mixing=mixing, method=method,
        outer=outer, wire=wire, error_feedback=not diloco, second_moments="local",
    )  # fmt: skip
    tokens = [
        jnp.asarray(np.random.default_rng(r).integers(0, 256, size=(2, SITES, 2, 9)), jnp.int32) for r in range(3)
    ]
    runner.compile(state, tokens[0])
    step = jax.jit(train_lib.train_step_fn(graphdef, optimizer))
    masks = [jax.tree.leaves(m) for m in streaming.fragments(state.train.params, 2)]
    flags = jax.tree.leaves(federation.expert_flags(state.train.params))
    as_np = lambda tree: [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]  # noqa: E731
    reference = jax.tree.map(np.asarray, state.train)
    # the plain schedule's own state, leaf by leaf: anchors, DiLoCo momentum, error feedback (params, mu)
    anchor = {"params": as_np(state.train.params), "mu": as_np(state.train.opt_state[0].mu)}
    momentum = [np.zeros_like(x) for x in anchor["params"]]
    feedback = {name: [np.zeros_like(x) for x in leaves] for name, leaves in anchor.items()}
    for r in range(3):
        state, metrics, probed, _ = runner(state, r, tokens[r], lambda train: jax.tree.map(jnp.copy, train.params))
        assert np.isfinite(metrics["loss"]).all()
        sites = []
        for s in range(SITES):
            site = jax.tree.map(lambda x, s=s: jnp.asarray(x[s]), reference)
            for t in tokens[r]:
                site, _ = step(site, t[s])
            sites.append(site)
        local = jax.tree.map(lambda *x: np.stack([np.asarray(v) for v in x]), *sites)
        params, moments = as_np(local.params), as_np(local.opt_state[0].mu)
        for w, g in zip(params, jax.tree.leaves(probed), strict=True):  # each site's own, before any averaging
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=f"round {r} probe")
        fragment = r % 2 if delay == 0 else None if r == 0 else (r - 1) % 2
        if fragment is not None:
            sent = {"params": as_np(reference.params), "mu": as_np(reference.opt_state[0].mu)}
            for i, (keep, expert) in enumerate(zip(masks[fragment], flags)):
                if not keep:
                    continue
                if diloco:
                    delta = anchor["params"][i] - _group_mean(params[i], placement, expert)
                    momentum[i] = mu * momentum[i] + delta
                    anchor["params"][i] = params[i] = (anchor["params"][i] - lr * (delta + mu * momentum[i])).astype(
                        np.float32
                    )
                    continue
                for name, now in (("params", params), ("mu", moments)):
                    x = sent[name][i] - anchor[name][i] + feedback[name][i]
                    q = _bf16(x)
                    feedback[name][i] = x - q
                    anchor[name][i] = anchor[name][i] + _bf16(_group_mean(q, placement, expert))
                    now[i] = now[i] + mixing * (anchor[name][i] - sent[name][i])
        for name, want, got, atol in (
            ("params", params, state.train.params, 1e-4),
            ("mu", moments, state.train.opt_state[0].mu, 1e-5),
            ("anchor", anchor["params"], state.anchor if diloco else state.anchor[0], 1e-4),
        ):
            for w, g in zip(want, jax.tree.leaves(got), strict=True):
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=atol, err_msg=f"round {r} {name}")
        if diloco:  # the outer momentum of both fragments: the stepped one's new, the other's kept
            for w, g in zip(momentum, jax.tree.leaves(state.outer), strict=True):
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=f"round {r} momentum")
        else:
            for w, g in zip(feedback["params"], jax.tree.leaves(state.feedback["params"]), strict=True):
                np.testing.assert_allclose(g, w, atol=1e-6, err_msg=f"round {r} feedback")
        reference = jax.tree.map(np.asarray, state.train)


def test_the_fragments_bytes_are_their_formula_and_add_up_to_a_whole_synchronisation():
    """Each fragment's compiled synchronisation (F = 2, blocking) moves exactly round_bytes' formula for its
    parameters and moments, and the two add up to the bytes of synchronising everything at once (F = 1)."""
    from moe.stepper import round_bytes

    optimizer = optax.adamw(1e-2)
    _, mesh, graphdef, state = _setup(optimizer, layers=2)
    tokens = jnp.zeros((2, SITES, 2, 9), jnp.int32)
    measured: dict[int, list[float]] = {}
    for count in (1, 2):
        runner = streaming.StreamingRound(
            graphdef, optimizer, mesh, state.train.params, fragments_count=count, method="local_adamw"
        )
        for text, mask in zip(runner.compile(state, tokens), runner.masks):
            got = round_bytes(text, None, optimizer, state.train, mesh, sites=SITES, overlap=2,
                              method="local_adamw", fragment=mask)  # fmt: skip
            assert got["measured"] == got["formula"] > 0
            measured.setdefault(count, []).append(got["measured"])
    assert sum(measured[2]) == measured[1][0] and min(measured[2]) > 0


def test_streaming_refuses_what_it_does_not_run():
    optimizer = optax.adamw(1e-2)
    _, mesh, graphdef, state = _setup(optimizer, layers=2)

    def build(fragments=1, delay=0, mixing=1.0, method="local_adamw"):
        streaming.StreamingRound(
            graphdef, optimizer, mesh, state.train.params, fragments_count=fragments, delay=delay, mixing=mixing,
            method=method,
        )  # fmt: skip

    for kwargs, needle in (
        ({"delay": 1}, "second_moments must be 'local'"),
        ({"delay": 2}, "delay = 2"),
        ({"mixing": 0.0}, "mixing = 0.0"),
    ):
        with pytest.raises(ValueError, match=needle):
            build(**kwargs)
    runner = streaming.StreamingRound(
        graphdef, optimizer, mesh, state.train.params, fragments_count=2, method="local_adamw", wire=WireFormat("int8")
    )
    with pytest.raises(ValueError, match="the state has no anchor; these rounds need"):
        runner.compile(state, jnp.zeros((2, SITES, 2, 9), jnp.int32))
