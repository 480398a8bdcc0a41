"""FoMoE's communication, compute and memory model (docs/fomoe.md, "Communication model" and
"System model"); projects a federation of MoEs to the paper's 100B scale.

Model family (the paper's): attention 4 d^2 per layer, experts of two matrices d x h and h x d, a router d x N_e
per layer, a tied embedding of `vocab_size` rows; norms are not counted (the paper's table does not count them).
Sites: M workers; every expert lives on O_e of them, so each site hosts N_le = O_e N_e / M experts per layer.

Bytes per site per round (ring all-reduce; S = bytes of a parameter group):
    B_dense  = 2 (M - 1) / M * S_dense
    B_sparse = (R(O_e) + P) * sum over layers of N_le * s_expert,   R(O_e) = 2 (O_e - 1) / O_e,
               P = gamma (1 - O_e / M)  (gamma = 0 fixed placement, 1 = every expert reshuffled every round)
    LocalAdamW averages parameters and both moments: x 3 (not P: arrived experts start with fresh moments, so a
    reshuffle moves weights only).      DDP: 2 (M - 1) / M * S_model every step.
    bytes per token: BPT = M * B_per_site / (K * global_batch_tokens).
Low-bit synchronisation (moe.lowbit_sync, a core.codec.WireFormat of b bits, s-byte scales per G values): a group of
n sites averaging N values moves 2 (n - 1) / n N' (b / 8 + s / G) per site, N' = N rounded up to a multiple of n G
(the quantised mean's chunks), `wire_bytes`.
`s_expert` holds both projections and, with the partitioned router, the expert's router row; with skip-token
the router is dense (scores all experts) and is averaged with the dense parameters.

Decisions where the paper is silent (ours, used by the projections; every one is an argument):
  * parameters travel in fp32 (4 bytes): DiLoCo and LocalAdamW average the fp32 master weights;
  * FLOPs per token follow PaLM's accounting (forward 2 x matmul parameters met + 4 L d T for attention
    scores; training = 3 x forward);
  * the 100B projection trains 20 tokens per active parameter (Chinchilla), global batch 4M tokens, K = 32, MFU
    0.4, 50 ms latency per synchronisation, no overlap of communication with compute (unless `hidden`: one round
    late; no synchronisation work on the processors, `sync_cpu_seconds` = 0), and a site is a cluster
    of 64 H100-class accelerators (989 dense bf16 TFLOP/s each): enough memory (64 x 80 GB) for the 104B
    model's full training state (1.75 TiB at O_e = M).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from core.codec import WireFormat

__all__ = [
    "PAPER_MODELS",
    "ModelShape",
    "Projection",
    "active_params",
    "bytes_per_round",
    "bytes_per_token",
    "ddp_bytes_per_step",
    "flops_per_token",
    "link_bytes",
    "local_experts",
    "memory_per_site",
    "param_count",
    "project",
    "round_seconds",
    "sync_bytes",
    "training_hours",
    "wire_bytes",
]

BYTES_PER_PARAM = 4
SITE_PEAK_FLOPS = 64 * 989e12
TOKENS_PER_ACTIVE_PARAM = 20.0
TRAIN_STATE_BYTES_PER_PARAM = 18  # bf16 weights 2 + fp32 master 4 + two fp32 moments 8 + fp32 gradients 4
FRAME_BYTES, TCP_PAYLOAD_BYTES = 1514, 1448  # a full Ethernet frame and its TCP payload (MTU 1500, timestamps)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """One member of the paper's model family (head dim 64, expert size 128, a quarter of the experts active)."""

    d_model: int
    num_layers: int
    num_experts: int
    top_k: int
    expert_size: int = 128
    vocab_size: int = 200_019
    seq_len: int = 2048


# name: (shape, the parameter count the paper's table states)
PAPER_MODELS: Mapping[str, tuple[ModelShape, float]] = {
    "small proxy": (ModelShape(256, 4, 8, 2), 54e6),
    "medium": (ModelShape(512, 16, 16, 4), 153e6),
    "large": (ModelShape(1024, 128, 32, 8), 1.8e9),
    "XL": (ModelShape(2048, 256, 64, 16), 13.3e9),
    "XXL": (ModelShape(4096, 512, 128, 32), 104e9),
}


