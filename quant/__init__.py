"""UFP4 (arXiv 2606.20381): 4-bit training with uniform grids, RHT and stochastic rounding; NVFP4/MXFP4 baselines.

quantize (block-scaled fake quantisation to e2m1, e1m2, int4, mxfp4, nvfp4), rht (blockwise random Hadamard
transform), the grid analysis (shrinkage_bias, sqnr, alpha, bucket_entropy). Spec: ../shared/specs/ufp4.md.
"""

from quant import analysis
from quant.analysis import alpha, bucket_entropy, shrinkage_bias, sqnr
from quant.grids import FORMATS, GRIDS, levels, round_to_grid
from quant.hadamard import hadamard, random_signs, rht
from quant.quantize import quantize

__all__ = ["FORMATS", "GRIDS", "alpha", "analysis", "bucket_entropy", "hadamard", "levels", "quantize",
           "random_signs", "rht", "round_to_grid", "shrinkage_bias", "sqnr"]
