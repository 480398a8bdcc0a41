"""Training: the loss, jitted train and eval steps, the learning-rate schedule, and the loop.

The loop is deliberately plain: for each step it builds the batch (a pure function of the step), runs the jitted
step, checks the loss is finite, appends metrics, evaluates and checkpoints on their cadences. Everything it needs
to continue (parameters, optimizer state, step, PRNG key and the running metric window) is in the checkpoint, so
rerunning the same command after a crash resumes and writes the same metrics as an uninterrupted run.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from core import checkpoint as checkpoint_lib
from core import hlo
from core.data import PAD_ID, Batches
from core.mesh import Sharder, param_shardings

__all__ = [
    "MetricsLog",
    "NonFiniteLossError",
    "TrainState",
    "checkpoint_compat",
    "evaluate",
    "init_state",
    "learning_rate_schedule",
    "lm_loss",
    "make_eval_step",
    "make_train_step",
    "mirror",
    "open_checkpoints",
    "train",
    "train_step_fn",
]

LN2 = math.log(2.0)


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient norm became NaN/Inf. Carries the step and the last good checkpoint."""

    def __init__(self, step: int, loss: float, grad_norm: float, last_checkpoint: int | None, directory: str):
        self.step, self.last_checkpoint = step, last_checkpoint
        kept = (
            f"the last good checkpoint (step {last_checkpoint}) is kept in {directory}"
            if last_checkpoint is not None
            else "no checkpoint had been written yet"
        )
        super().__init__(
            f"training stopped at step {step}: loss = {loss}, gradient norm = {grad_norm} (not "
            f"finite); {kept}. Lower optim.learning_rate or enable optim.grad_clip_norm."
        )


class TrainState(NamedTuple):
    """Everything that changes during training. `params`/`rest`: nnx.State of nnx.Param / other variables."""

    step: jax.Array  # int32 scalar: optimizer steps completed
    params: Any
    rest: Any
    opt_state: Any
    key: jax.Array  # uint32[2] base PRNG key; step s uses fold_in(key, s)


