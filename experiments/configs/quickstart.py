"""Quickstart: a small byte-level MoE trained by 2 federated sites on the Python standard library's sources, in
minutes on 2 CPU cores.

    python -m experiments.run --config experiments/configs/quickstart.py --workdir runs/quickstart

d_model 128, 4 layers, 2 query heads sharing 1 KV head; every block's FFN is a MoE of 8 experts of size 128 with
a sigmoid top-2 router (FoMoE's router; 1.28M parameters, 0.50M used per token). Federation (FoMoE): 2 sites as
virtual CPU devices, disjoint experts (O_e = 1: experts 0-3 on site 0, 4-7 on site 1, each site routing over its
own 4), 10 local AdamW steps per round, LocalAdamW synchronisation; 700 steps = 70 rounds of 2 x 4 x 256 bytes.
Goal: held-out bits per byte below 3.0 (uniform over bytes is 8). What it reaches, and the same MoE without
federation (`--config.mesh.site=1 --config.mesh.data=-1`) and the dense model (`--config.moe.every=0`, SwiGLU d_ff
384) beside it: docs/cli.md."""

from experiments import schema


def get_config():
    config = schema.default_config()
    config.model.update(d_model=128, num_layers=4, num_heads=2, num_kv_heads=1, d_ff=384)
    config.moe.update(every=1, num_experts=8, top_k=2, expert_size=128, router="sigmoid")
    config.mesh.update(site=2, data=1)  # two federated sites (virtual CPU devices of this process)
    config.fomoe.update(overlap=1, local_steps=10, outer="local_adamw")
    config.data.update(seq_len=256, batch_size=8)
    config.optim.update(learning_rate=5e-3, warmup_steps=40)
    config.train.update(steps=700, eval_every=100, eval_batches=32)
    config.checkpoint.every = 100
    return config
