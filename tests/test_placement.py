"""FoMoE placement: each expert on exactly O_e sites, N_le per site, replica groups of identical experts."""

import numpy as np
import pytest

from moe.placement import fixed_placement, random_placement

CASES = [(8, 8, 1), (8, 8, 2), (8, 8, 4), (8, 8, 8), (16, 4, 2), (6, 2, 1), (12, 6, 3), (4, 4, 4)]


@pytest.mark.parametrize("num_experts, sites, overlap", CASES)
def test_fixed_placement_is_the_spec_strided_blocks(num_experts, sites, overlap):
    p = fixed_placement(num_experts, sites, overlap)
    p.validate()
    n_le, blocks = overlap * num_experts // sites, sites // overlap
    assert p.local_experts == n_le and p.ideal_ghost_fraction == pytest.approx(1 - n_le / num_experts)
    for b in range(blocks):
        # block b: experts [b N_le, (b+1) N_le) on sites {b, b + B, b + 2B, ...}
        np.testing.assert_array_equal(p.replica_groups()[b], np.arange(b, sites, blocks))
        for e in range(b * n_le, (b + 1) * n_le):
            np.testing.assert_array_equal(p.hosts(e), np.arange(b, sites, blocks))
    assert p.resident().sum(axis=1).tolist() == [n_le] * sites
    assert not p.arrivals(p).any()


@pytest.mark.parametrize("num_experts, sites, overlap", CASES)
def test_random_placement_keeps_the_constraints(num_experts, sites, overlap):
    layouts = set()
    for seed in range(6):
        p = random_placement(num_experts, sites, overlap, seed)
        p.validate()
        assert sorted(len(p.hosts(e)) for e in range(num_experts)) == [overlap] * num_experts
        layouts.add(p.experts.tobytes())
    if overlap < sites:  # there is more than one way to place
        assert len(layouts) > 1


def test_arrivals_mark_experts_new_to_a_site():
    before = fixed_placement(8, 4, 2)  # sites 0, 2: experts 0-3; sites 1, 3: experts 4-7
    after = random_placement(8, 4, 2, seed=3)
    arrived = after.arrivals(before)
    for s in range(4):
        for j, e in enumerate(after.experts[s]):
            assert arrived[s, j] == (e not in before.experts[s])
    assert arrived.sum() == sum(len(set(after.experts[s]) - set(before.experts[s])) for s in range(4))


@pytest.mark.parametrize(
    "args, needle",
    [
        ((8, 8, 3), "must divide the number of sites M = 8"),
        ((6, 4, 1), "O_e x N_e = 1 x 6 is not divisible by M = 4"),
        ((8, 4, 5), "overlap O_e = 5 exceeds the number of sites M = 4"),
        ((8, 0, 1), "sites = 0"),
    ],
)
def test_impossible_placements_are_rejected(args: tuple[int, int, int], needle: str):
    with pytest.raises(ValueError, match=needle):
        fixed_placement(*args)
    with pytest.raises(ValueError, match=needle):
        random_placement(*args, seed=0)
