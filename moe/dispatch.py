"""Moving tokens to experts and back: dropless (sort + grouped matmul), capacity (GShard einsum), and the
expert-parallel dispatch (exact-size exchanges under `jax.shard_map`: a ragged all-to-all on GPU and TPU, its
fixed-size emulation on the CPU; dropless, or with receive buffers capped at O(tokens per shard) and the drops
counted).

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
from typing import NamedTuple

import jax
import jax.numpy as jnp

from core.model import DotGeneral, GroupedMatmul

__all__ = [
    "EXCHANGES",
    "ExchangePlan",
    "buffer_rows",
    "capacity",
    "capacity_assignment",
    "capacity_per_group",
    "dropless",
    "exchange_plan",
    "expert_ffn",
    "expert_parallel",
    "expert_parallel_dropless",
    "padded_ragged_all_to_all",
    "permute",
    "resolve_exchange",
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


EXCHANGES = ("auto", "padded", "ragged")


class ExchangePlan(NamedTuple):
    """One shard's arguments of a ragged all-to-all over P shards (`jax.lax.ragged_all_to_all`'s names), [P] int32
    each: it sends operand[input_offsets[j] : input_offsets[j] + send_sizes[j]] to shard j, which writes them at
    its rows output_offsets[j] ..., and it receives recv_sizes[j] rows from shard j."""

    input_offsets: jax.Array
    send_sizes: jax.Array
    output_offsets: jax.Array
    recv_sizes: jax.Array


def buffer_rows(assignments: int, devices: int, capacity_factor: float | None) -> int:
    """R, the rows of each shard's receive buffer for `assignments` (n k) sent by each of `devices` (P) shards.

    capacity_factor None: R = P n k, the exact worst case (every shard sends everything to one), so nothing is ever
    dropped, at P times the memory of a balanced routing. A factor c: R = min(P n k, ceil(c n k)), O(n k) whatever
    P (a balanced routing sends each shard n k rows), and assignments past R are dropped and counted
    (`exchange_plan`). A cap is the choice here rather than a two-pass exchange (counts first, then a buffer sized
    to the largest count): a buffer's size must be static under jit, so a second pass would recompile per size.
    Raises ValueError for a factor <= 0."""
    if capacity_factor is None:
        return devices * assignments
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor = {capacity_factor!r}; allowed: None (no cap) or a number > 0.")
    return max(1, min(devices * assignments, math.ceil(capacity_factor * assignments)))


def exchange_plan(counts: jax.Array, index: jax.Array | int, rows: int) -> tuple[ExchangePlan, ExchangePlan]:
    """The exact-size exchange of assignments to experts and of their results back, for shard `index`.

    Args:
      counts: [P, P, k] int32, counts[s, d, r] = assignments of choice rank r (a token's r-th expert) that shard s
        sends to shard d; every shard lays out its sends grouped by destination, then by rank.
      index: this shard (0 <= index < P).
      rows: R, the rows of each receive buffer (`buffer_rows`).
    Returns:
      (forward, back): `forward` sends the kept assignments (each shard's buffer is filled rank-major: every first
      choice, in source order, before any second choice; so past R the last ranks of the last sources drop, and the
      kept rows of each (source, destination) pair are a prefix of its block); `back` returns the results to the
      rows they came from (its output_offsets are the forward input_offsets, so a sender's result buffer is aligned
      with its sorted assignments). forward.send_sizes <= counts.sum(-1)[index]; the difference is this shard's
      dropped assignments per destination.
    """
    counts = jnp.asarray(counts, jnp.int32)
    p, _, k = counts.shape
    rank_major = jnp.transpose(counts, (1, 2, 0)).reshape(p, k * p)  # [d, (r, s)]
    before = jnp.cumsum(rank_major, axis=1) - rank_major
    kept = jnp.clip(rows - before, 0, rank_major).reshape(p, k, p).transpose(2, 0, 1).sum(-1)  # [s, d]
    totals = counts.sum(-1)  # [s, d]
    input_offsets = jnp.cumsum(totals, axis=1) - totals  # where each destination's block starts in a sender
    output_offsets = jnp.cumsum(kept, axis=0) - kept  # where each source's rows start in a receiver
    forward = ExchangePlan(input_offsets[index], kept[index], output_offsets[index], kept[:, index])
    back = ExchangePlan(output_offsets[:, index], kept[:, index], input_offsets[:, index], kept[index])
    return forward, back


def padded_ragged_all_to_all(
    operand: jax.Array, output: jax.Array, plan: ExchangePlan, *, axis_name: str, block: int | None = None
) -> jax.Array:
    """`jax.lax.ragged_all_to_all(operand, output, *plan, axis_name=axis_name)` through a fixed-size all_to_all,
    for backends without the op (XLA:CPU): each slice travels in a block of `block` rows (default: the most a slice
    can hold, min(operand rows, output rows)), so it moves P blocks per shard whatever the sizes. Same result, same
    argument contract (send_sizes equal to the receivers' recv_sizes; slices within bounds)."""
    p = plan.send_sizes.shape[0]
    block = min(operand.shape[0], output.shape[0]) if block is None else block
    r = jnp.arange(block, dtype=jnp.int32)
    source = jnp.minimum(plan.input_offsets[:, None] + r, operand.shape[0] - 1)  # [P, block]
    mask = (r < plan.send_sizes[:, None]).reshape((p, block) + (1,) * (operand.ndim - 1))
    send = jnp.where(mask, operand[source], jnp.zeros((), operand.dtype))
    exchange = functools.partial(jax.lax.all_to_all, axis_name=axis_name, split_axis=0, concat_axis=0)
    received, offsets = exchange(send), exchange(plan.output_offsets.reshape(p, 1)).reshape(p)
    target = jnp.where(r < plan.recv_sizes[:, None], offsets[:, None] + r, output.shape[0])  # past the end: dropped
    return output.at[target.reshape(-1)].set(received.reshape((p * block,) + operand.shape[1:]), mode="drop")


def resolve_exchange(exchange: str) -> str:
    """ "auto" -> "ragged" on GPU and TPU (XLA has the ragged all-to-all there), "padded" elsewhere (XLA:CPU refuses
    the op: "HLO opcode ragged-all-to-all is not supported"); "padded" and "ragged" as given. ValueError otherwise."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange = {exchange!r}; allowed: {list(EXCHANGES)}.")
    if exchange == "auto":
        return "ragged" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "padded"
    return exchange


def expert_parallel(
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
    exchange: str = "auto",
    capacity_factor: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Dispatch to experts sharded over mesh axis `axis`, with exact-size exchanges; call inside `jax.shard_map`.

    Each shard holds n local tokens and E_l = E / P consecutive experts (shard j: experts j E_l .. (j+1) E_l - 1).
      1. sort the n k local assignments by destination shard, then by choice rank (ghosts last, never sent);
      2. all-gather the counts per (destination, rank), [P, k] int32 per shard: every shard then computes the same
         plan (`exchange_plan`), one small collective instead of an all-to-all of counts and another of offsets;
      3. send exactly the kept rows (and their local expert ids) into each receiver's buffer of R rows
         (`buffer_rows`): R = P n k without a cap, nothing dropped; ceil(capacity_factor n k) with one, O(n k)
         whatever P, dropping past R rank-major (every first choice before any second choice);
      4. sort the received rows by local expert and run the experts as one grouped matmul per projection (the
         buffer's unused rows carry the id E_l and are not computed);
      5. send the results back to the rows they came from, and combine with the gates.
    The transport (`exchange`): "ragged" is `jax.lax.ragged_all_to_all` (the bytes on the wire are the kept rows'
    alone; GPU and TPU); "padded" moves each slice in a fixed block of n k rows through `jax.lax.all_to_all`
    (`padded_ragged_all_to_all`, P n k rows per shard: XLA:CPU has no ragged all-to-all); "auto" picks by backend
    (`resolve_exchange`). Both compute the same plan, hence the same kept set and the same result.

    Args (per shard):
      x: [n, d]; experts, gates: [n, k] (expert ids over all P E_l experts; P E_l = a ghost, never sent);
      up: [E_l, d, h]; down: [E_l, h, d]; gate: [E_l, d, h] for SwiGLU experts (with gmm_gate), else None.
      capacity_factor: None (no cap) or > 0.
    Returns:
      (y [n, d] in x.dtype, keep [n, k] bool: False where the cap dropped the assignment; a dropped assignment
      contributes zero, like a capacity dispatch's).
    """
    kind = resolve_exchange(exchange)
    n, k = experts.shape
    d, local = x.shape[1], up.shape[0]
    devices = jax.lax.axis_size(axis)
    a = n * k
    rows = buffer_rows(a, devices, capacity_factor)
    flat = experts.reshape(-1)
    dest = jnp.minimum(flat // local, devices)  # devices = a ghost
    key = dest * k + jnp.tile(jnp.arange(k, dtype=jnp.int32), n)
    order, inverse = _sort_by(key)
    xs = permute(jnp.repeat(x, k, axis=0), order, inverse)
    sorted_dest = dest[order]
    sorted_local = jnp.where(sorted_dest < devices, flat[order] % local, local)
    counts = jnp.bincount(key, length=(devices + 1) * k)[: devices * k].astype(jnp.int32).reshape(devices, k)
    index = jax.lax.axis_index(axis)
    forward, back = exchange_plan(jax.lax.all_gather(counts, axis), index, rows)

    def transport(operand, output, plan, block):
        if kind == "ragged":
            return jax.lax.ragged_all_to_all(operand, output, *plan, axis_name=axis)
        return padded_ragged_all_to_all(operand, output, plan, axis_name=axis, block=block)

    block = min(a, rows)  # the most rows one (source, destination) pair exchanges
    recv_x = transport(xs, jnp.zeros((rows, d), x.dtype), forward, block)
    recv_e = transport(sorted_local, jnp.full((rows,), local, jnp.int32), forward, block)
    order2, inverse2 = _sort_by(recv_e)
    group_sizes = jnp.bincount(recv_e, length=local).astype(jnp.int32)  # the unused-row marker E_l is not counted
    ys = expert_ffn(
        permute(recv_x, order2, inverse2), group_sizes, up, down, gmm_up, gmm_down, gate=gate, gmm_gate=gmm_gate
    )
    ys_sorted = transport(permute(ys, inverse2, order2), jnp.zeros((a, d), x.dtype), back, block)
    owner = jnp.minimum(sorted_dest, devices - 1)
    position = jnp.arange(a, dtype=jnp.int32) - forward.input_offsets[owner]
    kept_sorted = (sorted_dest == devices) | (position < forward.send_sizes[owner])  # ghosts are not drops
    return _combine(ys_sorted, inverse, order, gates), kept_sorted[inverse].reshape(n, k)


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
    exchange: str = "auto",
) -> jax.Array:
    """`expert_parallel` without a cap (receive buffers of P n k rows, nothing dropped): y [n, d] alone."""
    y, _ = expert_parallel(
        x,
        experts,
        gates,
        up,
        down,
        axis=axis,
        gmm_up=gmm_up,
        gmm_down=gmm_down,
        gate=gate,
        gmm_gate=gmm_gate,
        exchange=exchange,
    )
    return y
