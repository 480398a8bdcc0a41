"""Moving tokens to experts and back: dropless (sort + grouped matmul), capacity (GShard einsum), and the
expert-parallel dropless dispatch (all-to-all under `jax.shard_map`).

All three compute, for N tokens with top-k choices (experts [N, k], gates [N, k]),

    y[n] = sum_j gates[n, j] * E_{experts[n, j]}(x[n])

with the expert E_e an MLP of one of two forms (`MoEConfig.expert_mlp`):

    "silu":    E_e(x) = silu(x @ up[e]) @ down[e]                       (up [E, d, h], down [E, h, d])
    "swiglu":  E_e(x) = (silu(x @ gate[e]) * (x @ up[e])) @ down[e]     (gate [E, d, h] as well: Mixtral, Qwen3-MoE)

Each function takes `gate=None` for the first form and the gate matrices (with their own grouped matmul or
dot_general, so that a precision policy sees the gate projection by its own path) for the second. They differ in
which assignments they compute (capacity drops some) and where the experts live.

Ghost assignments (FoMoE's skip-token: the router chose an expert this site does not host) carry the expert id
E (one past the last local expert). They are never computed: the dropless sort puts them after every real
assignment, past the grouped matmul's sum(group_sizes), so no matmul row is spent on them; the capacity one-hot is
all zero for them; the expert-parallel dispatch never sends them. Their output is zero whatever their gate.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from core.model import DotGeneral, GroupedMatmul

__all__ = [
    "capacity",
    "capacity_assignment",
    "capacity_per_group",
    "dropless",
    "expert_ffn",
    "expert_parallel_dropless",
    "permute",
]


@jax.custom_vjp
def permute(x: jax.Array, perm: jax.Array, inverse: jax.Array) -> jax.Array:
    """x[perm] for a permutation `perm` with inverse `inverse` ([M] int32 each).

    The gradient is the gather g[inverse] instead of autodiff's scatter-add (maxtext does the same): on every
    backend a gather is cheaper than a scatter, and a permutation never needs the accumulation.
    """
    return x[perm]


permute.defvjp(lambda x, perm, inverse: (x[perm], inverse), lambda inverse, g: (g[inverse], None, None))


def _sort_by(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(order, inverse): a stable argsort of `ids` and its inverse permutation."""
    order = jnp.argsort(ids, stable=True).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    return order, inverse


def _check_gate(gate: jax.Array | None, up: jax.Array, product: object) -> None:
    """A gate needs the shape of `up` and its own product (grouped matmul or dot_general); ValueError if not."""
    if gate is None:
        return
    if gate.shape != up.shape:
        raise ValueError(f"expert gate matrices {gate.shape} must have the shape of the up matrices {up.shape}.")
    if product is None:
        raise ValueError("expert gate matrices given without their product (gmm_gate / gate_dot_general).")


def _hidden(h_up: jax.Array, h_gate: jax.Array | None, dtype) -> jax.Array:
    """The experts' hidden activation from float32 products: silu(h_up), or silu(h_gate) * h_up; in `dtype`."""
    h = jax.nn.silu(h_up) if h_gate is None else jax.nn.silu(h_gate) * h_up
    return h.astype(dtype)


def expert_ffn(
    xs: jax.Array,
    group_sizes: jax.Array,
    up: jax.Array,
    down: jax.Array,
    gmm_up: GroupedMatmul,
    gmm_down: GroupedMatmul,
    *,
    gate: jax.Array | None = None,
    gmm_gate: GroupedMatmul | None = None,
) -> jax.Array:
    """The experts on rows sorted by expert, group g through expert g:

        silu(xs @ up[g]) @ down[g]                        (gate None)
        (silu(xs @ gate[g]) * (xs @ up[g])) @ down[g]     (gate given, multiplied through gmm_gate)

    xs: [M, d] sorted by expert; group_sizes: [E] int32; up, gate: [E, d, h]; down: [E, h, d]. Products accumulate
    in float32 (the gating product too) and return in xs.dtype; rows past sum(group_sizes) come out zero.

    When the gate's product is the up product itself (the same callable: a precision policy that treats both
    paths alike), both run as one grouped matmul over [gate | up] [E, d, 2h], the same numbers in one pass over
    xs and one loop of wider matmuls (on the CPU 1.4x faster than two: docs/performance.md)."""
    _check_gate(gate, up, gmm_gate)
    g = None
    if gate is not None and gmm_gate is gmm_up:
        gate_up = jnp.concatenate([gate, up], axis=2).astype(xs.dtype)
        g, h = jnp.split(gmm_up(xs, gate_up, group_sizes, preferred_element_type=jnp.float32), 2, axis=1)
    else:
        h = gmm_up(xs, up.astype(xs.dtype), group_sizes, preferred_element_type=jnp.float32)
        if gate is not None:
            assert gmm_gate is not None  # _check_gate
            g = gmm_gate(xs, gate.astype(xs.dtype), group_sizes, preferred_element_type=jnp.float32)
    h = _hidden(h, g, xs.dtype)
    return gmm_down(h, down.astype(xs.dtype), group_sizes, preferred_element_type=jnp.float32).astype(xs.dtype)


