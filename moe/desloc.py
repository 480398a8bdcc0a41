"""DES-LOC's schedule (Desynced Low Communication, ICLR 2026): rounds that synchronise the parameters and the two
Adam moments on separate periods, for LocalAdamW and for DiLoCo's inner optimizer.

A LocalAdamW round averages the parameters and both moments every K local steps (moe.rounds), so its moments
cost twice the parameters' bytes. DES-LOC averages the first moments only every p_u-th synchronisation and the
second moments every p_v-th (the paper's K_u = 3 K_x, K_v = 6 K_x: p_u = 3, p_v = 6); between those, each site keeps
its own. Per round, on average, it moves the parameters' bytes plus 1 / p_u of the first moments' and 1 / p_v of the
second moments'. Periods (1, 1) are LocalAdamW itself.

DiLoCo averages the parameters' change and steps its outer optimizer on that mean, so the outer state (Nesterov
momentum) is the same on every site by construction and costs no bytes (tests/test_desloc.py checks it stays equal);
its inner AdamW moments are each site's own (DiLoCo's choice, which DES-LOC's paper finds without guarantees and
leaving a joining site no moments to start from). DES-LOC on DiLoCo averages those inner moments every p_u-th /
p_v-th round, in float32. Periods (1, 1) are DiLoCo itself: no moment is averaged (`own_cycle`).

`moments_at(call, periods)` names the moment groups synchronisation `call` (0-based) averages: "first" when
(call + 1) is a multiple of p_u, "second" when it is a multiple of p_v (the first synchronisation of the run averages
none unless a period is 1). The schedule is a pure function of the round, so a resumed run continues it exactly.
"""

from __future__ import annotations

import math

__all__ = ["MOMENTS", "check_periods", "cycle", "moments_at", "own_cycle"]

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


def own_cycle(method: str, periods) -> list[tuple[str, ...]]:
    """The moment groups each synchronisation of outer `method` averages over one cycle: `cycle(periods)`, except
    that DiLoCo's own (periods (1, 1)) averages none, [()], and SPES averages no optimizer state."""
    p_u, p_v = check_periods(periods)
    if method == "spes" or (method == "diloco" and (p_u, p_v) == (1, 1)):
        return [()]
    return cycle((p_u, p_v))
