"""FoMoE (arXiv 2606.19025): MoE layers, expert parallelism, federated training across sites.

    from moe import MoE, MoEConfig, route, grouped_matmul
"""

from moe.dispatch import capacity, dropless, expert_parallel_dropless
from moe.grouped_matmul import GroupedMatmulFn, grouped_matmul
from moe.layer import MoE, MoEConfig, expert_mesh_axis
from moe.router import Routing, load_balance_loss, route, routing_stats, z_loss

__all__ = ["MoE", "MoEConfig", "expert_mesh_axis", "Routing", "route", "load_balance_loss", "z_loss",
           "routing_stats", "grouped_matmul", "GroupedMatmulFn", "dropless", "capacity", "expert_parallel_dropless"]
