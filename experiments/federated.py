"""The federated training loop (FoMoE, mesh.site > 1): rounds of K local steps on every site, synchronised.

Composes moe.placement (which experts each site hosts), moe.rounds (one jitted round), moe.federation (the site
mesh, the measured collective bytes), moe.system_model (the formula bytes), core.checkpoint and core.data. Each
round: the K global batches of its steps (pure functions of the step) are split over the sites, the round runs,
its metrics (means over steps and sites) are logged, and the state is checkpointed, so a rerun resumes from the
last completed round. Evaluation: every site evaluates its own model (its resident experts, its routing) on the
same held-out batches; the reported loss is the mean over sites. Routing stability per round: the MoE statistics
(entropy, load CV, ghost fraction against its ideal 1 - N_le / N_e with skip-token) and the top-k agreement of
every site's routing on a fixed probe batch (the first held-out batch) with the previous round's.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from core import checkpoint as checkpoint_lib
from core import hlo
from core import train as train_lib
from core.data import Batches
from core.mesh import Sharder
from experiments import build
from moe import federation, reshuffle, rounds, system_model
from moe.placement import Placement, fixed_placement, random_placement
from optim import diloco_outer

__all__ = ["SiteLostError", "train_federated"]


class SiteLostError(RuntimeError):
    """A collective across sites failed in a multi-process run: another site's process died or became unreachable."""


def _crossed(done: int, every: int, k: int) -> bool:
    """Whether the round that ended at step `done` (K steps long) passed a multiple of `every`."""
    return every > 0 and done // every > (done - k) // every


