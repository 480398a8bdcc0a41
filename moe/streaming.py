"""Streaming synchronisation: the parameters in F fragments synchronised in turn, each one's synchronisation running
behind the next round's local steps (Streaming DiLoCo, arXiv 2501.18512, on FoMoE's LocalAdamW rounds; docs/fomoe.md,
"Synchronisation behind compute").

Fragments (as Streaming DiLoCo's, strided by layer): fragment f holds the blocks l with l mod F = f, and fragment 0
also what lies outside the blocks (the embedding, the final norm); each holds its parameters' optimizer state. With
F = 1 it is every parameter.

Schedule, round r = 0, 1, ... (K local steps each), delay tau:
  tau = 0   after round r's local steps, fragment r mod F is averaged (blocking; F = 1 is plain LocalAdamW).
  tau = 1   round r's local steps start from the state S_r that round r - 1 ended with, and meanwhile (r >= 1)
            fragment (r - 1) mod F of S_r is averaged: A = mean over the group of S_r's fragment. Once both are
            done, the fragment's leaves (parameters and first moments) become
                theta <- theta + alpha (A - S_r)        (every other leaf: theta, round r's local result)
            so each site keeps its own progress of round r and takes the group's correction of what it had at the
            round's start (delayed averaging; alpha = `mixing`, 1 = the whole correction). Second moments stay with
            each site (fomoe.second_moments = 'local'): a delayed correction could make one negative. Nothing is
            in flight between rounds, so a checkpoint after any round resumes exactly.
DiLoCo and low-bit synchronisation (Streaming DiLoCo's own setting, its outer gradients in 4 bits) need the value a
fragment's synchronisation starts from, equal within each group: the fragment's anchor A (FederatedState.anchor,
checkpointed), its value after its last synchronisation. Its synchronisation averages in A's terms, A + mean(S - A)
(low-bit: each site's S - A quantised, with error feedback when asked), and DiLoCo takes Delta = A - mean(S) and an
outer Nesterov step on the fragment's parameters and momentum only, A <- A - lr (Delta + mu v); then A becomes the
synchronised value, which replaces the fragment (tau = 0) or corrects it as above (tau = 1, A the mean).
Each round therefore moves one fragment's bytes (about 1/F of all), and with tau = 1 a round takes about
max(compute, synchronisation) where the runtime runs a collective while compute runs: on XLA:CPU with gloo it does
when the two programs are dispatched from two threads (experiments.bench.overlap measures it), which is how
`overlapped` runs them.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import optax

from moe import desloc, federation
from moe import rounds as rounds_lib

__all__ = ["StreamingRound", "anchor_kind", "fragments", "make_merge", "overlapped", "synced_fragment"]


def _block_index(path) -> int | None:
    """The l of a parameter under blocks/l/..., else None."""
    names = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path]
    for a, b in itertools.pairwise(names):
        if a == "blocks" and isinstance(b, int):
            return b
    return None


def fragments(params: Any, count: int) -> list[Any]:
    """`count` trees of bools shaped like `params` (nnx.State or any tree whose block parameters sit under
    "blocks"/l): fragment f marks the blocks l with l mod count = f, fragment 0 also every parameter outside the
    blocks. Raises ValueError for a count that leaves a fragment empty."""
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    blocks = [_block_index(p) for p in paths]
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"fragments = {count!r}: a positive integer.")
    out = []
    for f in range(count):
        marks = [(b % count == f) if b is not None else f == 0 for b in blocks]
        if not any(marks):
            layers = len({b for b in blocks if b is not None})
            raise ValueError(f"fragments = {count} with {layers} blocks: fragment {f} would hold no parameter.")
        out.append(jax.tree.unflatten(jax.tree.structure(params), marks))
    return out


def anchor_kind(method: str, wire, fragments_count: int, delay: int, moment_periods=(1, 1)) -> str | None:
    """What FederatedState.anchor holds for these rounds (moe.rounds.init_sites' `anchor`): what the
    synchronisation needs of its start (moe.rounds.round_start) when not every value is synchronised every round,
    under streaming synchronisation (F > 1 or delay 1) or DES-LOC's moment periods (a moment's last synchronised
    value, equal within its group, is what a low-bit send is a change from); else None."""
    # DiLoCo's inner moments average exactly (float32): their last synchronised value is not needed
    desynced = tuple(moment_periods) != (1, 1) and method == "local_adamw"
    partial = fragments_count > 1 or delay > 0 or desynced
    return rounds_lib.round_start(method, wire) if partial else None


def synced_fragment(call: int, count: int, delay: int) -> int | None:
    """The fragment a round averages: round `call`'s own (call mod F) with delay 0; with delay 1 the previous
    round's ((call - 1) mod F), none in round 0."""
    if delay == 0:
        return call % count
    return None if call == 0 else (call - 1) % count