def param_count(
    d_model: int, num_layers: int, num_experts: int, expert_size: int = 128, vocab_size: int = 200_019
) -> dict[str, int]:
    """Parameters of the paper's model family.

    Returns: embedding (tied, vocab x d), attention (4 d^2 per layer), router (d N_e per layer), experts
    (2 d h N_e per layer), per_expert (2 d h: one expert of one layer), dense = embedding + attention (the part
    every site holds), and total = dense + router + experts.
    """
    for name, value in (
        ("d_model", d_model),
        ("num_layers", num_layers),
        ("num_experts", num_experts),
        ("expert_size", expert_size),
        ("vocab_size", vocab_size),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"param_count: {name} = {value!r} must be a positive integer.")
    embedding = vocab_size * d_model
    attention = 4 * d_model * d_model * num_layers
    router = d_model * num_experts * num_layers
    per_expert = 2 * d_model * expert_size
    experts = per_expert * num_experts * num_layers
    dense = embedding + attention
    return {
        "embedding": embedding,
        "attention": attention,
        "router": router,
        "experts": experts,
        "per_expert": per_expert,
        "dense": dense,
        "total": dense + router + experts,
    }


def active_params(shape: ModelShape) -> float:
    """Parameters one token meets: dense, routers, and top_k / num_experts of the experts."""
    p = param_count(shape.d_model, shape.num_layers, shape.num_experts, shape.expert_size, shape.vocab_size)
    return p["dense"] + p["router"] + p["experts"] * shape.top_k / shape.num_experts


def local_experts(num_experts: int, sites: int, overlap: int) -> int:
    """N_le = O_e N_e / M, the experts per layer each site hosts. Raises ValueError naming the impossible values."""
    if not 1 <= overlap <= sites:
        raise ValueError(f"overlap O_e = {overlap} must be in [1, sites M = {sites}].")
    if (overlap * num_experts) % sites:
        raise ValueError(
            f"O_e x N_e = {overlap} x {num_experts} = {overlap * num_experts} is not divisible by the "
            f"number of sites M = {sites}; each site must host a whole number of experts."
        )
    return overlap * num_experts // sites


def _ring(n: int) -> float:
    return 2.0 * (n - 1) / n


def wire_bytes(values: float, group: int, wire: WireFormat | None = None) -> float:
    """Bytes per site that averaging `values` values over a group of `group` sites moves: float32 (wire None or
    float32) 2 (n - 1) / n 4 N; a low-bit `wire` 2 (n - 1) / n N' wire.bytes_per_value with N' = N rounded up to a
    multiple of n x wire.unit (moe.lowbit_sync pads its buffer so); a sparse (`gathered`) `wire` (n - 1) N'
    wire.bytes_per_value with N' a multiple of wire.unit (every site's whole message to the group). A group of one
    site moves nothing."""
    if wire is None or wire.exact:
        return _ring(group) * 4.0 * values
    if wire.gathered:
        return (group - 1) * math.ceil(values / wire.unit) * wire.unit * wire.bytes_per_value
    padded = math.ceil(values / (group * wire.unit)) * group * wire.unit
    return _ring(group) * padded * wire.bytes_per_value


def bytes_per_round(
    shape: ModelShape,
    sites: int,
    overlap: int,
    *,
    optimizer: str = "local_adamw",
    skip_token: bool = False,
    migration: float = 0.0,
    bytes_per_param: int = BYTES_PER_PARAM,
    wire: WireFormat | None = None,
    second_moments: str = "sent",
) -> dict[str, float]:
    """Bytes each site sends (and receives) per synchronisation round.

    Args:
      optimizer: "diloco" (parameters only) or "local_adamw" (parameters and both moments: x 3).
      skip_token: the router is dense (synced with the dense parameters) instead of partitioned with the experts.
      migration: gamma in [0, 1], the fraction of experts reshuffled per round (0 = fixed placement).
      wire: low-bit synchronisation's wire format (`sync_bytes`); None: parameters travel as `bytes_per_param`.
    Returns:
      {"dense", "sparse", "total"} in bytes per site per round.
    """
    n_le = local_experts(shape.num_experts, sites, overlap)
    p = param_count(shape.d_model, shape.num_layers, shape.num_experts, shape.expert_size, shape.vocab_size)
    dense_params = p["dense"] + (p["router"] if skip_token else 0)
    s_expert = p["per_expert"] + (0 if skip_token else shape.d_model)  # + its router row when partitioned
    return sync_bytes(
        dense_params * bytes_per_param,
        shape.num_layers * n_le * s_expert * bytes_per_param,
        sites,
        overlap,
        optimizer=optimizer,
        migration=migration,
        wire=wire,
        second_moments=second_moments,
    )


