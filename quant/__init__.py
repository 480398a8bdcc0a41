"""UFP4 (arXiv 2606.20381): 4-bit training with uniform grids, RHT and stochastic rounding; NVFP4/MXFP4 baselines.

quantize (block-scaled fake quantisation to e2m1, e1m2, int4, mxfp4, nvfp4), rht (blockwise random Hadamard
transform), recipes (BF16, UFP4, UFP4_INT4, E2M1_BASELINE, NVFP4, MXFP4), dot_general / grouped_matmul (the three
training GEMMs of a recipe behind jax.lax.dot_general's / ragged_dot's signature), QuantPrecision (the model's
precision slot), the grid analysis (shrinkage_bias, sqnr, alpha, bucket_entropy). Spec: ../shared/specs/ufp4.md.
"""

from quant import analysis, recipes
from quant.analysis import alpha, bucket_entropy, shrinkage_bias, sqnr
from quant.dot_general import dot_general
from quant.grids import FORMATS, GRIDS, levels, round_to_grid
from quant.grouped import grouped_matmul
from quant.hadamard import hadamard, random_signs, rht
from quant.precision import QuantPrecision
from quant.quantize import quantize, quantize_tiles

__all__ = [
    "FORMATS",
    "GRIDS",
    "QuantPrecision",
    "alpha",
    "analysis",
    "bucket_entropy",
    "dot_general",
    "grouped_matmul",
    "hadamard",
    "levels",
    "quantize",
    "quantize_tiles",
    "random_signs",
    "recipes",
    "rht",
    "round_to_grid",
    "shrinkage_bias",
    "sqnr",
]
