"""DES-LOC (moe.desloc): LocalAdamW rounds whose first and second moments synchronise on their own periods.

On 4 virtual sites of the tiny MoE federation: a round that averages a subset of the moment groups averages the
parameters and exactly those moments (over each parameter's replica group) and leaves the others each site's own,
against NumPy on the sites' unsynchronised local steps; the compiled program's cross-site bytes are the formula's
(parameters, plus each averaged group's bytes), so the schedule (3, 6) moves parameters + 1/3 of the first moments +
1/6 of the second per round on average; the streaming round (what the federation runs) compiles one
synchronisation per moment set and picks each round's by the schedule, float32 and int8 with error feedback alike;
the schedule is the definition's, and bad input is named."""

import jax
import numpy as np
import optax
import pytest
from test_rounds import SITES, _group_mean, _local_only, _setup, _tokens

from core import hlo
from core.codec import WireFormat
from moe import desloc, federation, rounds

from helpers import tiny_federation


def test_schedule_follows_the_periods():
    """(3, 6): first moments at synchronisations 3, 6, 9, ... (1-based), second at 6, 12, ...; (1, 1): LocalAdamW."""
    got = [desloc.moments_at(c, (3, 6)) for c in range(12)]
    want = [(), (), ("first",), (), (), ("first", "second")] * 2
    assert got == want
    assert desloc.cycle((3, 6)) == want[:6]
    assert desloc.cycle((1, 1)) == [("first", "second")]
    assert desloc.cycle((2, 3)) == [(), ("first",), ("second",), ("first",), (), ("first", "second")]
    for bad in ((0, 6), (3,), (3, 2.5), "36", (True, 2)):
        with pytest.raises(ValueError, match="moment periods = .*allowed: two positive integers"):
            desloc.moments_at(0, bad)
    with pytest.raises(ValueError, match=r"moments = \('third',\); allowed: a subset of \['first', 'second'\]"):
        rounds.make_round(None, optax.adamw(1e-2), None, method="local_adamw", moments=("third",))
    with pytest.raises(ValueError, match="with method 'spes': SPES keeps the optimizer state on each site"):
        rounds.make_round(None, optax.adamw(1e-2), None, method="spes", moments=("first",))
    with pytest.raises(ValueError, match="with method 'diloco': DiLoCo's inner moments average in float32"):
        rounds.make_round(
            None, optax.adamw(1e-2), None, method="diloco", outer=optax.sgd(1.0), moments=("first",),
            wire=WireFormat("int8", 32),
        )  # fmt: skip
    # DiLoCo's own: no moment averaged; DES-LOC's periods on it: the schedule
    assert desloc.own_cycle("diloco", (1, 1)) == [()] and desloc.own_cycle("diloco", (3, 6)) == want[:6]
    assert desloc.own_cycle("local_adamw", (1, 1)) == [("first", "second")]


@pytest.mark.parametrize(
    "moments", [pytest.param((), marks=pytest.mark.slow), ("first",), pytest.param(("second",), marks=pytest.mark.slow)]
)
def test_a_round_averages_the_parameters_and_only_its_moments(moments):
    """Parameters and the named moments are their replica group's mean; the other moments are each site's own."""
    optimizer = optax.adamw(1e-2)
    placement, mesh, graphdef, state = _setup(2, optimizer)
    tokens = _tokens(2, seed=3)
    manual = _local_only(graphdef, optimizer, state.train, tokens)
    new, _ = rounds.make_round(graphdef, optimizer, mesh, method="local_adamw", moments=moments)(state, tokens)
    flags = jax.tree.leaves(federation.expert_flags(manual.params))
    adam, new_adam = manual.opt_state[0], new.train.opt_state[0]
    # Parameters to 1e-3 of a step (where a gradient is tiny Adam's step is still about lr, so float32 rounding that
    # differs between the round's program and the reference's moves it by that much); moments to 1e-4 of each
    # tensor's largest value (second moments are ~1e-12 here).
    trees: list[tuple[object, object, bool, float | None]] = [(manual.params, new.train.params, True, None)]
    trees += [(adam.mu, new_adam.mu, "first" in moments, 1e-4), (adam.nu, new_adam.nu, "second" in moments, 1e-4)]
    for before_tree, after_tree, averaged, rel in trees:
        for before, after, expert in zip(jax.tree.leaves(before_tree), jax.tree.leaves(after_tree), flags):
            b = np.asarray(before, np.float64)
            mean = _group_mean(b, placement) if expert else np.broadcast_to(b.mean(0), b.shape)
            scale = np.abs(b).max()
            atol = 1e-5 if rel is None else rel * scale
            np.testing.assert_allclose(after, mean if averaged else b, rtol=1e-5, atol=atol)
            if not averaged:  # the sites really differ: keeping them is not the mean by accident
                assert np.abs(b - mean).max() > 1e-2 * scale


