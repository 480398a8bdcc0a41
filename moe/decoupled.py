"""Decoupled DiLoCo's synchroniser (Douillard et al., "Decoupled DiLoCo for Resilient Distributed Pre-training",
arXiv 2604.21428): learners train on their own clocks and send fragment pseudo-gradients; the synchroniser merges
each fragment once a minimum quorum of learners has sent it, waiting a grace window for the rest, weighting each
contribution by the tokens behind it, and steps the fragment's global parameters with an outer optimizer.

This module is the synchroniser's state machine only: host NumPy arrays in, host arrays out, the clock passed in
(`now`, seconds), no sockets and no threads, so that every rule below is a pure function of the events it is given
(experiments.decoupled serves it over TCP to learner processes).

The rules, per fragment p (a list of float32 arrays, e.g. moe.streaming.fragments' leaves):

- A learner that starts from version v of p sends `delta = (p at v) - (its p after local steps)` with the tokens and
  the steps behind it (`Contribution`).
- Merge when the pending contributions come from at least `quorum` distinct learners and either every live learner
  has one pending or `grace` seconds have passed since the quorum was reached. A learner that leaves (its connection
  lost) no longer counts as live: it is not waited for. Fewer than `quorum` learners: no merge (the run waits).
- The merged pseudo-gradient is the weighted mean of the pending deltas, weights `merge_weights`: tokens times
  tokens per step (the paper's token weighting; at equal batch sizes, weights proportional to tokens), summed in
  float64 in learner order (a merge does not depend on the order of arrival). The outer optimizer
  (optim.diloco_outer: Nesterov SGD) steps p with it; the version becomes v + 1.
- Every learner whose contribution was merged receives the new p. A contribution based on a version older than the
  current one (its learner missed a merge) is kept for the next merge, and its learner receives the current p at
  once: a late learner never waits.
- At the end of a run (`finish`), what reaches the quorum merges and the rest is dropped.

Not built: the paper's adaptive grace window (here fixed) and its radial-directional averaging.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
import optax

__all__ = ["Contribution", "Merge", "Reply", "Synchroniser", "merge_weights"]


@dataclasses.dataclass(frozen=True)
class Contribution:
    """One learner's pseudo-gradient of one fragment: `delta` (arrays shaped like the fragment's) = the fragment at
    version `base` minus the learner's after `steps` local steps over `tokens` tokens."""

    learner: int
    fragment: int
    delta: list[np.ndarray]
    tokens: int
    steps: int
    base: int


@dataclasses.dataclass(frozen=True)
class Reply:
    """What a learner is sent: fragment `fragment` at `version`."""

    learner: int
    fragment: int
    params: list[np.ndarray]
    version: int


@dataclasses.dataclass(frozen=True)
class Merge:
    """A merge's record: when, which fragment, whose contributions (learner, tokens, staleness in versions)."""

    time: float
    fragment: int
    version: int
    learners: tuple[int, ...]
    tokens: int
    staleness: tuple[int, ...]


def merge_weights(tokens, steps) -> np.ndarray:
    """Normalised weights of contributions with these token and step counts: tokens x tokens per step (arXiv
    2604.21428's token-weighted merge). Raises ValueError for no contribution or a non-positive count."""
    tokens, steps = np.asarray(tokens, np.float64), np.asarray(steps, np.float64)
    if tokens.size == 0 or tokens.shape != steps.shape or (tokens <= 0).any() or (steps <= 0).any():
        raise ValueError(
            f"merge_weights: tokens {tokens.tolist()} and steps {steps.tolist()} must be positive, paired."
        )
    w = tokens * (tokens / steps)
    return w / w.sum()