def sync_bytes(
    dense_bytes: float,
    local_expert_bytes: float,
    sites: int,
    overlap: int,
    *,
    optimizer: str = "local_adamw",
    migration: float = 0.0,
    state_bytes: tuple[float, float] | None = None,
    wire: WireFormat | None = None,
    second_moments: str = "sent",
) -> dict[str, float]:
    """The communication formulas on given byte counts: `dense_bytes` = S_dense (the parameters every site
    averages over all M sites), `local_expert_bytes` = sum over layers of N_le s_expert (what a site averages over
    its O_e-site replica group).

    With a low-bit `wire` the byte counts are read as float32 values (4 bytes each, the sites' master state) and
    each group (dense and expert parameters; dense and expert first and second moments, Adam's state halves) is one
    quantised mean of its own, `wire_bytes`; second moments travel as bf16 under a block format, or not at all with
    `second_moments` = "local" (moe.rounds.second_moment_wire); a reshuffle's migration still moves float32 weights.

    LocalAdamW also averages the optimizer state that mirrors the parameters: `state_bytes` = (dense, expert)
    bytes of it; by default AdamW's two moments, 2 x the parameters (Lion and Muon keep one momentum buffer per
    parameter; counts and statistics are not averaged). A reshuffle (`migration` gamma) moves expert weights only.
    Returns {"dense", "sparse", "total"} bytes per site per round."""
    if optimizer not in ("diloco", "local_adamw"):
        raise ValueError(f"optimizer = {optimizer!r}; allowed: ['diloco', 'local_adamw'].")
    if not 0.0 <= migration <= 1.0:
        raise ValueError(f"migration gamma = {migration} must be in [0, 1].")
    dense_state, expert_state = (2 * dense_bytes, 2 * local_expert_bytes) if state_bytes is None else state_bytes
    if second_moments == "local" and (wire is None or wire.exact):  # Adam's state halves: nu stays on each site
        dense_state, expert_state = dense_state / 2, expert_state / 2
    if optimizer == "diloco":
        dense_state = expert_state = 0.0
    if wire is None or wire.exact:
        dense = _ring(sites) * (dense_bytes + dense_state)
        sparse = _ring(overlap) * (local_expert_bytes + expert_state)
    else:
        nu_wire = None if second_moments == "local" else wire if not wire.scaled else WireFormat("bf16")

        def group(n: int, params: float, state: float) -> float:  # parameters, first and second moments
            total = wire_bytes(params / 4, n, wire) + wire_bytes(state / 8, n, wire)
            return total + (wire_bytes(state / 8, n, nu_wire) if nu_wire is not None else 0.0)

        dense, sparse = group(sites, dense_bytes, dense_state), group(overlap, local_expert_bytes, expert_state)
    sparse += migration * (1.0 - overlap / sites) * local_expert_bytes
    return {"dense": dense, "sparse": sparse, "total": dense + sparse}


def spes_bytes(dense_bytes: float, expert_bytes: float, sites: int) -> float:
    """SPES's synchronisation (moe.spes) per site: the dense parameters (routers included) all-reduced,
    2 (M - 1) / M S_dense, plus every expert all-gathered from its owner, (M - 1) / M S_experts (all N_e of them)."""
    return _ring(sites) * dense_bytes + (sites - 1) / sites * expert_bytes


def ddp_bytes_per_step(shape: ModelShape, sites: int, *, bytes_per_param: int = BYTES_PER_PARAM) -> float:
    """DDP: every step each site all-reduces the gradient of the whole model, 2 (M - 1) / M * S_model."""
    p = param_count(shape.d_model, shape.num_layers, shape.num_experts, shape.expert_size, shape.vocab_size)
    return _ring(sites) * p["total"] * bytes_per_param


def bytes_per_token(per_site_round_bytes: float, sites: int, local_steps: int, global_batch_tokens: int) -> float:
    """BPT = M * B_per_site / (K * global_batch_tokens): all sites' traffic per round over the tokens it trains."""
    return sites * per_site_round_bytes / (local_steps * global_batch_tokens)


