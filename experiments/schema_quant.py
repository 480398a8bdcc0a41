"""The `precision` section of an experiment config: which quant recipe (quant.recipes) the model trains with, and its
ablation overrides mapped onto the library's `Recipe` (`apply`). experiments/build.py builds the model's precision
slot from it; the quant package itself takes a `Recipe` and reads no config."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from core.fields import Compat, field
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
        "RHT on all GEMMs), e2m1_baseline, nvfp4 (NVIDIA's), nvfp4_4over6, mxfp4 (OCP), mxfp4_amd (AMD's), "
        "gridgames (Grid Games), nvfp4_ms_eden (MS-EDEN on dy)",
        choices=tuple(RECIPES),
    )
    last_blocks_high_precision: int = field(0, "keep the last n transformer blocks unquantised", low=0)
    fresh_signs: bool = field(
        False,
        "draw the RHT signs per step and layer (default: the recipe's own: fixed for the run, except "
        "nvfp4_ms_eden's, which are fresh: MS-EDEN is unbiased only over fresh rotations)",
    )
    rht: str = field(
        "recipe", "ablation: which GEMMs rotate their operands (RHT16), overriding the recipe", choices=RHT_SCOPES
    )
    stochastic_dy: str = field(
        "recipe",
        "ablation: stochastic rounding of dy in dgrad and wgrad, overriding the recipe",
        choices=("recipe", "on", "off"),
    )


def apply(recipe: Recipe, precision: PrecisionConfig) -> Recipe:
    """The recipe with the `precision` section's overrides applied to its 4-bit GEMMs. ValueError naming the field
    when an override has nothing to act on (a recipe without 4-bit GEMMs) or makes a GEMM the recipes refuse."""
    gemms = {name: getattr(recipe, name) for name in ("fprop", "dgrad", "wgrad")}
    overrides = {
        name: getattr(precision, name) for name in ("rht", "stochastic_dy") if getattr(precision, name) != "recipe"
    }
    if overrides and all(g.fmt is None for g in gemms.values()):
        raise ValueError(
            f"precision.{next(iter(overrides))} = {next(iter(overrides.values()))!r} with precision.recipe = "
            f"{recipe.name!r}: that recipe has no 4-bit GEMM to change; use a 4-bit recipe or 'recipe'."
        )
    for field_name, value in overrides.items():
        change: dict[str, dict[str, bool | str]]
        if field_name == "rht":
            scope = {"none": (), "all": tuple(gemms)}.get(value, tuple(value.split("+")))
            change = {name: {"rht": name in scope} for name in gemms}
        else:
            rounding = {name: "stochastic" if name != "fprop" and value == "on" else "nearest" for name in gemms}
            change = {name: {"stochastic_dy": r != "nearest", "dy_rounding": r} for name, r in rounding.items()}
        try:
            gemms = {n: g if g.fmt is None else dataclasses.replace(g, **change[n]) for n, g in gemms.items()}
        except ValueError as e:
            raise ValueError(f"precision.{field_name} = {value!r} with recipe {recipe.name!r}: {e}") from None
    return dataclasses.replace(
        recipe,
        **gemms,
        last_blocks_high_precision=precision.last_blocks_high_precision,
        fresh_signs=precision.fresh_signs or recipe.fresh_signs,
    )
