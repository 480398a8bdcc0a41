"""The federated round as a training-driver Stepper (docs/fomoe.md, "Synchronisation (one round)").

    stepper = FederatedStepper(graphdef, optimizer, state, mesh, batches, placement_at=lambda r: placement,
                               local_steps=K, total_rounds=R, eval_batches=4)
    core.train.run(config, stepper, state, workdir=..., compat=...)

Config-free: the site model's graphdef, the inner optimizer and the outer one (DiLoCo's, or None for LocalAdamW),
the site mesh (moe.federation.site_mesh), the placements and the batch source are passed in; experiments.federated
builds them from a config. One call is one round: the K global batches of its steps (pure functions of the step,
core.data.Batches) are split over the sites, the K local steps and the synchronisation run as two programs compiled
once in the constructor (moe.rounds), and the metrics are the means over steps and sites. The bytes a round moves
are read from the compiled synchronisation (moe.federation.sync_bytes_per_site) and given beside the spec's formula
(moe.system_model.sync_bytes).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from core import hlo
from core import train as train_lib
from core.codec import WireFormat
from core.data import Batches
from moe import federation, lowbit_sync, reshuffle, routing_health, spes, streaming, system_model
from moe import rounds as rounds_lib
from moe.config import ROUTING_MODES
from moe.placement import Placement

__all__ = ["FederatedStepper", "round_bytes"]


class FederatedStepper(train_lib.Stepper):
    """One call = one round: K local steps on every site, then their synchronisation (moe.rounds), compiled once.

    The round's metrics are means over its K steps and M sites, plus what the round moved per site
    ("bytes_per_site_per_round", read from the compiled program) and the routing stability:
    "routing/topk_agreement" of every site's routing on a fixed probe batch (the first held-out batch) after the round
    with its routing before it (the state the round started from: after a reshuffle, the migrated one, so a run
    resumed from any checkpoint measures what an uninterrupted one does; a model without MoE layers has none);
    "routing/js_divergence", the Jensen-Shannon divergence of the routing distributions of sites that route over the
    same experts (the replica groups; with skip-token all sites), and "routing/utilisation_entropy", each site's
    expert utilisation entropy over ln of the experts it routes over (moe.rounds); "sync/loss_jump", the mean over
    sites of the probe batch's loss after the synchronisation minus before it (each site's own model), which shows
    what averaging, compression or staleness costs; and with skip-token the ideal ghost fraction 1 - N_le / N_e.
    With `reshuffle_every` > 0 (random placement) the experts move to the next placement after every
    `reshuffle_every` rounds (a metric row of its own).
    Time: the local steps and the synchronisation are two programs, each waited for, so every round also reports
    "seconds/local_steps" and "seconds/sync" (means over processes; a site's synchronisation includes its wait for
    the slowest site) and "seconds/round" (process 0's whole round, host work included: batches, metrics, probe).
    Evaluation: every site evaluates its own model (its resident experts, its routing) on the same held-out
    batches; the reported loss is the mean over sites (and the worst site's bits per byte).

    Args:
      graphdef: the site model's graphdef (`rounds.init_sites`).
      optimizer: the inner optimizer every site steps with.
      state: the federation's initial FederatedState (its shapes and shardings are what the round compiles for).
      mesh: the site mesh (moe.federation.site_mesh).
      batches: the global batch source; each round takes steps r K .. (r + 1) K - 1, split over the sites.
      placement_at: round -> the placement that round trains with (a pure function of the round).
      local_steps: K, local steps per round.
      total_rounds: rounds of the whole run (no reshuffle after the last one).
      outer: DiLoCo's outer optimizer (method "diloco"), else None.
      method: the synchronisation, one of moe.rounds.OUTER_METHODS.
      reshuffle_every: 0 for a fixed placement; R > 0: the experts migrate after every R rounds (moe.reshuffle).
      routing: the MoE layers' mode, one of moe.config.ROUTING_MODES (skip-token also reports the ideal ghost
        fraction).
      eval_batches: held-out batches of `evaluate` (the first is the routing probe).
      state_metrics: what the optimizer state reports after a step (core.train.StateMetrics).
      wire: low-bit synchronisation's core.codec.WireFormat (None: float32); `error_feedback` with it needs the
        state's feedback (moe.rounds.init_sites(..., error_feedback=True)).
      feedback_decay: beta of error feedback (moe.rounds.make_round's; SparseLoCo's 0.95).
      merge: SPES's expert-merging warm-up (alpha_0, steps) for method "spes" (moe.rounds.make_round's).
      second_moments: LocalAdamW's second moments "sent" or kept "local" (moe.rounds.second_moment_wire).
      fragments, delay, mixing: streaming synchronisation (moe.streaming): F fragments synchronised in turn, one
        round late behind the next round's local steps with delay 1, the correction scaled by `mixing`.
      moment_periods: DES-LOC's (p_u, p_v) for LocalAdamW or DiLoCo's inner moments (moe.desloc): the first
        moments averaged every p_u-th round, the second every p_v-th; (1, 1) the method's own (LocalAdamW: both
        every round; DiLoCo: never). The bytes per round are the mean over its cycle.
    Raises:
      ValueError naming the argument for a method, routing mode or count outside what is allowed.
    """

    unit = "round"
    compiles_on_first_call = False  # the round is compiled in the constructor, which says so

    def __init__(
        self,
        graphdef: Any,
        optimizer: optax.GradientTransformation,
        state: rounds_lib.FederatedState,
        mesh: jax.sharding.Mesh,
        batches: Batches,
        *,
        placement_at: Callable[[int], Placement],
        local_steps: int,
        total_rounds: int,
        outer: optax.GradientTransformation | None = None,
        method: str = "local_adamw",
        reshuffle_every: int = 0,
        routing: str = "partitioned",
        eval_batches: int = 1,
        state_metrics: train_lib.StateMetrics | None = None,
        wire: WireFormat | None = None,
        error_feedback: bool = False,
        feedback_decay: float = 1.0,
        merge: tuple[float, int] = (0.0, 1),
        second_moments: str = "sent",
        fragments: int = 1,
        delay: int = 0,
        mixing: float = 1.0,
        moment_periods: tuple[int, int] = (1, 1),
    ):
        _check(method=method, routing=routing, local_steps=local_steps, eval_batches=eval_batches)
        if reshuffle_every < 0:
            raise ValueError(f"reshuffle_every = {reshuffle_every}: allowed 0 (fixed placement) or a positive count")
        self.batches, self.graphdef, self.placement_at = batches, graphdef, placement_at
        self.steps_per_call, self.total_rounds, self.reshuffle_every = local_steps, total_rounds, reshuffle_every
        placement = placement_at(0)
        self.sites = sites = placement.sites
        tok = batches.tokenizer
        loss_fn = functools.partial(train_lib.lm_loss, pad_id=tok.pad_id)
        if error_feedback != bool(state.feedback):
            raise ValueError(
                f"error_feedback = {error_feedback} but the state {'has' if state.feedback else 'has no'} error "
                "feedback (moe.rounds.init_sites' error_feedback)."
            )
        self.round = streaming.StreamingRound(
            graphdef,
            optimizer,
            mesh,
            state.train.params,
            fragments_count=fragments,
            delay=delay,
            mixing=mixing,
            moment_periods=moment_periods,
            method=method,
            outer=outer,
            loss_fn=loss_fn,
            state_metrics=state_metrics,
            wire=wire,
            error_feedback=error_feedback,
            feedback_decay=feedback_decay,
            merge=merge,
            second_moments=second_moments,
        )
        eval_step = train_lib.make_eval_step(graphdef, byte_lengths=tok.byte_lengths, pad_id=tok.pad_id)
        self.eval_fn = jax.jit(federation.per_site(eval_step, mesh, (0, 0, None)))
        self.token_sharding = NamedSharding(mesh, PartitionSpec(None, federation.SITE_AXES))
        self.replicated = NamedSharding(mesh, PartitionSpec())
        k = local_steps
        self.batch_shape = (k, sites, batches.global_batch // sites, batches.seq_len + 1)
        # Compiled once, in two programs (the K local steps, then the synchronisation) so that each round's compute
        # and synchronisation are timed apart; the executables also tell the bytes the synchronisation moves.
        tokens = jax.ShapeDtypeStruct(self.batch_shape, jnp.int32, sharding=self.token_sharding)
        if jax.process_index() == 0:
            print(f"compiling the round ({k} local steps and their synchronisation; can take a minute) ...", flush=True)
        t0 = time.perf_counter()
        sync_texts = self.round.compile(state, tokens)
        if jax.process_index() == 0:
            print(f"compiled the round in {time.perf_counter() - t0:.1f} s", flush=True)
        self.migrate_exec, self.site_sharding = None, NamedSharding(mesh, PartitionSpec(federation.SITE_AXES))
        if reshuffle_every:  # compiled once too: the plan is data
            plan = jax.ShapeDtypeStruct(placement.experts.shape, jnp.int32, sharding=self.site_sharding)
            migrate = jax.jit(
                functools.partial(reshuffle.migrate, mesh=mesh, optimizer=optimizer, outer=outer), donate_argnums=0
            )
            self.migrate_exec = migrate.lower(state, [plan] * 4).compile()
        # the local steps' program moves nothing across sites (tests/test_rounds); each fragment's synchronisation
        # its own bytes (F = 1: all of them), a round's mean over the fragments it cycles through
        migrate_hlo = None if self.migrate_exec is None else self.migrate_exec.as_text()
        per_variant = [
            round_bytes(
                text,
                migrate_hlo,
                optimizer,
                state.train,
                mesh,
                sites=sites,
                overlap=placement.overlap,
                method=method,
                reshuffle_every=reshuffle_every,
                wire=wire,
                second_moments=second_moments,
                fragment=mask,
                moments=moments,
            )
            for text, (mask, moments, _) in zip(sync_texts, self.round.variants)
        ]
        shares = [share for _, _, share in self.round.variants]  # of the rounds, over the schedule's cycle
        self.bytes_info = {key: float(np.dot(shares, [b[key] for b in per_variant])) for key in per_variant[0]}
        tokens_per_step = batches.global_batch * batches.seq_len
        self.bytes_info["bytes_per_token"] = system_model.bytes_per_token(
            self.bytes_info["measured"], sites, k, tokens_per_step
        )
        self.val = [jnp.asarray(b) for b in batches.every_row().val_batches(eval_batches)]
        # a model without MoE layers (moe.every = 0: the federation of a dense model) has no routing to probe
        routed = any(jax.tree.leaves(federation.expert_flags(state.train.params)))
        self.probe_fn = routing_health.make_probe(graphdef, mesh) if routed else None
        self.routing_stats = routing_health.make_routing_stats(mesh, placement.num_experts) if routed else None
        self.probe_tokens = self.val[0][:, :-1]
        self.routes: jax.Array | None = None  # every site's routes on the probe batch in the current state, on device
        self.ghosts = {"moe/ideal_ghost_fraction": placement.ideal_ghost_fraction} if routing == "skip_token" else {}
        # routing health across sites: sites that route over the same experts (skip-token: all of them)
        self.routing_groups = [np.arange(sites)] if routing == "skip_token" else placement.replica_groups()
        self.routed_over = placement.num_experts if routing == "skip_token" else placement.local_experts
        if jax.process_index() == 0:
            print(
                f"federation: {sites} sites, O_e = {placement.overlap}, {placement.local_experts} of "
                f"{placement.num_experts} experts per site, K = {k}, {method}"
                + _sync_words(wire, error_feedback, second_moments, fragments, delay, moment_periods)
                + f", {routing} routing; "
                f"{self.bytes_info['measured']:,.0f} bytes per site per round (formula "
                f"{self.bytes_info['formula']:,.0f})" + _migration_line(self.bytes_info, reshuffle_every),
                flush=True,
            )

    def completed_steps(self, state: rounds_lib.FederatedState) -> int:
        return int(self._host(state.train.step)[0])

    def tags(self, call: int) -> dict[str, Any]:
        return {"round": call + 1}

    def step(self, state: rounds_lib.FederatedState, call: int) -> tuple[rounds_lib.FederatedState, dict[str, float]]:
        if self.routes is None and self.probe_fn is not None:  # the routes of the state this round starts from
            self.routes = self._routes(state)
        k = self.steps_per_call
        local = np.stack([self.batches.train_batch(step) for step in range(call * k, (call + 1) * k)])
        local = rounds_lib.site_batches(local, self.sites // jax.process_count())
        tokens = jax.make_array_from_process_local_data(self.token_sharding, local, self.batch_shape)
        t0 = time.perf_counter()
        # the sites' own models on the probe batch before and after the synchronisation (neither compute nor sync),
        # dispatched as they become possible and brought to the host with the round's metrics in one gather
        state, metrics, before, seconds_of = self.round(state, call, tokens, self._probe_sums)
        after = self._probe_sums(state.train)
        routes, stats = self._probe_routing(state) if self.probe_fn is not None else (None, None)
        seconds = np.array([seconds_of["local_steps"], seconds_of["sync"]])
        seconds = jax.make_array_from_process_local_data(  # one row per site: the means are over processes
            self.site_sharding, np.tile(seconds, (self.sites // jax.process_count(), 1)), (self.sites, 2)
        )
        got = self._host({"metrics": metrics, "seconds": seconds, "before": before, "after": after, "routing": stats})
        means = {name: float(np.mean(v)) for name, v in got["metrics"].items()}
        local_seconds, sync_seconds = np.mean(got["seconds"], axis=0)
        jump = float(np.mean(_mean_loss(got["after"]) - _mean_loss(got["before"])))
        routing = {}
        if routes is not None:
            self.routes = routes
            routing["routing/topk_agreement"] = float(np.mean(got["routing"]["agreement"]))
            shares = routing_health.routing_shares(got["routing"]["counts"])
            routing["routing/js_divergence"] = routing_health.routing_divergence(shares, self.routing_groups)
            routing["routing/utilisation_entropy"] = routing_health.utilisation_entropy(shares, self.routed_over)
        return state, {
            "loss": means.pop("loss"),
            "grad_norm": means.pop("grad_norm"),
            "bytes_per_site_per_round": self.bytes_info["measured"],
            **routing,
            "sync/loss_jump": jump,
            "seconds/local_steps": float(local_seconds),
            "seconds/sync": float(sync_seconds),
            "seconds/round": time.perf_counter() - t0,
            **self.ghosts,
            **means,
        }

    def evaluate(self, state: rounds_lib.FederatedState) -> dict[str, float]:
        ev = train_lib.evaluate(self.eval_fn, state.train, self.val, fetch=self._host)
        return {
            "val_loss": float(np.mean(ev["val_loss"])),
            "val_bits_per_byte": float(np.mean(ev["val_bits_per_byte"])),
            "val_bits_per_byte_worst_site": float(np.max(ev["val_bits_per_byte"])),
        }

    def after_step(
        self, state: rounds_lib.FederatedState, call: int
    ) -> tuple[rounds_lib.FederatedState, dict[str, float]]:
        """Random placement: after every `reshuffle_every` rounds but the last, the experts move to the next
        placement (arrived ones with fresh optimizer state)."""
        every = self.reshuffle_every
        if self.migrate_exec is None or (call + 1) % every or call + 1 == self.total_rounds:
            return state, {}
        plan = reshuffle.plan_migration(self.placement_at(call), self.placement_at(call + 1))
        arrays = [jax.make_array_from_callback(a.shape, self.site_sharding, a.__getitem__) for a in plan.arrays()]
        arrived = float(plan.arrivals.sum(axis=1).mean())
        self.routes = None  # the next round starts from the migrated state: probe it then
        return self.migrate_exec(state, arrays), {"reshuffle/arrived_experts_per_site": arrived}

    def results(self, state: rounds_lib.FederatedState) -> dict[str, Any]:
        info = self.bytes_info
        return {
            "rounds": self.total_rounds,
            "bytes_per_site_per_round": info["measured"],
            "bytes_per_site_per_round_formula": info["formula"],
            "bytes_per_token": info["bytes_per_token"],
            **{f"bytes_per_site_{name}": v for name, v in info.items() if name.startswith("migration")},
            "graphdef": self.graphdef,
            # site 0's own model (its resident experts, its routing), e.g. to sample from
            "final_state": jax.tree.map(lambda x: x[0], state.train) if jax.process_count() == 1 else None,
        }

    def _host(self, tree):
        return _host(tree, self.replicated)

    def _probe_sums(self, train: train_lib.TrainState) -> dict[str, jax.Array]:
        """Every site's loss sums on the probe batch (the first held-out batch), dispatched, not fetched."""
        return self.eval_fn(train.params, train.rest, self.val[0])

    def _routes(self, state: rounds_lib.FederatedState) -> jax.Array:
        assert self.probe_fn is not None  # a model with MoE layers
        return self.probe_fn(state.train.params, state.train.rest, self.probe_tokens)

    def _probe_routing(self, state: rounds_lib.FederatedState) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The routes of `state` and their statistics against the round's starting routes, both on the devices."""
        assert self.routing_stats is not None and self.routes is not None  # probed before the round
        routes = self._routes(state)
        return routes, self.routing_stats(self.routes, routes)


