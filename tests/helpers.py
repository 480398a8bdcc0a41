"""What several test files share: a float64 MoE written from the formulas, random O(1) parameters, an 8-device
sharder, a tiny MoE transformer, a jitted forward, module call and quantiser, a tiny run config, a few jitted train
steps, and a run's metric rows."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core import mesh as mesh_lib
from experiments import schema
from moe import MoEConfig
from quant import quantize


def set_params(layer: nnx.Module, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    values = {}
    for path, var in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
        shape = var.get_value().shape
        values[".".join(map(str, path))] = rng.normal(size=shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1)
    state = nnx.state(layer, nnx.Param)
    for path, var in nnx.to_flat_state(state):
        var.set_value(jnp.asarray(values[".".join(map(str, path))], jnp.float32))
    nnx.update(layer, state)
    return {k: np.asarray(np.float32(v), np.float64) for k, v in values.items()}


@functools.partial(jax.jit, static_argnums=2)
def reference(p: dict, x, m: MoEConfig, chosen: np.ndarray):
    """float64 MoE written from the formulas: y = sum over experts e of gate_e(x) E_e(x) (+ the shared expert E_s(x)),
    E(x) = silu(x up) down, or with m.expert_mlp = "swiglu" (silu(x w_gate) * (x up)) down (p["gate"][e],
    p["shared_gate.kernel"]). `chosen` [N, k]: the top-k experts (computed from the float64 logits by the caller),
    fixed for autodiff. Jitted (one program per config and shape); float64 where the caller enables x64."""
    silu = lambda z: z * jax.nn.sigmoid(z)  # noqa: E731
    gated = m.expert_mlp == "swiglu"

    def mlp(x, up, down, w_gate):
        return ((silu(x @ w_gate) * (x @ up)) if gated else silu(x @ up)) @ down

    logits = x @ p["router"]
    if m.router == "softmax":
        gates = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), chosen, axis=1)
        if m.normalize_gates:
            gates = gates / jnp.sum(gates, axis=1, keepdims=True)
    else:
        gates = jax.nn.sigmoid(jnp.take_along_axis(logits, chosen, axis=1))
    y = jnp.zeros_like(x)
    for e in range(m.num_experts):
        gate_e = jnp.sum(jnp.where(chosen == e, gates, 0.0), axis=1)
        y = y + gate_e[:, None] * mlp(x, p["up"][e], p["down"][e], p["gate"][e] if gated else None)
    if m.shared_expert_size:
        y = y + mlp(x, p["shared_up.kernel"], p["shared_down.kernel"], p.get("shared_gate.kernel"))
    return y


def sharder(data: int, expert: int) -> mesh_lib.Sharder:
    c = schema.default_config()
    c.mesh.data, c.mesh.expert = data, expert
    return mesh_lib.Sharder(mesh_lib.make_mesh(c), tuple(tuple(r) for r in c.mesh.rules))


def tiny_moe_transformer(resident=None, routing_mode="partitioned", precision=None, num_layers=1):
    """A one-block transformer (`num_layers` blocks) whose FFN is a MoE layer of 8 experts (top-2), hosting
    `resident` of them (the federation's properties hold per leaf: one block shows them); `precision`: the
    matmul-precision slot of every projection and expert (default: plain products)."""
    from core.model import Transformer, TransformerConfig
    from moe import MoE

    cfg = TransformerConfig(vocab_size=264, d_model=16, num_layers=num_layers, num_heads=2, num_kv_heads=2, d_ff=32)
    m = MoEConfig(num_experts=8, top_k=2, expert_size=8)

    def ffn(layer, path, rngs):
        return MoE.in_transformer(
            cfg, m, path=path, rngs=rngs, resident=resident, routing_mode=routing_mode, precision=precision
        )

    return Transformer(cfg, rngs=nnx.Rngs(0), ffn_factory=ffn, precision=precision)


def tiny_federation(
    sites, overlap, optimizer, *, outer=None, layers=1, precision=None, on_mesh=True, seed=0, error_feedback=False,
    anchor=None,
):  # fmt: skip
    """`sites` sites of `tiny_moe_transformer` (8 experts, fixed placement at `overlap`), as moe.rounds.init_sites
    builds them: (placement, site mesh or None, site graphdef, FederatedState on the mesh, or on the default device
    when not `on_mesh`)."""
    from moe import federation, rounds
    from moe.placement import fixed_placement

    placement = fixed_placement(8, sites, overlap)
    mesh = federation.site_mesh(sites, overlap) if on_mesh else None
    graphdef, state = rounds.init_sites(
        tiny_moe_transformer(precision=precision, num_layers=layers),
        tiny_moe_transformer(placement.experts[0], precision=precision, num_layers=layers),
        placement,
        optimizer,
        outer,
        mesh,
        seed=seed,
        error_feedback=error_feedback,
        anchor=anchor,
    )
    return placement, mesh, graphdef, state


# A model's forward, a module's call: one compiled program each (op-by-op dispatch compiles every primitive, tens
# of milliseconds each on the CPU: seconds per test).
forward = nnx.jit(lambda model, tokens, cache=None: model(tokens, cache=cache))
call = nnx.jit(lambda module, *args: module(*args))
# quant.quantize as training runs it: jitted (XLA fuses it), one program per format, axis and shape
jit_quantize = jax.jit(quantize, static_argnames=("fmt", "axis", "block_size", "rounding", "scale", "select"))


def by_key_path(tree, params, values, default):
    """An independent reference for core.train.optimizer_state_like: a leaf of `tree` whose key path ends with a
    parameter's key path and has its shape gets that parameter's entry of `values` (shaped like `params`); any
    other leaf gets `default`."""
    flat_params, _ = jax.tree_util.tree_flatten_with_path(params)
    by_path = {tuple(path): (leaf.shape, v) for (path, leaf), v in zip(flat_params, jax.tree.leaves(values))}

    def pick(path, leaf):
        for i in range(len(path)):
            hit = by_path.get(tuple(path[i:]))
            if hit is not None and hit[0] == leaf.shape:
                return hit[1]
        return default

    return jax.tree_util.tree_map_with_path(pick, tree)


def make_tiny_config():
    """A config small enough to train a few steps in seconds on one device (tests that shard set the mesh)."""
    c = schema.default_config()
    c.model.d_model, c.model.num_layers, c.model.num_heads, c.model.num_kv_heads, c.model.d_ff = 32, 2, 4, 2, 64
    c.data.seq_len, c.data.batch_size = 16, 8
    c.optim.warmup_steps = 2
    c.train.steps, c.train.log_every, c.train.eval_every, c.train.eval_batches = 6, 1, 3, 2
    c.train.progress = False
    c.checkpoint.every = 2
    c.sample.num_tokens = 0
    c.mesh.data = 1
    return c


def train_losses(model: nnx.Module, optimizer, tokens: jax.Array, steps: int) -> list[float]:
    """The training loss of each of `steps` jitted train steps of `model` with `optimizer` on one batch."""
    from core import train as train_lib
    from core.model import split_params

    graphdef, params, rest = split_params(model)
    state = train_lib.TrainState(jnp.zeros((), jnp.int32), params, rest, optimizer.init(params), jax.random.key(0))
    step = jax.jit(train_lib.train_step_fn(graphdef, optimizer))
    losses = []
    for _ in range(steps):
        state, metrics = step(state, tokens)
        losses.append(float(metrics["loss"]))
    return losses


def metric_rows(workdir) -> list[dict]:
    """The rows of a run's metrics.jsonl without its timing columns (tokens_per_second, a federated run's seconds/...),
    which differ between runs."""
    timing = lambda k: k == "tokens_per_second" or k.startswith("seconds/")  # noqa: E731
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not timing(k)} for line in f]


def running(pid) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie; Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
