"""DES-LOC (moe.desloc): LocalAdamW rounds whose first and second moments synchronise on their own periods.

On 4 virtual sites of the tiny MoE federation: a round that averages a subset of the moment groups averages the
parameters and exactly those moments (over each parameter's replica group) and leaves the others each site's own,
against NumPy on the sites' unsynchronised local steps; the compiled program's cross-site bytes are the formula's
(parameters, plus each averaged group's bytes), so the schedule (3, 6) moves parameters + 1/3 of the first moments +
1/6 of the second per round on average; the schedule is the definition's, and bad input is named."""

import jax
import numpy as np
import optax
import pytest
from test_rounds import SITES, _group_mean, _local_only, _setup, _tokens

from core import hlo
from moe import desloc, federation, rounds


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
    with pytest.raises(ValueError, match="only LocalAdamW averages moments"):
        rounds.make_round(None, optax.sgd(1.0), None, method="diloco", outer=optax.sgd(1.0), moments=())


@pytest.mark.parametrize("moments", [(), ("first",), ("second",)])
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
    trees = [(manual.params, new.train.params, True, None)]
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
        measured[moments] = hlo.collective_bytes(text)["bytes_per_device"]
        assert measured[moments] == params * (1 + len(moments)), moments
    cycle = desloc.cycle((3, 6))
    mean = np.mean([measured[m] for m in cycle])
    assert mean == pytest.approx(params * (1 + 1 / 3 + 1 / 6))
