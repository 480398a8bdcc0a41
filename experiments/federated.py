"""Federated training (FoMoE, mesh.site > 1): the round that the one training loop (`core.train.run`) drives.

Composes moe.placement (which experts each site hosts), moe.rounds (one jitted round), moe.federation (the site
mesh, the measured collective bytes), moe.system_model (the formula bytes) and core.data into a `Stepper` whose
one call is one round: the K global batches of its steps (pure functions of the step) are split over the sites,
the K local steps and the synchronisation run as one compiled program, and its metrics are the means over steps
and sites. Checkpoints are written in whole rounds, every ceil(checkpoint.every / K) rounds and after the last (the
driver's `Stepper.checkpoint_every`), so a rerun resumes from the last saved round and writes the same metrics.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from core import config as config_lib
from core import hlo
from core import train as train_lib
from core.data import Batches
from experiments import build
from moe import federation, reshuffle, rounds, system_model
from moe.placement import Placement, fixed_placement, random_placement
from optim import diloco_outer

__all__ = ["FederatedStepper", "initial_state", "site_config", "train_federated"]


class FederatedStepper(train_lib.Stepper):
    """One call = one round: K local steps on every site, then their synchronisation (moe.rounds), compiled once.

    The round's metrics are means over its K steps and M sites, plus what the round moved per site
    ("bytes_per_site_per_round", read from the compiled program) and the routing stability:
    "routing/topk_agreement" of every site's routing on a fixed probe batch (the first held-out batch) after the round
    with its routing before it (the state the round started from: after a reshuffle, the migrated one, so a run
    resumed from any checkpoint measures what an uninterrupted one does), and with skip-token the ideal ghost
    fraction 1 - N_le / N_e. With random placement the experts move to the next placement after every
    `reshuffle_every` rounds (a metric row of its own).
    Time: the local steps and the synchronisation are two programs, each waited for, so every round also reports
    "seconds/local_steps" and "seconds/sync" (means over processes; a site's synchronisation includes its wait for
    the slowest site) and "seconds/round" (process 0's whole round, host work included: batches, metrics, probe).
    Evaluation: every site evaluates its own model (its resident experts, its routing) on the same held-out
    batches; the reported loss is the mean over sites (and the worst site's bits per byte).
    """

    unit = "round"
    compiles_on_first_call = False  # the round is compiled in the constructor, which says so

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        batches: Batches,
        mesh: jax.sharding.Mesh,
        graphdef: Any,
        optimizer: optax.GradientTransformation,
        outer: optax.GradientTransformation | None,
        state: rounds.FederatedState,
        *,
        state_metrics: train_lib.StateMetrics | None = None,
    ):
        f = config.fomoe
        self.config, self.batches, self.graphdef = config, batches, graphdef
        self.sites, self.steps_per_call = config.mesh.site, f.local_steps
        self.placement_at = _placements(config)
        placement = self.placement_at(0)
        tok = batches.tokenizer
        loss_fn = functools.partial(train_lib.lm_loss, pad_id=tok.pad_id)
        local_fn, sync_fn = rounds.make_round_parts(
            graphdef, optimizer, mesh, method=f.outer, outer=outer, loss_fn=loss_fn, state_metrics=state_metrics
        )
        eval_step = train_lib.make_eval_step(graphdef, byte_lengths=tok.byte_lengths, pad_id=tok.pad_id)
        self.eval_fn = jax.jit(federation.per_site(eval_step, mesh, (0, 0, None)))
        self.token_sharding = NamedSharding(mesh, PartitionSpec(None, federation.SITE_AXES))
        k, sites = self.steps_per_call, self.sites
        self.batch_shape = (k, sites, config.data.batch_size // sites, config.data.seq_len + 1)
        # Compiled once, in two programs (the K local steps, then the synchronisation) so that each round's compute
        # and synchronisation are timed apart; the executables also tell the bytes the synchronisation moves.
        tokens = jax.ShapeDtypeStruct(self.batch_shape, jnp.int32, sharding=self.token_sharding)
        if jax.process_index() == 0:
            print(f"compiling the round ({k} local steps and their synchronisation; can take a minute) ...", flush=True)
        t0 = time.perf_counter()
        self.start_kept = f.outer == "diloco"  # DiLoCo's synchronisation needs the parameters the round started from
        others = state.train._replace(params=None)
        self.local_exec = local_fn.lower(state.train.params, others, tokens).compile()
        start = state.train.params if self.start_kept else None
        self.sync_exec = sync_fn.lower(start, state.outer, state.train).compile()
        if jax.process_index() == 0:
            print(f"compiled the round in {time.perf_counter() - t0:.1f} s", flush=True)
        self.migrate_exec, self.plan_sharding = None, NamedSharding(mesh, PartitionSpec(federation.SITE_AXES))
        if f.placement == "random":  # compiled once too: the plan is data
            plan = jax.ShapeDtypeStruct(placement.experts.shape, jnp.int32, sharding=self.plan_sharding)
            migrate = jax.jit(functools.partial(reshuffle.migrate, mesh=mesh), donate_argnums=0)
            self.migrate_exec = migrate.lower(state, [plan] * 4).compile()
        round_hlo = self.sync_exec.as_text()  # the local steps' program moves nothing across sites (tests/test_rounds)
        assert round_hlo is not None  # None only where a backend has no text form; CPU, GPU and TPU all have one
        migrate_hlo = None if self.migrate_exec is None else self.migrate_exec.as_text()
        self.bytes_info = _round_bytes(round_hlo, migrate_hlo, state.train, sites, f, mesh)
        tokens_per_step = config.data.batch_size * config.data.seq_len
        self.bytes_info["bytes_per_token"] = system_model.bytes_per_token(
            self.bytes_info["measured"], sites, k, tokens_per_step
        )
        self.val = [jnp.asarray(b) for b in batches.every_row().val_batches(config.train.eval_batches)]
        self.probe_fn, self.probe_tokens = rounds.make_probe(graphdef, mesh), self.val[0][:, :-1]
        self.routes: np.ndarray | None = None  # every site's routes on the probe batch in the current state
        self.ghosts = {"moe/ideal_ghost_fraction": placement.ideal_ghost_fraction} if f.routing == "skip_token" else {}
        if jax.process_index() == 0:
            print(
                f"federation: {sites} sites, O_e = {f.overlap}, {placement.local_experts} of "
                f"{placement.num_experts} experts per site, K = {k}, {f.outer}, {f.routing} routing; "
                f"{self.bytes_info['measured']:,.0f} bytes per site per round (formula "
                f"{self.bytes_info['formula']:,.0f})" + _migration_line(self.bytes_info, f),
                flush=True,
            )

    def completed_steps(self, state: rounds.FederatedState) -> int:
        return int(_host(state.train.step)[0])

    def tags(self, call: int) -> dict[str, Any]:
        return {"round": call + 1}

    def step(self, state: rounds.FederatedState, call: int) -> tuple[rounds.FederatedState, dict[str, float]]:
        if self.routes is None:  # the routes of the state this round starts from
            self.routes = self._probe(state)
        k = self.steps_per_call
        local = np.stack([self.batches.train_batch(step) for step in range(call * k, (call + 1) * k)])
        local = rounds.site_batches(local, self.sites // jax.process_count())
        tokens = jax.make_array_from_process_local_data(self.token_sharding, local, self.batch_shape)
        t0 = time.perf_counter()
        start = state.train.params if self.start_kept else None
        train, metrics = self.local_exec(state.train.params, state.train._replace(params=None), tokens)
        jax.block_until_ready(train)
        t1 = time.perf_counter()
        state = self.sync_exec(start, state.outer, train)
        jax.block_until_ready(state)
        t2 = time.perf_counter()
        gathered = _host({"metrics": metrics, "seconds": np.array([[t1 - t0, t2 - t1]])})  # [processes, 2]
        means = {name: float(np.mean(v)) for name, v in gathered["metrics"].items()}
        local_seconds, sync_seconds = np.mean(gathered["seconds"], axis=0)
        previous, self.routes = self.routes, self._probe(state)
        return state, {
            "loss": means.pop("loss"),
            "grad_norm": means.pop("grad_norm"),
            "bytes_per_site_per_round": self.bytes_info["measured"],
            "routing/topk_agreement": rounds.topk_agreement(previous, self.routes),
            "seconds/local_steps": float(local_seconds),
            "seconds/sync": float(sync_seconds),
            "seconds/round": time.perf_counter() - t0,
            **self.ghosts,
            **means,
        }

    def evaluate(self, state: rounds.FederatedState) -> dict[str, float]:
        ev = train_lib.evaluate(self.eval_fn, state.train, self.val, fetch=_host)
        return {
            "val_loss": float(np.mean(ev["val_loss"])),
            "val_bits_per_byte": float(np.mean(ev["val_bits_per_byte"])),
            "val_bits_per_byte_worst_site": float(np.max(ev["val_bits_per_byte"])),
        }

    def after_step(self, state: rounds.FederatedState, call: int) -> tuple[rounds.FederatedState, dict[str, float]]:
        """Random placement: after every `reshuffle_every` rounds but the last, the experts move to the next
        placement (arrived ones with fresh optimizer state)."""
        every, total = self.config.fomoe.reshuffle_every, self.config.train.steps // self.steps_per_call
        if self.migrate_exec is None or (call + 1) % every or call + 1 == total:
            return state, {}
        plan = reshuffle.plan_migration(self.placement_at(call), self.placement_at(call + 1))
        arrays = [jax.make_array_from_callback(a.shape, self.plan_sharding, a.__getitem__) for a in plan.arrays()]
        arrived = float(plan.arrivals.sum(axis=1).mean())
        self.routes = None  # the next round starts from the migrated state: probe it then
        return self.migrate_exec(state, arrays), {"reshuffle/arrived_experts_per_site": arrived}

    def results(self, state: rounds.FederatedState) -> dict[str, Any]:
        info = self.bytes_info
        return {
            "rounds": self.config.train.steps // self.steps_per_call,
            "bytes_per_site_per_round": info["measured"],
            "bytes_per_site_per_round_formula": info["formula"],
            "bytes_per_token": info["bytes_per_token"],
            **{f"bytes_per_site_{name}": v for name, v in info.items() if name.startswith("migration")},
            "graphdef": self.graphdef,
            # site 0's own model (its resident experts, its routing), e.g. to sample from
            "final_state": jax.tree.map(lambda x: x[0], state.train) if jax.process_count() == 1 else None,
        }

    def _probe(self, state: rounds.FederatedState) -> np.ndarray:
        return _host(self.probe_fn(state.train.params, state.train.rest, self.probe_tokens))


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
    `FederatedStepper`. Arguments as `run`'s; the results add `rounds`, `bytes_per_site_per_round` (measured from
    the compiled round, and by the formula), `bytes_per_token`, and site 0's final TrainState (single process)."""
    if jax.process_index() == 0:
        train_lib.tensorboard_enabled(config)  # tensorboardX missing: refused before anything compiles
    expert = config_lib.mesh_shape(config, jax.device_count())["expert"]  # E devices per site (moe.federation)
    mesh = federation.site_mesh(config.mesh.site, config.fomoe.overlap, expert=expert)
    graphdef, optimizer, outer, state = initial_state(config, mesh, pretrained=True)
    stepper = FederatedStepper(config, batches, mesh, graphdef, optimizer, outer, state, state_metrics=state_metrics)
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
    outer = diloco_outer(f.outer_learning_rate, momentum=f.outer_momentum) if f.outer == "diloco" else None
    sharder = federation.site_sharder(mesh, tuple(tuple(r) for r in config.mesh.rules))  # E > 1: the site's devices
    model_fn = lambda **kw: build.build_model_fn(config, sharder, routing_mode=f.routing, **kw)  # noqa: E731
    make = lambda **kw: model_fn(**kw)(nnx.Rngs(config.train.seed))  # noqa: E731
    site_model = make(resident=placement.experts[0])
    optimizer = build.build_optimizer(config)
    if f.placement == "random":  # arrived experts ramp their learning rate up (moe.reshuffle)
        dims = reshuffle.expert_dims(nnx.state(site_model, nnx.Param))
        optimizer = optax.chain(optimizer, reshuffle.arrival_warmup(dims, f.arrival_warmup))
    if pretrained and config.checkpoint.init_from:  # built abstractly: no random parameters are computed
        from experiments.hf import load as hf_load

        global_model = hf_load.pretrained_model(config, model_fn())
    else:
        global_model = make()
    graphdef, state = rounds.init_sites(global_model, site_model, placement, optimizer, outer, mesh, config.train.seed)
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


def _host(tree):
    """The full values of (possibly multi-process) arrays on every process."""
    return multihost_utils.process_allgather(tree, tiled=True)


def _placements(config: ml_collections.ConfigDict) -> Callable[[int], Placement]:
    """round -> the placement that round trains with: fixed, or random and redrawn every `reshuffle_every` rounds
    (a pure function of the seed and the round, so a resumed run continues with the same placements)."""
    f, experts, sites = config.fomoe, config.moe.num_experts, config.mesh.site
    if f.placement == "fixed":
        return lambda r: fixed_placement(experts, sites, f.overlap)
    return lambda r: random_placement(experts, sites, f.overlap, seed=(config.train.seed, r // f.reshuffle_every))


def _migration_line(bytes_info: dict, f) -> str:
    if "migration_per_reshuffle" not in bytes_info:
        return ""
    moved, arrivals = bytes_info["migration_per_reshuffle"], bytes_info["migration_per_reshuffle_formula"]
    return (
        f"; random placement reshuffled every {f.reshuffle_every} rounds: {moved:,.0f} bytes per site per "
        f"reshuffle (expected arrivals {arrivals:,.0f}), included per round"
    )


def _split_bytes(tree, flags, sites: int) -> tuple[int, int]:
    """(dense, expert) bytes per site of a stacked tree's floating leaves, by `flags` (True expert, False dense,
    None not averaged)."""
    totals = {False: 0, True: 0}
    for x, e in zip(jax.tree.leaves(tree), federation.leaf_flags(flags, tree)):
        if e is not None and jnp.issubdtype(x.dtype, jnp.inexact):
            totals[bool(e)] += x.nbytes // sites
    return totals[False], totals[True]


def _round_bytes(
    round_hlo: str, migrate_hlo: str | None, train: train_lib.TrainState, sites: int, f, mesh: jax.sharding.Mesh
) -> dict:
    """Bytes per site per round, read from the compiled programs' collectives and by the spec's formulas (their
    inputs: the bytes of the parameters and of the optimizer state LocalAdamW averages, from the state's tree). With
    random placement a reshuffle's bytes count 1 / reshuffle_every per round: measured, what the migration's
    all-gather moves; by formula, the expected arrivals (P with gamma = 1 / reshuffle_every)."""
    measured = federation.sync_bytes_per_site(round_hlo, mesh)["cross_site"]  # summed over a site's devices
    dense, experts = _split_bytes(train.params, federation.expert_flags(train.params), sites)
    state = _split_bytes(train.opt_state, rounds.moment_flags(train.opt_state, train.params), sites)
    gamma = 1.0 / f.reshuffle_every if migrate_hlo is not None else 0.0
    formula = system_model.sync_bytes(
        dense, experts, sites, f.overlap, optimizer=f.outer, migration=gamma, state_bytes=state
    )["total"]
    out = {"measured": measured, "formula": formula}
    if migrate_hlo is not None:
        out["migration_per_reshuffle"] = hlo.collective_bytes(migrate_hlo)["bytes_per_device"]
        out["migration_per_reshuffle_formula"] = (1.0 - f.overlap / sites) * experts
        out["measured"] += out["migration_per_reshuffle"] / f.reshuffle_every
    return out
