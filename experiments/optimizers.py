"""The optimizers a config can name: `optim.name` -> its family and its builder. The one table that
experiments.build (build_optimizer), the config schema (experiments.schema_optim: the allowed names, the family keys'
defaults), docs/configuration.md (experiments.config_doc) and the tests read.

A family says which of the family keys (`FAMILY_KEYS`: optim.b1, b2, eps, momentum) its optimizers read, their
defaults when the config leaves them None, what each means and the values it allows (`Bound`; AdamW's moments also
b1^2 < b2, `check_moments`); a key the family does not list must stay unset. `check(section)` is the one validation
of an optimizer section: those, and a peak learning rate whose decoupled weight decay keeps every weight's sign
(learning_rate x weight_decay < 1).
A builder turns a validated config into the optimizer, without gradient clipping (experiments.build adds it):

    build(learning_rate, section, hyper, decay_mask) -> optax.GradientTransformation

    learning_rate  a number or an optax schedule (the config's warm-up + decay)
    section        the `optim` config section (attributes weight_decay, mask_ratio, alpha, gamma, selection, ...)
    hyper          the family keys the optimizer reads, resolved by `hyperparameters(section)`
    decay_mask     which leaves weight decay applies to (optax.add_decayed_weights' mask: a tree or a callable)

Adding an optimizer: its transform in optim/, one entry in `OPTIMIZERS` (and, for a new family, one `Family`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import optax

from core.fields import ConfigError
from optim import alias, muon

__all__ = [
    "ADAMW",
    "FAMILIES",
    "FAMILY_KEYS",
    "LION",
    "MUON",
    "NAMES",
    "OPTIMIZERS",
    "Bound",
    "Builder",
    "Family",
    "Optimizer",
    "check",
    "check_moments",
    "hyperparameters",
    "lookup",
]

FAMILY_KEYS = ("b1", "b2", "eps", "momentum")
"""The `optim` keys whose default depends on the optimizer's family (they default to None in the config)."""

Builder = Callable[[optax.ScalarOrSchedule, Any, Mapping[str, float], Any], optax.GradientTransformation]
"""(learning_rate, optim section, resolved family keys, weight-decay mask) -> the optimizer (see the module)."""


