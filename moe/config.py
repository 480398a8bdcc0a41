"""The config section `moe`: declared fields and the checks that involve other sections."""

from __future__ import annotations

import ml_collections

from core.config import ConfigError, Field
from moe.grouped_matmul import IMPLEMENTATIONS
from moe.layer import DISPATCH
from moe.router import ROUTERS

__all__ = ["section", "check"]


def section() -> dict[str, Field]:
    """The `moe` section: which layers are MoE and how they route and dispatch."""
    return {
        "every": Field(0, (int,), "MoE FFN in every n-th block (layer i is MoE iff (i + 1) % every == 0; 1 = all "
                       "blocks, 2 = blocks 1, 3, ...); 0 = a dense model", low=0),
        "num_experts": Field(8, (int,), "experts per MoE layer", low=1),
        "top_k": Field(2, (int,), "experts chosen per token", low=1),
        "expert_size": Field(128, (int,), "hidden width of each expert (up: d_model -> expert_size, SiLU, down)",
                             low=1),
        "shared_expert_size": Field(0, (int,), "hidden width of an always-on shared expert (0 = none)", low=0),
        "router": Field("sigmoid", (str,), "'sigmoid' (sigma-MoE: gates sigmoid(logit), not renormalised) or "
                        "'softmax' (gates = softmax probabilities of the chosen experts)", choices=ROUTERS),
        "normalize_gates": Field(False, (bool,), "softmax router: divide the k gates by their sum (Mixtral)"),
        "dispatch": Field("dropless", (str,), "'dropless' (sort + grouped matmul; all-to-all when experts are "
                          "sharded) or 'capacity' (GShard einsum, drops assignments past capacity)",
                          choices=DISPATCH),
        "capacity_factor": Field(1.25, (float,), "capacity dispatch: slots per expert per sequence = "
                                 "ceil(factor x seq_len x top_k / num_experts)", low=0.0, low_open=True),
        "load_balance_weight": Field(0.01, (float,), "weight of the Switch load-balance loss", low=0.0),
        "z_loss_weight": Field(0.001, (float,), "weight of the router z-loss", low=0.0),
        "grouped_matmul": Field("auto", (str,), "dropless expert product: 'auto' (ragged_dot on GPU/TPU, "
                                "windowed loop on CPU), 'ragged_dot', 'windowed'",
                                choices=IMPLEMENTATIONS),
    }


def check(config: ml_collections.ConfigDict, mesh_sizes: dict[str, int] | None) -> None:
    """Cross-field checks of `moe` against `model` and, when known, the mesh sizes. Raises ConfigError."""
    m = config.moe
    if m.every == 0:
        return
    if m.every > config.model.num_layers:
        raise ConfigError(f"config key 'moe.every' = {m.every} exceeds 'model.num_layers' = "
                          f"{config.model.num_layers}: no block would be MoE. Use 0 for a dense model.")
    if m.top_k > m.num_experts:
        raise ConfigError(f"config key 'moe.top_k' = {m.top_k} exceeds 'moe.num_experts' = {m.num_experts}; "
                          "a token chooses at most every expert once.")
    if m.normalize_gates and m.router != "softmax":
        raise ConfigError(f"config key 'moe.normalize_gates' = True needs 'moe.router' = 'softmax' (got "
                          f"{m.router!r}); sigmoid gates are never renormalised.")
    if mesh_sizes is None:
        return
    rules = dict((name, target) for name, target in config.mesh.rules)
    target = rules.get("expert")
    targets = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    shards = 1
    for axis in targets:
        shards *= mesh_sizes[axis]
    if m.num_experts % shards:
        raise ConfigError(f"config key 'moe.num_experts' = {m.num_experts} is not divisible by the mesh axes "
                          f"{list(targets)} = {shards} devices that shard the experts (mesh.rules maps 'expert' "
                          "to them); use a multiple of that or change the mesh.")
