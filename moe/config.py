"""The MoE layer's own arguments (`MoEConfig`) and the names its choices allow. Plain typed values: nothing here
reads an experiment config (experiments.schema_moe maps the config's `moe` section onto `MoEConfig` and re-raises
its errors with the config keys).

    MoEConfig(num_experts=8, top_k=2, expert_size=64)   # raises ValueError naming MoEConfig.<field> if invalid
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from core.fields import MAX_WIDTH, Compat, field
from moe.dispatch import EXCHANGES
from moe.grouped_matmul import IMPLEMENTATIONS
from moe.router import ROUTERS

__all__ = ["DISPATCH", "EXPERT_MLPS", "ROUTING_MODES", "MoEConfig"]


DISPATCH = ("dropless", "capacity")
EXPERT_MLPS = ("silu", "swiglu")
ROUTING_MODES = ("partitioned", "skip_token")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """What a MoE layer (moe.layer.MoE) computes: its experts, their width and form, the router and the dispatch;
    and, for a transformer, which blocks are MoE (`every`, `dense_layers`). Every key's default, allowed values and
    meaning are declared with `core.fields.field`; the experiment config's section `moe` has exactly these keys.

    Construction checks each value (its allowed names, its lower bound) and `check` the keys that must agree; both
    raise ValueError naming the argument ("MoEConfig.top_k = 3 exceeds MoEConfig.num_experts = 2; ...")."""

    compat: ClassVar[Compat] = True

    every: int = field(
        0,
        "MoE FFN in every n-th block (layer i is MoE iff (i + 1) % every == 0; 1 = all blocks, 2 = blocks 1, 3, "
        "...); 0 = a dense model",
        low=0,
    )
    dense_layers: tuple[int, ...] = field(
        (), "layers kept dense although `every` selects them (Qwen3-MoE's mlp_only_layers), 0-based"
    )
    num_experts: int = field(8, "experts per MoE layer", low=1, high=MAX_WIDTH)
    top_k: int = field(2, "experts chosen per token", low=1)
    expert_size: int = field(
        128, "hidden width h of each expert (d_model -> h -> d_model; its form: expert_mlp)", low=1, high=MAX_WIDTH
    )
    shared_expert_size: int = field(0, "hidden width of an always-on shared expert (0 = none)", low=0, high=MAX_WIDTH)
    shared_expert_gate: bool = field(
        False,
        "scale the shared expert's output by sigmoid(x @ w), w [d_model, 1] (Qwen2-MoE's shared_expert_gate)",
        since_checkpoints=True,
    )
    expert_mlp: str = field(
        "silu",
        "form of every expert and of the shared expert: 'silu' (silu(x @ up) @ down; 2 matrices) or 'swiglu' "
        "((silu(x @ gate) * (x @ up)) @ down; 3 matrices, the experts of Mixtral and Qwen3-MoE)",
        choices=EXPERT_MLPS,
    )
    router: str = field(
        "sigmoid",
        "'sigmoid' (sigma-MoE: gates sigmoid(logit), not renormalised) or 'softmax' (gates = softmax "
        "probabilities of the chosen experts)",
        choices=ROUTERS,
    )
    normalize_gates: bool = field(False, "softmax router: divide the k gates by their sum (Mixtral)")
    dispatch: str = field(
        "dropless",
        "'dropless' (sort + grouped matmul; all-to-all when experts are sharded) or 'capacity' (GShard einsum, "
        "drops assignments past capacity)",
        choices=DISPATCH,
    )
    capacity_factor: float = field(
        1.25,
        "capacity dispatch: slots per expert per sequence = ceil(factor x seq_len x top_k / num_experts)",
        low=0.0,
        low_open=True,
    )
    load_balance_weight: float = field(0.01, "weight of the Switch load-balance loss", low=0.0)
    z_loss_weight: float = field(0.001, "weight of the router z-loss", low=0.0)
    grouped_matmul: str = field(
        "auto",
        "dropless expert product: 'auto' (ragged_dot on GPU/TPU; on CPU batched from 32 rows per expert, else"
        " windowed), 'ragged_dot', 'windowed' (a loop of per-window matmuls), 'batched' (one batched matmul at a"
        " capacity near the mean, the rest in windows)",
        choices=IMPLEMENTATIONS,
    )

    ep_exchange: str = field(
        "auto",
        "experts sharded over devices: the all-to-all's transport, 'ragged' (exact sizes, jax.lax.ragged_all_to_all; "
        "GPU and TPU), 'padded' (worst-case buffers; any backend) or 'auto' (ragged on GPU/TPU, padded on CPU)",
        choices=EXCHANGES,
        since_checkpoints=True,
    )
    ep_capacity_factor: float | None = field(
        None,
        "experts sharded over devices: receive buffers of ceil(factor x n x top_k) rows for n tokens per shard, the "
        "assignments past them dropped and counted in moe/dropped; None = P n top_k rows, nothing dropped",
        low=0.0,
        low_open=True,
        since_checkpoints=True,
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))  # a list (ConfigDict, JSON) as a tuple
        for name, allowed in (
            ("expert_mlp", EXPERT_MLPS),
            ("router", ROUTERS),
            ("dispatch", DISPATCH),
            ("grouped_matmul", IMPLEMENTATIONS),
            ("ep_exchange", EXCHANGES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"MoEConfig.{name} = {getattr(self, name)!r}; allowed: {list(allowed)}.")
        for name, low in (
            ("every", 0),
            ("num_experts", 1),
            ("top_k", 1),
            ("expert_size", 1),
            ("shared_expert_size", 0),
        ):
            if getattr(self, name) < low:
                raise ValueError(f"MoEConfig.{name} = {getattr(self, name)!r} must be >= {low}.")
        for name in ("load_balance_weight", "z_loss_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"MoEConfig.{name} = {getattr(self, name)!r} must be >= 0.")
        if not self.capacity_factor > 0:
            raise ValueError(f"MoEConfig.capacity_factor = {self.capacity_factor!r} must be > 0.")
        if self.ep_capacity_factor is not None and not self.ep_capacity_factor > 0:
            raise ValueError(
                f"MoEConfig.ep_capacity_factor = {self.ep_capacity_factor!r}; allowed: None (no cap) or a number > 0."
            )

    def check(self) -> None:
        """The keys that must agree with each other, for a layer that is built (moe.layer.MoE calls it; a dense
        transformer's unused MoEConfig is not held to it). Raises ValueError naming the arguments."""
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k = {self.top_k} exceeds MoEConfig.num_experts = {self.num_experts}; "
                "a token chooses at most every expert once."
            )
        if self.normalize_gates and self.router != "softmax":
            raise ValueError(
                f"MoEConfig.normalize_gates = True needs MoEConfig.router = 'softmax' (got {self.router!r}); "
                "sigmoid gates are never renormalised."
            )

    def is_moe_layer(self, layer: int) -> bool:
        """Layer i (0-based) is a MoE layer iff every > 0, (i + 1) % every == 0 (every=2: layers 1, 3, ...) and i is
        not one of `dense_layers`."""
        return self.every > 0 and (layer + 1) % self.every == 0 and layer not in self.dense_layers
