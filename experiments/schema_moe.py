"""The config sections of FoMoE, `moe` and `fomoe`: their mapping onto the MoE layer's own arguments
(moe.MoEConfig), the `fomoe` section's declaration, and the checks that involve other sections (`model`, `mesh`,
`train`, `data`). The library (moe/) takes typed arguments and names them in its errors ("MoEConfig.top_k = 3 ...");
this module re-raises those with the config keys ("config key 'moe.top_k' = 3 ...").

    moe = schema_moe.moe_config(config)        # the `moe` section as moe.MoEConfig (ConfigError naming a key)
    schema_moe.check(config, mesh_sizes)       # `moe` against `model` and the mesh
    schema_moe.check_fomoe(config, mesh_sizes) # a federated run's keys
    schema_moe.wire_format(config.fomoe)       # the synchronisation's core.codec.WireFormat
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import ClassVar

import ml_collections

from core.codec import FORMATS, ROUNDINGS, SCALES, WireFormat
from core.fields import Compat, ConfigError, field, from_config
from core.mesh_config import rule_mesh_axes
from moe import desloc
from moe.config import ROUTING_MODES, MoEConfig

__all__ = ["FoMoEConfig", "check", "check_fomoe", "moe_config", "wire_format"]


def moe_config(config: ml_collections.ConfigDict) -> MoEConfig:
    """The section `moe` as the layer's moe.MoEConfig; a value it refuses is a ConfigError naming the config key."""
    try:
        return from_config(MoEConfig, config.moe)
    except ValueError as e:
        raise _as_config_error(e) from None


def _as_config_error(error: ValueError) -> ConfigError:
    """A library error naming MoEConfig's arguments ("MoEConfig.top_k = 3 exceeds MoEConfig.num_experts = 2; ...")
    as the config error naming their keys ("config key 'moe.top_k' = 3 exceeds 'moe.num_experts' = 2; ...")."""
    text = re.sub(r"MoEConfig\.(\w+)", r"'moe.\1'", str(error))
    return ConfigError(f"config key {text}" if text.startswith("'moe.") else text)


def check(config: ml_collections.ConfigDict, mesh_sizes: dict[str, int] | None) -> None:
    """Cross-field checks of `moe` (MoEConfig.check's, re-raised with the config keys) and of `moe` against `model`
    and, when known, the mesh sizes. Raises ConfigError."""
    m = config.moe
    if m.every == 0:
        return
    bad = [i for i in m.dense_layers if not 0 <= i < config.model.num_layers]
    if bad:
        raise ConfigError(
            f"config key 'moe.dense_layers' = {tuple(m.dense_layers)} names layers {bad} outside 0..."
            f"{config.model.num_layers - 1} ('model.num_layers' = {config.model.num_layers})."
        )
    if m.every > config.model.num_layers:
        raise ConfigError(
            f"config key 'moe.every' = {m.every} exceeds 'model.num_layers' = "
            f"{config.model.num_layers}: no block would be MoE. Use 0 for a dense model."
        )
    layer = moe_config(config)
    try:
        layer.check()
    except ValueError as e:
        raise _as_config_error(e) from None
    if mesh_sizes is None:
        return
    targets = rule_mesh_axes(config.mesh.rules, "expert")
    shards = math.prod(mesh_sizes[axis] for axis in targets)
    if m.num_experts % shards:
        raise ConfigError(
            f"config key 'moe.num_experts' = {m.num_experts} is not divisible by the mesh axes "
            f"{list(targets)} = {shards} devices that shard the experts (mesh.rules maps 'expert' "
            "to them); use a multiple of that or change the mesh."
        )


