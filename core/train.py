"""Training: the loss, jitted train and eval steps, the learning-rate schedule, and the one training loop.

`run` is the loop every experiment uses. It drives a `Stepper`, which advances the state by one call: one train step
(`PlainStepper`, `train`) or one federated round of K local steps and their synchronisation
(experiments/federated.py). The loop itself is deliberately plain and the same for both: run the call, check the
loss is finite, write metric rows, evaluate and checkpoint on their cadences. Everything it needs to continue
(parameters, optimizer state, step, PRNG key and the open metric window) is in the checkpoint, so rerunning the
same command after a crash resumes and writes the same metrics as an uninterrupted run.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from core import checkpoint as checkpoint_lib
from core import hlo
from core import workdir as workdir_lib
from core.data import Batches
from core.mesh import Sharder, param_shardings
from core.model import split_params
from core.tokenizer import PAD_ID, ByteTokenizer

__all__ = [
    "NonFiniteLossError",
    "PeerLostError",
    "PlainStepper",
    "StateMetrics",
    "Stepper",
    "TrainState",
    "count_target_bytes",
    "crossed",
    "evaluate",
    "init_state",
    "learning_rate_schedule",
    "lm_loss",
    "make_eval_step",
    "make_train_step",
    "mirror",
    "nonfinite_advice",
    "progress_bar",
    "run",
    "state_layout",
    "tensorboard_enabled",
    "train",
    "train_step_fn",
]

LN2 = math.log(2.0)


StateMetrics = Callable[[Any], dict[str, jax.Array]]
"""opt_state -> metrics the optimizer reports about its last update (e.g. MGUP's selected fraction)."""


class NonFiniteLossError(FloatingPointError):
    """The loss, the gradient norm, the state after an update or a held-out loss became NaN/Inf. Carries `step`
    (the last step of the call that produced it), `where` ("step 7", or "round 3 (steps 7-9)") and
    `last_checkpoint` (the last good checkpoint's step or None; every checkpoint is finite, checked before it is
    written)."""

    def __init__(
        self, step: int, what: str, last_checkpoint: int | None, directory: str, *, where: str, advice: str = ""
    ):
        self.step, self.where, self.last_checkpoint = step, where, last_checkpoint
        kept = (
            f"the last good checkpoint (step {last_checkpoint}) is kept in {directory}"
            if last_checkpoint is not None
            else "no checkpoint had been written yet"
        )
        super().__init__(f"training stopped at {where}: {what}; {kept}. {advice}".rstrip())


def nonfinite_advice(optim: ml_collections.ConfigDict) -> str:
    """What to change when training diverged, given the optimizer section (not advice it already follows)."""
    hints = []
    if optim.get("eps") == 0:
        hints.append("optim.eps = 0 divides by zero where a second moment vanishes: set it > 0.")
    if optim.grad_clip_norm > 0:
        hints.append(f"Lower optim.learning_rate (gradients are already clipped to norm {optim.grad_clip_norm:g}).")
    else:
        hints.append("Lower optim.learning_rate or enable optim.grad_clip_norm.")
    return " ".join(hints)


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


def lm_loss(model: nnx.Module, tokens: jax.Array, *, key: jax.Array | None = None, pad_id: int | None = PAD_ID):
    """Next-token cross entropy over the targets that are not `pad_id`, plus every `loss/...` entry the model
    reports in aux.

    Args:
      tokens: [B, T + 1] int32; inputs tokens[:, :-1], targets tokens[:, 1:].
      pad_id: the tokenizer's padding id, left out of the mean (default the byte tokenizer's PAD, 256; None: every
        target counts). Bind it with functools.partial to pass this as a train step's `loss_fn`.
    Returns:
      (objective scalar, metrics dict with "loss" = the mean token NLL in nats and the aux entries).
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits, aux, _ = model(inputs, key=key)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    mask = jnp.ones(targets.shape, jnp.float32) if pad_id is None else (targets != pad_id).astype(jnp.float32)
    loss = jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    objective = loss + sum((v for k, v in aux.items() if k.startswith("loss/")), jnp.float32(0.0))
    return objective, {"loss": loss, **aux}


def make_train_step(
    graphdef,
    optimizer: optax.GradientTransformation,
    loss_fn: Callable = lm_loss,
    *,
    state_metrics: StateMetrics | None = None,
) -> jax.stages.Wrapped:
    """A jitted `(state, tokens [B, T+1]) -> (state, metrics)`; the state is donated."""
    return jax.jit(train_step_fn(graphdef, optimizer, loss_fn, state_metrics=state_metrics), donate_argnums=0)


def train_step_fn(
    graphdef,
    optimizer: optax.GradientTransformation,
    loss_fn: Callable = lm_loss,
    *,
    state_metrics: StateMetrics | None = None,
) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict]]:
    """The train step as a plain function (to jit, vmap over sites, ...): forward, backward, optimizer update.

    Metrics: the loss function's, "grad_norm" (global norm of the gradient before clipping), and
    `state_metrics(new optimizer state)` when given.
    """

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
        if state_metrics is not None:
            metrics.update(state_metrics(opt_state))
        return TrainState(state.step + 1, params, rest, opt_state, state.key), metrics

    return step


def _global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


_BYTE_LENGTHS = ByteTokenizer().byte_lengths


def count_target_bytes(targets: jax.Array, byte_lengths: np.ndarray, pad_id: int | None = PAD_ID) -> jax.Array:
    """How many bytes of text `targets` stand for: `sum(byte_lengths[t])` over the targets `t != pad_id`.

    Args:
      targets: int [...] token ids in [0, len(byte_lengths)).
      byte_lengths: int32 [vocab_size], the tokenizer's bytes per id (core.tokenizer; specials 0).
      pad_id: left out (it is a special, 0 bytes, in every tokenizer we build; None: nothing left out).
    Returns:
      int32 scalar. Bits per byte = total NLL / (ln 2 x this), comparable across tokenizers: the same held-out text
      has the same bytes whatever the ids.
    """
    counted = jnp.asarray(byte_lengths, jnp.int32)[targets]
    if pad_id is not None:
        counted = jnp.where(targets != pad_id, counted, 0)
    return jnp.sum(counted, dtype=jnp.int32)


def make_eval_step(
    graphdef, *, byte_lengths: np.ndarray = _BYTE_LENGTHS, pad_id: int | None = PAD_ID
) -> Callable[[Any, Any, jax.Array], dict]:
    """A jitted `(params, rest, tokens [B, T + 1]) -> {"nll_sum", "tokens", "bytes"}` (sums, for exact
    aggregation) over the targets that are not `pad_id`: their NLL, their number and the bytes of text they stand
    for (`count_target_bytes` with the tokenizer's `byte_lengths`). Defaults: the byte tokenizer's."""
    byte_lengths = np.asarray(byte_lengths, np.int32)

    @jax.jit
    def step(params, rest, tokens):
        model = nnx.merge(graphdef, params, rest)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits, _, _ = model(inputs)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        mask = jnp.ones(targets.shape, bool) if pad_id is None else targets != pad_id
        return {
            "nll_sum": jnp.sum(jnp.where(mask, nll, 0.0)),
            "tokens": jnp.sum(mask),
            "bytes": count_target_bytes(targets, byte_lengths, pad_id),
        }

    return step


def init_state(
    model_fn: Callable[[nnx.Rngs], nnx.Module],
    optimizer: optax.GradientTransformation,
    seed: int,
    sharder: Sharder,
    *,
    init_params: Callable[[nnx.State, nnx.State], nnx.State] | None = None,
) -> tuple[Any, TrainState]:
    """Builds the model and optimizer state directly in their shardings: (graphdef, TrainState at step 0).

    Everything is created inside one `jax.jit` whose output shardings come from the parameters' logical `axes`
    metadata, so no device ever holds a full copy of a sharded parameter. Optimizer-state leaves that mirror a
    parameter (Adam's moments) get that parameter's sharding; the rest (step counts) are replicated.

    Args:
      init_params: the parameters to start from instead of `model_fn`'s random ones (pretrained weights):
        `init_params(abstract params, their shardings) -> params` (an nnx.State shaped like the first, each array
        already in its sharding). The random parameters are then never computed.
    """
    graphdef, shapes, shardings = state_layout(model_fn, optimizer, seed, sharder)

    @functools.partial(jax.jit, out_shardings=shardings, donate_argnums=0)
    def make(given):
        _, params, rest = split_params(model_fn(nnx.Rngs(seed)))  # unused random parameters are dead code
        params = params if given is None else given
        return TrainState(jnp.zeros((), jnp.int32), params, rest, optimizer.init(params), jax.random.PRNGKey(seed))

    return graphdef, make(None if init_params is None else init_params(shapes.params, shardings.params))


def state_layout(
    model_fn: Callable[[nnx.Rngs], nnx.Module], optimizer: optax.GradientTransformation, seed: int, sharder: Sharder
) -> tuple[Any, TrainState, TrainState]:
    """(graphdef, the step-0 TrainState's shapes and dtypes (jax.ShapeDtypeStruct), their shardings): what
    `init_state` builds, computed without building it (also a checkpoint's restore target). Parameters are sharded
    by their logical `axes`; optimizer-state leaves that mirror a parameter get its sharding, the rest are
    replicated."""
    graphdef, params, rest = split_params(nnx.eval_shape(lambda: model_fn(nnx.Rngs(seed))))
    replicated = sharder.named(())
    params_sh = param_shardings(params, sharder)
    opt_state = jax.eval_shape(optimizer.init, params)
    step, key = jax.ShapeDtypeStruct((), jnp.int32), jax.eval_shape(lambda: jax.random.PRNGKey(seed))
    shapes = TrainState(step, params, rest, opt_state, key)  # type: ignore[arg-type] # (of shapes)
    shardings = TrainState(
        replicated,  # type: ignore[arg-type] # (of shardings)
        params_sh,
        param_shardings(rest, sharder),
        mirror(opt_state, params, params_sh, replicated),
        replicated,  # type: ignore[arg-type]
    )
    return graphdef, shapes, shardings


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
    totals: dict[str, np.ndarray] = {}
    for tokens in batches:
        out = {k: np.asarray(v, np.float64) for k, v in fetch(eval_step(state.params, state.rest, tokens)).items()}
        totals = {k: totals[k] + out[k] for k in out} if totals else out
    loss = totals["nll_sum"] / np.maximum(totals["tokens"], 1)
    bits = totals["nll_sum"] / (LN2 * np.maximum(totals["bytes"], 1))
    host = lambda x: float(x) if np.ndim(x) == 0 else x  # noqa: E731
    return {"val_loss": host(loss), "val_bits_per_byte": host(bits)}


class PeerLostError(RuntimeError):
    """A call failed in a multi-process run: another process died or became unreachable and the collective that
    joined them broke. The message names the last checkpoint to resume from."""


class Stepper(abc.ABC):
    """What the training driver (`run`) advances: one call runs `steps_per_call` optimizer steps.

    A plain run calls one train step (`PlainStepper`); a federated run calls one round of K local steps on every
    site and their synchronisation (experiments/federated.py). The driver does everything else the same way for
    both: NaN/Inf guard, metric rows, evaluation and checkpoint cadences, progress, resume, cleanup.
    """

    steps_per_call: int = 1
    unit: str = "step"  # what one call is called in the progress bar and in error messages
    warmup_calls: int = 1  # first calls of a process left out of the throughput (they compile or warm up)
    compiles_on_first_call: bool = True  # False: the stepper compiled its call ahead (and said so itself)

    @abc.abstractmethod
    def completed_steps(self, state: Any) -> int:
        """Optimizer steps `state` has completed (a whole number of calls)."""

    @abc.abstractmethod
    def step(self, state: Any, call: int) -> tuple[Any, dict[str, float]]:
        """Runs call number `call` (0-based: steps call * steps_per_call + 1 .. (call + 1) * steps_per_call).
        Returns the new state and host floats: "loss" and "grad_norm" (the driver checks both are finite) and any
        other metric, each the mean over the call's steps (and sites)."""

    @abc.abstractmethod
    def evaluate(self, state: Any) -> dict[str, float]:
        """Held-out metrics of `state`: at least "val_loss" and "val_bits_per_byte"."""

    def checkpoint_every(self, every: int) -> int:
        """Steps between checkpoints given `checkpoint.every` (0: only the last step), in whole calls: `every`
        rounded up to a multiple of `steps_per_call` (a federated run saves every ceil(every / K) rounds)."""
        return -(-every // self.steps_per_call) * self.steps_per_call

    def tags(self, call: int) -> dict[str, Any]:
        """Columns that identify the call in every metric row it writes (a federated round's number)."""
        del call
        return {}

    def after_step(self, state: Any, call: int) -> tuple[Any, dict[str, float]]:
        """Work between a call's evaluation and its checkpoint (a federation's reshuffle); returns the new state and
        metrics for a row of their own ({} writes none)."""
        del call
        return state, {}

    def results(self, state: Any) -> dict[str, Any]:
        """Entries the driver's result adds at the end: final_state, graphdef, measured bytes, ..."""
        return {"final_state": state}


def crossed(done: int, every: int, span: int) -> bool:
    """Whether the call that ended at step `done` (`span` steps long) passed a multiple of `every` (0: never)."""
    return every > 0 and done // every > (done - span) // every


def run(
    config: ml_collections.ConfigDict,
    stepper: Stepper,
    state: Any,
    *,
    workdir: str,
    compat: Mapping[str, Any],
    provenance: Mapping[str, Any] | None = None,
    hooks: Sequence[Callable[[int, dict[str, float]], None]] = (),
    on_start: Callable[[int | None], None] | None = None,
) -> dict[str, Any]:
    """The one training loop: advances `state` by `stepper` calls up to `train.steps`, resuming from
    `<workdir>/checkpoints` when it holds one.

    Every call: the stepper runs; a non-finite loss or gradient norm stops the run (`NonFiniteLossError`, naming
    the step and the last good checkpoint); a row of train metrics is written whenever the call passes a multiple
    of `train.log_every` (train_loss: the mean over the calls since the last row), an evaluation row at multiples
    of `train.eval_every` and at the end (a non-finite held-out loss stops the run too), and a checkpoint at
    multiples of the stepper's checkpoint cadence (`checkpoint.every` in whole calls, printed once) and at the end,
    once the state to be saved (parameters and optimizer state after the update) is checked finite. Rows go to
    `<workdir>/metrics.jsonl` and, unless `train.tensorboard` is False, as TensorBoard scalars to event files beside
    it (`core.workdir.EventLog`). The console gets "compiling ..." before the first call and its time after it, and
    `progress_bar`'s display. The checkpoint holds the state and the open metric
    window, so a rerun after a crash resumes and writes the same rows as an uninterrupted run. The workdir is
    locked for the run (`core.workdir.lock`); checkpointer and progress bar are closed whatever happens.

    Args:
      state: the initial state (its structure and shardings are also the template a checkpoint restores into).
      compat: what a checkpoint must share with this program to be resumed (core.config.checkpoint_compat).
      provenance: how the weights are trained (core.config.provenance): a resume refuses a change unless
        `checkpoint.accept_changes`, which records it in `<workdir>/history.jsonl`.
      hooks: called after every call as `hook(step, metrics)`; an exception stops the run as a crash would.
      on_start: called once the state is built or restored, before the first call, with the step resumed from
        (or None); the place to write run records, since a refused checkpoint never gets there.
    Returns:
      train_loss (of the last row), val_loss, val_bits_per_byte and the other evaluation entries, tokens_per_second
      (steady state, warm-up calls excluded; None if none ran), steps, resumed_from, and the stepper's `results`.
    Raises:
      NonFiniteLossError, checkpoint.CheckpointError (a damaged checkpoint, one beyond train.steps, from another
      program, with changed provenance, or present while checkpoint.resume is False; nothing on disk changes
      then), workdir.WorkdirError (in use by another run, not writable, a malformed metrics.jsonl), PeerLostError.
    """
    is_main = jax.process_index() == 0
    with workdir_lib.lock(workdir) if is_main else contextlib.nullcontext():
        return _run(config, stepper, state, workdir, compat, dict(provenance or {}), hooks, on_start)


def _run(config, stepper, state, workdir, compat, provenance, hooks, on_start) -> dict[str, Any]:
    tc, k = config.train, stepper.steps_per_call
    is_main = jax.process_index() == 0
    tensorboard = is_main and tensorboard_enabled(config)  # tensorboardX missing: refused before anything runs
    log = workdir_lib.MetricsLog(workdir, enabled=is_main)
    checkpointer, state, loop, resumed_from = _open_checkpoints(config, workdir, state, compat, provenance, log)
    events = workdir_lib.EventLog(workdir, resumed_from=resumed_from, enabled=tensorboard)

    def write(row: dict[str, Any]) -> None:  # one row, to metrics.jsonl and as TensorBoard scalars
        log.write(row)
        events.write(row)

    window, steady = _Window.restore(loop), _Timer.restore(loop)  # the run's steady timing spans its resumes
    if on_start is not None:
        on_start(resumed_from)
    schedule = learning_rate_schedule(config.optim, tc.steps)
    tokens_per_call = config.data.batch_size * config.data.seq_len * k
    checkpoint_every = stepper.checkpoint_every(config.checkpoint.every)
    start, total = stepper.completed_steps(state) // k, tc.steps // k
    results: dict[str, Any] = {"steps": start * k, "resumed_from": resumed_from}
    if is_main and start < total:
        print(_cadence_line(stepper, config.checkpoint, checkpoint_every, checkpointer.directory), flush=True)
    progress = progress_bar(
        start, total, enabled=tc.progress and is_main, desc=f"train ({stepper.unit}s)", unit=stepper.unit, steps=k
    )
    last_saved, call = resumed_from, start

    def stop(done: int, what: str) -> NonFiniteLossError:
        where = f"step {done}" if k == 1 else f"{stepper.unit} {call + 1} (steps {done - k + 1}-{done})"
        advice = nonfinite_advice(config.optim)
        return NonFiniteLossError(done, what, last_saved, checkpointer.directory, where=where, advice=advice)

    try:
        for call in range(start, total):
            first = call == start and is_main and stepper.compiles_on_first_call
            if first:
                progress.write(f"compiling the {stepper.unit} (its first call compiles it; this can take a minute) ...")
            t0 = time.perf_counter()
            state, metrics = stepper.step(state, call)
            seconds = time.perf_counter() - t0
            done = (call + 1) * k
            if first:
                progress.write(f"compiled: the first {stepper.unit} took {seconds:.1f} s, compilation included")
            if call >= start + stepper.warmup_calls:
                steady.add(seconds)
                window.time.add(seconds)
            if not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])):
                raise stop(done, f"loss = {metrics['loss']}, gradient norm = {metrics['grad_norm']} (not finite)")
            window.add(metrics["loss"])
            tags = {"step": done, **stepper.tags(call)}
            if crossed(done, tc.log_every, k) or done == tc.steps:
                row = {
                    **tags,
                    "train_loss": window.mean(),
                    "grad_norm": metrics["grad_norm"],
                    "learning_rate": float(schedule(done - 1)),
                    "tokens_per_second": window.time.rate(tokens_per_call),
                    **{name: v for name, v in metrics.items() if name not in ("loss", "grad_norm")},
                }
                write(row)
                results["train_loss"] = row["train_loss"]
                progress.set_postfix(loss=f"{row['train_loss']:.3f}", refresh=False)
                window = _Window()
            bad_eval = ""
            if crossed(done, tc.eval_every, k) or done == tc.steps:
                ev = stepper.evaluate(state)
                if not math.isfinite(ev["val_loss"]):
                    bad_eval = f"the held-out loss is {ev['val_loss']}"  # raised below, after the state's check
                else:
                    write({**tags, **ev})
                    results.update(ev)
                    if is_main:
                        progress.write(
                            f"{stepper.unit} {call + 1}/{total} (step {done}): held-out "
                            f"{ev['val_bits_per_byte']:.3f} bits/byte"
                        )
            if not bad_eval:
                state, extra = stepper.after_step(state, call)
                if extra:
                    write({**tags, **extra})
            if crossed(done, checkpoint_every, k) or done == tc.steps or bad_eval:
                checked = checkpoint_lib.digest(state)  # what would be saved: finite, or the run stops here
                if checked.nonfinite:
                    bad = sorted(checked.nonfinite, key=lambda name: -checked.nonfinite[name])
                    raise stop(
                        done,
                        f"the state after the update holds {sum(checked.nonfinite.values()):,} non-finite values "
                        f"(in {len(bad)} arrays: {bad[:3]}{' ...' if len(bad) > 3 else ''}); it was not saved",
                    )
                if bad_eval:
                    raise stop(done, bad_eval)
                loop = {**window.record(), **steady.record()}
                checkpointer.save(done, state, loop=loop, compat=compat, provenance=provenance, checked=checked)
                last_saved = done
            results["steps"] = done
            progress.update(1)
            for hook in hooks:
                hook(done, metrics)
    except (NonFiniteLossError, checkpoint_lib.CheckpointError):
        raise
    except Exception as e:
        if jax.process_count() == 1:
            raise
        kept = f"step {last_saved} in {checkpointer.directory}" if last_saved is not None else "none was written"
        raise PeerLostError(
            f"{stepper.unit} {call + 1} failed in a collective across processes ({type(e).__name__}: "
            f"{str(e)[:200]}): another process has probably died. The last checkpoint: {kept}; rerun the same "
            "command on every process to resume from it."
        ) from None
    finally:
        progress.close()
        events.close()
        checkpointer.wait()
        checkpointer.close()
    if "val_loss" not in results:  # resumed at the final step: evaluate the restored state
        results.update(stepper.evaluate(state))
        if not math.isfinite(results["val_loss"]):
            raise stop(results["steps"], f"the held-out loss of the restored state is {results['val_loss']}")
        results["train_loss"] = next((r["train_loss"] for r in reversed(log.read()) if "train_loss" in r), math.nan)
    results["tokens_per_second"] = steady.rate(tokens_per_call)
    return {**results, **stepper.results(state)}


class _Timer:
    """Seconds and count of timed calls."""

    def __init__(self, seconds: float = 0.0, calls: int = 0) -> None:
        self.seconds, self.calls = seconds, calls

    def record(self) -> dict[str, Any]:
        return {"steady_seconds": self.seconds, "steady_calls": self.calls}

    @classmethod
    def restore(cls, record: Mapping[str, Any]) -> _Timer:
        return cls(record.get("steady_seconds", 0.0), record.get("steady_calls", 0))

    def add(self, seconds: float) -> None:
        self.seconds, self.calls = self.seconds + seconds, self.calls + 1

    def rate(self, per_call: float) -> float | None:
        return per_call * self.calls / self.seconds if self.calls else None


class _Window:
    """The calls since the last train row: the sum of their mean losses (saved in checkpoints) and their timing
    (not saved: a resumed window is timed from the resume on)."""

    def __init__(self, loss_sum: float = 0.0, calls: int = 0) -> None:
        self.loss_sum, self.calls, self.time = loss_sum, calls, _Timer()

    def add(self, loss: float) -> None:
        self.loss_sum, self.calls = self.loss_sum + loss, self.calls + 1

    def mean(self) -> float:
        return self.loss_sum / self.calls

    def record(self) -> dict[str, Any]:
        return {"window_loss_sum": self.loss_sum, "window_calls": self.calls}

    @classmethod
    def restore(cls, record: Mapping[str, Any]) -> _Window:
        # "window_steps": checkpoints of plain runs written before calls and steps were told apart
        return cls(record.get("window_loss_sum", 0.0), record.get("window_calls", record.get("window_steps", 0)))


def _open_checkpoints(
    config: ml_collections.ConfigDict,
    workdir: str,
    state: Any,
    compat: Mapping[str, Any],
    provenance: dict[str, Any],
    log: workdir_lib.MetricsLog,
) -> tuple[checkpoint_lib.Checkpointer, Any, dict[str, Any], int | None]:
    """The run's `<workdir>/checkpoints`: restores the latest checkpoint into `state` when `checkpoint.resume`
    allows (after checking it belongs to this program, was trained as the config says, and is intact), then sets
    metric rows written after it (all of them on a fresh start) aside.

    Returns (checkpointer, state, the checkpoint's loop record ({} on a fresh start), the step resumed from or
    None). Raises CheckpointError for a damaged checkpoint (unless `checkpoint.fallback`: then it is moved to
    `checkpoints.damaged/` and the next newest is tried), one beyond train.steps, one from another program, one
    trained with other hyper-parameters (unless `checkpoint.accept_changes`), or checkpoints present while
    checkpoint.resume is False; WorkdirError for a malformed metrics.jsonl. Nothing on disk changes before a
    restore succeeds.
    """
    cc, steps = config.checkpoint, config.train.steps
    log.check()  # a malformed metrics.jsonl is refused before anything else
    directory = os.path.join(workdir, "checkpoints")
    checkpointer = checkpoint_lib.Checkpointer(directory, keep=cc.keep, async_save=cc.async_save)
    latest = checkpointer.latest_step()
    if latest is not None and not cc.resume:
        raise checkpoint_lib.CheckpointError(
            f"{checkpointer.directory} already holds checkpoints and checkpoint.resume is False; use a new "
            "--workdir so they are not overwritten."
        )
    if latest is not None and latest > steps:
        raise checkpoint_lib.CheckpointError(
            f"the latest checkpoint in {checkpointer.directory} is at step {latest}, beyond train.steps = "
            f"{steps}; raise train.steps (with checkpoint.accept_changes) or use a new --workdir. Nothing was "
            "changed."
        )
    changes: dict[str, list] = {}
    loop: dict[str, Any] = {}
    while latest is not None:
        try:
            record = checkpointer.read_record(latest)
            changes = _changes(record, provenance)
            if changes and not cc.accept_changes:
                raise checkpoint_lib.CheckpointError(_changes_message(checkpointer, latest, changes))
            state, loop = checkpointer.restore(latest, state, compat=compat, record=record)
            break
        except checkpoint_lib.DamagedCheckpointError as e:
            if not cc.fallback:
                raise checkpoint_lib.DamagedCheckpointError(
                    f"{e} Rerun with --config.checkpoint.fallback=True to resume from the newest intact checkpoint "
                    "(the damaged one is moved to checkpoints.damaged/), or use a new --workdir."
                ) from e
            checkpointer.close()
            aside = os.path.join(workdir, "checkpoints.damaged", str(latest))
            if jax.process_index() == 0:
                os.makedirs(os.path.dirname(aside), exist_ok=True)
                os.replace(os.path.join(directory, str(latest)), aside)
                print(f"checkpoint.fallback: {e}\nmoved it to {aside}; trying the next newest", flush=True)
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("checkpoint fallback")
            checkpointer = checkpoint_lib.Checkpointer(directory, keep=cc.keep, async_save=cc.async_save)
            latest = checkpointer.latest_step()
    log.truncate_after(latest or 0)
    if latest is None:
        return checkpointer, state, {}, None
    if changes and jax.process_index() == 0:
        workdir_lib.append_history(workdir, {"resumed_from": latest, "changes": changes})
        print(f"checkpoint.accept_changes: {_describe_changes(changes)} (recorded in history.jsonl)", flush=True)
    if jax.process_index() == 0:
        print(f"resuming from the checkpoint of step {latest} in {checkpointer.directory}", flush=True)
    return checkpointer, state, loop, latest


def _changes(record: Mapping[str, Any], provenance: Mapping[str, Any]) -> dict[str, list]:
    """{key: [saved, now]} of the provenance keys whose value differs from the checkpoint's record."""
    saved = record.get("provenance") or {}
    now = json.loads(json.dumps(provenance))
    return {key: [saved[key], now[key]] for key in sorted(now) if key in saved and saved[key] != now[key]}


def _describe_changes(changes: Mapping[str, list]) -> str:
    return ", ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in changes.items())


def _changes_message(checkpointer, step: int, changes: Mapping[str, list]) -> str:
    return (
        f"the checkpoint of step {step} in {checkpointer.directory} was trained with other hyper-parameters "
        f"({_describe_changes(changes)}); resuming would make config.json describe weights it did not train. "
        "Restore the original values, start a new --workdir, or rerun with --config.checkpoint.accept_changes=True "
        "to continue with the change recorded in the workdir's history.jsonl. Nothing was changed."
    )


class PlainStepper(Stepper):
    """One jitted train step per call on the (data / tensor / expert parallel) mesh of `sharder`.

    Each call puts step s's global batch (a pure function of s, `core.data.Batches`) onto the mesh. On several
    devices the first call also reads what the step's all-reduces move per device (`core.hlo`).
    """

    warmup_calls = 2  # the first two calls compile (the second because donated outputs come back re-sharded)

    def __init__(
        self,
        graphdef,
        optimizer: optax.GradientTransformation,
        batches: Batches,
        sharder: Sharder,
        *,
        eval_batches: int,
        state_metrics: StateMetrics | None = None,
    ):
        self.graphdef = graphdef
        tok = batches.tokenizer  # its padding is left out of the loss; its bytes per id give bits per byte
        loss_fn = functools.partial(lm_loss, pad_id=tok.pad_id)
        self.train_step = make_train_step(graphdef, optimizer, loss_fn, state_metrics=state_metrics)
        self.eval_step = make_eval_step(graphdef, byte_lengths=tok.byte_lengths, pad_id=tok.pad_id)
        batch_sharding = sharder.named(("batch", None))
        self.put = lambda b: jax.make_array_from_process_local_data(batch_sharding, b)
        self.batches = batches
        self.val = [self.put(b) for b in batches.val_batches(eval_batches)]
        self.bytes_per_step: float | None = None

    def completed_steps(self, state: TrainState) -> int:
        return int(state.step)

    def step(self, state: TrainState, call: int) -> tuple[TrainState, dict[str, float]]:
        tokens = self.put(self.batches.train_batch(call))
        if self.bytes_per_step is None and jax.device_count() > 1:  # what data parallelism sends per step
            compiled = self.train_step.lower(state, tokens).compile()
            self.bytes_per_step = hlo.collective_bytes(compiled.as_text() or "")["bytes_per_device"]
        state, metrics = self.train_step(state, tokens)
        return state, {name: float(v) for name, v in jax.device_get(metrics).items()}

    def evaluate(self, state: TrainState) -> dict[str, float]:
        return evaluate(self.eval_step, state, self.val)

    def results(self, state: TrainState) -> dict[str, Any]:
        out = {"final_state": state, "graphdef": self.graphdef}
        if self.bytes_per_step is not None:
            out["bytes_per_device_per_step"] = self.bytes_per_step
        return out


def train(
    config: ml_collections.ConfigDict,
    *,
    workdir: str,
    model_fn: Callable[[nnx.Rngs], nnx.Module],
    optimizer: optax.GradientTransformation,
    batches: Batches,
    sharder: Sharder,
    compat: Mapping[str, Any],
    provenance: Mapping[str, Any] | None = None,
    state_metrics: StateMetrics | None = None,
    hooks: Sequence[Callable[[int, dict[str, float]], None]] = (),
    on_start: Callable[[int | None], None] | None = None,
    init_params: Callable[[nnx.State, nnx.State], nnx.State] | None = None,
) -> dict[str, Any]:
    """Trains the model built by `model_fn(rngs)` with `optimizer` one step per call (`PlainStepper` driven by
    `run`), building the state directly in its shardings (from `init_params`, as `init_state`'s, when given).
    Arguments and results as `run`'s; the results add `graphdef` and, on several devices,
    `bytes_per_device_per_step` (what the step's all-reduces move)."""
    if jax.process_index() == 0:
        tensorboard_enabled(config)  # tensorboardX missing: refused before anything compiles
    graphdef, state = init_state(model_fn, optimizer, config.train.seed, sharder, init_params=init_params)
    stepper = PlainStepper(
        graphdef, optimizer, batches, sharder, eval_batches=config.train.eval_batches, state_metrics=state_metrics
    )
    return run(
        config, stepper, state, workdir=workdir, compat=compat, provenance=provenance, hooks=hooks, on_start=on_start
    )


def progress_bar(
    start: int, total: int, *, enabled: bool, desc: str = "train", unit: str = "step", steps: int = 1, stream=None
):
    """The progress display of a training loop over calls `start`..`total` (each `steps` optimizer steps).

    Where `stream` (default stderr) is a terminal: a tqdm bar on it. Elsewhere (CI, output redirected to a file),
    no bar: a plain line on stdout every tenth of the run or every minute, whichever comes first, and at the end
    (`round 12/70 (step 120): train loss 2.345, 0:41 elapsed, about 3:05 left`). Disabled: nothing. Each has tqdm's
    `update`, `set_postfix`, `write` (a line that does not break the bar; printed even when disabled) and `close`.
    """
    stream = sys.stderr if stream is None else stream
    if enabled and stream.isatty():
        from tqdm.auto import tqdm

        return tqdm(
            total=total,
            initial=start,
            desc=desc,
            unit=unit,
            dynamic_ncols=True,
            mininterval=1.0,
            file=stream,
        )
    return _ProgressLines(start, total, enabled=enabled, unit=unit, steps=steps)


class _ProgressLines:
    """`progress_bar` where no terminal shows a bar: plain lines on stdout (none when disabled)."""

    seconds = 60.0  # at most this long between two lines

    def __init__(self, start: int, total: int, *, enabled: bool, unit: str, steps: int):
        self.n, self.start, self.total, self.enabled, self.unit, self.steps = start, start, total, enabled, unit, steps
        self.every = max(1, -(-(total - start) // 10))
        self.t0 = self.last_time = time.monotonic()
        self.last_n, self.loss = start, ""

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        due = self.n - self.last_n >= self.every or now - self.last_time >= self.seconds or self.n == self.total
        if not (self.enabled and due):
            return
        self.last_n, self.last_time = self.n, now
        elapsed = now - self.t0
        left = elapsed / (self.n - self.start) * (self.total - self.n)
        loss = f": train loss {self.loss}," if self.loss else ":"
        print(
            f"{self.unit} {self.n}/{self.total} (step {self.n * self.steps}){loss} {_clock(elapsed)} elapsed, "
            f"about {_clock(left)} left",
            flush=True,
        )

    def set_postfix(self, refresh: bool = False, **values: str) -> None:
        del refresh
        self.loss = values.get("loss", self.loss)

    def write(self, line: str) -> None:
        print(line, flush=True)

    def close(self) -> None:
        pass


def _clock(seconds: float) -> str:
    """1:05 for 65 s, 1:01:05 for 3665 s."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def tensorboard_enabled(config: ml_collections.ConfigDict) -> bool:
    """Whether the run writes its metric rows as TensorBoard event files too (`train.tensorboard`, default True).
    When it does, tensorboardX must be importable: WorkdirError saying how to install it or turn the events off,
    so a caller can check before it compiles anything."""
    enabled = bool(config.train.get("tensorboard", True))
    if enabled:
        workdir_lib.tensorboard_writer()
    return enabled


def _cadence_line(stepper: Stepper, cc: ml_collections.ConfigDict, every: int, directory: str) -> str:
    """How often the run saves, in the stepper's units, said once at its start."""
    k, unit = stepper.steps_per_call, stepper.unit
    if every == 0:
        when = "at the last step only (checkpoint.every = 0)"
    elif k == 1:
        when = f"every {every} {unit}s and at the last"
    else:
        when = (
            f"every {every // k} {unit}s ({every} steps: checkpoint.every = {cc.every} in whole {unit}s of {k} "
            "steps) and at the last"
        )
    return f"checkpoints: {when}, the last {cc.keep} kept in {directory}"
