"""The `optim` fields MGUP adds to the core optimizer section (merged by experiments/build.py)."""

from __future__ import annotations

from core.config import Field
from optim.mgup import SELECTIONS

__all__ = ["fields"]


def fields() -> dict[str, Field]:
    return {
        "mask_ratio": Field(
            0.5,
            (float,),
            "MGUP: fraction tau of each tensor's coordinates (best update x gradient "
            "alignment) whose step is multiplied by alpha; k = int(tau x size)",
            low=0.0,
            high=1.0,
        ),
        "alpha": Field(
            2.0,
            (float,),
            "MGUP: multiplier of the selected coordinates (paper: 1 / mask_ratio)",
            low=0.0,
            low_open=True,
        ),
        "gamma": Field(
            0.1,
            (float,),
            "MGUP: multiplier of every other coordinate (paper: mask_ratio; never 0)",
            low=0.0,
            low_open=True,
        ),
        "selection": Field(
            "exact",
            (str,),
            "MGUP: 'exact' top-k per tensor or 'approx' (threshold from a sample)",
            choices=tuple(s for s in SELECTIONS if s != "sign"),
        ),
        "momentum": Field(0.95, (float,), "Muon: momentum of the Nesterov SGD buffer", low=0.0, high=1.0),
    }