@dataclasses.dataclass(frozen=True)
class FoMoEConfig:
    """The section `fomoe`: federated training across `mesh.site` sites (used when mesh.site > 1).

    Each site runs on one device, or with mesh.expert = E > 1 on E devices of its own over which its resident
    experts are sharded (expert parallelism inside the site; its collectives stay among the site's devices and the
    synchronisation's bytes per site are unchanged, moe.federation). Then the resident experts per site,
    overlap x moe.num_experts / mesh.site, must be divisible by E, with the 'dropless' dispatch and the fixed
    placement; mesh.data and mesh.model stay 1."""

    compat: ClassVar[Compat] = True

    overlap: int = field(
        1,
        "O_e: sites hosting each expert (1 = disjoint experts, mesh.site = full replica); must divide mesh.site, "
        "and O_e x moe.num_experts must be divisible by it",
        low=1,
    )
    local_steps: int = field(32, "K: local optimizer steps per round; train.steps must be a multiple", low=1)
    outer: str = field(
        "local_adamw",
        "synchronisation: 'local_adamw' (average parameters and both AdamW moments), 'diloco' (outer Nesterov "
        "step on the averaged change) or 'spes' (SPES, moe.spes: every site holds every expert, overlap = "
        "mesh.site, trains the num_experts / mesh.site it owns; dense parameters averaged, experts from their "
        "owners)",
        choices=("local_adamw", "diloco", "spes"),
    )
    outer_learning_rate: float = field(0.7, "DiLoCo outer learning rate", low=0.0, low_open=True)
    outer_momentum: float = field(0.9, "DiLoCo outer Nesterov momentum", low=0.0, high=0.999)
    routing: str = field(
        "partitioned",
        "'partitioned' (a site routes over its resident experts, top min(k, N_le)) or 'skip_token' (global "
        "router; non-resident choices are skipped)",
        choices=ROUTING_MODES,
    )
    placement: str = field(
        "fixed",
        "'fixed' (the spec's strided blocks) or 'random' (experts regrouped into the blocks at random every "
        "reshuffle_every rounds; arrived experts get fresh optimizer state and a learning-rate warm-up)",
        choices=("fixed", "random"),
    )
    reshuffle_every: int = field(4, "random placement: rounds between reshuffles (T)", low=1)
    arrival_warmup: int = field(
        8,
        "random placement: local steps over which an arrived expert's learning rate ramps linearly up to the "
        "schedule's",
        low=1,
    )
    sync_format: str = field(
        "float32",
        "what crosses the links at synchronisation: 'float32' (the exact mean), 'bf16', 'int8', 'fp4' (E2M1), "
        "'int4' (the uniform grid) or 'topk2' (sparse: sync_keep per chunk, all-gathered); low-bit formats send "
        "each site's change since the round's start, averaged in float32 (moe.lowbit_sync)",
        choices=FORMATS,
        since_checkpoints=True,
    )
    sync_block: int = field(
        32, "int8 / fp4 / int4 synchronisation: values per block scale (even for 4-bit)", low=1, since_checkpoints=True
    )
    sync_scale: str = field(
        "ue8m0",
        "int8 / fp4 / int4 synchronisation: block scale 'ue8m0' (a power of two, 1 byte) or 'fp32' (4 bytes)",
        choices=SCALES,
        since_checkpoints=True,
    )
    sync_rounding: str = field(
        "nearest",
        "low-bit synchronisation: 'nearest' (ties to even) or 'stochastic' (unbiased) rounding",
        choices=ROUNDINGS,
        since_checkpoints=True,
    )
    sync_keep: int = field(
        0,
        "'topk2' synchronisation (SparseLoCo's top-k with 2-bit values): values sent per chunk of sync_block "
        "(1..sync_block, sync_block <= 16384, sync_scale 'fp32'); 0 for the other formats",
        low=0,
        since_checkpoints=True,
    )
    second_moments: str = field(
        "sent",
        "LocalAdamW's second moments: 'sent' (in sync_format when that is float32 or bf16; as bf16 under int8 / fp4 / "
        "int4, whose block scales would round a small one to zero or below) or 'local' (each site keeps its own)",
        choices=("sent", "local"),
        since_checkpoints=True,
    )
    fragments: int = field(
        1,
        "streaming synchronisation: F fragments of the parameters (fragment f: the blocks l with l mod F = f, and "
        "fragment 0 the rest), one averaged per round in turn (moe.streaming); 1 = all every round",
        low=1,
        since_checkpoints=True,
    )
    delay: int = field(
        0,
        "streaming synchronisation: 0 = a round's fragment is averaged after its local steps (blocking); 1 = behind "
        "the next round's local steps, its correction applied one round late (LocalAdamW: needs second_moments = "
        "'local')",
        choices=(0, 1),
        since_checkpoints=True,
    )
    mixing: float = field(
        1.0,
        "delay 1: the share alpha of the group's correction a site applies (theta + alpha (mean - own))",
        low=0.0,
        low_open=True,
        high=1.0,
        since_checkpoints=True,
    )
    error_feedback: bool = field(
        False,
        "low-bit synchronisation: each site keeps what quantisation dropped and adds it to its next send "
        "(checkpointed)",
        since_checkpoints=True,
    )
    feedback_decay: float = field(
        1.0,
        "error feedback: beta, the share of what was dropped that the next send adds (SparseLoCo's e <- beta e + "
        "Delta, its 0.95); 1 = all of it",
        low=0.0,
        low_open=True,
        high=1.0,
        since_checkpoints=True,
    )
    merge_alpha: float = field(
        0.05,
        "outer 'spes': the expert-merging warm-up's alpha_0 (each expert moves alpha of the way to its 4 most "
        "similar, alpha decaying linearly to 0 over merge_steps; the authors' 0.05); 0 = no warm-up",
        low=0.0,
        high=1.0,
        since_checkpoints=True,
    )
    merge_steps: int = field(
        2000, "outer 'spes': steps over which the merging warm-up's alpha decays to 0", low=1, since_checkpoints=True
    )
    moment_periods: tuple[int, int] = field(
        (1, 1),
        "DES-LOC (moe.desloc), outer 'local_adamw' or 'diloco' (its inner moments, float32): (p_u, p_v), the first "
        "moments averaged every p_u-th round and the second every p_v-th (the paper's (3, 6)), each site keeping "
        "its own between; (1, 1) = the outer method's own (LocalAdamW: both every round; DiLoCo: never)",
        since_checkpoints=True,
    )


