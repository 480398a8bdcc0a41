"""Federated training (FoMoE, mesh.site > 1) from a config: the round that the one training loop
(`core.train.run`) drives, wired.

Builds, from the `fomoe`, `mesh`, `moe` and `train` sections, what moe.stepper.FederatedStepper takes: the site
mesh (moe.federation), the placements (moe.placement: fixed, or random and redrawn every `fomoe.reshuffle_every`
rounds), the site model, its inner and outer optimizers (experiments.build, which builds every run's optimizer:
with random placement, the arrival warm-up of moe.reshuffle; optim.diloco_outer for `fomoe.outer = "diloco"`) and
the initial stacked state (moe.rounds.init_sites, from checkpoint.init_from's weights when it names a checkpoint).
Checkpoints are written in whole rounds, every ceil(checkpoint.every / K) rounds and after the last (the driver's
`Stepper.checkpoint_every`), so a rerun resumes from the last saved round and writes the same metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import ml_collections
from flax import nnx

from core import mesh_config
from core import train as train_lib
from core.data import Batches
from experiments import build, schema_moe
from experiments.hf import load as hf_load
from moe import federation, rounds, spes, streaming
from moe.placement import Placement, fixed_placement, random_placement
from moe.stepper import FederatedStepper

__all__ = ["initial_state", "site_config", "train_federated"]


def train_federated(
    config: ml_collections.ConfigDict,
    *,
    workdir: str,
    batches: Batches,
    compat: Mapping[str, Any],
    provenance: Mapping[str, Any] | None = None,
    state_metrics: train_lib.StateMetrics | None = None,
    hooks: Sequence[Callable[[int, dict[str, float]], None]] = (),
    on_start: Callable[[int | None], None] | None = None,
) -> dict[str, Any]:
    """Trains a federation of `mesh.site` sites: the one training loop (`core.train.run`) driving a
    moe.stepper.FederatedStepper. Arguments as `run`'s; the results add `rounds`, `bytes_per_site_per_round`
    (measured from the compiled round, and by the formula), `bytes_per_token`, and site 0's final TrainState (single
    process)."""
    if jax.process_index() == 0:
        train_lib.tensorboard_enabled(config)  # tensorboardX missing: refused before anything compiles
    expert = mesh_config.mesh_shape(config, jax.device_count())["expert"]  # E devices per site (moe.federation)
    mesh = federation.site_mesh(config.mesh.site, config.fomoe.overlap, expert=expert)
    graphdef, optimizer, outer, state = initial_state(config, mesh, pretrained=True)
    f = config.fomoe
    stepper = FederatedStepper(
        graphdef,
        optimizer,
        state,
        mesh,
        batches,
        placement_at=_placements(config),
        local_steps=f.local_steps,
        total_rounds=config.train.steps // f.local_steps,
        outer=outer,
        method=f.outer,
        reshuffle_every=f.reshuffle_every if f.placement == "random" else 0,
        routing=f.routing,
        eval_batches=config.train.eval_batches,
        state_metrics=state_metrics,
        wire=schema_moe.wire_format(f),
        error_feedback=f.error_feedback,
        feedback_decay=f.feedback_decay,
        merge=(f.merge_alpha, f.merge_steps) if f.outer == "spes" else (0.0, 1),
        second_moments=f.second_moments,
        fragments=f.fragments,
        delay=f.delay,
        mixing=f.mixing,
        moment_periods=tuple(f.moment_periods),
    )
    return train_lib.run(
        config, stepper, state, workdir=workdir, compat=compat, provenance=provenance, hooks=hooks, on_start=on_start
    )


def initial_state(config: ml_collections.ConfigDict, mesh=None, *, pretrained: bool = False):
    """(site graphdef, inner optimizer, outer optimizer or None, the federation's initial FederatedState): what
    `train_federated` starts from on the site `mesh`, and what a loader restores a checkpoint into (mesh None: on
    the default device). `pretrained`: start from `checkpoint.init_from`'s weights when it names a checkpoint (each
    site receives its resident experts' weights, by the placement); otherwise the weights are random (train.seed).
    """
    f = config.fomoe
    placement = _placements(config)(0)
    outer = build.build_outer_optimizer(config)
    sharder = federation.site_sharder(mesh, tuple(tuple(r) for r in config.mesh.rules))  # E > 1: the site's devices
    model_fn = lambda **kw: build.build_model_fn(config, sharder, routing_mode=f.routing, **kw)  # noqa: E731
    make = lambda **kw: model_fn(**kw)(nnx.Rngs(config.train.seed))  # noqa: E731
    site_model = make(resident=placement.experts[0])
    optimizer = build.build_optimizer(config, nnx.state(site_model, nnx.Param))  # random placement: arrival warm-up
    if pretrained and config.checkpoint.init_from:  # built abstractly: no random parameters are computed
        global_model = hf_load.pretrained_model(config, model_fn())
    else:
        global_model = make()
    anchor = streaming.anchor_kind(f.outer, schema_moe.wire_format(f), f.fragments, f.delay, tuple(f.moment_periods))
    graphdef, state = rounds.init_sites(
        global_model, site_model, placement, optimizer, outer, mesh, config.train.seed,
        error_feedback=f.error_feedback, anchor=anchor,
    )  # fmt: skip
    if f.outer == "spes":  # which experts each site trains
        train = state.train._replace(opt_state=spes.assign_owners(state.train.opt_state, placement.sites))
        state = state._replace(train=train)
    return graphdef, optimizer, outer, state


def site_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The config of one site's model taken as a model of its own (what `experiments.load.trained_model` returns
    beside a site's model). With partitioned routing a site routes over and holds only its L resident experts, so it
    is a plain MoE of L experts (moe.num_experts = L, mesh.site = 1), as is a dense federation's site. Under
    skip-token routing a site routes over all N experts but holds only L, which no plain model expresses: the config
    is returned as it is, so that what reads it (experiments.hf.export) can refuse it by name."""
    out = config.copy_and_resolve_references()
    if config.mesh.site > 1 and not (config.moe.every and config.fomoe.routing == "skip_token"):
        if config.moe.every:
            out.moe.num_experts = _placements(config)(0).local_experts
        out.mesh.site = 1
    return out


def _placements(config: ml_collections.ConfigDict) -> Callable[[int], Placement]:
    """round -> the placement that round trains with: fixed, or random and redrawn every `reshuffle_every` rounds
    (a pure function of the seed and the round, so a resumed run continues with the same placements)."""
    f, experts, sites = config.fomoe, config.moe.num_experts, config.mesh.site
    if f.placement == "fixed":
        return lambda r: fixed_placement(experts, sites, f.overlap)
    return lambda r: random_placement(experts, sites, f.overlap, seed=(config.train.seed, r // f.reshuffle_every))
