"""The FoMoE reproduction's bookkeeping: the grid it runs, and how rows and ratios come out of run summaries."""

import math

import pytest

from experiments.reproduce import fomoe


def test_grid_is_sites_by_overlap_by_k_by_outer_method_plus_random_placement_and_ddp():
    runs = fomoe.grid()
    names = [r["name"] for r in runs]
    assert len(names) == len(set(names))
    fed = [r for r in runs if r["outer"] != "ddp"]
    assert {(r["sites"], r["overlap"]) for r in fed} == {(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)}
    assert {r["k"] for r in fed} == {8, 32} and {r["outer"] for r in fed} == {"local_adamw", "diloco"}
    fixed = {(r["sites"], r["overlap"], r["k"], r["outer"]) for r in fed if r["placement"] == "fixed"}
    assert len(fixed) == 5 * 2 * 2  # the full cross product with fixed placement
    assert all(r["overlap"] < r["sites"] for r in fed if r["placement"] == "random")
    assert {r["sites"] for r in runs if r["outer"] == "ddp"} == {2, 4}


def _summary(loss, per_round=None, formula=None, per_step=None):
    s = {"val_loss": loss, "val_bits_per_byte": loss / math.log(2), "tokens_per_second": 1.0, "num_params": 1000}
    if per_round is not None:
        s.update(
            bytes_per_site_per_round=per_round,
            bytes_per_site_per_round_formula=formula or per_round,
            bytes_per_token=per_round / 7,
            val_bits_per_byte_worst_site=loss,
        )
    if per_step is not None:
        s["bytes_per_device_per_step"] = per_step
    return s


def test_rows_count_every_round_and_ratios_divide_bytes_over_the_same_tokens():
    steps, tps = 64, 4096
    ddp = {"name": "ddp_M4", "sites": 4, "overlap": None, "k": 1, "outer": "ddp", "placement": "-"}
    full = {"name": "f", "sites": 4, "overlap": 4, "k": 8, "outer": "local_adamw", "placement": "fixed"}
    part = {"name": "p", "sites": 4, "overlap": 2, "k": 8, "outer": "local_adamw", "placement": "fixed"}
    rows = [
        fomoe.row(ddp, _summary(2.0, per_step=6000.0), steps, tps),
        fomoe.row(full, _summary(2.1, per_round=9000.0), steps, tps),
        fomoe.row(part, _summary(2.2, per_round=5000.0, formula=4000.0), steps, tps),
    ]
    assert rows[0]["bytes_per_site"] == 64 * 6000.0
    assert rows[0]["bytes_per_site_formula"] == pytest.approx(64 * 2 * 3 / 4 * 4 * 1000)  # fp32 gradients
    assert rows[0]["bytes_per_token"] == pytest.approx(4 * 6000.0 / tps)
    assert rows[2]["bytes_per_site"] == 8 * 5000.0 and rows[2]["bytes_per_site_formula"] == 8 * 4000.0
    assert rows[2]["perplexity"] == pytest.approx(math.exp(2.2))
    (ratio,) = fomoe.ratios(rows)
    assert ratio["name"] == "p"
    assert ratio["vs_ddp"] == pytest.approx(64 * 6000.0 / (8 * 5000.0))
    assert ratio["vs_full_replica"] == pytest.approx(9000.0 / 5000.0)
    assert ratio["full_replica_perplexity"] == pytest.approx(math.exp(2.1))