def check_fomoe(config: ml_collections.ConfigDict, mesh_sizes: dict[str, int] | None) -> None:
    """Cross-field checks of a federated run (mesh.site > 1). Raises ConfigError."""
    sites = config.mesh.site
    if sites == 1:
        return
    f = config.fomoe
    if sites == -1:
        raise ConfigError("config key 'mesh.site' = -1: a federated run needs an explicit number of sites.")
    if mesh_sizes is not None:
        inner = {a: mesh_sizes[a] for a in ("data", "model") if mesh_sizes[a] != 1}
        if inner:
            raise ConfigError(
                f"a federated run (mesh.site = {sites}) splits a site over mesh.expert only; got "
                f"{', '.join(f'mesh.{a} = {n}' for a, n in inner.items())}: set them to 1 (mesh.expert = E > 1 "
                "gives each site E devices that run its experts expert-parallel)."
            )
    expert = mesh_sizes["expert"] if mesh_sizes is not None else config.mesh.expert
    if expert > 1:
        _check_site_experts(config, expert)
    if f.overlap > sites or sites % f.overlap:
        raise ConfigError(
            f"config key 'fomoe.overlap' = {f.overlap} must divide 'mesh.site' = {sites} (the sites "
            "form mesh.site / overlap replica groups)."
        )
    if config.moe.every and (f.overlap * config.moe.num_experts) % sites:
        raise ConfigError(
            f"config keys 'fomoe.overlap' x 'moe.num_experts' = {f.overlap} x "
            f"{config.moe.num_experts} must be divisible by 'mesh.site' = {sites}: each site hosts "
            "overlap x num_experts / site experts."
        )
    if f.placement == "random" and f.overlap == sites:
        raise ConfigError(
            f"config key 'fomoe.placement' = 'random' needs 'fomoe.overlap' < 'mesh.site' (got "
            f"{f.overlap} = {sites}): with a full replica every site hosts every expert and there "
            "is nothing to reshuffle. Use 'fixed'."
        )
    _check_wire(config, expert)
    _check_streaming(config)
    _check_spes(config, expert)
    _check_desloc(config)
    if config.train.steps % f.local_steps:
        below = config.train.steps // f.local_steps * f.local_steps
        fits = " or ".join(str(s) for s in (below, below + f.local_steps) if s > 0)
        raise ConfigError(
            f"config key 'train.steps' = {config.train.steps} must be a multiple of "
            f"'fomoe.local_steps' = {f.local_steps} (whole rounds): e.g. --config.train.steps={fits}, "
            f"or a fomoe.local_steps that divides {config.train.steps}."
        )
    if config.data.batch_size % sites:
        raise ConfigError(
            f"config key 'data.batch_size' = {config.data.batch_size} must be divisible by "
            f"'mesh.site' = {sites} (each site trains on its share of the global batch)."
        )