class Synchroniser:
    """The fragments' global parameters, their outer optimizer states, versions and pending contributions.

    Args:
      fragments: the initial global parameters, one list of arrays per fragment (copied, kept in float32).
      outer: the outer optimizer, one state per fragment (`outer.update(delta, state, params)`, as DiLoCo's).
      learners: how many learners the run has (ids 0 .. learners - 1).
      quorum: the minimum number of distinct learners a merge takes (1 .. learners).
      grace: seconds a reached quorum waits for the remaining live learners (>= 0).
    Refuses (ValueError, naming the argument) a quorum outside 1..learners or a negative grace.
    """

    def __init__(
        self,
        fragments: list[list[Any]],
        outer: optax.GradientTransformation,
        *,
        learners: int,
        quorum: int,
        grace: float,
    ):
        if not 1 <= quorum <= learners:
            raise ValueError(f"quorum = {quorum}: allowed 1..learners ({learners}).")
        if not grace >= 0:  # NaN included
            raise ValueError(f"grace = {grace}: seconds, >= 0.")
        self.outer, self.learners, self.quorum, self.grace = outer, learners, quorum, grace
        self.params = [[np.array(a, np.float32) for a in f] for f in fragments]
        self.states = [outer.init(f) for f in self.params]
        self.versions = [0] * len(self.params)
        self.pending: list[list[Contribution]] = [[] for _ in self.params]
        self.quorum_since: list[float | None] = [None] * len(self.params)
        self.live: set[int] = set()
        self.merges: list[Merge] = []

    def join(self, learner: int) -> list[Reply]:
        """A learner (re)connects: it counts as live and receives every fragment at its current version."""
        self._check_learner(learner)
        self.live.add(learner)
        return [Reply(learner, p, self._copy(p), v) for p, v in enumerate(self.versions)]

    def leave(self, learner: int, now: float) -> list[Reply]:
        """A learner is lost: it is no longer waited for (its pending contributions stay). Returns the replies of
        the merges this makes due."""
        self.live.discard(learner)
        return self.poll(now)

    def submit(self, c: Contribution, now: float) -> list[Reply]:
        """Queues a contribution; returns the replies due now (the late learner's, and those of merges it
        completes). Raises ValueError for an unknown fragment or learner, a future base or a delta of other
        shapes."""
        self._check_learner(c.learner)
        if not 0 <= c.fragment < len(self.params):
            raise ValueError(f"fragment {c.fragment}: allowed 0..{len(self.params) - 1}.")
        if c.base > self.versions[c.fragment]:
            raise ValueError(f"base version {c.base} of fragment {c.fragment} is ahead of the synchroniser's.")
        shapes = [a.shape for a in self.params[c.fragment]]
        if [np.shape(d) for d in c.delta] != shapes:
            raise ValueError(f"delta shapes {[np.shape(d) for d in c.delta]} != fragment {c.fragment}'s {shapes}.")
        self.pending[c.fragment].append(c)
        out = []
        if c.base < self.versions[c.fragment]:  # it missed a merge: current parameters now, its delta merged next
            out.append(Reply(c.learner, c.fragment, self._copy(c.fragment), self.versions[c.fragment]))
        return out + self.poll(now)

    def poll(self, now: float) -> list[Reply]:
        """Merges every fragment that is due at `now` (the rules above); returns the replies to send."""
        out = []
        for p, pending in enumerate(self.pending):
            senders = {c.learner for c in pending}
            if len(senders) < self.quorum:
                self.quorum_since[p] = None
                continue
            since = self.quorum_since[p]
            if since is None:
                since = self.quorum_since[p] = now
            if self.live <= senders or now >= since + self.grace:
                out += self._merge(p, now)
        return out

    def deadline(self) -> float | None:
        """The earliest time a grace window ends (when `poll` should next be called without a new event)."""
        times = [t + self.grace for t in self.quorum_since if t is not None]
        return min(times) if times else None

    def finish(self, now: float) -> tuple[list[Reply], list[Contribution]]:
        """The end of a run: merges every fragment whose pending contributions reach the quorum, grace or not, and
        drops the rest (a merge of fewer learners would step the outer optimizer, its momentum included, on a part of
        the signal). Returns (the replies, the dropped contributions)."""
        replies = self.poll(math.inf)
        dropped = [c for pending in self.pending for c in pending]
        self.pending = [[] for _ in self.params]
        self.quorum_since = [None] * len(self.params)
        return replies, dropped

    def _merge(self, p: int, now: float) -> list[Reply]:
        pending, self.pending[p], self.quorum_since[p] = self.pending[p], [], None
        pending = sorted(pending, key=lambda c: (c.learner, c.base))  # summed in one order, whatever the arrivals
        weights = merge_weights([c.tokens for c in pending], [c.steps for c in pending])
        mean = [
            sum(w * np.asarray(c.delta[i], np.float64) for w, c in zip(weights, pending)).astype(np.float32)
            for i in range(len(self.params[p]))
        ]
        updates, self.states[p] = self.outer.update(mean, self.states[p], self.params[p])
        self.params[p] = [np.asarray(a, np.float32) for a in optax.apply_updates(self.params[p], updates)]
        self.states[p] = jax.device_get(self.states[p])
        version = self.versions[p]
        self.versions[p] += 1
        self.merges.append(
            Merge(now, p, version + 1, tuple(c.learner for c in pending), sum(c.tokens for c in pending),
                  tuple(version - c.base for c in pending))
        )  # fmt: skip
        waiting = sorted({c.learner for c in pending if c.base == version})  # the late ones were answered already
        return [Reply(m, p, self._copy(p), self.versions[p]) for m in waiting]

    def _copy(self, p: int) -> list[np.ndarray]:
        return [a.copy() for a in self.params[p]]

    def _check_learner(self, learner: int) -> None:
        if not 0 <= learner < self.learners:
            raise ValueError(f"learner {learner}: allowed 0..{self.learners - 1}.")