def _check(**given: Any) -> None:
    allowed = {"method": rounds_lib.OUTER_METHODS, "routing": ROUTING_MODES}
    for name, value in given.items():
        if name in allowed and value not in allowed[name]:
            raise ValueError(f"{name} = {value!r}: allowed {', '.join(map(repr, allowed[name]))}")
        if name not in allowed and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} = {value!r}: allowed a positive integer")


def _host(tree, replicated: NamedSharding):
    """The full values of a tree of (possibly multi-process) jax.Arrays on every process, as NumPy arrays, in one
    program that replicates them all (`replicated`: over the site mesh; multihost_utils.process_allgather runs one
    program per leaf, each a wait for the slowest process)."""
    leaves, treedef = jax.tree.flatten(tree)
    if jax.process_count() > 1:
        leaves = [x.addressable_data(0) for x in _replicate(replicated, len(leaves))(tuple(leaves))]
    return jax.tree.unflatten(treedef, [np.asarray(x) for x in jax.device_get(leaves)])


@functools.lru_cache(maxsize=16)
def _replicate(replicated: NamedSharding, count: int):
    return jax.jit(lambda xs: xs, out_shardings=(replicated,) * count)


def _mean_loss(sums: dict[str, np.ndarray]) -> np.ndarray:
    """[M] every site's mean loss from its eval sums."""
    return np.asarray(sums["nll_sum"], np.float64) / np.asarray(sums["tokens"])