def _combine(y_sorted: jax.Array, inverse: jax.Array, order: jax.Array, gates: jax.Array) -> jax.Array:
    n, k = gates.shape
    y = permute(y_sorted, inverse, order).reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", y, gates.astype(y.dtype), preferred_element_type=jnp.float32).astype(y.dtype)


def dropless(
    x: jax.Array,
    experts: jax.Array,
    gates: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    gmm_up: GroupedMatmul,
    gmm_down: GroupedMatmul,
    gate: jax.Array | None = None,
    gmm_gate: GroupedMatmul | None = None,
) -> jax.Array:
    """Every assignment computed: sort the N k (token, expert) pairs by expert, run the experts as one grouped
    matmul per projection, unsort and combine with the gates.

    Args:
      x: [N, d]; experts, gates: [N, k] (expert E = a ghost, not computed); up: [E, d, h]; down: [E, h, d];
      gate: [E, d, h] for SwiGLU experts (with gmm_gate), None for SiLU experts.
    Returns:
      y: [N, d] in x.dtype.
    """
    _n, k = experts.shape
    order, inverse = _sort_by(experts.reshape(-1))
    group_sizes = jnp.bincount(experts.reshape(-1), length=up.shape[0]).astype(jnp.int32)
    xs = permute(jnp.repeat(x, k, axis=0), order, inverse)
    ys = expert_ffn(xs, group_sizes, up, down, gmm_up, gmm_down, gate=gate, gmm_gate=gmm_gate)
    return _combine(ys, inverse, order, gates)


def capacity_per_group(tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """C = min(T, ceil(capacity_factor * T * k / E)), at least 1: the slots of each expert in a group of T tokens
    (an expert receives at most one assignment per token, hence at most T)."""
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * k / num_experts)))


def capacity_assignment(experts: jax.Array, num_experts: int, slots: int) -> tuple[jax.Array, jax.Array]:
    """Queue position of each assignment in its expert, and whether it fits.

    Order (GShard / Switch): within a group, all first choices are queued before any second choice, and so on;
    within one choice rank, tokens queue in position order. The first `slots` assignments of each expert are kept.

    Args:
      experts: [B, T, k] int32 (B groups of T tokens).
    Returns:
      position: [B, T, k] int32, 0-based place in the expert's queue; keep: [B, T, k] bool, position < slots.
    """
    b, t, k = experts.shape
    onehot = jax.nn.one_hot(experts, num_experts, dtype=jnp.int32)  # [B, T, k, E]
    rank_major = jnp.swapaxes(onehot, 1, 2).reshape(b, k * t, num_experts)
    queued = jnp.cumsum(rank_major, axis=1) - rank_major  # assignments of the same expert ahead in the queue
    position = jnp.sum(queued * rank_major, axis=-1).reshape(b, k, t).swapaxes(1, 2)
    return position, position < slots