def make_merge(mesh, optimizer: optax.GradientTransformation, fragment: Any, mixing: float) -> Callable:
    """A jitted `(train, synced, start) -> train` (stacked TrainStates, no collectives): the fragment's parameters
    and the optimizer leaves mirroring them (moe.rounds.moment_flags) become train + mixing (synced - start); every
    other leaf is train's."""

    def one_site(train, synced, start):
        def mix(flags, now, avg, before):
            leaves = federation.leaf_flags(flags, now)
            return jax.tree.unflatten(
                jax.tree.structure(now),
                [
                    x if f is None else x + mixing * (a - b)
                    for f, x, a, b in zip(leaves, jax.tree.leaves(now), jax.tree.leaves(avg), jax.tree.leaves(before))
                ],
            )

        flags = rounds_lib.masked_flags(federation.expert_flags(train.params), train.params, fragment)
        moments = rounds_lib.moment_flags(optimizer, train.opt_state, train.params, fragment)
        first, _ = rounds_lib.split_second_moments(moments, train.opt_state)
        params = mix(flags, train.params, synced.params, start.params)
        opt_state = mix(first, train.opt_state, synced.opt_state, start.opt_state)
        return train._replace(params=params, opt_state=opt_state)

    return jax.jit(federation.per_site(one_site, mesh, (0, 0, 0), 0))


def overlapped(
    sync: Callable[[], Any], local: Callable[[], Any], then: Callable[[Any], Any] | None = None
) -> tuple[Any, Any, float, float, Any]:
    """Runs `sync()` in a second thread while `local()` runs in this one, each waited for (jax.block_until_ready):
    (sync's result, local's result, sync's seconds, local's seconds, `then(local's result)`). `then` is called in
    this thread once local's result is ready and before waiting for sync: work dispatched there (not waited for)
    runs while the synchronisation still does. It must start no collective across processes: XLA:CPU's gloo
    collectives all use one tag, so two in flight at once could take each other's messages. An exception in either
    thread is raised here."""
    box: dict[str, Any] = {}

    def run_sync():
        t0 = time.perf_counter()
        try:
            box["out"] = jax.block_until_ready(sync())
        except BaseException as e:  # raised in the caller's thread below
            box["error"] = e
        box["seconds"] = time.perf_counter() - t0

    thread = threading.Thread(target=run_sync, name="fomoe-sync", daemon=True)
    thread.start()
    t0 = time.perf_counter()
    try:
        out = jax.block_until_ready(local())
        local_seconds = time.perf_counter() - t0
        extra = then(out) if then is not None else None
    finally:
        thread.join()
    if "error" in box:
        raise box["error"]
    return box["out"], out, box["seconds"], local_seconds, extra


