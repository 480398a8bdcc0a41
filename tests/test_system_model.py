"""FoMoE's system model against the paper's parameter table and hand-computed bytes, FLOPs and memory."""

import itertools
import math

import numpy as np
import pytest

from moe import system_model as sm


@pytest.mark.parametrize("name", list(sm.PAPER_MODELS))
def test_param_count_reproduces_the_paper_table(name):
    shape, stated = sm.PAPER_MODELS[name]
    p = sm.param_count(shape.d_model, shape.num_layers, shape.num_experts, shape.expert_size, shape.vocab_size)
    assert p["total"] == p["embedding"] + p["attention"] + p["router"] + p["experts"]
    assert p["dense"] == p["embedding"] + p["attention"]
    # Within 1%, or within the rounding of the stated value when it has two significant digits (~1.8B).
    digits = 2 if name in ("small proxy", "large") else 3
    half_unit = 0.5 * 10 ** (math.floor(math.log10(stated)) - digits + 1)
    assert abs(p["total"] - stated) <= max(0.01 * stated, half_unit), (p["total"], stated)


def test_param_count_equals_the_built_models_parameters():
    """The paper family's count against the parameters of our transformer with MoE FFNs of that shape (tied
    embedding, d x d attention projections, router d x N_e and experts 2 d h per layer), less the norms the paper's
    table leaves out."""
    from flax import nnx

    from core.config import TransformerConfig
    from core.model import Transformer, count_params
    from moe import MoE, MoEConfig

    d, layers, experts, h, vocab = 16, 3, 6, 10, 300
    cfg = TransformerConfig(vocab_size=vocab, d_model=d, num_layers=layers, num_heads=2, num_kv_heads=2)
    m = MoEConfig(every=1, num_experts=experts, top_k=2, expert_size=h)
    model = Transformer(
        cfg, rngs=nnx.Rngs(0), ffn_factory=lambda i, path, rngs: MoE.in_transformer(cfg, m, path=path, rngs=rngs)
    )
    norms = (2 * layers + 1) * d
    p = sm.param_count(d, layers, experts, expert_size=h, vocab_size=vocab)
    assert p["total"] == count_params(model) - norms
    assert p["per_expert"] * experts * layers == sum(
        x.size for path, x in nnx.to_flat_state(nnx.state(model, nnx.Param)) if path[-1] in ("up", "down")
    )
    with pytest.raises(ValueError, match="d_model = 0"):
        sm.param_count(0, 2, 3)


def _ring_allreduce_bytes(values: list, itemsize: int) -> list[int]:
    """Bytes each of len(values) participants sends in a ring all-reduce of equal-length vectors, simulated chunk by
    chunk (reduce-scatter then all-gather, as NCCL and gloo do); asserts every participant ends with the sum."""
    n = len(values)
    if n == 1:
        return [0]
    chunks = [list(np.array_split(np.asarray(v, np.float64), n)) for v in values]
    sent = [0] * n
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(n - 1):
            moves = []
            for p in range(n):
                c = (p - step + (0 if phase == "reduce-scatter" else 1)) % n
                moves.append((p, (p + 1) % n, c, chunks[p][c].copy()))
            for src, dst, c, data in moves:
                sent[src] += data.size * itemsize
                chunks[dst][c] = chunks[dst][c] + data if phase == "reduce-scatter" else data
    total = np.sum(values, axis=0)
    for p in range(n):
        np.testing.assert_allclose(np.concatenate(chunks[p]), total)
    return sent


