"""The `precision` config section (merged by experiments/build.py): which quant recipe the model trains with."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from core.config import Compat, field
from quant.recipes import RECIPES, Recipe

__all__ = ["RHT_SCOPES", "PrecisionConfig", "apply"]

RHT_SCOPES = ("recipe", "none", "fprop", "dgrad", "wgrad", "fprop+dgrad", "fprop+wgrad", "dgrad+wgrad", "all")


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """The section `precision`: the quant recipe every projection and expert trains with (quant.recipes)."""

    compat: ClassVar[Compat] = True

    recipe: str = field(
        "none",
        "matmul recipe of every projection and expert (quant/recipes.py): none = unquantised, the GEMMs in the "
        "model's dtype; bf16 = operands rounded to bfloat16, float32 accumulation; ufp4 / ufp4_int4 (uniform grid, "
        "RHT on all GEMMs), e2m1_baseline, nvfp4, mxfp4",
        choices=tuple(RECIPES),
    )
    last_blocks_high_precision: int = field(0, "keep the last n transformer blocks unquantised", low=0)
    fresh_signs: bool = field(False, "draw the RHT signs per step and layer (default: fixed for the run)")
    rht: str = field(
        "recipe", "ablation: which GEMMs rotate their operands (RHT16), overriding the recipe", choices=RHT_SCOPES
    )
    stochastic_dy: str = field(
        "recipe",
        "ablation: stochastic rounding of dy in dgrad and wgrad, overriding the recipe",
        choices=("recipe", "on", "off"),
    )


def apply(recipe: Recipe, precision: PrecisionConfig) -> Recipe:
    """The recipe with the `precision` section's overrides applied."""
    gemms = {name: getattr(recipe, name) for name in ("fprop", "dgrad", "wgrad")}
    if precision.rht != "recipe":
        scope = {"none": (), "all": tuple(gemms)}.get(precision.rht, tuple(precision.rht.split("+")))
        gemms = {name: dataclasses.replace(g, rht=name in scope) for name, g in gemms.items()}
    if precision.stochastic_dy != "recipe":
        gemms = {
            name: dataclasses.replace(g, stochastic_dy=name != "fprop" and precision.stochastic_dy == "on")
            for name, g in gemms.items()
        }
    return dataclasses.replace(
        recipe,
        **gemms,
        last_blocks_high_precision=precision.last_blocks_high_precision,
        fresh_signs=precision.fresh_signs,
    )
