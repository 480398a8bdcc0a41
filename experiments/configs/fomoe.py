"""FoMoE at CPU scale: 4 sites train a byte-level sigma-MoE in rounds; each expert lives on 2 of them.

    python -m experiments.run --config experiments/configs/fomoe.py --workdir runs/fomoe
    python -m experiments.launch --processes 4 -- --config experiments/configs/fomoe.py --workdir runs/fomoe

The first command runs the 4 sites as virtual CPU devices of one process; the second runs one process per site
on 127.0.0.1 through jax.distributed (gloo); both give the same numbers. On a cluster, run experiments.run on every
host with --config.mesh.num_processes, --config.mesh.process_id and --config.mesh.coordinator_address.

The paper's model family at its smallest width: head dim 64, expert size 128, a quarter of the experts active
(8 experts, top-2), sigmoid router, tied embedding; d_model 128 and 4 layers so that a run takes minutes on 2 CPU
cores. Federation: M = 4 sites, O_e = 2 (fixed placement: experts 0-3 on sites 0 and 2, 4-7 on sites 1 and 3),
K = 8 local AdamW steps per round, LocalAdamW synchronisation, the partitioned router. Change them from the command
line: --config.fomoe.overlap=1|2|4, --config.fomoe.local_steps=32, --config.fomoe.outer=diloco,
--config.fomoe.routing=skip_token, --config.fomoe.placement=random (regrouped every fomoe.reshuffle_every rounds).
The DDP baseline is the same model with
--config.mesh.site=1 --config.mesh.data=4 (gradients all-reduced every step).
"""

from experiments import schema


def get_config():
    config = schema.default_config()
    config.model.update(d_model=128, num_layers=4, num_heads=2, num_kv_heads=2, d_ff=512)
    config.moe.update(every=1, num_experts=8, top_k=2, expert_size=128, router="sigmoid")
    config.mesh.update(site=4, data=1)
    config.fomoe.update(overlap=2, local_steps=8, outer="local_adamw", routing="partitioned")
    config.data.update(seq_len=256, batch_size=16)
    config.optim.update(learning_rate=5e-3, warmup_steps=40)
    config.train.update(steps=512, eval_every=128, eval_batches=16)
    config.sample.num_tokens = 0
    return config