def flops_per_token(
    shape: ModelShape,
    sites: int = 1,
    overlap: int = 1,
    *,
    skip_token: bool = False,
    ghost_fraction: float | None = None,
    training: bool = True,
) -> dict[str, float]:
    """FLOPs per token on one site (PaLM accounting: 2 per multiply-add of a weight, 4 L d T for attention).

    Per layer the MoE part is [min(k, N_le)/k * F_ffn + (N_le / N_e) * F_gate] with the partitioned router (each
    site routes its tokens over its N_le resident experts). With skip-token the router scores all N_e experts and
    the executed experts per token are k (1 - ghost fraction), by default the balanced-routing value k N_le / N_e.
    With O_e = M (full replica) both modes are a standard top-k MoE.

    Returns: {"dense", "router", "experts", "total"} (training = 3 x forward).
    """
    n_le = local_experts(shape.num_experts, sites, overlap)
    d, layers, k = shape.d_model, shape.num_layers, shape.top_k
    f_ffn = k * 2 * (2 * d * shape.expert_size)  # k experts, two matrices
    f_gate = 2.0 * d * shape.num_experts
    if skip_token:
        ghost = (1.0 - n_le / shape.num_experts) if ghost_fraction is None else ghost_fraction
        experts, router = (1.0 - ghost) * f_ffn, f_gate
    else:
        experts, router = min(k, n_le) / k * f_ffn, n_le / shape.num_experts * f_gate
    dense = layers * (2 * 4 * d * d + 4 * d * shape.seq_len) + 2 * d * shape.vocab_size
    scale = 3.0 if training else 1.0
    out = {"dense": dense, "router": layers * router, "experts": layers * experts}
    out = {key: scale * v for key, v in out.items()}
    out["total"] = sum(out.values())
    return out


def memory_per_site(
    shape: ModelShape, sites: int, overlap: int, *, bytes_per_param: float = TRAIN_STATE_BYTES_PER_PARAM
) -> float:
    """Training-state bytes on one site: (dense + (O_e / M) x (experts and their router rows)) x 18 bytes."""
    local_experts(shape.num_experts, sites, overlap)
    p = param_count(shape.d_model, shape.num_layers, shape.num_experts, shape.expert_size, shape.vocab_size)
    return (p["dense"] + overlap / sites * (p["experts"] + p["router"])) * bytes_per_param


def round_seconds(
    *,
    flops_per_token: float,
    tokens_per_step: float,
    local_steps: int,
    round_bytes: float,
    bandwidth_bits_per_second: float,
    latency_seconds: float = 0.05,
    peak_flops: float = SITE_PEAK_FLOPS,
    mfu: float = 0.4,
    overlap_fraction: float = 0.0,
    hidden: bool = False,
    sync_cpu_seconds: float = 0.0,
    host_bytes: float = 0.0,
) -> dict[str, float]:
    """t_comp = F_token * tokens_per_step / (MFU * peak) per local step; t_comm = bytes / bandwidth + latency (the
    time a site waits on its link); c = `sync_cpu_seconds`, the synchronisation's own work on the processors that
    also compute (quantisation, the reduction's arithmetic, the collective library's copies: what the unlimited-link
    runs measure, experiments.reproduce.links); t_host = `host_bytes` / bandwidth, what the round moves besides its
    synchronisation (the host's gathers of metrics and probes between the programs). A round takes
    K t_comp + c + (1 - overlap) t_comm + t_host, or with the synchronisation `hidden` behind the next round's local
    steps (one round late, Streaming DiLoCo's overlap) K t_comp + c + max(0, t_comm - K t_comp) + t_host: only the
    synchronisation's wait hides, never its work nor the host's gathers, and a round is never shorter than its
    transfer. `tokens_per_step` is one site's tokens per step. Returns {"compute": K t_comp, "communication":
    t_comm, "host_communication": t_host, "sync_cpu": c, "total"}."""
    compute = local_steps * flops_per_token * tokens_per_step / (mfu * peak_flops)
    t_comm = 8.0 * round_bytes / bandwidth_bits_per_second + latency_seconds
    t_host = 8.0 * host_bytes / bandwidth_bits_per_second
    waited = max(0.0, t_comm - compute) if hidden else (1.0 - overlap_fraction) * t_comm
    return {"compute": compute, "communication": t_comm, "host_communication": t_host, "sync_cpu": sync_cpu_seconds,
            "total": compute + sync_cpu_seconds + waited + t_host}  # fmt: skip


