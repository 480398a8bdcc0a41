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


def test_collectives_list_every_op_with_its_device_groups():
    text = "\n".join(
        [
            "  %a = f32[1,3]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,2},{1,3}}, to_apply=%add",
            "  %b = f32[2,5]{1,0} all-gather(%s), channel_id=2, replica_groups=[2,2]<=[4], dimensions={0}",
            "  %c = f32[6]{0} all-reduce(%u), replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%add",
            "  %d = (f32[4,2]{1,0}, s32[4]{0}) all-to-all(%x, %y), channel_id=3, replica_groups={{0,1},{2,3}}",
            "  %e = f32[2]{0} reduce-scatter(%v), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add",
            "  %f = f32[5]{0} collective-permute(%w), channel_id=4, source_target_pairs={{0,1},{1,0}}",
            "  %g = f32[7]{0} all-reduce(%z), replica_groups={}, to_apply=%add",
            "  %h = f32[8]{0} add(%x, %y)",
            "  %i = f32[10]{0} all-reduce(%z), replica_groups=mesh['a'=2,'b'=2] {'a'}, to_apply=%add",
        ]
    )
    ops = hlo.collectives(text, 4)
    assert [op.op for op in ops] == ["all-reduce", "all-gather", "all-reduce", "all-to-all", "reduce-scatter"] + [
        "collective-permute",
        "all-reduce",
        "all-reduce",
    ]
    assert [op.groups for op in ops] == [
        ((0, 2), (1, 3)),
        ((0, 1), (2, 3)),
        ((0, 2), (1, 3)),  # iota [2,2]<=[2,2]T(1,0): the transposed 2x2 grid's rows
        ((0, 1), (2, 3)),
        ((0, 1, 2, 3),),
        ((0, 1), (1, 0)),  # (source, target) pairs
        ((0, 1, 2, 3),),  # no groups: every device
        ((0, 2), (1, 3)),  # row-major ids over (a, b); groups vary 'a'
    ]
    assert [op.bytes_per_device for op in ops] == pytest.approx(
        [1.0 * 12, 0.5 * 40, 1.0 * 24, 0.5 * (32 + 16), 0.75 * 4 * 8, 20, 1.5 * 28, 1.0 * 40]
    )
    # all-reduce and all-gather as `collective_bytes` counts them (which takes an op without groups for one device's)
    counted = [
        op.bytes_per_device for op in ops if op.op in ("all-reduce", "all-gather") and op.groups != ops[6].groups
    ]
    assert sum(counted) == pytest.approx(hlo.collective_bytes(text)["bytes_per_device"])
