"""The `precision` config section (merged by experiments/build.py): which quant recipe the model trains with."""

from __future__ import annotations

from core.config import Field
from quant.recipes import RECIPES

__all__ = ["section"]


def section() -> dict[str, Field]:
    return {
        "recipe": Field("bf16", (str,), "matmul recipe of every projection and expert (quant/recipes.py): bf16 = "
                        "unquantised; ufp4 / ufp4_int4 (uniform grid, RHT on all GEMMs), e2m1_baseline, nvfp4, mxfp4",
                        choices=tuple(RECIPES)),
        "last_blocks_high_precision": Field(0, (int,), "keep the last n transformer blocks unquantised", low=0),
        "fresh_signs": Field(False, (bool,), "draw the RHT signs per step and layer (default: fixed for the run)"),
    }