def link_bytes(payload_bytes: float, *, framing: float = FRAME_BYTES / TCP_PAYLOAD_BYTES, fixed_bytes: float = 0.0):
    """What a link carries for `payload_bytes` of collectives: framing x payload + fixed_bytes. The default framing
    is a full Ethernet frame per TCP segment (1514 bytes for 1448 of payload: Ethernet, IP and TCP headers with
    timestamps), a floor; `fixed_bytes`, what a round sends besides its collectives (metrics, coordination).
    experiments.reproduce.links fits both on its unlimited-link runs (a framing of about 1.09 there: the frames,
    the acknowledgements and gloo's own headers)."""
    return framing * payload_bytes + fixed_bytes


def training_hours(rounds: float, seconds_per_round: float) -> float:
    return rounds * seconds_per_round / 3600.0


@dataclasses.dataclass(frozen=True)
class Projection:
    """One row of a projection: a method at one overlap and bandwidth."""

    method: str
    overlap: int
    bandwidth_gbps: float
    bytes_per_site_per_round: float
    rounds: float
    hours: float
    memory_gib_per_site: float
    sync_period_steps: int = 1
    """Local steps between two synchronisations of the same parameter (K F; DDP: 1)."""
    staleness_steps: int = 0
    """Local steps a synchronisation's result is applied late (hidden: K, the one round it runs behind; else 0)."""


def project(
    shape: ModelShape,
    *,
    sites: int = 32,
    overlaps=(1, 2, 4, 8, 16, 32),
    bandwidths_gbps=(1, 10, 100),
    local_steps: int = 32,
    global_batch_tokens: int = 4 * 2**20,
    tokens_per_active_param: float = TOKENS_PER_ACTIVE_PARAM,
    optimizer: str = "local_adamw",
    skip_token: bool = False,
    peak_flops: float = SITE_PEAK_FLOPS,
    mfu: float = 0.4,
    latency_seconds: float = 0.05,
    wire: WireFormat | None = None,
    second_moments: str = "sent",
    hidden: bool = False,
    fragments: int = 1,
) -> list[Projection]:
    """Training time and traffic of FoMoE at each overlap, and of DDP, at each bandwidth (module decisions); FoMoE's
    synchronisation in `wire` (low-bit: `sync_bytes`), in `fragments` synchronised in turn (a round moves 1/F of the
    bytes; moe.streaming) and, with `hidden`, behind the next round's compute (`round_seconds`), applied K steps late
    (each row's staleness_steps; a fragment is synchronised every K F steps, sync_period_steps). DDP stays float32
    and blocking."""
    total_tokens = tokens_per_active_param * active_params(shape)
    steps = total_tokens / global_batch_tokens
    rows = []
    for gbps in bandwidths_gbps:
        for o in overlaps:
            b = (
                bytes_per_round(
                    shape,
                    sites,
                    o,
                    optimizer=optimizer,
                    skip_token=skip_token,
                    wire=wire,
                    second_moments=second_moments,
                )["total"]
                / fragments
            )
            f = flops_per_token(shape, sites, o, skip_token=skip_token)["total"]
            t = round_seconds(
                flops_per_token=f,
                tokens_per_step=global_batch_tokens / sites,
                local_steps=local_steps,
                round_bytes=b,
                bandwidth_bits_per_second=gbps * 1e9,
                latency_seconds=latency_seconds,
                peak_flops=peak_flops,
                mfu=mfu,
                hidden=hidden,
            )
            rounds = steps / local_steps
            rows.append(
                Projection(
                    f"FoMoE {optimizer}",
                    o,
                    gbps,
                    b,
                    rounds,
                    training_hours(rounds, t["total"]),
                    memory_per_site(shape, sites, o) / 2**30,
                    sync_period_steps=local_steps * fragments,
                    staleness_steps=local_steps if hidden else 0,
                )
            )
        f = flops_per_token(shape, sites, sites)["total"]
        t = round_seconds(
            flops_per_token=f,
            tokens_per_step=global_batch_tokens / sites,
            local_steps=1,
            round_bytes=ddp_bytes_per_step(shape, sites),
            bandwidth_bits_per_second=gbps * 1e9,
            latency_seconds=latency_seconds,
            peak_flops=peak_flops,
            mfu=mfu,
        )
        rows.append(
            Projection(
                "DDP",
                sites,
                gbps,
                ddp_bytes_per_step(shape, sites),
                steps,
                training_hours(steps, t["total"]),
                memory_per_site(shape, sites, sites) / 2**30,
            )
        )
    return rows