def _sync_words(wire, error_feedback: bool, second_moments: str, fragments: int, delay: int, periods=(1, 1)) -> str:
    """How the round synchronises, for the federation line (nothing for today's float32 blocking round)."""
    words = []
    if wire is not None and not wire.exact:
        words.append(f"{wire.name} synchronisation" + (" with error feedback" if error_feedback else ""))
    if second_moments == "local":
        words.append("second moments local")
    if fragments > 1:
        words.append(f"{fragments} fragments in turn")
    if delay:
        words.append("behind the next round's local steps")
    if tuple(periods) != (1, 1):
        words.append(f"DES-LOC moments every {periods[0]} / {periods[1]} rounds")
    return "".join(f", {w}" for w in words)


def _migration_line(bytes_info: dict, reshuffle_every: int) -> str:
    if "migration_per_reshuffle" not in bytes_info:
        return ""
    moved, arrivals = bytes_info["migration_per_reshuffle"], bytes_info["migration_per_reshuffle_formula"]
    return (
        f"; random placement reshuffled every {reshuffle_every} rounds: {moved:,.0f} bytes per site per "
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


def round_bytes(
    round_hlo: str,
    migrate_hlo: str | None,
    optimizer: optax.GradientTransformation,
    train: train_lib.TrainState,
    mesh: jax.sharding.Mesh,
    *,
    sites: int,
    overlap: int,
    method: str,
    reshuffle_every: int = 0,
    wire: WireFormat | None = None,
    second_moments: str = "sent",
    fragment: Any = None,
    moments: tuple[str, ...] | None = None,
) -> dict[str, float]:
    """Bytes per site per round, read from the compiled programs' collectives ("measured") and by the spec's
    formulas ("formula"; their inputs: the bytes of the parameters and of the optimizer state LocalAdamW averages,
    from the stacked `train` state's tree of `sites` sites). With random placement (`migrate_hlo`, the compiled
    migration) a reshuffle's bytes count 1 / reshuffle_every per round: measured, what the migration's all-gather moves
    ("migration_per_reshuffle"); by formula, the expected arrivals (P with gamma = 1 / reshuffle_every,
    "migration_per_reshuffle_formula"). A low-bit `wire` counts values (4 bytes each in the formula's terms: what
    moe.lowbit_sync quantises is float32). `fragment` (moe.streaming): the parameters that synchronisation averages;
    `moments`: the moment groups it averages (moe.desloc; None: the method's own, moe.rounds.averaged_moments)."""
    measured = federation.sync_bytes_per_site(round_hlo, mesh)["cross_site"]  # summed over a site's devices
    params_flags = rounds_lib.masked_flags(federation.expert_flags(train.params), train.params, fragment)
    moments = rounds_lib.averaged_moments(method, moments)
    first, second, nu_wire = rounds_lib.sent_moments(optimizer, train, fragment, moments, wire, second_moments)
    local_adamw = method == "local_adamw"
    gamma = 1.0 / reshuffle_every if migrate_hlo is not None else 0.0
    dense, experts = _split_bytes(train.params, params_flags, sites)
    if method == "spes":
        owned = [d >= 0 for d in jax.tree.leaves(spes.expert_matrices(train.params))]
        nbytes = [x.nbytes // sites for x in jax.tree.leaves(train.params)]
        spes_experts = sum(b for b, o in zip(nbytes, owned) if o)
        formula = system_model.spes_bytes(sum(nbytes) - spes_experts, spes_experts, sites)
    elif wire is None or wire.exact:
        (d1, e1), (d2, e2) = (_split_bytes(train.opt_state, f, sites) for f in (first, second if nu_wire else None))
        state = (float(d1 + d2), float(e1 + e2))
        # the state averaged (LocalAdamW's moments, DES-LOC's of DiLoCo's inner optimizer) costs what the
        # parameters' would: LocalAdamW's formula with these state bytes (DiLoCo's own: none)
        formula = system_model.sync_bytes(
            dense, experts, sites, overlap, optimizer="local_adamw", migration=gamma, state_bytes=state
        )["total"]
    else:  # one quantised mean per group: parameters, first moments, second moments (moe.rounds)
        groups = [(train.params, params_flags, wire)]
        if local_adamw:
            groups += [(train.opt_state, first, wire)]
            groups += [(train.opt_state, second, nu_wire)] if nu_wire else []
        formula = 0.0
        for tree, flags, fmt in groups:
            count = lowbit_sync.group_values(tree, flags, sites, overlap)
            formula += system_model.wire_bytes(count[False], sites, fmt)
            formula += system_model.wire_bytes(count[True], overlap, fmt)
    out = {"measured": measured, "formula": formula}
    if migrate_hlo is not None:
        out["migration_per_reshuffle"] = hlo.collective_bytes(migrate_hlo)["bytes_per_device"]
        out["migration_per_reshuffle_formula"] = (1.0 - overlap / sites) * experts
        out["measured"] += out["migration_per_reshuffle"] / reshuffle_every
    return out