def learning_rate_schedule(optim: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
    """Linear warm-up from 0 to `learning_rate` over `warmup_steps`, then cosine / linear decay to
    `min_lr_ratio * learning_rate` at `total_steps` (or constant)."""
    peak, warmup = optim.learning_rate, optim.warmup_steps
    decay_steps = max(total_steps - warmup, 1)
    end = peak * optim.min_lr_ratio
    if optim.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=optim.min_lr_ratio)
    elif optim.schedule == "linear":
        decay = optax.linear_schedule(peak, end, decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def lm_loss(model: nnx.Module, tokens: jax.Array, *, key: jax.Array | None = None):
    """Next-token cross entropy over non-PAD targets, plus every `loss/...` entry the model reports in aux.

    Args:
      tokens: [B, T + 1] int32; inputs tokens[:, :-1], targets tokens[:, 1:].
    Returns:
      (objective scalar, metrics dict with "loss" = the mean token NLL in nats and the aux entries).
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits, aux, _ = model(inputs, key=key)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    mask = (targets != PAD_ID).astype(jnp.float32)
    loss = jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    objective = loss + sum((v for k, v in aux.items() if k.startswith("loss/")), jnp.float32(0.0))
    return objective, {"loss": loss, **aux}


def make_train_step(
    graphdef, optimizer: optax.GradientTransformation, loss_fn: Callable = lm_loss
) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict]]:
    """A jitted `(state, tokens [B, T+1]) -> (state, metrics)`; the state is donated."""
    return jax.jit(train_step_fn(graphdef, optimizer, loss_fn), donate_argnums=0)


def train_step_fn(
    graphdef, optimizer: optax.GradientTransformation, loss_fn: Callable = lm_loss
) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict]]:
    """The train step as a plain function (to jit, vmap over sites, ...): forward, backward, optimizer update."""

    def step(state: TrainState, tokens: jax.Array):
        key = jax.random.fold_in(state.key, state.step)

        def objective(params):
            model = nnx.merge(graphdef, params, state.rest)
            value, metrics = loss_fn(model, tokens, key=key)
            return value, (metrics, nnx.state(model, nnx.Not(nnx.Param)))

        (_, (metrics, rest)), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {**metrics, "grad_norm": _global_norm(grads)}
        return TrainState(state.step + 1, params, rest, opt_state, state.key), metrics

    return step


def _global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def make_eval_step(graphdef) -> Callable[[Any, Any, jax.Array], dict]:
    """A jitted `(params, rest, tokens) -> {"nll_sum", "tokens", "bytes"}` (sums, for exact aggregation)."""

    @jax.jit
    def step(params, rest, tokens):
        model = nnx.merge(graphdef, params, rest)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits, _, _ = model(inputs)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        mask = targets != PAD_ID
        return {"nll_sum": jnp.sum(jnp.where(mask, nll, 0.0)), "tokens": jnp.sum(mask), "bytes": jnp.sum(targets < 256)}

    return step


def init_state(
    model_fn: Callable[[nnx.Rngs], nnx.Module], optimizer: optax.GradientTransformation, seed: int, sharder: Sharder
) -> tuple[Any, TrainState]:
    """Builds the model and optimizer state directly in their shardings: (graphdef, TrainState at step 0).

    Everything is created inside one `jax.jit` whose output shardings come from the parameters' logical `axes`
    metadata, so no device ever holds a full copy of a sharded parameter. Optimizer-state leaves that mirror a
    parameter (Adam's moments) get that parameter's sharding; the rest (step counts) are replicated.
    """
    abstract = nnx.eval_shape(lambda: model_fn(nnx.Rngs(seed)))
    graphdef, abs_params, abs_rest = nnx.split(abstract, nnx.Param, ...)
    replicated = sharder.named(())
    params_sh = param_shardings(abs_params, sharder)
    opt_sh = mirror(jax.eval_shape(optimizer.init, abs_params), abs_params, params_sh, replicated)
    out_shardings = TrainState(replicated, params_sh, param_shardings(abs_rest, sharder), opt_sh, replicated)

    @functools.partial(jax.jit, out_shardings=out_shardings)
    def make():
        _, params, rest = nnx.split(model_fn(nnx.Rngs(seed)), nnx.Param, ...)
        return TrainState(jnp.zeros((), jnp.int32), params, rest, optimizer.init(params), jax.random.PRNGKey(seed))

    return graphdef, make()


def mirror(tree, params, values, default):
    """Carries a per-parameter value over to a tree whose leaves mirror the parameters (an optimizer's moments):
    a leaf whose key path ends with a parameter's key path and has its shape gets that parameter's entry of
    `values` (a tree shaped like `params`: shardings, flags, ...); any other leaf (a step count) gets `default`."""
    flat_params, _ = jax.tree_util.tree_flatten_with_path(params)
    by_path = {tuple(path): (leaf.shape, v) for (path, leaf), v in zip(flat_params, jax.tree.leaves(values))}

    def pick(path, leaf):
        for i in range(len(path)):
            hit = by_path.get(tuple(path[i:]))
            if hit is not None and hit[0] == leaf.shape:
                return hit[1]
        return default

    return jax.tree_util.tree_map_with_path(pick, tree)


def evaluate(eval_step, state: TrainState, batches: Sequence[jax.Array], *, fetch=jax.device_get) -> dict:
    """Held-out loss (nats per token) and bits per byte = total NLL / (ln 2 x byte targets), summed in float64.

    `eval_step(params, rest, tokens)` returns the sums of `make_eval_step`; when it returns one value per site (a
    vmapped step over stacked site states) the results are arrays [M]. `fetch` brings outputs to the host.
    """
    totals = None
    for tokens in batches:
        out = {k: np.asarray(v, np.float64) for k, v in fetch(eval_step(state.params, state.rest, tokens)).items()}
        totals = out if totals is None else {k: totals[k] + out[k] for k in out}
    loss = totals["nll_sum"] / np.maximum(totals["tokens"], 1)
    bits = totals["nll_sum"] / (LN2 * np.maximum(totals["bytes"], 1))
    host = lambda x: float(x) if np.ndim(x) == 0 else x  # noqa: E731
    return {"val_loss": host(loss), "val_bits_per_byte": host(bits)}


class MetricsLog:
    """Appends one JSON object per line to `<workdir>/metrics.jsonl` (flushed at once, so a crash loses nothing
    written). On resume from step s, rows after s (written by the crashed run after its last checkpoint, and about
    to be recomputed) are moved to `metrics.superseded.jsonl`, so metrics.jsonl reads as one uninterrupted run."""

    def __init__(self, workdir: str, *, enabled: bool = True):
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.enabled = enabled

    def truncate_after(self, step: int) -> None:
        if not (self.enabled and os.path.exists(self.path)):
            return
        rows = self.read()
        keep = [r for r in rows if r["step"] <= step]
        if len(keep) == len(rows):
            return
        with open(os.path.join(os.path.dirname(self.path), "metrics.superseded.jsonl"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows if r["step"] > step)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in keep)
        os.replace(tmp, self.path)

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]


def checkpoint_compat(config: ml_collections.ConfigDict, data_fingerprint: str) -> dict[str, Any]:
    """Facts a checkpoint must share with the running program to be resumed: the architecture (`model` and every
    section other packages add, such as `moe`), the optimizer and the data."""
    runtime = ("data", "optim", "train", "mesh", "checkpoint", "sample", "kvcache")  # kvcache: inference only
    arch = {name: config[name].to_dict() for name in config if name not in runtime}
    return {
        **arch,
        "optim.name": config.optim.name,
        "data": data_fingerprint,
        "data.seq_len": config.data.seq_len,
        "data.batch_size": config.data.batch_size,
    }


def open_checkpoints(config: ml_collections.ConfigDict, workdir: str, state, data_fingerprint: str, log: MetricsLog):
    """The run's `<workdir>/checkpoints`: restores the latest checkpoint into `state` when `checkpoint.resume`
    allows (after checking it belongs to this program), and moves metric rows written after it aside.

    Returns (checkpointer, compat facts, state, the saved loop record or None, the step resumed from or None).
    Raises CheckpointError for a checkpoint beyond train.steps, one from another program, or checkpoints present
    while checkpoint.resume is False; nothing on disk changes then.
    """
    cc, steps = config.checkpoint, config.train.steps
    checkpointer = checkpoint_lib.Checkpointer(
        os.path.join(workdir, "checkpoints"), keep=cc.keep, async_save=cc.async_save
    )
    compat = checkpoint_compat(config, data_fingerprint)
    latest = checkpointer.latest_step()
    if latest is not None and not cc.resume:
        raise checkpoint_lib.CheckpointError(
            f"{checkpointer.directory} already holds checkpoints and checkpoint.resume is False; use a new "
            "--workdir so they are not overwritten."
        )
    if latest is None:
        return checkpointer, compat, state, None, None
    if latest > steps:
        raise checkpoint_lib.CheckpointError(
            f"the latest checkpoint in {checkpointer.directory} is at step {latest}, beyond train.steps = "
            f"{steps}; raise train.steps or use a new --workdir. Nothing was changed."
        )
    state, loop = checkpointer.restore(latest, state, compat=compat)
    log.truncate_after(latest)
    if jax.process_index() == 0:
        print(f"resuming from the checkpoint of step {latest} in {checkpointer.directory}", flush=True)
    return checkpointer, compat, state, loop, latest


def train(
    config: ml_collections.ConfigDict,
    *,
    workdir: str,
    model_fn: Callable[[nnx.Rngs], nnx.Module],
    optimizer: optax.GradientTransformation,
    batches: Batches,
    sharder: Sharder,
    data_fingerprint: str,
    hooks: Sequence[Callable[[int, dict[str, float]], None]] = (),
    on_start: Callable[[int | None], None] | None = None,
) -> dict[str, Any]:
    """Trains the model built by `model_fn(rngs)`, resuming from `<workdir>/checkpoints` when it holds one.

    Args:
      hooks: called at the end of every step (after logging, evaluation and checkpointing) as
        `hook(step, metrics)` with host floats; an exception stops the run as a crash would.
      on_start: called once the state is built or restored, before the first step, with the step resumed
        from (or None); the place to write run records, since a refused checkpoint never gets there.
    Returns:
      the run's results: train_loss (mean over the last log window), val_loss, val_bits_per_byte,
      tokens_per_second (steady state, compile steps excluded; None if no step ran), steps, resumed_from,
      bytes_per_device_per_step (on several devices: what the step's all-reduces move, `core.hlo`),
      final_state (TrainState) and graphdef.
    """
    tc, cc = config.train, config.checkpoint
    is_main = jax.process_index() == 0
    os.makedirs(workdir, exist_ok=True)
    log = MetricsLog(workdir, enabled=is_main)
    graphdef, state = init_state(model_fn, optimizer, tc.seed, sharder)
    checkpointer, compat, state, loop, resumed_from = open_checkpoints(config, workdir, state, data_fingerprint, log)
    loop = loop or {"window_loss_sum": 0.0, "window_steps": 0}

    if on_start is not None:
        on_start(resumed_from)
    train_step, eval_step = make_train_step(graphdef, optimizer), make_eval_step(graphdef)
    batch_sharding = sharder.named(("batch", None))
    put = lambda b: jax.make_array_from_process_local_data(batch_sharding, b)  # noqa: E731
    val = [put(b) for b in batches.val_batches(tc.eval_batches)]
    schedule = learning_rate_schedule(config.optim, tc.steps)
    tokens_per_step = config.data.batch_size * config.data.seq_len
    start = int(state.step)
    results: dict[str, Any] = {"steps": start, "resumed_from": resumed_from}
    steady_time, steady_steps, window_time, window_timed = 0.0, 0, 0.0, 0
    progress = progress_bar(start, tc.steps, enabled=tc.progress and is_main)
    last_saved = resumed_from
    try:
        for step in range(start, tc.steps):
            tokens = put(batches.train_batch(step))
            if step == start and jax.device_count() > 1:  # what data parallelism sends per step (its all-reduces)
                compiled = train_step.lower(state, tokens).compile()
                results["bytes_per_device_per_step"] = hlo.collective_bytes(compiled.as_text())["bytes_per_device"]
            t0 = time.perf_counter()
            state, metrics = train_step(state, tokens)
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            dt = time.perf_counter() - t0
            done = step + 1
            if step > start + 1:  # the first two calls of a process include compilation
                steady_time, steady_steps = steady_time + dt, steady_steps + 1
                window_time, window_timed = window_time + dt, window_timed + 1
            if not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])):
                raise NonFiniteLossError(
                    done, metrics["loss"], metrics["grad_norm"], last_saved, checkpointer.directory
                )
            loop["window_loss_sum"] += metrics["loss"]
            loop["window_steps"] += 1
            if done % tc.log_every == 0 or done == tc.steps:
                row = {
                    "step": done,
                    "train_loss": loop["window_loss_sum"] / loop["window_steps"],
                    "grad_norm": metrics["grad_norm"],
                    "learning_rate": float(schedule(step)),
                    "tokens_per_second": tokens_per_step * window_timed / window_time if window_timed else None,
                    **{k: v for k, v in metrics.items() if k not in ("loss", "grad_norm")},
                }
                log.write(row)
                results["train_loss"] = row["train_loss"]
                progress.set_postfix(loss=f"{row['train_loss']:.3f}", refresh=False)
                loop = {"window_loss_sum": 0.0, "window_steps": 0}
                window_time, window_timed = 0.0, 0
            if done % tc.eval_every == 0 or done == tc.steps:
                ev = evaluate(eval_step, state, val)
                log.write({"step": done, **ev})
                results.update(ev)
                progress.set_postfix(
                    loss=f"{results.get('train_loss', float('nan')):.3f}",
                    val_bpb=f"{ev['val_bits_per_byte']:.3f}",
                    refresh=False,
                )
            if (cc.every and done % cc.every == 0) or done == tc.steps:
                checkpointer.save(done, state, loop=loop, compat=compat)
                last_saved = done
            progress.update(1)
            results["steps"] = done
            for hook in hooks:
                hook(done, metrics)
    finally:
        progress.close()
        checkpointer.wait()
        checkpointer.close()
    if "val_loss" not in results:  # resumed at the final step: evaluate the restored state
        results.update(evaluate(eval_step, state, val))
        results["train_loss"] = next((r["train_loss"] for r in reversed(log.read()) if "train_loss" in r), float("nan"))
    results["tokens_per_second"] = tokens_per_step * steady_steps / steady_time if steady_steps else None
    results["final_state"] = state
    results["graphdef"] = graphdef
    return results


def progress_bar(start: int, total: int, *, enabled: bool, desc: str = "train", unit: str = "step"):
    """The progress display of a training loop (tqdm on stderr; a no-op when disabled)."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total, initial=start, disable=not enabled, desc=desc, unit=unit, dynamic_ncols=True, mininterval=1.0
    )
