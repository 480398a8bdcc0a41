"""The optimizers a config can name: `optim.name` -> its family and its builder. The one table that
experiments.build (build_optimizer), the config schema (optim.config: the allowed names, the family keys' defaults),
docs/configuration.md (experiments.config_doc) and the tests read.

A family says which of the family keys (`FAMILY_KEYS`: optim.b1, b2, eps, momentum) its optimizers read, their
defaults when the config leaves them None, and what each means; a key the family does not list must stay unset.
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

from core.config import ConfigError
from optim import alias, muon

__all__ = [
    "ADAMW",
    "FAMILIES",
    "FAMILY_KEYS",
    "LION",
    "MUON",
    "NAMES",
    "OPTIMIZERS",
    "Builder",
    "Family",
    "Optimizer",
    "hyperparameters",
    "lookup",
]

FAMILY_KEYS = ("b1", "b2", "eps", "momentum")
"""The `optim` keys whose default depends on the optimizer's family (they default to None in the config)."""

Builder = Callable[[optax.ScalarOrSchedule, Any, Mapping[str, float], Any], optax.GradientTransformation]
"""(learning_rate, optim section, resolved family keys, weight-decay mask) -> the optimizer (see the module)."""


@dataclasses.dataclass(frozen=True)
class Family:
    """A family of optimizers sharing the meaning and defaults of the family keys.

    name: as docs and errors call it; label: its name in prose; defaults: each family key it reads -> the value used
    when the config leaves it None; meanings: each of those keys -> what it is in this family; source: where the
    defaults come from. Raises ValueError if `defaults` and `meanings` name different keys, or a key outside
    FAMILY_KEYS."""

    name: str
    label: str
    defaults: Mapping[str, float]
    meanings: Mapping[str, str]
    source: str

    def __post_init__(self):
        if set(self.defaults) != set(self.meanings) or not set(self.defaults) <= set(FAMILY_KEYS):
            raise ValueError(
                f"Family {self.name!r}: defaults {sorted(self.defaults)} and meanings {sorted(self.meanings)} must "
                f"name the same keys, out of {list(FAMILY_KEYS)}."
            )


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
)
LION = Family(
    "lion",
    "Lion",
    {"b1": 0.9, "b2": 0.99},
    {"b1": "interpolation beta of the update sign", "b2": "momentum decay"},
    "the Lion paper's (Chen et al., arXiv 2302.06675) and the MGUP reference's MGUP_Lion.py betas",
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
    not read (e.g. `optim.eps` with Lion), and naming `optim.name` for an unknown optimizer."""
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
    return out
