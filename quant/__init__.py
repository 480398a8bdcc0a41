"""UFP4 (arXiv 2606.20381): 4-bit training with uniform grids, RHT and stochastic rounding; NVFP4/MXFP4 baselines."""