def test_each_rounds_bytes_are_the_formula_and_the_schedule_averages_them():
    """Cross-site bytes per device of each compiled variant = parameters (dense over 4 sites, experts over their
    pairs: 2 (n - 1) / n x bytes of a ring all-reduce, as moe.system_model) + the same for each averaged moment
    group (Adam's mu and nu mirror the parameters); the mean over (3, 6)'s cycle is P + U / 3 + V / 6."""
    from moe import system_model

    optimizer = optax.adamw(1e-2)
    _, mesh, graphdef, state = _setup(2, optimizer)
    sizes = {False: 0, True: 0}
    flags = jax.tree.leaves(federation.expert_flags(state.train.params))
    for x, expert in zip(jax.tree.leaves(state.train.params), flags):
        sizes[expert] += x.nbytes // SITES
    params = system_model.sync_bytes(sizes[False], sizes[True], SITES, 2, optimizer="diloco")["total"]
    measured = {}
    for moments in [(), ("first",), ("first", "second")]:
        step = rounds.make_round(graphdef, optimizer, mesh, method="local_adamw", moments=moments)
        text = step.lower(state, _tokens(1)).compile().as_text()
        assert text is not None  # the CPU backend gives the compiled program's text
        measured[moments] = hlo.collective_bytes(text)["bytes_per_device"]
        assert measured[moments] == params * (1 + len(moments)), moments
    cycle = desloc.cycle((3, 6))
    mean = np.mean([measured[m] for m in cycle])
    assert mean == pytest.approx(params * (1 + 1 / 3 + 1 / 6))


def test_the_streaming_round_follows_the_schedule_and_its_bytes_are_the_formula():
    """moe.streaming.StreamingRound with periods (1, 2) compiles one synchronisation per moment set of the cycle
    (first moments only; both), each moving the formula's bytes (moe.stepper.round_bytes, read from the compiled
    program); round 0 leaves the second moments unequal within a replica group, round 1 makes them equal, the
    first moments equal after both. Bad combinations are refused by name."""
    from moe import streaming

    optimizer = optax.adamw(1e-2)
    placement, mesh, graphdef, state = _setup(2, optimizer)
    make = lambda **kw: streaming.StreamingRound(  # noqa: E731
        graphdef, optimizer, mesh, state.train.params, method="local_adamw", **kw
    )
    with pytest.raises(ValueError, match=r"moment periods = \(3, 6\) \(DES-LOC\): LocalAdamW or DiLoCo with delay = 0"):
        make(moment_periods=(3, 6), delay=1, second_moments="local")
    round_ = make(moment_periods=(1, 2))
    assert [(ms, share) for _, ms, share in round_.variants] == [(("first",), 0.5), (("first", "second"), 0.5)]
    texts = round_.compile(state, _tokens(1))
    _assert_variant_bytes(round_, texts, optimizer, state, mesh)

    def spread(tree):  # the largest difference within a replica group, relative to the tensor's scale
        worst = 0.0
        for leaf in jax.tree.leaves(tree):
            x = np.asarray(leaf, np.float64)
            within = max(np.abs(x[g] - x[g].mean(0)).max() for g in placement.replica_groups())
            worst = max(worst, within / np.abs(x).max())
        return worst

    for call, second_equal in ((0, False), (1, True)):
        state, _, _, _ = round_(state, call, _tokens(1, seed=call))
        adam = state.train.opt_state[0]
        assert spread(adam.mu) < 1e-6
        assert (spread(adam.nu) < 1e-6) == second_equal, call