def train_federated(
    config: ml_collections.ConfigDict, *, workdir: str, batches: Batches, data_fingerprint: str, on_start=None
) -> dict[str, Any]:
    """Trains a federation of `mesh.site` sites; returns the same result keys as core.train.train plus `rounds`,
    `bytes_per_site_per_round` (measured from the compiled round and by the formula) and `bytes_per_token`."""
    f, tc = config.fomoe, config.train
    sites, k = config.mesh.site, f.local_steps
    placement_at = _placements(config)
    placement = placement_at(0)
    mesh = federation.site_mesh(sites, f.overlap)
    graphdef, optimizer, outer, state = initial_state(config, mesh)
    round_fn = rounds.make_round(graphdef, optimizer, mesh, method=f.outer, outer=outer)
    eval_fn = jax.jit(federation.per_site(train_lib.make_eval_step(graphdef), mesh, (0, 0, None)))

    is_main = jax.process_index() == 0
    log = train_lib.MetricsLog(workdir, enabled=is_main)
    checkpointer, compat, state, _, resumed_from = train_lib.open_checkpoints(
        config, workdir, state, data_fingerprint, log
    )
    if on_start is not None:
        on_start(resumed_from)

    token_sharding = NamedSharding(mesh, PartitionSpec(None, federation.SITE_AXES))
    batch_shape = (k, sites, config.data.batch_size // sites, config.data.seq_len + 1)

    def round_tokens(r: int) -> jax.Array:
        local = np.stack([batches.train_batch(step) for step in range(r * k, (r + 1) * k)])
        local = rounds.site_batches(local, sites // jax.process_count())
        return jax.make_array_from_process_local_data(token_sharding, local, batch_shape)

    # Compiled once: the executable both runs every round and tells the bytes its all-reduces move.
    round_exec = round_fn.lower(state, jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=token_sharding)).compile()
    migrate_exec, plan_sharding = None, NamedSharding(mesh, PartitionSpec(federation.SITE_AXES))
    if f.placement == "random":  # compiled once too: the plan is data
        migrate_exec = (
            jax.jit(functools.partial(reshuffle.migrate, mesh=mesh), donate_argnums=0)
            .lower(state, [jax.ShapeDtypeStruct(placement.experts.shape, jnp.int32, sharding=plan_sharding)] * 4)
            .compile()
        )
    bytes_info = _round_bytes(
        round_exec.as_text(), migrate_exec and migrate_exec.as_text(), state.train.params, sites, f
    )
    tokens_per_step = config.data.batch_size * config.data.seq_len
    bytes_info["bytes_per_token"] = system_model.bytes_per_token(bytes_info["measured"], sites, k, tokens_per_step)
    val = [jnp.asarray(b) for b in batches.every_row().val_batches(tc.eval_batches)]  # every site, every row
    probe_fn, probe_tokens = rounds.make_probe(graphdef, mesh), val[0][:, :-1]
    routes = _host(probe_fn(state.train.params, state.train.rest, probe_tokens))
    if is_main:
        print(
            f"federation: {sites} sites, O_e = {f.overlap}, {placement.local_experts} of {placement.num_experts} "
            f"experts per site, K = {k}, {f.outer}, {f.routing} routing; "
            f"{bytes_info['measured'] / 1e6:.3f} MB per site per round "
            f"(formula {bytes_info['formula'] / 1e6:.3f} MB)" + _migration_line(bytes_info, f),
            flush=True,
        )

    total_rounds, start_round = tc.steps // k, int(_host(state.train.step)[0]) // k
    results: dict[str, Any] = {"steps": start_round * k, "resumed_from": resumed_from}
    timed, seconds = 0, 0.0
    progress = train_lib.progress_bar(
        start_round, total_rounds, enabled=tc.progress and is_main, desc="rounds", unit="round"
    )

    def run_round(r: int) -> None:
        nonlocal state, routes, timed, seconds
        tokens = round_tokens(r)
        t0 = time.perf_counter()
        state, metrics = round_exec(state, tokens)
        metrics = {name: float(np.mean(v)) for name, v in _host(metrics).items()}
        if r > start_round:  # the first round of a process warms up
            timed, seconds = timed + 1, seconds + time.perf_counter() - t0
        done = (r + 1) * k
        if not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])):
            raise train_lib.NonFiniteLossError(
                done, metrics["loss"], metrics["grad_norm"], checkpointer.latest_step(), checkpointer.directory
            )
        previous, routes = routes, _host(probe_fn(state.train.params, state.train.rest, probe_tokens))
        ghosts = {"moe/ideal_ghost_fraction": placement.ideal_ghost_fraction} if f.routing == "skip_token" else {}
        log.write(
            {
                "step": done,
                "round": r + 1,
                "train_loss": metrics["loss"],
                "grad_norm": metrics["grad_norm"],
                "bytes_per_site_per_round": bytes_info["measured"],
                "routing/topk_agreement": rounds.topk_agreement(previous, routes),
                **ghosts,
                **{name: v for name, v in metrics.items() if name not in ("loss", "grad_norm")},
            }
        )
        results["train_loss"] = metrics["loss"]
        progress.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)
        if _crossed(done, tc.eval_every, k) or r + 1 == total_rounds:
            ev = _evaluate(eval_fn, state, val)
            log.write({"step": done, "round": r + 1, **ev})
            results.update(ev)
            if is_main:
                progress.write(
                    f"round {r + 1}/{total_rounds} (step {done}): train loss {metrics['loss']:.3f}, "
                    f"held-out {ev['val_bits_per_byte']:.3f} bits/byte (mean over sites)"
                )
        if migrate_exec is not None and (r + 1) % f.reshuffle_every == 0 and r + 1 < total_rounds:
            plan = reshuffle.plan_migration(placement_at(r), placement_at(r + 1))
            state = migrate_exec(
                state, [jax.make_array_from_callback(a.shape, plan_sharding, a.__getitem__) for a in plan.arrays()]
            )
            log.write(
                {
                    "step": done,
                    "round": r + 1,
                    "reshuffle/arrived_experts_per_site": float(plan.arrivals.sum(axis=1).mean()),
                }
            )
        checkpointer.save(done, state, loop={"round": r + 1}, compat=compat)
        results["steps"] = done
        progress.update(1)

    r = start_round
    try:
        for r in range(start_round, total_rounds):
            run_round(r)
    except (train_lib.NonFiniteLossError, checkpoint_lib.CheckpointError):
        raise
    except Exception as e:
        if jax.process_count() == 1:
            raise
        raise SiteLostError(
            f"round {r + 1} failed in a collective across sites ({type(e).__name__}: {str(e)[:200]}): another "
            f"site's process has probably died. The last completed round's checkpoint is step "
            f"{checkpointer.latest_step()} in {checkpointer.directory}; rerun the same command on every site to "
            "resume from it."
        ) from None
    finally:
        progress.close()
    checkpointer.wait()
    checkpointer.close()
    if "val_loss" not in results:  # resumed at the final round: evaluate the restored state
        results.update(_evaluate(eval_fn, state, val))
        results["train_loss"] = next(
            (row["train_loss"] for row in reversed(log.read()) if "train_loss" in row), float("nan")
        )
    results.update(
        {
            "rounds": total_rounds,
            "tokens_per_second": k * tokens_per_step * timed / seconds if timed else None,
            "bytes_per_site_per_round": bytes_info["measured"],
            "bytes_per_site_per_round_formula": bytes_info["formula"],
            "bytes_per_token": bytes_info["bytes_per_token"],
            "graphdef": graphdef,
            **{f"bytes_per_site_{name}": v for name, v in bytes_info.items() if name.startswith("migration")},
            # site 0's own model (its resident experts, its routing), e.g. to sample from
            "final_state": jax.tree.map(lambda x: x[0], state.train) if jax.process_count() == 1 else None,
        }
    )
    return results


