"""The `optim` section of an experiment: core's keys (name, schedule, clipping, weight decay), the optimizer
families' keys and MGUP's.

`optim.name` takes the names of experiments.optimizers; b1, b2, eps and momentum default to None, meaning "the family's
default" (experiments.optimizers's families); a value set in the config is used as given, and
experiments.optimizers.hyperparameters(section) resolves them for the chosen optimizer. The keys' descriptions are
generated from the registry's families.
"""

from __future__ import annotations

import dataclasses

from core.config import OptimConfig
from core.fields import field
from experiments import optimizers
from optim.select import SELECTIONS

__all__ = ["OptimizerConfig"]


def _number(value: float) -> str:
    return f"{value:g}".replace("e-0", "e-")


def _family_key_doc(key: str) -> str:
    """What a family key means in each family that reads it, who does not read it, and its defaults."""
    users = [f for f in optimizers.FAMILIES if key in f.defaults]
    others = [f.label for f in optimizers.FAMILIES if key not in f.defaults]
    doc = "; ".join(f"{f.label}: {f.meanings[key]} in {f.bounds[key]}" for f in users)
    if key in ("b1", "b2") and any(f.moments for f in users):
        doc += f" ({', '.join(f.label for f in users if f.moments)}: b1^2 < b2, which bounds Adam's step)"
    doc += f"; not used by {', '.join(others)}" if others else ""
    defaults = ", ".join(f"{f.name} {_number(f.defaults[key])}" for f in users)
    return f"{doc}. None: the family's default ({defaults})"


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(OptimConfig):
    """The section `optim` of an experiment: core's keys (the optimizer's name, schedule, clipping, weight decay)
    and the optimizer families'. b1, b2, eps and momentum default to None: the family's default."""

    name: str = field("adamw", "optimizer", choices=optimizers.NAMES)
    b1: float | None = field(None, _family_key_doc("b1"), low=0.0, high=1.0)
    b2: float | None = field(None, _family_key_doc("b2"), low=0.0, high=1.0)
    eps: float | None = field(None, _family_key_doc("eps"), low=0.0)
    momentum: float | None = field(None, _family_key_doc("momentum"), low=0.0, high=1.0)
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
