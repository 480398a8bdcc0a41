"""The decode benchmark's report: the Pallas section a GPU run adds, and its verdict on the decode goal it states."""

import pytest

from experiments.bench import decode


def _result(pallas_ms: dict[str, float], of_copy: float) -> dict:
    rows = []
    for context in (4096, decode.GPU_GOAL["context"]):
        for f in decode.FORMATS:
            for impl in decode.IMPLEMENTATIONS + ("pallas",):
                ms = pallas_ms[f] * context / 4096 if impl == "pallas" else 10.0 * context / 4096
                rows.append(
                    {
                        "context": context,
                        "format": f,
                        "implementation": impl,
                        "ms": ms,
                        "gb_per_s": 100.0,
                        "of_copy": of_copy if f == "fp4" else 0.5,
                    }
                )
    machine = {"backend": "gpu", "device": "test", "cores": 1}
    return {
        "command": "python -m experiments.bench.decode --out results/bench",
        "rows": rows,
        "copy_gb_per_s": {"4096": 1000.0, str(decode.GPU_GOAL["context"]): 1000.0},
        "machine": machine,
        "repeats": 1,
    }


@pytest.mark.parametrize(
    "fp4_ms, of_copy, verdict",
    [
        (1.0, 0.7, "met"),  # 3.0x faster, 70% of the copy
        (1.0, 0.5, "missed"),  # fast enough, too little bandwidth
        (2.0, 0.7, "missed"),  # 1.5x faster only
    ],
)
def test_the_pallas_section_reads_the_goal_at_128k(fp4_ms, of_copy, verdict, monkeypatch):
    table = decode.markdown(_result({"bf16": 3.0, "fp8": 2.0, "fp4": fp4_ms}, of_copy))
    assert "The Pallas kernel is timed below." in table
    goal = next(line for line in table.splitlines() if line.startswith("Goal at 131,072 tokens"))
    assert f"measured {3.0 / fp4_ms:.2f}x and {of_copy:.0%} ({verdict})" in goal
