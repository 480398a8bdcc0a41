"""FoMoE (arXiv 2606.19025): MoE layers, expert parallelism, federated training across sites. See docs/specs."""