@pytest.mark.parametrize("sites, overlap, optimizer", [(4, 1, "diloco"), (4, 2, "local_adamw"), (6, 3, "diloco")])
def test_bytes_per_round_equal_a_simulated_ring_all_reduce(sites, overlap, optimizer):
    """Every site all-reduces the dense parameters (and with LocalAdamW both moments) over all M sites and each
    expert's parameters (with its router row) over the O_e sites hosting it: the bytes a simulated ring sends per
    site equal the formula's."""
    # sizes that 4 and 6 sites (and groups of 2 and 3) split into equal chunks, as the formula assumes
    shape = sm.ModelShape(d_model=6, num_layers=2, num_experts=12, top_k=2, expert_size=5, vocab_size=8)
    p = sm.param_count(6, 2, 12, 5, 8)
    copies = 3 if optimizer == "local_adamw" else 1
    rng = np.random.default_rng(0)
    sent = np.zeros(sites)
    dense = rng.normal(size=(sites, p["dense"] * copies))
    sent += _ring_allreduce_bytes(list(dense), itemsize=4)
    groups = [list(range(g, sites, sites // overlap)) for g in range(sites // overlap)]  # strided blocks
    expert_size = (p["per_expert"] + shape.d_model) * copies  # + its router row (partitioned router)
    for _ in range(shape.num_layers):
        for e in range(shape.num_experts):
            members = groups[e % len(groups)]
            values = list(rng.normal(size=(len(members), expert_size)))
            for member, b in zip(members, _ring_allreduce_bytes(values, itemsize=4)):
                sent[member] += b
    want = sm.bytes_per_round(shape, sites, overlap, optimizer=optimizer)["total"]
    np.testing.assert_allclose(sent, want, rtol=1e-12)


def test_local_experts_and_its_errors():
    assert sm.local_experts(16, 8, 4) == 8 and sm.local_experts(16, 8, 8) == 16 and sm.local_experts(16, 8, 1) == 2
    with pytest.raises(ValueError, match="not divisible by the number of sites M = 8"):
        sm.local_experts(4, 8, 1)
    with pytest.raises(ValueError, match="overlap O_e = 9"):
        sm.local_experts(16, 8, 9)


def test_bytes_per_round_by_hand():
    shape = sm.ModelShape(d_model=4, num_layers=2, num_experts=8, top_k=2, expert_size=5, vocab_size=7)
    # dense = 28 + 128 = 156 params; per expert 40 (+ 4 router row when partitioned); M = 4, O_e = 2 -> N_le = 4.
    b = sm.bytes_per_round(shape, 4, 2, optimizer="diloco", bytes_per_param=1)
    assert b["dense"] == pytest.approx(2 * 3 / 4 * 156)
    assert b["sparse"] == pytest.approx(2 * 1 / 2 * 2 * 4 * 44)
    adamw = sm.bytes_per_round(shape, 4, 2, optimizer="local_adamw", bytes_per_param=1)
    assert adamw["total"] == pytest.approx(3 * b["total"])
    skip = sm.bytes_per_round(shape, 4, 2, optimizer="diloco", skip_token=True, bytes_per_param=1)
    assert skip["dense"] == pytest.approx(2 * 3 / 4 * (156 + 2 * 4 * 8)) and skip["sparse"] == pytest.approx(2 * 4 * 40)
    moved = sm.bytes_per_round(shape, 4, 2, optimizer="diloco", migration=1.0, bytes_per_param=1)
    assert moved["sparse"] == pytest.approx((1.0 + 1.0 * (1 - 2 / 4)) * 2 * 4 * 44)
    moved = sm.bytes_per_round(shape, 4, 2, optimizer="local_adamw", migration=0.5, bytes_per_param=1)
    assert moved["sparse"] == pytest.approx((3 * 1.0 + 0.5 * (1 - 2 / 4)) * 2 * 4 * 44)  # moments are not moved
    # Disjoint experts, fixed placement: nothing sparse to average. Full replica: experts ring over all M sites.
    assert sm.bytes_per_round(shape, 4, 1, optimizer="diloco")["sparse"] == 0
    full = sm.bytes_per_round(shape, 4, 4, optimizer="diloco", bytes_per_param=1)
    assert full["sparse"] == pytest.approx(2 * 3 / 4 * 2 * 8 * 44)
    with pytest.raises(ValueError, match="optimizer = 'adam'"):
        sm.bytes_per_round(shape, 4, 2, optimizer="adam")
    with pytest.raises(ValueError, match="migration gamma = 2"):
        sm.bytes_per_round(shape, 4, 2, migration=2)


def test_ddp_and_bytes_per_token():
    shape = sm.ModelShape(d_model=4, num_layers=2, num_experts=8, top_k=2, expert_size=5, vocab_size=7)
    total = sm.param_count(4, 2, 8, 5, 7)["total"]
    assert sm.ddp_bytes_per_step(shape, 4, bytes_per_param=2) == pytest.approx(2 * 3 / 4 * total * 2)
    assert sm.bytes_per_token(1000.0, sites=4, local_steps=8, global_batch_tokens=50) == pytest.approx(10.0)
    # With K = 32 a full-replica DiLoCo round sends what 1/32 of DDP's rounds send.
    full = sm.bytes_per_round(shape, 4, 4, optimizer="diloco", skip_token=True)["total"]
    assert 32 * sm.ddp_bytes_per_step(shape, 4) / full == pytest.approx(32.0)


def test_flops_per_token():
    shape = sm.ModelShape(d_model=8, num_layers=3, num_experts=8, top_k=2, expert_size=4, vocab_size=11, seq_len=5)
    full = sm.flops_per_token(shape, 4, 4, training=False)
    # Forward, full replica: 2 x (attention 4 d^2 + k experts 2 d h + router d E) per layer + 4 L d T + head 2 d V.
    matmul_params = 3 * (4 * 64 + 2 * 2 * 8 * 4 + 8 * 8)
    assert full["total"] == pytest.approx(2 * matmul_params + 4 * 3 * 8 * 5 + 2 * 8 * 11)
    assert sm.flops_per_token(shape, 4, 4)["total"] == pytest.approx(3 * full["total"])
    # Partitioned router at O_e = 1: N_le = 2 experts per site, top-min(k, N_le) = 2: all k experts still run,
    # the router scores 2 of 8.
    part = sm.flops_per_token(shape, 4, 1, training=False)
    assert part["experts"] == pytest.approx(full["experts"]) and part["router"] == pytest.approx(full["router"] / 4)
    # Skip-token: the router scores all experts; k N_le / N_e experts run on average, or k (1 - measured ghosts).
    skip = sm.flops_per_token(shape, 4, 1, skip_token=True, training=False)
    assert skip["router"] == pytest.approx(full["router"]) and skip["experts"] == pytest.approx(full["experts"] / 4)
    measured = sm.flops_per_token(shape, 4, 1, skip_token=True, ghost_fraction=0.5, training=False)
    assert measured["experts"] == pytest.approx(full["experts"] / 2)


def test_memory_and_round_time():
    shape = sm.ModelShape(d_model=4, num_layers=2, num_experts=8, top_k=2, expert_size=5, vocab_size=7)
    # 156 dense + O_e / M x (2 layers x 8 experts x 40 + 64 router) params, 18 bytes each.
    assert sm.memory_per_site(shape, 4, 2) == pytest.approx((156 + 0.5 * (640 + 64)) * 18)
    t = sm.round_seconds(
        flops_per_token=100.0,
        tokens_per_step=10.0,
        local_steps=4,
        round_bytes=1e9,
        bandwidth_bits_per_second=8e9,
        latency_seconds=0.5,
        peak_flops=1000.0,
        mfu=0.5,
        overlap_fraction=0.25,
    )
    assert t["compute"] == pytest.approx(4 * 2.0) and t["communication"] == pytest.approx(1.5)
    assert t["total"] == pytest.approx(8.0 + 0.75 * 1.5)


def test_projection_orders_methods_as_the_formulas_say():
    rows = sm.project(sm.PAPER_MODELS["XXL"][0])
    assert len(rows) == 3 * 7
    by = {(r.method.split()[0], r.overlap, r.bandwidth_gbps): r for r in rows}
    for gbps in (1, 10, 100):
        fomoe = [by[("FoMoE", o, gbps)] for o in (1, 2, 4, 8, 16, 32)]
        assert all(a.bytes_per_site_per_round < b.bytes_per_site_per_round for a, b in itertools.pairwise(fomoe))
        assert all(a.memory_gib_per_site < b.memory_gib_per_site for a, b in itertools.pairwise(fomoe))
        assert by[("DDP", 32, gbps)].hours > fomoe[-1].hours  # DDP syncs every step: 32x the rounds
    assert by[("FoMoE", 4, 1)].hours > by[("FoMoE", 4, 100)].hours


def test_low_bit_synchronisation_and_hidden_rounds_by_hand():
    """wire_bytes pads to whole chunks of n x G values: 1000 values over 4 sites in fp4 with UE8M0 scales per 32 are
    1024 padded values, 2 x 3/4 x 1024 x (0.5 + 1/32) bytes; LocalAdamW's state (Adam: two moments) sends its first
    half in the wire format and its second (the second moments) as bf16, or nothing with second_moments = "local";
    a hidden round takes max(compute, transfer) plus the synchronisation's own processor work and the host's
    gathers, which never hide."""
    from core.codec import WireFormat

    fp4 = WireFormat("fp4", 32, "ue8m0")
    assert sm.wire_bytes(1000, 4, fp4) == 2 * 3 / 4 * 1024 * (0.5 + 1 / 32)
    assert sm.wire_bytes(1000, 4) == 2 * 3 / 4 * 4000 and sm.wire_bytes(1000, 1, fp4) == 0
    got = sm.sync_bytes(4000, 2000, 4, 2, optimizer="local_adamw", wire=fp4)
    dense = sm.wire_bytes(1000, 4, fp4) + sm.wire_bytes(1000, 4, fp4) + sm.wire_bytes(1000, 4, WireFormat("bf16"))
    sparse = sm.wire_bytes(500, 2, fp4) * 2 + sm.wire_bytes(500, 2, WireFormat("bf16"))
    assert got == {"dense": dense, "sparse": sparse, "total": dense + sparse}
    local = sm.sync_bytes(4000, 2000, 4, 2, optimizer="local_adamw", wire=fp4, second_moments="local")
    assert local["total"] == 2 * sm.wire_bytes(1000, 4, fp4) + 2 * sm.wire_bytes(500, 2, fp4)
    diloco = sm.sync_bytes(4000, 2000, 4, 2, optimizer="diloco", wire=fp4)
    assert diloco["total"] == sm.wire_bytes(1000, 4, fp4) + sm.wire_bytes(500, 2, fp4)
    slow, hidden, short = (
        sm.round_seconds(
            flops_per_token=1e9, tokens_per_step=1e3, local_steps=4, round_bytes=size, latency_seconds=0.0,
            bandwidth_bits_per_second=1e6, peak_flops=1e12, mfu=1.0, hidden=h, sync_cpu_seconds=0.5,
            host_bytes=host,
        )
        for h, size, host in ((False, 1e6, 0.0), (True, 1e6, 0.0), (True, 1e5, 2.5e4))
    )  # fmt: skip
    assert slow["total"] == 4.0 + 0.5 + 8.0 and hidden["total"] == 4.0 + 0.5 + (8.0 - 4.0)
    # a transfer (0.8 s) shorter than the compute hides whole; the host's gathers (0.2 s) do not
    assert short["total"] == pytest.approx(4.0 + 0.5 + 0.2) and short["host_communication"] == pytest.approx(0.2)
    assert sm.link_bytes(1448.0) == 1514.0 and sm.link_bytes(100.0, framing=1.25, fixed_bytes=7.0) == 132.0