def wire_format(fomoe: ml_collections.ConfigDict) -> WireFormat:
    """The synchronisation's core.codec.WireFormat from the section `fomoe`."""
    return WireFormat(fomoe.sync_format, fomoe.sync_block, fomoe.sync_scale, fomoe.sync_rounding, fomoe.sync_keep)


def _check_wire(config: ml_collections.ConfigDict, expert: int) -> None:
    """Low-bit synchronisation's keys against each other and the rest of the federation. Raises ConfigError."""
    f = config.fomoe
    try:
        wire_format(f)
    except ValueError as error:  # "wire format keep = 0 for 'topk2'; ..." -> "config key 'fomoe.sync_keep' = 0 ..."
        message = str(error)
        for name in ("name", "block", "scale", "rounding", "keep"):
            key = "sync_format" if name == "name" else f"sync_{name}"
            message = message.replace(f"wire format {name} =", f"config key 'fomoe.{key}' =")
        raise ConfigError(message) from None
    if f.feedback_decay != 1.0 and not f.error_feedback:
        raise ConfigError(
            f"config key 'fomoe.feedback_decay' = {f.feedback_decay} needs 'fomoe.error_feedback' = True (it decays "
            "the feedback); set error_feedback, or feedback_decay to 1.0."
        )
    if f.sync_format == "float32":
        if f.error_feedback:
            raise ConfigError(
                "config key 'fomoe.error_feedback' = True needs a low-bit 'fomoe.sync_format' (got 'float32', which "
                "drops nothing): set sync_format to 'bf16', 'int8', 'fp4', 'int4' or 'topk2', or error_feedback "
                "to False."
            )
        return
    for key, value, allowed in (("mesh.expert", expert, 1), ("fomoe.placement", f.placement, "fixed")):
        if value != allowed:
            raise ConfigError(
                f"config key {key!r} = {value!r} with 'fomoe.sync_format' = {f.sync_format!r}: low-bit "
                f"synchronisation runs with {key} = {allowed!r}; set it so, or sync_format to 'float32'."
            )


def _check_streaming(config: ml_collections.ConfigDict) -> None:
    """Streaming synchronisation's keys (moe.streaming) against the rest of the federation. Raises ConfigError."""
    f = config.fomoe
    if f.fragments > config.model.num_layers:
        raise ConfigError(
            f"config key 'fomoe.fragments' = {f.fragments} exceeds 'model.num_layers' = {config.model.num_layers}: "
            "fragments are strided by layer, so some would hold no parameter."
        )
    if f.fragments == 1 and f.delay == 0:
        return
    if f.placement != "fixed":
        raise ConfigError(
            f"config key 'fomoe.placement' = {f.placement!r} with 'fomoe.fragments' = {f.fragments}, 'fomoe.delay' "
            f"= {f.delay}: streaming synchronisation runs with a fixed placement; set fomoe.placement to 'fixed', or "
            "fomoe.fragments = 1 and fomoe.delay = 0."
        )
    if f.delay == 1 and f.outer == "local_adamw" and f.second_moments != "local":
        raise ConfigError(
            f"config key 'fomoe.delay' = 1 with 'fomoe.outer' = 'local_adamw' needs 'fomoe.second_moments' = "
            f"'local' (got {f.second_moments!r}): a second moment corrected a round late could turn negative."
        )


def _check_spes(config: ml_collections.ConfigDict, expert: int) -> None:
    """SPES's keys (moe.spes) against the rest of the federation. Raises ConfigError."""
    f, sites = config.fomoe, config.mesh.site
    default = FoMoEConfig()
    if f.outer != "spes":
        for key in ("merge_alpha", "merge_steps"):
            if f[key] != getattr(default, key):
                raise ConfigError(
                    f"config key 'fomoe.{key}' = {f[key]!r} is SPES's; it needs 'fomoe.outer' = 'spes' (got "
                    f"{f.outer!r}): leave it at {getattr(default, key)!r}, or set outer to 'spes'."
                )
        return
    wanted = {
        "fomoe.overlap": (f.overlap, sites),
        "mesh.expert": (expert, 1),
        "fomoe.placement": (f.placement, "fixed"),
        "fomoe.sync_format": (f.sync_format, "float32"),
        "fomoe.fragments": (f.fragments, 1),
        "fomoe.delay": (f.delay, 0),
        "fomoe.moment_periods": (tuple(f.moment_periods), (1, 1)),
    }
    for key, (value, allowed) in wanted.items():
        if value != allowed:
            raise ConfigError(
                f"config key {key!r} = {value!r} with 'fomoe.outer' = 'spes': SPES runs with {key} = {allowed!r} "
                "(every site holds every expert and synchronises all parameters in float32 every round)."
            )
    if config.moe.num_experts % sites:
        raise ConfigError(
            f"config key 'moe.num_experts' = {config.moe.num_experts} with 'fomoe.outer' = 'spes' must be "
            f"divisible by 'mesh.site' = {sites}: each site owns num_experts / mesh.site experts."
        )


