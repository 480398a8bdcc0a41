"""The MoE feed-forward layer: router, experts, optional shared expert; fits the transformer's FFN slot.

    y = sum_{e in topk(x)} g_e(x) * E_e(x)   (+ E_s(x), the shared expert, times sigmoid(x @ w_s) with
                                              moe.shared_expert_gate, Qwen2-MoE's)

g_e(x) the router's gate of expert e (moe.router), and every expert (the shared one too) an MLP of the form
`MoEConfig.expert_mlp`:

    "silu"    E_e(x) = silu(x @ up_e) @ down_e
    "swiglu"  E_e(x) = (silu(x @ gate_e) * (x @ up_e)) @ down_e     (Mixtral, Qwen3-MoE)

Dispatch (`MoEConfig.dispatch`):
  * "dropless": sort + grouped matmul (moe.dispatch.dropless). When the logical axis "expert" maps to a mesh
    axis of size P > 1, the experts are sharded over it and tokens reach them through exact-size exchanges under
    `jax.shard_map` (moe.dispatch.expert_parallel: `ep_exchange` picks the transport, a ragged all-to-all on GPU
    and TPU); the result is the same as on one device, unless `ep_capacity_factor` caps the receive buffers at
    O(tokens per shard), when the assignments past the cap are dropped and reported in "moe/dropped".
  * "capacity": the GShard einsum baseline with `capacity_factor`; expert parallelism by annotation only.

Parameters (logical axes): router [d, E] ("embed", "expert"); up [E, d, h] ("expert", "embed", "expert_mlp");
down [E, h, d] ("expert", "expert_mlp", "embed"); with "swiglu" also gate [E, d, h], axes like up's. Every
expert matrix names the axis "expert", which is all that FoMoE's site views, synchronisation and reshuffles and
expert parallelism look for. The shared expert's matrices (shared_up, shared_down, with "swiglu" shared_gate, with
moe.shared_expert_gate shared_scale [d, 1]) are Dense layers like the dense MLP's.
The layer imports nothing from `quant`: it asks the precision slot for its dot_general and its grouped matmul by
module path: "<path>.router", "<path>.shared.{gate,up,down}", the dropless experts' grouped matmul
"<path>.experts.{gate,up,down}", and the capacity products' dot_general "<path>.experts" (up and down) and
"<path>.experts.gate".

FoMoE sites (docs/fomoe.md, "Routing"): a layer may host only some of the `num_experts` experts
(`resident`, global ids). Then `routing_mode` says how tokens are routed:
  * "partitioned": the router has one column per resident expert and takes the top min(k, N_le) of them;
  * "skip_token": the router scores all N_e experts (a dense parameter) and takes the global top-k; a chosen
    expert that is not resident (a ghost) is not computed at all, its gate is not redistributed, and a token
    whose choices are all ghosts gets a zero output (the residual stream only). aux adds "moe/ghost_fraction".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from core.mesh import Sharder, logical_to_spec
from core.mesh_config import mesh_axes
from core.model import DefaultPrecision, Precision, TransformerConfig, layer_key
from moe import dispatch as dispatch_lib
from moe import router as router_lib
from moe.config import ROUTING_MODES, MoEConfig
from moe.grouped_matmul import GroupedMatmulFn

__all__ = ["MoE", "Residency", "expert_mesh_axis"]


class Residency(nnx.Variable):
    """Global ids [N_le] of the experts a site hosts: state, not a trained parameter, so that sites sharing one
    program (stacked along the `site` axis) can host different experts, and a reshuffle can move them."""


def expert_mesh_axis(shard: Sharder, num_experts: int) -> str | None:
    """The mesh axis the experts are sharded over (None: not sharded). Raises ValueError if the experts cannot
    be split evenly over it, or if "expert" maps to several mesh axes."""
    if shard.mesh is None:
        return None
    target = logical_to_spec(("expert",), shard.rules, shard.mesh)[0]
    if target is None:
        return None
    if not isinstance(target, str):
        raise ValueError(
            f"the logical axis 'expert' maps to mesh axes {target}; expert parallelism supports "
            "one mesh axis (give the Sharder rules that map 'expert' to one axis, e.g. 'expert')."
        )
    size = shard.mesh.shape[target]
    if num_experts % size:
        raise ValueError(
            f"MoEConfig.num_experts = {num_experts} is not divisible by the mesh axis '{target}' = {size} "
            "that shards the experts; use a multiple of it or a mesh whose axis size divides it."
        )
    return target


class _Linear(nnx.Module):
    """y = x @ W through the precision slot at `path` (core.model.Dense's product, sized by the layer's own
    arguments): W [in, out] in `param_dtype` with logical axes `axes`, x and y in `dtype`, float32 accumulation."""

    def __init__(self, w: jax.Array, *, axes: tuple[str | None, str | None], path: str, precision: Precision, dtype):
        self.kernel = nnx.Param(w, axes=axes)
        self.path, self.precision, self.dtype = path, precision, dtype

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        dot_general = self.precision.dot_general(self.path, layer_key(key, self.path))
        lead = x.shape[:-1]
        x = x.astype(self.dtype).reshape(-1, x.shape[-1])
        w = self.kernel.get_value().astype(self.dtype)
        y = dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return y.astype(self.dtype).reshape(*lead, w.shape[1])


class MoE(nnx.Module):
    """A MoE FFN. `__call__(x [B, T, d], *, key=None) -> (y [B, T, d], aux)`, the FFN-slot signature.

    Args (its own; no experiment config or transformer config is needed):
      d_model: d, the width of x and y.
      moe: the experts, their width and form, the router and the dispatch (moe.MoEConfig; `moe.check()` is
        enforced here). Its `every` and `dense_layers` concern a transformer and are not read.
      path: the module path the precision slot is asked by ("<path>.router", "<path>.experts.up", ...).
      rngs: nnx.Rngs; parameters are drawn from `rngs.params()`.
      dtype: the compute dtype of x, the experts' products and y (the router runs in float32).
      param_dtype: the parameters' storage dtype.
      init_std: std of the normal initialiser of the router and the input-side matrices (up, gate).
      out_std: std of the output-side matrices (down); default `init_std` (a transformer passes
        init_std / sqrt(2 num_layers): `MoE.in_transformer`).
      precision: the matmul-precision slot (core.model.Precision); default lax.dot_general and
        moe.GroupedMatmulFn(moe.grouped_matmul).
      shard: a core.mesh.Sharder (mesh and logical-axis rules); default none (one device).
      resident, routing_mode: a FoMoE site's hosted experts (global ids) and how it routes (ROUTING_MODES).

    aux: "loss/moe_balance" (load_balance_weight x Switch loss), "loss/moe_z" (z_loss_weight x z-loss), and the
    statistics "moe/load_cv", "moe/load_entropy", "moe/token_entropy", "moe/max_load", "moe/dropped"
    (moe.router.routing_stats), scalars; and the intermediate "routes", the chosen global expert ids [B T, k] int32,
    which the transformer returns only when asked (`Transformer(..., intermediates=True)`).
    """

    def __init__(
        self,
        d_model: int,
        moe: MoEConfig,
        *,
        path: str,
        rngs: nnx.Rngs,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        init_std: float = 0.02,
        out_std: float | None = None,
        precision: Precision | None = None,
        shard: Sharder | None = None,
        resident: Sequence[int] | None = None,
        routing_mode: str = "partitioned",
    ):
        if not (isinstance(d_model, int) and d_model >= 1):
            raise ValueError(f"MoE d_model = {d_model!r} must be a positive int.")
        moe.check()
        if routing_mode not in ROUTING_MODES:
            raise ValueError(f"routing_mode = {routing_mode!r}; allowed: {list(ROUTING_MODES)}.")
        e = moe.num_experts
        ids = list(range(e)) if resident is None else [int(i) for i in resident]
        if not ids or len(set(ids)) != len(ids) or not all(0 <= i < e for i in ids):
            raise ValueError(f"{path}: resident experts {ids} must be distinct ids in [0, {e}).")
        local = len(ids)
        self.resident = Residency(jnp.asarray(ids, jnp.int32))
        self.skip_token = routing_mode == "skip_token" and local < e
        self.shard = Sharder() if shard is None else shard
        self.ep_axis = expert_mesh_axis(self.shard, local) if moe.dispatch == "dropless" else None
        self.precision = (
            precision if precision is not None else DefaultPrecision(grouped=GroupedMatmulFn(moe.grouped_matmul))
        )
        self.moe, self.path, self.dtype = moe, path, jnp.dtype(dtype)
        d, h = d_model, moe.expert_size
        out_std = init_std if out_std is None else out_std

        def normal(shape, std):
            return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(param_dtype)

        # Partitioned router: one column per resident expert, so the columns belong to the experts (logical axis
        # "expert": sharded and synchronised with them). Skip-token: a dense parameter over all N_e experts.
        dense_router = routing_mode == "skip_token"
        self.router = nnx.Param(
            normal((d, e if dense_router else local), init_std), axes=("embed", None if dense_router else "expert")
        )
        self.up = nnx.Param(normal((local, d, h), init_std), axes=("expert", "embed", "expert_mlp"))
        self.down = nnx.Param(normal((local, h, d), out_std), axes=("expert", "expert_mlp", "embed"))
        self.gated = moe.expert_mlp == "swiglu"
        if self.gated:
            self.gate = nnx.Param(normal((local, d, h), init_std), axes=("expert", "embed", "expert_mlp"))
        if moe.shared_expert_size:
            s = moe.shared_expert_size

            def linear(shape, axes, name, std=init_std):
                return _Linear(
                    normal(shape, std),
                    axes=axes,
                    path=f"{path}.shared.{name}",
                    precision=self.precision,
                    dtype=self.dtype,
                )

            if self.gated:
                self.shared_gate = linear((d, s), ("embed", "mlp"), "gate")
            self.shared_up = linear((d, s), ("embed", "mlp"), "up")
            self.shared_down = linear((s, d), ("mlp", "embed"), "down", out_std)
            if moe.shared_expert_gate:
                self.shared_scale = linear((d, 1), ("embed", None), "scale")

    @classmethod
    def in_transformer(cls, cfg: TransformerConfig, moe: MoEConfig, **kwargs: Any) -> MoE:
        """The layer in core.model.Transformer's FFN slot: d_model, dtypes and initialisation from the transformer's
        config (out_std = init_std / sqrt(2 num_layers), as its dense MLP's); `kwargs` as `MoE`'s."""
        return cls(
            cfg.d_model,
            moe,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.weight_dtype,
            init_std=cfg.init_std,
            out_std=cfg.init_std / math.sqrt(2 * cfg.num_layers),
            **kwargs,
        )

    def route(self, x: jax.Array, key: jax.Array | None = None, router: jax.Array | None = None) -> router_lib.Routing:
        """Router logits in float32 for x [..., d] flattened to [N, d]; the top-k Routing over the router's
        columns (all experts with skip-token, else the resident ones, top min(k, N_le)). `router` defaults to the
        layer's weight (a shard_map passes its own view)."""
        path = f"{self.path}.router"
        dot_general = self.precision.dot_general(path, layer_key(key, path))
        x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
        router = (self.router.get_value() if router is None else router).astype(jnp.float32)
        logits = dot_general(x, router, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        k = min(self.moe.top_k, router.shape[1])
        return router_lib.route(logits, k, self.moe.router, normalize=self.moe.normalize_gates)

    def global_ids(self, experts: jax.Array) -> jax.Array:
        """Router column -> global expert id (the partitioned router's columns are the resident experts)."""
        return (
            experts
            if self.router.get_value().shape[1] == self.moe.num_experts
            else (self.resident.get_value()[experts])
        )

    def local_ids(self, experts: jax.Array, resident: jax.Array | None = None) -> jax.Array:
        """Router column -> local expert slot; a ghost (not resident) -> N_le, which no dispatch computes."""
        if not self.skip_token:
            return experts
        ids = self.resident.get_value() if resident is None else resident
        table = jnp.full((self.moe.num_experts,), ids.shape[0], jnp.int32)
        return table.at[ids].set(jnp.arange(ids.shape[0], dtype=jnp.int32))[experts]

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        chex.assert_shape(x, (None, None, self.up.shape[1]), custom_message="MoE input x: [batch, seq, d_model]")
        b, t, d = x.shape
        m = self.moe
        x = x.astype(self.dtype)
        up, down = self.up.get_value(), self.down.get_value()
        gate = self.gate.get_value() if self.gated else None
        keep = None
        if m.dispatch == "capacity":
            routing = self.route(x, key)
            experts = self.local_ids(routing.experts)

            def dot_general(path):
                return self.precision.dot_general(path, layer_key(key, path))

            y, keep = dispatch_lib.capacity(
                x,
                experts.reshape(b, t, -1),
                routing.gates.reshape(b, t, -1),
                up,
                down,
                capacity_factor=m.capacity_factor,
                dot_general=dot_general(f"{self.path}.experts"),
                shard=self.shard,
                gate=gate,
                gate_dot_general=None if gate is None else dot_general(f"{self.path}.experts.gate"),
            )
            keep = keep.reshape(b * t, -1)
        else:
            y, routing, experts, keep = self._dropless(x.reshape(b * t, d), up, down, gate, key)
            y = y.reshape(b, t, d)
        if m.shared_expert_size:
            y = y + self._shared(x, key)
        y = self.shard(y, ("batch", "seq", "embed"))
        stats = router_lib.routing_stats(routing, keep)
        aux = {
            f"moe/{name}": stats[name] for name in ("load_cv", "load_entropy", "token_entropy", "max_load", "dropped")
        }
        if self.skip_token:
            aux["moe/ghost_fraction"] = jnp.mean((experts == self.up.get_value().shape[0]).astype(jnp.float32))
        if m.load_balance_weight:
            aux["loss/moe_balance"] = m.load_balance_weight * router_lib.load_balance_loss(routing)
        if m.z_loss_weight:
            aux["loss/moe_z"] = m.z_loss_weight * router_lib.z_loss(routing)
        aux["routes"] = self.global_ids(routing.experts)  # an intermediate: the model returns it only on request
        return y, aux

    def _shared(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
        """The shared expert on x [B, T, d] -> [B, T, d]: silu(x @ up) @ down, or with "swiglu"
        (silu(x @ gate) * (x @ up)) @ down (each product through the precision slot, in the compute dtype)."""
        h = self.shared_up(x, key=key)
        h = jax.nn.silu(self.shared_gate(x, key=key)) * h if self.gated else jax.nn.silu(h)
        y = self.shared_down(h, key=key)
        return y * jax.nn.sigmoid(self.shared_scale(x, key=key)) if self.moe.shared_expert_gate else y

    def _dropless(self, x, up, down, gate, key):
        """Routing and dropless dispatch of x [N, d] -> (y [N, d], Routing, local expert slots [N, k], keep [N, k]
        bool or None: with expert parallelism, False where `ep_capacity_factor` dropped the assignment); gate: the
        SwiGLU experts' gate matrices [N_le, d, h], or None.

        With a mesh whose batch axes (or expert axis) have several devices, both run under shard_map on each
        device's own tokens: the routing's top-k and the dispatch's sort stay local (left to the partitioner, they
        would gather every token), and with expert parallelism the tokens travel by all_to_all. A token count the
        devices cannot split evenly (e.g. one decode step of one sequence) is padded with zero rows, computed and
        discarded; they never enter the routing statistics.

        The step key enters the shard_map as an argument (not a closure), and inside a FoMoE site's manual region
        (`moe.federation.per_site`: the Sharder's mesh has manual site axes) the shard_map nests with
        check_vma=False: jax 0.10's linearisation of a nested shard_map gives its residuals specs over the outer
        manual axes too, which fail to lower. Its transposes are then still the same (the replicated inputs'
        cotangents are summed over the token shards; every output is split over them)."""

        def local(x, key, router, resident, up, down, gate=None):
            def grouped_matmul(name):
                path = f"{self.path}.experts.{name}"
                return self.precision.grouped_matmul(path, layer_key(key, path))

            products = dict(
                gmm_up=grouped_matmul("up"),
                gmm_down=grouped_matmul("down"),
                gmm_gate=None if gate is None else grouped_matmul("gate"),
            )
            routing = self.route(x, key, router)
            experts = self.local_ids(routing.experts, resident)
            if self.ep_axis is None:
                y = dispatch_lib.dropless(x, experts, routing.gates, up, down, gate=gate, **products)
                return y, routing, experts, None
            y, keep = dispatch_lib.expert_parallel(
                x,
                experts,
                routing.gates,
                up,
                down,
                axis=self.ep_axis,
                gate=gate,
                exchange=self.moe.ep_exchange,
                capacity_factor=self.moe.ep_capacity_factor,
                **products,
            )
            return y, routing, experts, keep

        weights = (self.router.get_value(), self.resident.get_value(), up, down) + (() if gate is None else (gate,))
        mesh = self.shard.mesh
        token_axes: tuple[str, ...] = ()
        if mesh is not None:
            axes = mesh_axes(logical_to_spec(("batch",), self.shard.rules, mesh)[0])
            if self.ep_axis is not None and self.ep_axis not in axes:
                axes += (self.ep_axis,)
            token_axes = tuple(a for a in axes if mesh.shape[a] > 1)
        if not token_axes and self.ep_axis is None:
            return local(x, key, *weights)
        assert mesh is not None  # expert parallelism needs a mesh (expert_mesh_axis)
        n = x.shape[0]
        pad = -n % math.prod(mesh.shape[a] for a in token_axes)
        if pad:
            x = jnp.concatenate([x, jnp.zeros((pad,) + x.shape[1:], x.dtype)])
        tokens, experts_spec = PartitionSpec(token_axes), PartitionSpec(self.ep_axis)
        fn = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(tokens, PartitionSpec(), PartitionSpec(), PartitionSpec()) + (experts_spec,) * (len(weights) - 2),
            out_specs=tokens,
            check_vma=not getattr(mesh, "manual_axes", ()),  # nested in a site's manual region: see above
        )
        y, routing, experts, keep = fn(x, key, *weights)
        return y[:n], jax.tree.map(lambda a: a[:n], routing), experts[:n], None if keep is None else keep[:n]
