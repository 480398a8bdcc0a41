"""FoMoE (arXiv 2606.19025): MoE layers, expert parallelism, federated training across sites.

from moe import MoE, MoEConfig, route, grouped_matmul
"""

from moe.config import MoEConfig
from moe.dispatch import capacity, dropless, expert_parallel_dropless
from moe.grouped_matmul import GroupedMatmulFn, grouped_matmul
from moe.layer import MoE, expert_mesh_axis
from moe.router import Routing, load_balance_loss, route, routing_stats, z_loss

__all__ = [
    "GroupedMatmulFn",
    "MoE",
    "MoEConfig",
    "Routing",
    "capacity",
    "dropless",
    "expert_mesh_axis",
    "expert_parallel_dropless",
    "grouped_matmul",
    "load_balance_loss",
    "route",
    "routing_stats",
    "z_loss",
]
