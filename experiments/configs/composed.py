"""The four results in one run: the quickstart's federated MoE (FoMoE: 2 sites, disjoint experts, LocalAdamW rounds)
trained with MGUP-AdamW on UFP4 4-bit GEMMs (experts included), its sample generated through an FP4 KV cache.

    python -m experiments.run --config experiments/configs/composed.py --workdir runs/composed
    python -m experiments.serve --workdir runs/composed --prompt "def " --kv-format fp4

The same model, data, steps and schedule as experiments/configs/quickstart.py; only the optimizer
(`optim.name = "mgup_adamw"`, the paper's tau = 0.5, alpha = 2, gamma = 0.1 on top of the quickstart's AdamW
settings), the matmul recipe (`precision.recipe = "ufp4"`: E1M2 grid, RHT16 on all three GEMMs, stochastic
rounding of dY) and the KV format of the end-of-run sample (`kvcache.format = "fp4"`, UltraQuant) change. Swap any
of them back from the command line (`--config.optim.name=adamw`, `--config.precision.recipe=none`,
`--config.kvcache.format=bf16`) to see what each costs.
"""

from experiments.configs import quickstart


def get_config():
    config = quickstart.get_config()
    config.optim.name = "mgup_adamw"
    config.precision.recipe = "ufp4"
    config.kvcache.format = "fp4"
    return config