def test_with_fragments_each_fragment_follows_the_schedule_over_its_own_synchronisations():
    """Two fragments (2 layers: block 0 and the rest, block 1) under periods (1, 2): rounds 0 and 1 average fragment
    0 and then 1 with their first moments only, rounds 2 and 3 each with both moments, so a fragment's second moments
    are equal within each replica group right after its second synchronisation (round 2: fragment 0, round 3:
    fragment 1; the local steps part them again) and never before (a schedule by the round number alone would
    average fragment 1's in rounds 1 and 3 and fragment 0's never). Each of the four variants moves the formula's
    bytes, and their shares are a quarter each."""
    from moe import streaming

    optimizer = optax.adamw(1e-2)
    placement, mesh, graphdef, state = tiny_federation(SITES, 2, optimizer, layers=2)
    round_ = streaming.StreamingRound(
        graphdef, optimizer, mesh, state.train.params, method="local_adamw", fragments_count=2, moment_periods=(1, 2)
    )
    assert [share for _, _, share in round_.variants] == [0.25] * 4
    texts = round_.compile(state, _tokens(1))
    _assert_variant_bytes(round_, texts, optimizer, state, mesh)

    def nu_equal(block: int) -> bool:
        nu = state.train.opt_state[0].nu["blocks"][block]
        return equal_within_groups(nu, placement)

    for call, equal in enumerate([(False, False), (False, False), (True, False), (False, True)]):
        state, _, _, _ = round_(state, call, _tokens(1, seed=call))
        assert (nu_equal(0), nu_equal(1)) == equal, call


def test_low_bit_rounds_with_error_feedback_move_the_formulas_bytes():
    """int8 synchronisation with error feedback under (1, 2): each variant's compiled bytes equal the formula (the
    quantised parameters; + the quantised first moments; + the second moments as bf16), and the first moments'
    error feedback is left as it was by a round that does not send them, and moves in one that does. A send is a
    change from the moments' last synchronised value (the state's anchor): after it the group holds one value."""
    from moe import streaming

    optimizer, wire = optax.adamw(1e-2), WireFormat("int8", 32)
    placement, mesh, graphdef, state = tiny_federation(
        SITES, 2, optimizer, error_feedback=True, anchor=streaming.anchor_kind("local_adamw", wire, 1, 0, (2, 1))
    )
    round_ = streaming.StreamingRound(
        graphdef, optimizer, mesh, state.train.params, method="local_adamw", wire=wire, error_feedback=True,
        moment_periods=(2, 1),
    )  # fmt: skip
    assert [ms for _, ms, _ in round_.variants] == [("second",), ("first", "second")]
    texts = round_.compile(state, _tokens(1))
    _assert_variant_bytes(round_, texts, optimizer, state, mesh, wire=wire)
    before = [np.asarray(x) for x in jax.tree.leaves(state.feedback["opt_state"])]
    state, _, _, _ = round_(state, 0, _tokens(1))  # round 0 sends the second moments only
    for a, b in zip(before, jax.tree.leaves(state.feedback["opt_state"])):
        np.testing.assert_array_equal(a, b)
    assert not equal_within_groups(state.train.opt_state[0].mu, placement)
    assert equal_within_groups(state.train.opt_state[0].nu, placement)
    state, _, _, _ = round_(state, 1, _tokens(1, seed=1))  # round 1 sends them: their feedback moves
    after = jax.tree.leaves(state.feedback["opt_state"])
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(before, after))
    # a change from the moments' last synchronised value (the anchor), not from each site's own start: the group
    # ends on one value
    assert equal_within_groups(state.train.opt_state[0].mu, placement)