def _check_desloc(config: ml_collections.ConfigDict) -> None:
    """DES-LOC's periods (moe.desloc) against the rest of the federation. Raises ConfigError."""
    f = config.fomoe
    try:
        periods = desloc.check_periods(tuple(f.moment_periods))
    except (ValueError, TypeError):
        raise ConfigError(
            f"config key 'fomoe.moment_periods' = {f.moment_periods!r}; allowed: two positive integers (p_u, p_v)."
        ) from None
    if periods == (1, 1):
        return
    if f.outer not in ("local_adamw", "diloco") or f.delay != 0:
        raise ConfigError(
            f"config key 'fomoe.moment_periods' = {periods} (DES-LOC) needs 'fomoe.outer' = 'local_adamw' or "
            f"'diloco' and 'fomoe.delay' = 0 (got {f.outer!r}, {f.delay})."
        )
    if f.outer == "diloco" and f.sync_format != "float32":
        raise ConfigError(
            f"config key 'fomoe.sync_format' = {f.sync_format!r} with 'fomoe.moment_periods' = {periods} and "
            "'fomoe.outer' = 'diloco': DES-LOC averages DiLoCo's inner moments in float32; allowed: 'float32'."
        )
    if f.second_moments == "local" and periods[1] != 1:
        raise ConfigError(
            f"config key 'fomoe.moment_periods' = {periods} sets a period for second moments that "
            "'fomoe.second_moments' = 'local' never sends: set p_v to 1, or second_moments to 'sent'."
        )


def _check_site_experts(config: ml_collections.ConfigDict, expert: int) -> None:
    """A federated run with mesh.expert = E > 1 devices per site (moe.federation): what expert parallelism inside
    a site needs. Raises ConfigError."""
    sites, f, m = config.mesh.site, config.fomoe, config.moe
    if not m.every:
        raise ConfigError(
            f"config key 'mesh.expert' = {expert} with 'mesh.site' = {sites} shards each site's experts over "
            "its devices, but 'moe.every' = 0 (a dense model has none): set mesh.expert to 1, or moe.every >= 1."
        )
    if rule_mesh_axes(config.mesh.rules, "expert") != ("expert",):
        raise ConfigError(
            f"config key 'mesh.rules' maps the logical axis 'expert' to "
            f"{list(rule_mesh_axes(config.mesh.rules, 'expert'))}; a federated run with 'mesh.expert' = {expert} "
            "shards each site's experts over the mesh axis 'expert': map 'expert' to 'expert'."
        )
    if m.dispatch != "dropless":
        raise ConfigError(
            f"config key 'moe.dispatch' = {m.dispatch!r} with 'mesh.expert' = {expert} and 'mesh.site' = {sites}: "
            "expert parallelism inside a site uses the 'dropless' dispatch (its all-to-all); set moe.dispatch to "
            "'dropless' or mesh.expert to 1."
        )
    if f.placement != "fixed":
        raise ConfigError(
            f"config key 'fomoe.placement' = {f.placement!r} with 'mesh.expert' = {expert}: reshuffles "
            "(moe.reshuffle) run with one device per site; use 'fixed' placement or mesh.expert = 1."
        )
    if f.overlap <= sites and not sites % f.overlap and (f.overlap * m.num_experts) % sites == 0:
        local = f.overlap * m.num_experts // sites
        if local % expert:
            raise ConfigError(
                f"each site hosts 'fomoe.overlap' x 'moe.num_experts' / 'mesh.site' = {f.overlap} x "
                f"{m.num_experts} / {sites} = {local} experts, which 'mesh.expert' = {expert} devices cannot share "
                f"evenly: use a mesh.expert that divides {local} (or change those keys)."
            )