def capacity(
    x: jax.Array,
    experts: jax.Array,
    gates: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    capacity_factor: float,
    dot_general: DotGeneral,
    shard: Callable[[jax.Array, tuple], jax.Array],
    gate: jax.Array | None = None,
    gate_dot_general: DotGeneral | None = None,
) -> tuple[jax.Array, jax.Array]:
    """GShard capacity dispatch: one-hot dispatch/combine einsums, each sequence a group of T tokens with
    `capacity_per_group` slots per expert; assignments past capacity are dropped (`capacity_assignment` order).

    Expert parallelism is by annotation only: the dispatched [E, B, C, d] tensor is constrained to
    ("expert", "batch", ...) and XLA inserts the all-to-all.

    Args:
      x: [B, T, d]; experts, gates: [B, T, k]; up: [E, d, h]; down: [E, h, d].
      dot_general: the precision slot's dot_general for the up and down products (batch dimension E).
      gate: [E, d, h] for SwiGLU experts, multiplied through `gate_dot_general`; None for SiLU experts.
    Returns:
      (y [B, T, d] in x.dtype, keep [B, T, k] bool).
    """
    _check_gate(gate, up, gate_dot_general)
    _b, t, k = experts.shape
    num_experts = up.shape[0]
    slots = capacity_per_group(t, k, num_experts, capacity_factor)
    position, keep = capacity_assignment(experts, num_experts, slots)
    expert_1h = jax.nn.one_hot(experts, num_experts, dtype=x.dtype)  # [B, T, k, E]
    slot_1h = jax.nn.one_hot(jnp.where(keep, position, slots), slots, dtype=x.dtype)  # dropped -> all zero
    dispatch = jnp.einsum("btke,btkc->btec", expert_1h, slot_1h)
    combine = jnp.einsum("btke,btkc,btk->btec", expert_1h, slot_1h, gates.astype(x.dtype))
    xe = shard(jnp.einsum("btec,btd->ebcd", dispatch, x), ("expert", "batch", None, "embed"))
    batch_dims = (((3,), (1,)), ((0,), (0,)))
    h = dot_general(xe, up.astype(x.dtype), batch_dims, preferred_element_type=jnp.float32)
    g = None
    if gate is not None:
        assert gate_dot_general is not None  # _check_gate
        g = gate_dot_general(xe, gate.astype(x.dtype), batch_dims, preferred_element_type=jnp.float32)
    h = _hidden(h, g, x.dtype)
    ye = dot_general(h, down.astype(x.dtype), batch_dims, preferred_element_type=jnp.float32).astype(x.dtype)
    ye = shard(ye, ("expert", "batch", None, "embed"))
    y = jnp.einsum("btec,ebcd->btd", combine, ye, preferred_element_type=jnp.float32).astype(x.dtype)
    return y, keep


def expert_parallel_dropless(
    x: jax.Array,
    experts: jax.Array,
    gates: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    axis: str,
    gmm_up: GroupedMatmul,
    gmm_down: GroupedMatmul,
    gate: jax.Array | None = None,
    gmm_gate: GroupedMatmul | None = None,
) -> jax.Array:
    """Dropless dispatch to experts sharded over mesh axis `axis`; call inside `jax.shard_map`.

    Each device holds n local tokens and E_l = E / P consecutive experts (device j: experts j E_l .. (j+1) E_l - 1).
      1. sort the n k local assignments by expert, hence by destination device;
      2. all-to-all fixed-size buffers [P, n k, d] (row c of block j: the c-th assignment bound for device j), with
         the local expert id of each row (E_l marks an empty row);
      3. each device sorts what it received by local expert and runs its experts as one grouped matmul per
         projection (empty rows sort last and are not computed by the grouped matmuls);
      4. all-to-all the results back to the same slots, unsort, and combine with the gates.
    The buffers are sized for the worst case (every assignment to one device), so no token is ever dropped; that
    costs P x the memory and bytes of an exact-size exchange. A ragged all-to-all would remove it where the
    backend supports one.

    Args (per device):
      x: [n, d]; experts, gates: [n, k] (expert ids over all P E_l experts; P E_l = a ghost, never sent);
      up: [E_l, d, h]; down: [E_l, h, d]; gate: [E_l, d, h] for SwiGLU experts (with gmm_gate), else None.
    Returns:
      y: [n, d] in x.dtype.
    """
    n, k = experts.shape
    d, local = x.shape[1], up.shape[0]
    devices = jax.lax.axis_size(axis)
    a = n * k
    flat = experts.reshape(-1)
    order, inverse = _sort_by(flat)
    xs = permute(jnp.repeat(x, k, axis=0), order, inverse)
    sorted_experts = flat[order]
    dest = sorted_experts // local
    counts = jnp.bincount(dest, length=devices)
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(a, dtype=jnp.int32)
    valid = slot[None, :] < counts[:, None]  # [P, a]
    source = jnp.minimum(starts[:, None] + slot[None, :], a - 1)
    send_x = jnp.where(valid[..., None], xs[source], 0)
    send_e = jnp.where(valid, sorted_experts[source] % local, local)
    exchange = functools.partial(jax.lax.all_to_all, axis_name=axis, split_axis=0, concat_axis=0)
    recv_x, recv_e = exchange(send_x).reshape(devices * a, d), exchange(send_e).reshape(devices * a)
    order2, inverse2 = _sort_by(recv_e)
    group_sizes = jnp.bincount(recv_e, length=local).astype(jnp.int32)  # the empty-row marker E_l is not counted
    xs2 = permute(recv_x, order2, inverse2)
    ys = expert_ffn(xs2, group_sizes, up, down, gmm_up, gmm_down, gate=gate, gmm_gate=gmm_gate)
    back = exchange(permute(ys, inverse2, order2).reshape(devices, a, d))
    owner = jnp.minimum(dest, devices - 1)  # ghosts (dest == P) were never sent and get no result
    ys_sorted = jnp.where((dest < devices)[:, None], back[owner, slot - starts[owner]], 0)
    return _combine(ys_sorted, inverse, order, gates)
