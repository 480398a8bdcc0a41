"""The side-by-side peers table's arithmetic (experiments.reproduce.fomoe_peers) and the churn reproduction's useful
tokens (experiments.reproduce.links_churn), against values worked by hand."""

import math

import pytest

from experiments.reproduce import fomoe_peers, links_churn


def test_the_paired_interval_is_the_t_interval_of_the_per_seed_differences():
    """Differences 0.1, 0.2, 0.3: mean 0.2, sample sd 0.1, half-width t(0.975, 2) 0.1 / sqrt(3) = 0.24843."""
    mean, half = fomoe_peers.paired_interval([2.1, 2.3, 2.5], [2.0, 2.1, 2.2])
    assert mean == pytest.approx(0.2) and half == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    assert math.isnan(fomoe_peers.paired_interval([2.0], [1.0])[1])


def test_a_rerun_is_covered_when_its_difference_to_ddps_rerun_lies_in_the_runs_interval():
    """Runs 0.1, 0.2, 0.3 above DDP (interval 0.2 ± 0.248); reruns 0.3, 0.4, 0.5 above DDP's reruns (0.4: covered),
    or 0.5, 0.6, 0.7 (0.6: not). Drift is rerun - run per seed; the pooled interval is over the 6 differences."""
    runs, ddp, ddp_again = [2.1, 2.3, 2.5], [2.0, 2.1, 2.2], [2.0, 2.0, 2.0]
    near = fomoe_peers.rerun_check(runs, [2.3, 2.4, 2.5], ddp, ddp_again)
    assert near["covered"] and near["vs_ddp"] == pytest.approx(0.4)
    assert near["drift"] == pytest.approx([0.2, 0.1, 0.0])
    d = [0.1, 0.2, 0.3, 0.3, 0.4, 0.5]
    mean, sd = sum(d) / 6, math.sqrt(sum((x - sum(d) / 6) ** 2 for x in d) / 5)
    assert near["vs_ddp_all"] == pytest.approx([mean, 2.571 * sd / math.sqrt(6)])
    assert not fomoe_peers.rerun_check(runs, [2.5, 2.6, 2.7], ddp, ddp_again)["covered"]


def test_bytes_to_target_and_the_pareto_front():
    curve = [(64, 2.9), (128, 2.5), (192, 2.3)]
    assert fomoe_peers.bytes_to_target(curve, 10.0, 2.5) == 1280.0  # first reached at step 128
    assert fomoe_peers.bytes_to_target(curve, 10.0, 2.0) is None
    rows = [
        {"row": "a", "bytes_total": 1.0, "val_loss_mean": 2.5},
        {"row": "b", "bytes_total": 2.0, "val_loss_mean": 2.2},
        {"row": "c", "bytes_total": 3.0, "val_loss_mean": 2.3},  # beaten by b on both
        {"row": "d", "bytes_total": 0.5, "val_loss_mean": 2.6},
    ]
    assert fomoe_peers.pareto(rows) == {"a", "b", "d"}


def test_useful_tokens_count_each_step_of_the_final_history_once_at_its_sites_rows():
    """128 steps, 10 tokens per site per step; regrouped from step 40 onto 3 sites and from step 80 onto 4: 40 + 48
    steps at 4 sites and 40 at 3 (the steps run past a checkpoint before a regrouping are not counted)."""
    lines = [
        "launch: --elastic: regrouped the checkpoint of step 40: 4 -> 3 sites, O_e 2 -> 3; lost site 1",
        "launch: --elastic: regrouped the checkpoint of step 80: 3 -> 4 sites, O_e 3 -> 4",
    ]
    assert links_churn.useful_tokens(128, lines, 10) == (40 + 48) * 4 * 10 + 40 * 3 * 10
    assert links_churn.useful_tokens(128, [], 10) == 128 * 4 * 10
