"""Which experts each site hosts: FoMoE's partial replication (docs/fomoe.md, "Partial expert
replication").

M sites, N_e experts per layer, overlap O_e (sites per expert). Each site hosts N_le = O_e N_e / M experts.

  * Fixed (the spec's decision): the experts form B = M / O_e contiguous blocks of N_le; block b lives on sites
    {b, b + B, b + 2B, ...}. Site s therefore holds block s mod B and is replica s div B of it, and the O_e sites of a
    block are a replica group holding identical experts: averaging an expert is a mean over its group, and
    factoring the site axis into (replica = O_e, block = B) mesh axes expresses it as a `pmean` over `replica`.
  * Random (decision where the paper is silent): every reshuffle draws which experts form each block, uniformly
    at random; the sites of block b stay {b, b + B, ...}. Both constraints (every expert on exactly O_e sites, N_le
    per site) hold, replica groups stay disjoint sets of identical experts, and the (replica, block) factoring of
    the site axis is the same for every placement, so synchronisation is unchanged. An expert that arrives on a
    site it was not on is reported by `arrivals` (it gets fresh optimizer state and a warm-up).

The same placement applies to every MoE layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["Placement", "fixed_placement", "random_placement"]


def _check(num_experts: int, sites: int, overlap: int) -> None:
    for name, value in (("num_experts", num_experts), ("sites", sites), ("overlap", overlap)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"placement: {name} = {value!r} must be a positive integer.")
    if overlap > sites:
        raise ValueError(
            f"placement: overlap O_e = {overlap} exceeds the number of sites M = {sites}; an expert "
            "can be hosted by at most every site (O_e = M is a full replica)."
        )
    if sites % overlap:
        raise ValueError(
            f"placement: overlap O_e = {overlap} must divide the number of sites M = {sites} (the "
            f"sites form M / O_e replica groups of O_e sites)."
        )
    if (overlap * num_experts) % sites:
        raise ValueError(
            f"placement: O_e x N_e = {overlap} x {num_experts} is not divisible by M = {sites}; each "
            "site must host a whole number of experts (N_le = O_e N_e / M)."
        )


@dataclasses.dataclass(frozen=True)
class Placement:
    """`experts[s]`: the sorted expert ids site s hosts ([M, N_le] int); `block[s]`: its replica group."""

    experts: np.ndarray
    block: np.ndarray
    num_experts: int
    overlap: int

    @property
    def sites(self) -> int:
        return self.experts.shape[0]

    @property
    def local_experts(self) -> int:
        """N_le, experts per site."""
        return self.experts.shape[1]

    @property
    def ideal_ghost_fraction(self) -> float:
        """1 - N_le / N_e: the share of a balanced router's choices that are not resident on a site."""
        return 1.0 - self.local_experts / self.num_experts

    def hosts(self, expert: int) -> np.ndarray:
        """The sites hosting `expert`, ascending."""
        return np.flatnonzero((self.experts == expert).any(axis=1))

    def replica_groups(self) -> list[np.ndarray]:
        """Site sets that hold identical experts, one per block, each sorted."""
        return [np.flatnonzero(self.block == b) for b in range(self.sites // self.overlap)]

    def resident(self) -> np.ndarray:
        """[M, N_e] bool: whether site s hosts expert e."""
        mask = np.zeros((self.sites, self.num_experts), bool)
        np.put_along_axis(mask, self.experts, True, axis=1)
        return mask

    def arrivals(self, previous: Placement) -> np.ndarray:
        """[M, N_le] bool: experts[s, j] was not on site s under `previous` (fresh state and warm-up needed)."""
        if previous.experts.shape != self.experts.shape or previous.num_experts != self.num_experts:
            raise ValueError(f"placements of different shapes: {previous.experts.shape} and {self.experts.shape}.")
        return ~np.take_along_axis(previous.resident(), self.experts, axis=1)

    def validate(self) -> None:
        """Raises AssertionError unless every expert is on exactly O_e sites, each site holds N_le distinct
        experts, and the sites of each block hold identical experts."""
        counts = np.bincount(self.experts.ravel(), minlength=self.num_experts)
        assert (counts == self.overlap).all(), f"expert replica counts {counts} != O_e = {self.overlap}"
        assert all(len(set(row)) == self.local_experts for row in self.experts.tolist()), "duplicate experts"
        for group in self.replica_groups():
            assert len(group) == self.overlap and (self.experts[group] == self.experts[group[0]]).all()


def fixed_placement(num_experts: int, sites: int, overlap: int) -> Placement:
    """The spec's strided blocks: site s holds experts [b N_le, (b + 1) N_le) with b = s mod (M / O_e)."""
    _check(num_experts, sites, overlap)
    blocks, n_le = sites // overlap, overlap * num_experts // sites
    block = np.arange(sites) % blocks
    experts = block[:, None] * n_le + np.arange(n_le)[None, :]
    return Placement(experts, block, num_experts, overlap)


def random_placement(num_experts: int, sites: int, overlap: int, seed: int | Sequence[int]) -> Placement:
    """A uniformly random grouping of the experts into the blocks (module docstring); `seed` as for
    `np.random.default_rng`."""
    _check(num_experts, sites, overlap)
    rng = np.random.default_rng(seed)
    blocks, n_le = sites // overlap, overlap * num_experts // sites
    expert_blocks = np.sort(rng.permutation(num_experts).reshape(blocks, n_le), axis=1)
    block = np.arange(sites) % blocks
    return Placement(expert_blocks[block], block, num_experts, overlap)