def test_desloc_on_diloco_averages_the_inner_moments_and_the_outer_state_needs_no_bytes():
    """DiLoCo (AdamW inner, Nesterov outer) under periods (1, 2), against plain DiLoCo from the same state on the
    same tokens: round 0 gives the same parameters, the inner first moments are plain DiLoCo's per-site moments
    averaged over each replica group (float64 NumPy), the second moments are left each site's own; round 1 averages
    both. The outer momentum, never sent, is one value within every replica group after each round (it steps on the
    averaged change). Each variant moves the formula's bytes: the parameters plus the averaged moment groups."""
    from moe import streaming
    from optim import diloco_outer

    optimizer, outer = optax.adamw(1e-2), diloco_outer(0.7, momentum=0.9)
    placement, mesh, graphdef, state = _setup(2, optimizer, outer=outer)
    make = lambda periods: streaming.StreamingRound(  # noqa: E731
        graphdef, optimizer, mesh, state.train.params, method="diloco", outer=outer, moment_periods=periods
    )
    plain, desynced = make((1, 1)), make((1, 2))
    assert [ms for _, ms, _ in plain.variants] == [()]
    assert [ms for _, ms, _ in desynced.variants] == [("first",), ("first", "second")]
    _assert_variant_bytes(plain, plain.compile(state, _tokens(1)), optimizer, state, mesh, method="diloco")
    texts = desynced.compile(state, _tokens(1))
    _assert_variant_bytes(desynced, texts, optimizer, state, mesh, method="diloco")
    copy = jax.tree.map(np.array, state)  # the synchronisation donates its inputs
    want, _, _, _ = plain(state, 0, _tokens(1))
    got, _, _, _ = desynced(jax.tree.map(jax.numpy.asarray, copy), 0, _tokens(1))
    for a, b in zip(jax.tree.leaves(want.train.params), jax.tree.leaves(got.train.params)):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    flags = jax.tree.leaves(federation.expert_flags(want.train.params))
    mine, theirs = want.train.opt_state[0], got.train.opt_state[0]
    for kept, averaged, expert in zip(jax.tree.leaves(mine.mu), jax.tree.leaves(theirs.mu), flags):
        b = np.asarray(kept, np.float64)
        mean = _group_mean(b, placement) if expert else np.broadcast_to(b.mean(0), b.shape)
        np.testing.assert_allclose(averaged, mean, rtol=1e-5, atol=1e-6 * np.abs(b).max())
    for a, b in zip(jax.tree.leaves(mine.nu), jax.tree.leaves(theirs.nu)):
        np.testing.assert_array_equal(a, b)
    assert not equal_within_groups(theirs.nu, placement)
    assert equal_within_groups(got.outer, placement)
    got, _, _, _ = desynced(got, 1, _tokens(1, seed=1))
    assert equal_within_groups(got.train.opt_state[0].nu, placement) and equal_within_groups(got.outer, placement)


def _assert_variant_bytes(round_, texts, optimizer, state, mesh, wire=None, method="local_adamw") -> None:
    """Every compiled synchronisation of a StreamingRound (its fragment, its moment groups) moves exactly
    moe.stepper.round_bytes' formula, and some bytes."""
    from moe import stepper

    for text, (mask, moments, _) in zip(texts, round_.variants):
        info = stepper.round_bytes(
            text, None, optimizer, state.train, mesh, sites=SITES, overlap=2, method=method, wire=wire,
            fragment=mask, moments=moments,
        )  # fmt: skip
        assert info["measured"] == info["formula"] > 0, (mask is None, moments)


def equal_within_groups(tree, placement) -> bool:
    """Every leaf identical across the sites of each replica group (dense leaves across all sites)."""
    for leaf in jax.tree.leaves(tree):
        x = np.asarray(leaf)
        if any(not (x[g] == x[g][0]).all() for g in placement.replica_groups()):
            return False
    return True
