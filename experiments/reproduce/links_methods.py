"""The links reproduction's methods and model (experiments.reproduce.links, experiments.reproduce.links_elastic):
what every method trains, with which experiments.run flags, at which rates' names.

The model is experiments/configs/fomoe.py made smaller (`MODEL`: d_model 64, 2 layers, 8 experts of 128, top-2,
sequences of 128 bytes) so that at 10 Mbit/s the link dominates a round and at 1000 Mbit/s it does not.
"""

from __future__ import annotations

from experiments.reproduce import runs
from moe import system_model as sm

CONFIG = runs.config_path("fomoe")
UNLIMITED_MBIT = 10_000.0
K = 8  # local steps per round (and DDP steps per reported "round")
MODEL = {
    "model.d_model": 64,
    "model.num_layers": 2,
    "model.num_heads": 1,
    "model.num_kv_heads": 1,
    "moe.num_experts": 8,
    "moe.top_k": 2,
    "moe.expert_size": 128,
    "data.seq_len": 128,
    "data.batch_size": 16,
    "optim.warmup_steps": 16,
    "train.eval_batches": 4,
    "sample.num_tokens": 0,
}
_LOCAL_NU = {"second_moments": "local"}
SPARSELOCO = {  # SparseLoCo (arXiv 2508.15706) as its paper runs it: fomoe keys of a full-replica DiLoCo run
    "outer_learning_rate": 1.0, "outer_momentum": 0.0, "sync_format": "topk2", "sync_block": 4096, "sync_keep": 64,
    "sync_scale": "fp32", "error_feedback": True, "feedback_decay": 0.95,
}  # fmt: skip
Method = tuple[str, int | None, int | None, str | None, dict[str, object]]
METHODS: dict[str, Method] = {  # name: (label, mesh.site, fomoe.overlap (None: M), fomoe.outer, other fomoe keys)
    "ddp": ("DDP", 1, None, None, {}),
    "full_local_adamw": ("full replica, LocalAdamW", None, None, "local_adamw", {}),
    "full_diloco": ("full replica, DiLoCo", None, None, "diloco", {}),
    "fomoe_o1": ("FoMoE O_e = 1, LocalAdamW", None, 1, "local_adamw", {}),
    "fomoe_o2": ("FoMoE O_e = 2, LocalAdamW", None, 2, "local_adamw", {}),
    "fomoe_o2_int8_ef": ("FoMoE O_e = 2, int8 + EF", None, 2, "local_adamw", {"sync_format": "int8",
                                                                              "error_feedback": True}),
    "fomoe_o2_fp4": ("FoMoE O_e = 2, fp4", None, 2, "local_adamw", {"sync_format": "fp4"}),
    "fomoe_o2_fp4_ef": ("FoMoE O_e = 2, fp4 + EF", None, 2, "local_adamw", {"sync_format": "fp4",
                                                                            "error_feedback": True}),
    "fomoe_o2_fp4_ef_local": ("FoMoE O_e = 2, fp4 + EF, nu local", None, 2, "local_adamw",
                              {"sync_format": "fp4", "error_feedback": True, **_LOCAL_NU}),
    "fomoe_o2_local": ("FoMoE O_e = 2, nu local", None, 2, "local_adamw", {**_LOCAL_NU}),
    "fomoe_o2_overlap": ("FoMoE O_e = 2, behind compute", None, 2, "local_adamw", {"delay": 1, **_LOCAL_NU}),
    "fomoe_o2_frag2": ("FoMoE O_e = 2, 2 fragments", None, 2, "local_adamw", {"fragments": 2, **_LOCAL_NU}),
    "fomoe_o2_stream": ("FoMoE O_e = 2, 2 fragments behind compute", None, 2, "local_adamw",
                        {"delay": 1, "fragments": 2, **_LOCAL_NU}),
    "fomoe_o2_fp4_ef_overlap": ("FoMoE O_e = 2, fp4 + EF, nu local, behind compute", None, 2, "local_adamw",
                                {"sync_format": "fp4", "error_feedback": True, "delay": 1, **_LOCAL_NU}),
    "fomoe_o2_fp4_ef_frag2": ("FoMoE O_e = 2, fp4 + EF, nu local, 2 fragments", None, 2, "local_adamw",
                              {"sync_format": "fp4", "error_feedback": True, "fragments": 2, **_LOCAL_NU}),
    "fomoe_o2_fp4_ef_stream": ("FoMoE O_e = 2, fp4 + EF, nu local, 2 fragments behind compute", None, 2,
                               "local_adamw", {"sync_format": "fp4", "error_feedback": True, "delay": 1,
                                               "fragments": 2, **_LOCAL_NU}),
    # the peers, as experiments.reproduce.fomoe_peers runs them
    "spes": ("SPES", None, None, "spes", {}),
    "desloc": ("DES-LOC (3, 6), full replica", None, None, "local_adamw", {"moment_periods": "(3, 6)"}),
    "sparseloco": ("SparseLoCo, full replica", None, None, "diloco", SPARSELOCO),
}  # fmt: skip
"""Low-bit synchronisation: UE8M0 scales per 32 values, nearest rounding (LocalAdamW's second moments as bf16
unless "nu local"); "behind compute": fomoe.delay = 1 (moe.streaming)."""
TOLERANCE = 0.20  # the bound on the system model's relative error that the table checks
BLOCKING = {
    "fomoe_o2_overlap": "fomoe_o2_local",
    "fomoe_o2_stream": "fomoe_o2_frag2",
    "fomoe_o2_fp4_ef_overlap": "fomoe_o2_fp4_ef_local",
    "fomoe_o2_fp4_ef_stream": "fomoe_o2_fp4_ef_frag2",
}
"""Each method behind compute: the same synchronisation, blocking (what its overlap is measured against)."""


def flags(method: str, sites: int, steps: int, eval_every: int) -> list[str]:
    """The experiments.run flags of `method` at M = `sites`."""
    _, site, overlap, outer, extra = METHODS[method]
    out = [f"--config.{key}={value}" for key, value in MODEL.items()]
    out += [f"--config.train.eval_every={eval_every}", f"--config.checkpoint.every={steps}"]
    if site == 1:
        return out + ["--config.mesh.site=1", f"--config.mesh.data={sites}", "--config.train.log_every=1"]
    return out + [
        f"--config.mesh.site={sites}",
        "--config.mesh.data=1",
        f"--config.fomoe.overlap={overlap or sites}",
        f"--config.fomoe.local_steps={K}",
        f"--config.fomoe.outer={outer}",
        "--config.fomoe.placement=fixed",
        f"--config.train.log_every={K}",
        *(f"--config.fomoe.{key}={value}" for key, value in extra.items()),
    ]


def rate_name(rate_mbit: float) -> str:
    return "unlimited" if rate_mbit == UNLIMITED_MBIT else f"{rate_mbit:g}mbit"


def model_shape(sites: int) -> sm.ModelShape:
    return sm.ModelShape(
        d_model=MODEL["model.d_model"],
        num_layers=MODEL["model.num_layers"],
        num_experts=MODEL["moe.num_experts"],
        top_k=MODEL["moe.top_k"],
        expert_size=MODEL["moe.expert_size"],
        vocab_size=256,
        seq_len=MODEL["data.seq_len"],
    )
