"""UFP4 (arXiv 2606.20381): 4-bit training with uniform grids, RHT and stochastic rounding; NVFP4/MXFP4 baselines.

quantize (block-scaled fake quantisation to e2m1, e1m2, int4, mxfp4, nvfp4; any grid with fp32, e4m3 or ue8m0
scales, "4 over 6" selection), rht (blockwise random Hadamard transform; run_signs: the run's fixed signs from its
seed), recipes (per-GEMM knobs, `recipes.Gemm`; presets NONE, BF16, UFP4, UFP4_INT4, E2M1_BASELINE, NVFP4,
NVFP4_4OVER6, MXFP4, MXFP4_AMD), make_dot_general / make_grouped_matmul (factories: a recipe in, its three
training GEMMs out behind jax.lax.dot_general's / ragged_dot's signature; with rngs= a FreshKeys nnx.Module drawing
a fresh key per call), QuantPrecision (the model's precision slot), the grid analysis (shrinkage_bias, sqnr,
alpha, bucket_entropy). The exact low-bit numerics underneath (grids, rounding, powers of two, E4M3 / UE8M0 scales,
Hadamard) are core.lowbit's. Paper and recipes: docs/ufp4.md.
"""

from quant import analysis, recipes
from quant.analysis import alpha, bucket_entropy, shrinkage_bias, sqnr
from quant.gemm import FreshKeys, make_dot_general
from quant.grids import FORMATS, GRIDS, grid_max, levels, round_to_grid
from quant.grouped import make_grouped_matmul
from quant.hadamard import hadamard, random_signs, rht, run_signs
from quant.precision import QuantPrecision
from quant.quantize import DEFAULT_BLOCK, block_scales, quantize, quantize_tiles

__all__ = [
    "DEFAULT_BLOCK",
    "FORMATS",
    "GRIDS",
    "FreshKeys",
    "QuantPrecision",
    "alpha",
    "analysis",
    "block_scales",
    "bucket_entropy",
    "grid_max",
    "hadamard",
    "levels",
    "make_dot_general",
    "make_grouped_matmul",
    "quantize",
    "quantize_tiles",
    "random_signs",
    "recipes",
    "rht",
    "round_to_grid",
    "run_signs",
    "shrinkage_bias",
    "sqnr",
]
