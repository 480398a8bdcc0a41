"""The composed reproduction's bookkeeping: paired differences within a seed, their standard error, and the table's
reading of them."""

import math

import numpy as np
import pytest

from experiments.reproduce import composed


def _runs(values: dict[str, list[float]]) -> dict:
    return {
        name: {
            s: {
                "val_bits_per_byte": v,
                "val_bits_per_byte_worst_site": v + 0.01,
                "tokens_per_second": 10.0,
                "curve": [(10, v + 1.0), (20, v)],
            }
            for s, v in enumerate(vs)
        }
        for name, vs in values.items()
    }


def test_effects_pair_variants_within_each_seed():
    rng = np.random.default_rng(0)
    values = {name: list(rng.uniform(2.5, 2.8, 3)) for name in composed.VARIANTS}
    out = composed.summarise(_runs(values), [0, 1, 2])
    for label, (with_, without) in composed.EFFECTS.items():
        diffs = [a - b for a, b in zip(values[with_], values[without])]
        mean = sum(diffs) / 3
        stderr = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2 / 3)
        e = out["effects"][label]
        assert e["per_seed"] == pytest.approx(diffs) and e["mean"] == pytest.approx(mean)
        assert e["stderr"] == pytest.approx(stderr)


@pytest.mark.parametrize("gap, reading", [(0.05, "beyond 2 standard errors"), (0.001, "within 2 standard errors")])
def test_the_table_reads_a_difference_against_two_standard_errors(gap, reading):
    noise = [0.004, -0.006, 0.002]
    label = next(iter(composed.EFFECTS))  # MGUP-AdamW against AdamW on the unquantised GEMMs
    values = {name: [2.7 + n for n in noise] for name in composed.VARIANTS}
    values[composed.EFFECTS[label][0]] = [2.7 - gap + 0.003 * i for i in range(3)]
    result = {"command": "python -m x", "steps": 20, "seeds": [0, 1, 2], **composed.summarise(_runs(values), [0, 1, 2])}
    row = next(line for line in composed.markdown(result).splitlines() if line.startswith(f"| {label} |"))
    assert reading in row


def test_one_seed_gives_no_error_estimate():
    values = {name: [2.6 + 0.01 * i] for i, name in enumerate(composed.VARIANTS)}
    result = {"command": "python -m x", "steps": 20, "seeds": [0], **composed.summarise(_runs(values), [0])}
    assert all(e["stderr"] is None for e in result["effects"].values())
    assert composed.markdown(result).count("one seed: no error estimate") == len(composed.EFFECTS)


def test_bad_seeds_are_rejected_before_any_run(capsys):
    for seeds in ("0,0", "a", "-1", ""):
        with pytest.raises(SystemExit):
            composed.main(["--seeds", seeds, "--out", "/nonexistent"])
        assert "--seeds" in capsys.readouterr().err
