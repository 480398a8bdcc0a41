"""Low-bit synchronisation of FoMoE sites: a quantised mean over each parameter's site group, with error feedback
(docs/fomoe.md, "Beyond the paper"; INTELLECT-1 arXiv 2412.01152, Streaming DiLoCo arXiv 2501.18512, MuLoCo arXiv
2505.23725).

What a round sends is quantised, what sites keep is not. `compressed_average(values, start, ...)` returns, for every
averaged leaf, start + D(mean over the leaf's group of Q(values - start + e)): the change since the round's start
(identical on every site of a group: the state a round starts from is the synchronised one) travels in a
core.codec.WireFormat, and the mean is never a sum of low-bit values. Per group (dense leaves: all M sites; expert
leaves: the O_e-site replica group), every site

  1. concatenates its leaves' sends x = values - start + e into one float32 buffer, zero-padded to a multiple of
     n G (n the group's size, G the format's block) and split into n chunks;
  2. encodes the n chunks and exchanges them (all-to-all: chunk j goes to the group's j-th site);
  3. as owner of one chunk, decodes the n sites' copies of it and sums them in float32, divides by n, encodes the
     mean (the format's rounding) and all-gathers it;
  4. decodes the n gathered chunks: every site of the group holds the same mean.

Wire bytes per site per group: (n - 1) / n of the encoded buffer in each of steps 2 and 3, so with N padded values,
2 (n - 1) / n N (b / 8 + s / G), moe.system_model.wire_bytes. Groups of one site (O_e = 1's experts) send nothing
and keep their values exactly.

A sparse format (`WireFormat.gathered`: topk2, SparseLoCo arXiv 2508.15706) keeps each site's top-k per chunk, and a
mean of n sparse messages is not sparse: every site encodes its whole buffer (padded to whole chunks) once, the
messages are all-gathered, and every site decodes the n messages and sums them in the same order, so the group
holds one mean that is never re-encoded: (n - 1) N (2 keep + 8) / G bytes per site.

Error feedback (EF21 family): e_0 = 0, e_{r+1} = x_r - D(Q(x_r)), what step 2's encoding dropped, per site and leaf,
float32; it is state (checkpointed with the round). The owner's second rounding (step 3) is not fed back: it is the
same on every site of the group, so the sites stay equal. Stochastic rounding draws from the site's own key, folded
with the round, so a resumed run repeats the draws.

One device per site (mesh.expert = 1): `moe.federation.site_mesh(sites, overlap)`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from core.codec import WireFormat
from moe import federation

__all__ = ["compressed_average", "group_values", "init_feedback"]


def _compressed(flag, x) -> bool:
    return flag is not None and jnp.issubdtype(x.dtype, jnp.inexact)


def init_feedback(values, flags, sites: int, overlap: int):
    """The error-feedback state of `compressed_average`: float32 zeros like each leaf of `values` (stacked [M, ...])
    that is averaged over a group of more than one site, None for the others (not averaged, integer, or O_e = 1's
    experts)."""
    sizes = {True: overlap, False: sites}
    leaves, treedef = jax.tree.flatten(values)
    out = [
        jnp.zeros(x.shape, jnp.float32) if _compressed(f, x) and sizes[bool(f)] > 1 else None
        for x, f in zip(leaves, federation.leaf_flags(flags, values))
    ]
    return jax.tree.unflatten(treedef, out)


def group_values(values, flags, sites: int, overlap: int) -> dict[bool, int]:
    """{False: dense, True: expert} values per site that `compressed_average` sends over groups of more than one site
    (before padding): the inputs of moe.system_model.wire_bytes."""
    sizes, out = {True: overlap, False: sites}, {False: 0, True: 0}
    for x, f in zip(jax.tree.leaves(values), federation.leaf_flags(flags, values)):
        if _compressed(f, x) and sizes[bool(f)] > 1:
            out[bool(f)] += x.size // sites
    return out


def _group_sizes(mesh) -> dict[bool, int]:
    shape = dict(mesh.shape)
    return {True: shape["replica"], False: shape["replica"] * shape["block"]}


def compressed_average(values, start, flags, mesh, fmt: WireFormat, keys: jax.Array, feedback=None, decay=1.0):
    """Averages stacked per-site trees through low-bit messages (module docstring).

    Args:
      values: leaves [M, ...], site s's value at index s (e.g. the parameters after the local steps).
      start: `values`' structure: the synchronised values the round started from (equal within each group).
      flags: as `moe.federation.average`'s is_expert (True: the replica group, False: all sites, None: kept).
      mesh: the site mesh with one device per site.
      fmt: the wire format (not float32: that is `moe.federation.average`).
      keys: [M] PRNG keys (one per site; stochastic rounding only), e.g. folded with the round.
      feedback: `init_feedback`'s tree (error feedback on), or None (off).
      decay: beta, the share of the feedback added to the send (SparseLoCo's e <- beta e + Delta); 1: all of it.
    Returns:
      (averaged, feedback'): leaves not averaged (None flags, integers) are `values`' own; feedback' is None when
      `feedback` is.
    """
    if federation.devices_per_site(mesh) != 1:
        raise ValueError(
            f"low-bit synchronisation runs on a site mesh with one device per site (this `mesh` has "
            f"{federation.devices_per_site(mesh)}: moe.federation.site_mesh(..., expert=1))."
        )
    leaves, treedef = jax.tree.flatten(values)
    starts = jax.tree.leaves(start)  # (`values`' structure)
    flag_list = federation.leaf_flags(flags, values)
    fb = [None] * len(leaves) if feedback is None else jax.tree.leaves(feedback, is_leaf=lambda x: x is None)
    sizes = _group_sizes(mesh)
    groups = {
        g: [i for i, (x, f) in enumerate(zip(leaves, flag_list)) if _compressed(f, x) and bool(f) == g]
        for g in (False, True)
        if sizes[g] > 1
    }
    spec = PartitionSpec(federation.SITE_AXES)
    fed = [i for g in groups.values() for i in g if fb[i] is not None]

    def local(key, xs, ss, es):
        key = key[0]
        out, new_fb = list(xs), dict(zip(fed, es))
        for g, members in groups.items():
            axes = "replica" if g else federation.SITE_AXES
            sends = [xs[i][0].astype(jnp.float32) - ss[i][0] for i in members]
            sends = [x + decay * new_fb[i][0] if i in new_fb else x for x, i in zip(sends, members)]
            mean, dropped = _group_mean(sends, axes, sizes[g], fmt, jax.random.fold_in(key, int(g)))
            for i, m, d in zip(members, mean, dropped):
                out[i] = (ss[i][0] + m).astype(xs[i].dtype)[None]
                if i in new_fb:
                    new_fb[i] = d[None]
        return out, [new_fb[i] for i in fed]

    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(spec, [spec] * len(leaves), [spec] * len(leaves), [spec] * len(fed)),
        out_specs=([spec] * len(leaves), [spec] * len(fed)),
    )
    out, fb_out = mapped(keys, leaves, starts, [fb[i] for i in fed])
    averaged = jax.tree.unflatten(treedef, out)
    if feedback is None:
        return averaged, None
    fb_new = list(fb)
    for i, e in zip(fed, fb_out):
        fb_new[i] = e
    return averaged, jax.tree.unflatten(treedef, fb_new)


def _group_mean(sends, axes, n: int, fmt: WireFormat, key):
    """One site's part of a group's quantised mean: (the group's mean of each send, what this site's encoding of
    each send dropped), both float32 of the sends' shapes."""
    flat = jnp.concatenate([x.reshape(-1) for x in sends])
    size = flat.size
    if fmt.gathered:
        buf = jnp.pad(flat, (0, -size % fmt.unit))[None]
        encoded = fmt.encode(buf, key)
        dropped = (buf - fmt.decode(encoded)).reshape(-1)
        messages = tuple(jax.lax.all_gather(a[0], axes, tiled=False) for a in encoded)  # [n, ...]
        gathered = jnp.sum(fmt.decode(messages), axis=0) / n
        return _split(gathered, dropped, sends)
    chunk = math.ceil(size / (n * fmt.unit)) * fmt.unit
    buf = jnp.pad(flat, (0, n * chunk - size)).reshape(n, chunk)
    first, second = jax.random.split(key)
    encoded = fmt.encode(buf, first)
    dropped = (buf - fmt.decode(encoded)).reshape(-1)
    mine = fmt.decode(tuple(jax.lax.all_to_all(a, axes, 0, 0, tiled=False) for a in encoded))  # [n, chunk]
    reduced = fmt.encode(jnp.sum(mine, axis=0, keepdims=True) / n, second)
    gathered = fmt.decode(tuple(jax.lax.all_gather(a[0], axes, tiled=False) for a in reduced)).reshape(-1)
    return _split(gathered, dropped, sends)


def _split(gathered, dropped, sends):
    """The flat mean and drops cut back into the sends' shapes."""
    means, drops, offset = [], [], 0
    for x in sends:
        means.append(gathered[offset : offset + x.size].reshape(x.shape))
        drops.append(dropped[offset : offset + x.size].reshape(x.shape))
        offset += x.size
    return means, drops
