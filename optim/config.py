"""The `optim` section of an experiment (core's keys and the optimizer families') and each family's defaults.

b1, b2, eps and momentum default to None, meaning "the family's default" (`FAMILY_DEFAULTS`); a value set in the
config is used as given. `hyperparameters(section)` resolves them for the chosen optimizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from core.config import ConfigError, OptimConfig, field
from optim.select import SELECTIONS

__all__ = ["FAMILIES", "FAMILY_DEFAULTS", "FAMILY_SOURCES", "OptimizerConfig", "hyperparameters"]

FAMILIES: dict[str, str] = {
    "adamw": "adamw",
    "cautious_adamw": "adamw",
    "mgup_adamw": "adamw",
    "cautious_mgup_adamw": "adamw",
    "lion": "lion",
    "mgup_lion": "lion",
    "muon": "muon",
    "mgup_muon": "muon",
}
"""Optimizer name (`optim.name`) -> its family, whose defaults it takes."""

FAMILY_DEFAULTS: dict[str, dict[str, float]] = {
    "adamw": {"b1": 0.9, "b2": 0.95, "eps": 1e-8},
    "lion": {"b1": 0.9, "b2": 0.99},
    "muon": {"b1": 0.95, "b2": 0.95, "eps": 1e-8, "momentum": 0.95},
}
"""Family -> the value of each family key it uses when the config leaves the key unset. A key a family does not
list (Lion's eps, momentum outside Muon) is not used by it, and setting it is an error."""

FAMILY_SOURCES: dict[str, str] = {
    "adamw": "the pre-training betas (0.9, 0.95) and eps 1e-8 the quickstart has always trained with",
    "lion": "the Lion paper's (Chen et al., arXiv 2302.06675) and the MGUP reference's MGUP_Lion.py betas",
    "muon": "the MGUP reference's MGUP_Muon.py / Moonlight: AdamW backup betas (0.95, 0.95), eps 1e-8; momentum 0.95",
}
"""Family -> where its defaults come from (for docs/configuration.md)."""

_FAMILY_KEYS = ("b1", "b2", "eps", "momentum")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(OptimConfig):
    """The section `optim` of an experiment: core's keys (the optimizer's name, schedule, clipping, weight decay)
    and the optimizer families'. b1, b2, eps and momentum default to None: the family's default."""

    b1: float | None = field(
        None,
        "AdamW: first-moment decay; Lion: interpolation beta of the update sign; Muon: the AdamW backup's b1. "
        "None: the family's default (adamw 0.9, lion 0.9, muon 0.95)",
        low=0.0,
        high=1.0,
    )
    b2: float | None = field(
        None,
        "AdamW: second-moment decay; Lion: momentum decay; Muon: the AdamW backup's b2. None: the family's "
        "default (adamw 0.95, lion 0.99, muon 0.95)",
        low=0.0,
        high=1.0,
    )
    eps: float | None = field(
        None,
        "AdamW and Muon's AdamW backup: denominator epsilon; not used by Lion. None: the family's default "
        "(adamw 1e-8, muon 1e-8)",
        low=0.0,
    )
    momentum: float | None = field(
        None, "Muon only: momentum of the Nesterov SGD buffer. None: the family's default (0.95)", low=0.0, high=1.0
    )
    mask_ratio: float = field(
        0.5,
        "MGUP: fraction tau of each tensor's coordinates (best update x gradient alignment) whose step is "
        "multiplied by alpha; k = int(tau x size)",
        low=0.0,
        high=1.0,
    )
    alpha: float = field(
        2.0, "MGUP: multiplier of the selected coordinates (paper: 1 / mask_ratio)", low=0.0, low_open=True
    )
    gamma: float = field(
        0.1, "MGUP: multiplier of every other coordinate (paper: mask_ratio; never 0)", low=0.0, low_open=True
    )
    selection: str = field(
        "exact",
        "MGUP: 'exact' top-k per tensor or 'approx' (threshold from a sample)",
        choices=tuple(s for s in SELECTIONS if s != "sign"),
    )


def hyperparameters(section: Mapping[str, Any]) -> dict[str, float]:
    """The family keys (b1, b2, eps, momentum) the optimizer `section["name"]` uses: the config's value where it is
    set (not None), its family's default elsewhere. Raises ConfigError naming the key if the config sets a key the
    family does not use (e.g. `optim.eps` with Lion), or if the name has no family."""
    name = section["name"]
    if name not in FAMILIES:
        raise ConfigError(f"config key 'optim.name' = {name!r} has no optimizer family; known: {sorted(FAMILIES)}.")
    family = FAMILIES[name]
    defaults = FAMILY_DEFAULTS[family]
    out = {}
    for key in _FAMILY_KEYS:
        value = section.get(key)
        if key not in defaults:
            if value is not None:
                raise ConfigError(
                    f"config key 'optim.{key}' = {value!r} is not used by optim.name = {name!r} ({family} family; "
                    f"it uses {', '.join(f'optim.{k}' for k in defaults)}); leave it unset (None)."
                )
            continue
        out[key] = defaults[key] if value is None else float(value)
    return out