def initial_state(config: ml_collections.ConfigDict, mesh=None):
    """(site graphdef, inner optimizer, outer optimizer or None, the federation's initial FederatedState): what
    `train_federated` starts from on the site `mesh`, and what a loader restores a checkpoint into (mesh None: on
    the default device)."""
    f = config.fomoe
    placement = _placements(config)(0)
    outer = diloco_outer(f.outer_learning_rate, f.outer_momentum) if f.outer == "diloco" else None
    make = lambda **kw: build.build_model_fn(config, Sharder(), routing_mode=f.routing, **kw)(  # noqa: E731
        nnx.Rngs(config.train.seed)
    )
    site_model = make(resident=placement.experts[0])
    optimizer = build.build_optimizer(config)
    if f.placement == "random":  # arrived experts ramp their learning rate up (moe.reshuffle)
        dims = reshuffle.expert_dims(nnx.state(site_model, nnx.Param))
        optimizer = optax.chain(optimizer, reshuffle.arrival_warmup(dims, f.arrival_warmup))
    graphdef, state = rounds.init_sites(make(), site_model, placement, optimizer, outer, mesh, config.train.seed)
    return graphdef, optimizer, outer, state


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
        f"; random placement reshuffled every {f.reshuffle_every} rounds: {moved / 1e6:.3f} MB per site per "
        f"reshuffle (expected arrivals {arrivals / 1e6:.3f} MB), included per round"
    )


def _round_bytes(round_hlo: str, migrate_hlo: str | None, params, sites: int, f) -> dict[str, float]:
    """Bytes per site per round, read from the compiled programs' collectives and by the spec's formulas. With
    random placement a reshuffle's bytes count 1 / reshuffle_every per round: measured, what the migration's
    all-gather moves; by formula, the expected arrivals (P with gamma = 1 / reshuffle_every)."""
    measured = hlo.collective_bytes(round_hlo)["bytes_per_device"]
    flags = jax.tree.leaves(federation.expert_flags(params))
    per_site = [x.nbytes // sites for x in jax.tree.leaves(params)]
    dense = sum(b for b, e in zip(per_site, flags) if not e)
    experts = sum(b for b, e in zip(per_site, flags) if e)
    gamma = 1.0 / f.reshuffle_every if migrate_hlo is not None else 0.0
    formula = system_model.sync_bytes(dense, experts, sites, f.overlap, optimizer=f.outer, migration=gamma)["total"]
    out = {"measured": measured, "formula": formula}
    if migrate_hlo is not None:
        out["migration_per_reshuffle"] = hlo.collective_bytes(migrate_hlo)["bytes_per_device"]
        out["migration_per_reshuffle_formula"] = (1.0 - f.overlap / sites) * experts
        out["measured"] += out["migration_per_reshuffle"] / f.reshuffle_every
    return out


def _evaluate(eval_fn, state, val) -> dict[str, float]:
    """Held-out loss and bits per byte of every site's model, averaged over the sites (and the worst site)."""
    ev = train_lib.evaluate(eval_fn, state.train, val, fetch=_host)
    return {
        "val_loss": float(np.mean(ev["val_loss"])),
        "val_bits_per_byte": float(np.mean(ev["val_bits_per_byte"])),
        "val_bits_per_byte_worst_site": float(np.max(ev["val_bits_per_byte"])),
    }