class StreamingRound:
    """A federated round under the streaming schedule (module docstring), compiled once: `compile(state, tokens)`
    (ahead of time, for the state's shapes and shardings; returns each fragment's synchronisation program text),
    then `state, metrics, probed, seconds = round(state, call, tokens, probe)`: `probed` is `probe(train)` of the
    sites' state after their local steps and before any averaging (the loss jump; None without a probe), called
    once the local steps are done (blocking: waited for before the synchronisation, which donates `train`; behind
    compute: dispatched while the synchronisation still runs, not waited for, so it must start no collective across
    processes: `overlapped`); `seconds` {"local_steps", "sync"}.

    With fragments = 1 and delay = 0 it is moe.rounds.make_round_parts' round; otherwise, for DiLoCo or a low-bit
    wire, the state holds its anchor (moe.rounds.init_sites with `anchor_kind`), and LocalAdamW with delay 1 keeps
    second moments on each site (ValueError otherwise, naming the argument). `moment_periods` (p_u, p_v): DES-LOC's
    schedule for LocalAdamW or DiLoCo's inner moments (moe.desloc.own_cycle; (1, 1): the method's own), blocking
    (delay = 0) only; with F fragments each fragment follows the schedule over its own synchronisations (round
    `call` is fragment call mod F's (call // F)-th), so every fragment's moments are averaged every p_u-th / p_v-th
    time it is.
    `kwargs`: make_round_parts' (method, outer, loss_fn, state_metrics, wire, error_feedback, second_moments).

    `variants`: one (fragment mask, moment groups, share of rounds) per compiled synchronisation, in the order of
    `compile`'s texts: each fragment with each distinct moment set of the DES-LOC cycle."""

    def __init__(self, graphdef, optimizer, mesh, params, *, fragments_count: int = 1, delay: int = 0,
                 mixing: float = 1.0, moment_periods=(1, 1), **kwargs):  # fmt: skip
        if delay not in (0, 1):
            raise ValueError(f"delay = {delay!r}: allowed 0 (blocking) or 1 (one round late, behind compute).")
        if not 0.0 < mixing <= 1.0:
            raise ValueError(f"mixing = {mixing!r}: allowed (0, 1].")
        streaming = fragments_count > 1 or delay > 0
        self.method, self.wire, self.delay = str(kwargs.get("method")), kwargs.get("wire"), delay
        if delay and self.method == "local_adamw" and kwargs.get("second_moments", "sent") != "local":
            raise ValueError("delay = 1 keeps second moments on each site: second_moments must be 'local'.")
        self.periods = desloc.check_periods(moment_periods)
        if self.periods != (1, 1) and (delay or self.method not in ("local_adamw", "diloco")):
            raise ValueError(
                f"moment periods = {self.periods} (DES-LOC): LocalAdamW or DiLoCo with delay = 0 only "
                f"(got outer method {self.method!r}, delay {delay})."
            )
        self.anchored = anchor_kind(self.method, self.wire, fragments_count, delay, self.periods) is not None
        self.masks = fragments(params, fragments_count) if streaming else [None]
        self.cycle = cycle = desloc.own_cycle(self.method, self.periods)
        self.moment_sets = list(dict.fromkeys(cycle))  # distinct, in the cycle's order
        self.variants = [
            (m, ms, cycle.count(ms) / (len(cycle) * len(self.masks))) for m in self.masks for ms in self.moment_sets
        ]
        parts = [
            rounds_lib.make_round_parts(
                graphdef, optimizer, mesh, fragment=m, anchored=self.anchored, donate=not delay, moments=ms, **kwargs
            )
            for m, ms, _ in self.variants
        ]
        self.local: Any = parts[0][0]  # jitted, then (`compile`) compiled
        self.syncs: list[Any] = [p[1] for p in parts]
        self.merges: list[Any] = [make_merge(mesh, optimizer, m, mixing) for m in self.masks] if delay else []

    def compile(self, state, tokens) -> list[str]:
        if self.anchored != bool(jax.tree.leaves(state.anchor)):
            raise ValueError(
                f"the state {'has no' if self.anchored else 'has an'} anchor; these rounds "
                f"{'need' if self.anchored else 'take none'} (moe.rounds.init_sites' anchor, `anchor_kind`)."
            )
        others = state.train._replace(params=None)
        self.local = self.local.lower(state.train.params, others, tokens).compile()
        start = self._start(state)
        self.syncs = [s.lower(start, state.outer, state.feedback, state.train).compile() for s in self.syncs]
        self.merges = [m.lower(state.train, state.train, state.train).compile() for m in self.merges]
        texts = [s.as_text() for s in self.syncs]
        assert all(t is not None for t in texts)  # None only where a backend has no text form
        return texts

    def _start(self, state):
        return state.anchor if self.anchored else rounds_lib.start_of(state.train, self.method, self.wire)

    def __call__(self, state, call: int, tokens, probe: Callable[[Any], Any] | None = None):
        start = self._start(state)
        fragment = synced_fragment(call, len(self.masks), self.delay)
        if fragment is not None:  # the variant compiled for this fragment and this round's moment groups
            own = self.cycle[(call // len(self.masks)) % len(self.cycle)]  # the fragment's own schedule
            fragment = fragment * len(self.moment_sets) + self.moment_sets.index(own)

        def local():
            return self.local(state.train.params, state.train._replace(params=None), tokens)

        if not self.delay:
            assert fragment is not None  # (delay 0 averages a fragment every round)
            t0 = time.perf_counter()
            train, metrics = jax.block_until_ready(local())
            local_s = time.perf_counter() - t0
            # waited for here, or the synchronisation (which donates `train`) would wait for it inside its timing
            probed = jax.block_until_ready(probe(train)) if probe else None
            t1 = time.perf_counter()
            out = jax.block_until_ready(self.syncs[fragment](start, state.outer, state.feedback, train))
            return out, metrics, probed, {"local_steps": local_s, "sync": time.perf_counter() - t1}
        if fragment is None:  # round 0: nothing to average yet
            t0 = time.perf_counter()
            train, metrics = jax.block_until_ready(local())
            seconds = {"local_steps": time.perf_counter() - t0, "sync": 0.0}
            return state._replace(train=train), metrics, probe(train) if probe else None, seconds
        synced, (train, metrics), sync_s, local_s, probed = overlapped(
            lambda: self.syncs[fragment](start, state.outer, state.feedback, state.train),
            local,
            (lambda out: probe(out[0])) if probe else None,
        )
        merged = self.merges[fragment](train, synced.train, state.train)
        return synced._replace(train=merged), metrics, probed, {"local_steps": local_s, "sync": sync_s}