@dataclasses.dataclass(frozen=True)
class Bound:
    """The interval a family key must lie in, [low, high] with either end open, and why (said when it is refused)."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    why: str = ""

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        high = "inf" if self.high == float("inf") else f"{self.high:g}"
        return f"{'(' if self.low_open else '['}{self.low:g}, {high}{')' if self.high_open else ']'}"


_DECAY = Bound(0.0, 1.0, high_open=True, why="a decay of 1 never updates the average: it stays at its first value, 0")
_MOMENTUM = Bound(
    0.0, 1.0, high_open=True, why="at 1 the buffer (mu buf + G) adds up every gradient so far and forgets none"
)
_ADAM_B1 = Bound(
    0.0, 1.0, high_open=True, why="at 1 the first moment stays 0 and its bias correction divides by 1 - 1^t = 0"
)
_ADAM_B2 = Bound(
    0.0,
    1.0,
    low_open=True,
    high_open=True,
    why="at 0 the second moment is the last gradient's square alone (a step m / |g| without bound), at 1 it stays 0",
)
_ADAM_EPS = Bound(
    0.0, float("inf"), low_open=True, high_open=True, why="at 0 a coordinate whose gradients were all 0 divides 0 by 0"
)


@dataclasses.dataclass(frozen=True)
class Family:
    """A family of optimizers sharing the meaning, defaults and allowed values of the family keys.

    name: as docs and errors call it; label: its name in prose; defaults: each family key it reads -> the value used
    when the config leaves it None; meanings: each of those keys -> what it is in this family; source: where the
    defaults come from; bounds: each of those keys -> the values it allows (`Bound`); moments: whether b1 and b2 are
    Adam's moment decays, which must satisfy b1^2 < b2 (`check_moments`). Raises ValueError if `defaults`,
    `meanings` and `bounds` name different keys, a key outside FAMILY_KEYS, or a default outside its bound."""

    name: str
    label: str
    defaults: Mapping[str, float]
    meanings: Mapping[str, str]
    source: str
    bounds: Mapping[str, Bound]
    moments: bool = False

    def __post_init__(self):
        if not set(self.defaults) == set(self.meanings) == set(self.bounds) or not set(self.defaults) <= set(
            FAMILY_KEYS
        ):
            raise ValueError(
                f"Family {self.name!r}: defaults {sorted(self.defaults)}, meanings {sorted(self.meanings)} and bounds "
                f"{sorted(self.bounds)} must name the same keys, out of {list(FAMILY_KEYS)}."
            )
        bad = [k for k, v in self.defaults.items() if not self.bounds[k].holds(v)]
        if bad:
            raise ValueError(f"Family {self.name!r}: the defaults of {bad} lie outside their bounds.")


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """One entry of the table: its family (which family keys it reads, their defaults) and its builder."""

    family: Family
    build: Builder


ADAMW = Family(
    "adamw",
    "AdamW",
    {"b1": 0.9, "b2": 0.95, "eps": 1e-8},
    {"b1": "first-moment decay", "b2": "second-moment decay", "eps": "denominator epsilon"},
    "the quickstart's pre-training betas (0.9, 0.95) and eps 1e-8",
    {"b1": _ADAM_B1, "b2": _ADAM_B2, "eps": _ADAM_EPS},
    moments=True,
)
LION = Family(
    "lion",
    "Lion",
    {"b1": 0.9, "b2": 0.99},
    {"b1": "interpolation beta of the update sign", "b2": "momentum decay"},
    "the Lion paper's (Chen et al., arXiv 2302.06675) and the MGUP reference's MGUP_Lion.py betas",
    {"b1": Bound(0.0, 1.0), "b2": _DECAY},
)
MUON = Family(
    "muon",
    "Muon",
    {"b1": 0.95, "b2": 0.95, "eps": 1e-8, "momentum": 0.95},
    {
        "b1": "the AdamW backup's b1",
        "b2": "the AdamW backup's b2",
        "eps": "the AdamW backup's denominator epsilon",
        "momentum": "momentum of the Nesterov SGD buffer",
    },
    "the MGUP reference's MGUP_Muon.py / Moonlight: AdamW backup betas (0.95, 0.95), eps 1e-8; momentum 0.95",
    {"b1": _ADAM_B1, "b2": _ADAM_B2, "eps": _ADAM_EPS, "momentum": _MOMENTUM},
    moments=True,
)
FAMILIES: tuple[Family, ...] = (ADAMW, LION, MUON)
"""Every family, in the order docs list them."""


OPTIMIZERS: dict[str, Optimizer] = {
    "adamw": Optimizer(
        ADAMW,
        lambda lr, o, h, mask: optax.adamw(
            lr, b1=h["b1"], b2=h["b2"], eps=h["eps"], weight_decay=o.weight_decay, mask=mask
        ),
    ),
    "cautious_adamw": Optimizer(
        ADAMW,
        lambda lr, o, h, mask: alias.cautious_adamw(
            lr, b1=h["b1"], b2=h["b2"], eps=h["eps"], weight_decay=o.weight_decay, weight_decay_mask=mask
        ),
    ),
    "mgup_adamw": Optimizer(
        ADAMW,
        lambda lr, o, h, mask: alias.mgup_adamw(
            lr,
            b1=h["b1"],
            b2=h["b2"],
            eps=h["eps"],
            weight_decay=o.weight_decay,
            mask_ratio=o.mask_ratio,
            alpha=o.alpha,
            gamma=o.gamma,
            selection=o.selection,
            weight_decay_mask=mask,
        ),
    ),
    "cautious_mgup_adamw": Optimizer(
        ADAMW,
        lambda lr, o, h, mask: alias.cautious_mgup_adamw(
            lr,
            b1=h["b1"],
            b2=h["b2"],
            eps=h["eps"],
            weight_decay=o.weight_decay,
            alpha=o.alpha,
            gamma=o.gamma,
            weight_decay_mask=mask,
        ),
    ),
    "lion": Optimizer(
        LION, lambda lr, o, h, mask: optax.lion(lr, b1=h["b1"], b2=h["b2"], weight_decay=o.weight_decay, mask=mask)
    ),
    "mgup_lion": Optimizer(
        LION,
        lambda lr, o, h, mask: alias.mgup_lion(
            lr,
            b1=h["b1"],
            b2=h["b2"],
            weight_decay=o.weight_decay,
            mask_ratio=o.mask_ratio,
            alpha=o.alpha,
            gamma=o.gamma,
            selection=o.selection,
            weight_decay_mask=mask,
        ),
    ),
    "muon": Optimizer(
        MUON,
        lambda lr, o, h, mask: muon.mgup_muon(
            lr,
            weight_decay=o.weight_decay,
            momentum=h["momentum"],
            adam_b1=h["b1"],
            adam_b2=h["b2"],
            adam_eps=h["eps"],
            mgup=False,
            weight_decay_mask=mask,
        ),
    ),
    "mgup_muon": Optimizer(
        MUON,
        lambda lr, o, h, mask: muon.mgup_muon(
            lr,
            weight_decay=o.weight_decay,
            momentum=h["momentum"],
            adam_b1=h["b1"],
            adam_b2=h["b2"],
            adam_eps=h["eps"],
            mask_ratio=o.mask_ratio,
            alpha=o.alpha,
            gamma=o.gamma,
            selection=o.selection,
            weight_decay_mask=mask,
        ),
    ),
}
"""`optim.name` -> its entry: the families' base optimizers (optax's AdamW and Lion, Muon) and their MGUP and
Cautious variants (optim/alias.py, optim/muon.py; docs/mgup.md)."""

NAMES: tuple[str, ...] = tuple(OPTIMIZERS)
"""The allowed values of `optim.name`, in the table's order."""


