"""DES-LOC's schedule (Desynced Low Communication, ICLR 2026): LocalAdamW rounds that synchronise the parameters
and the two Adam moments on separate periods.

A LocalAdamW round averages the parameters and both moments every K local steps (moe.rounds), so its moments
cost twice the parameters' bytes. DES-LOC averages the first moments only every p_u-th synchronisation and the
second moments every p_v-th (the paper's K_u = 3 K_x, K_v = 6 K_x: p_u = 3, p_v = 6); between those, each site keeps
its own. Per round, on average, it moves the parameters' bytes plus 1 / p_u of the first moments' and 1 / p_v of the
second moments'. Periods (1, 1) are LocalAdamW itself.

`moments_at(call, periods)` names the moment groups synchronisation `call` (0-based) averages: "first" when
(call + 1) is a multiple of p_u, "second" when it is a multiple of p_v (the first synchronisation of the run averages
none unless a period is 1). The schedule is a pure function of the round, so a resumed run continues it exactly.
"""

from __future__ import annotations

import math

__all__ = ["MOMENTS", "check_periods", "cycle", "moments_at"]

MOMENTS = ("first", "second")  # moe.rounds' moment groups: Adam's first moments (and momenta), its second moments


def check_periods(periods) -> tuple[int, int]:
    """`periods` as (p_u, p_v), positive integers; ValueError naming the value and what is allowed otherwise."""
    try:
        p_u, p_v = periods
    except (TypeError, ValueError):
        raise ValueError(f"moment periods = {periods!r}; allowed: two positive integers (p_u, p_v)") from None
    for p in (p_u, p_v):
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"moment periods = {tuple(periods)!r}; allowed: two positive integers (p_u, p_v)")
    return p_u, p_v


def moments_at(call: int, periods) -> tuple[str, ...]:
    """The moment groups (a sub-tuple of MOMENTS, in its order) synchronisation `call` (0-based) averages."""
    p_u, p_v = check_periods(periods)
    return tuple(name for name, p in zip(MOMENTS, (p_u, p_v)) if (call + 1) % p == 0)


def cycle(periods) -> list[tuple[str, ...]]:
    """`moments_at` over one whole cycle, lcm(p_u, p_v) synchronisations: the schedule repeats it."""
    p_u, p_v = check_periods(periods)
    return [moments_at(c, (p_u, p_v)) for c in range(math.lcm(p_u, p_v))]
