"""Reading collectives' bytes from HLO text: every op and group form XLA prints, against hand-computed sums."""

import pytest

from core import hlo


def test_collective_bytes_parses_hlo_lines():
    text = "\n".join(
        [
            "  %a = f32[1,3]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,2},{1,3}}, to_apply=%add",
            "  %b = (f32[4]{0}, bf16[2,2]{1,0}) all-reduce(%q, %r), replica_groups={{0,1,2,3}}, to_apply=%add",
            "  %c = f32[8]{0} add(%x, %y)",
            "  %d = f32[2,5]{1,0} all-gather(%s), channel_id=2, replica_groups=[2,2]<=[4], dimensions={0}",
            "  %e = (f32[1,5]{1,0}, f32[4,5]{1,0}) all-gather-start(%t), replica_groups={{0,1,2,3}}, dimensions={0}",
            "  %f = f32[4,5]{1,0} all-gather-done(%e)",
            "  %g = f32[6]{0} all-reduce(%u), replica_groups=[4,1]<=[4], to_apply=%add",
            "  %h = s32[3]{0} all-reduce(%v), replica_groups=[1,4]<=[4], to_apply=%add",
            "  %i = f32[4096,8]{1,0} all-gather(%w), channel_id=1, "
            "replica_groups=mesh['axis_0'=2,'axis_1'=1] {'axis_0'}, dimensions={0}, use_global_device_ids=true",
            "  %j = f32[10]{0} all-reduce(%z), "
            "replica_groups=mesh['data'=2,'expert'=4] {'data','expert'}, to_apply=%add",
        ]
    )
    out = hlo.collective_bytes(text)
    assert out["ops"] == 8  # the -done op and the add are not collectives
    assert out["by_group_size"] == {
        2: pytest.approx(1.0 * 12 + 0.5 * 40 + 0.5 * 4096 * 8 * 4),
        4: pytest.approx(1.5 * (16 + 8) + 0.75 * 80 + 1.5 * 12),
        8: pytest.approx(2 * 7 / 8 * 40),
    }
    assert out["bytes_per_device"] == pytest.approx(sum(out["by_group_size"].values()))