def lookup(name: str) -> Optimizer:
    """The entry of `name`; raises ConfigError naming `optim.name`, the value and the allowed names if none."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"config key 'optim.name' = {name!r} is not an optimizer; allowed: {list(NAMES)}.")
    return OPTIMIZERS[name]


def hyperparameters(section: Mapping[str, Any]) -> dict[str, float]:
    """The family keys the optimizer `section["name"]` reads: the config's value where it is set (not None), its
    family's default elsewhere, as floats. Raises ConfigError naming the key if the config sets a key the family does
    not read (e.g. `optim.eps` with Lion) or a value outside the family's bound (`Family.bounds`: AdamW's b2 = 0, a
    momentum of 1, eps = 0), if AdamW's moments break b1^2 < b2 (`check_moments`), and naming `optim.name` for an
    unknown optimizer."""
    name = section["name"]
    family = lookup(name).family
    out = {}
    for key in FAMILY_KEYS:
        value = section.get(key)
        if key not in family.defaults:
            if value is not None:
                raise ConfigError(
                    f"config key 'optim.{key}' = {value!r} is not used by optim.name = {name!r} ({family.name} "
                    f"family; it uses {', '.join(f'optim.{k}' for k in family.defaults)}); leave it unset (None)."
                )
            continue
        out[key] = family.defaults[key] if value is None else float(value)
        bound = family.bounds[key]
        if not bound.holds(out[key]):
            shown = "None, the family's default" if value is None else repr(value)
            raise ConfigError(
                f"config key 'optim.{key}' = {shown} ({family.label}'s {family.meanings[key]}) is outside "
                f"{bound} for optim.name = {name!r}: {bound.why}; allowed: {bound}."
            )
    if family.moments:
        check_moments(out["b1"], out["b2"], name=name)
    return out


def check_moments(b1: float, b2: float, *, name: str = "adamw") -> None:
    """Raises ConfigError unless Adam's moment decays satisfy b1^2 < b2, the condition under which its step is bounded.

    With m = (1 - b1) sum_k b1^k g_{t-k} and v = (1 - b2) sum_k b2^k g_{t-k}^2, Cauchy-Schwarz gives, whatever the
    gradients, |m| / sqrt(v) <= (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2)) when b1^2 < b2 (1.16 at 0.9 / 0.95; the
    bias corrections change it by a factor that tends to 1). With b1^2 >= b2 the sum diverges: one large gradient
    followed by small ones makes the step of that coordinate grow without bound (b2 = 0 with b1 = 0.9: a held-out loss
    of thousands of nats after a few steps, with nothing non-finite to stop it)."""
    if b1 * b1 >= b2:
        raise ConfigError(
            f"config keys 'optim.b1' = {b1:g} and 'optim.b2' = {b2:g} (optim.name = {name!r}): Adam's step "
            f"m / sqrt(v) is bounded only when b1^2 < b2, and b1^2 = {b1 * b1:g}; with b2 <= b1^2 a large gradient "
            f"followed by small ones makes it grow without bound. Allowed: b2 > b1^2 = {b1 * b1:g}, or b1 < sqrt(b2) "
            f"= {b2**0.5:.4g}."
        )


def check(section: Mapping[str, Any]) -> dict[str, float]:
    """The one validation of an `optim` section beyond each key's own range: the family keys (`hyperparameters`, which
    it returns) and the decoupled weight decay, which multiplies every decayed weight by 1 - lr x weight_decay per
    step (optax.add_decayed_weights, then the learning rate): at the peak learning rate that factor must stay above 0,
    else weights shrink to 0 or flip sign every step. Raises ConfigError naming the keys, their values and what is
    allowed."""
    hyper = hyperparameters(section)
    lr, wd = float(section["learning_rate"]), float(section["weight_decay"])
    if lr * wd >= 1:
        raise ConfigError(
            f"config keys 'optim.learning_rate' = {lr:g} and 'optim.weight_decay' = {wd:g}: decoupled weight decay "
            f"multiplies every decayed weight by 1 - learning_rate x weight_decay = {1 - lr * wd:g} per step at the "
            f"peak, which zeroes or flips the weights. Allowed: learning_rate x weight_decay < 1 (weight_decay < "
            f"{1 / lr:g} at this learning rate)."
        )
    return hyper
