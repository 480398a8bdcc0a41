"""The one training loop: `run` drives a `Stepper`, which advances the state by one call: one train step
(`PlainStepper`, `train`) or one federated round of K local steps and their synchronisation (FoMoE's stepper). The loop
is the same for both: run the call, check the loss is finite, write metric rows, evaluate and checkpoint on their
cadences. Everything it needs to continue (parameters, optimizer state, step, PRNG key and the open metric window)
is in the checkpoint, so rerunning the same command after a crash resumes and writes the same metrics as an
uninterrupted run.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import optax
from flax import nnx

from core import checkpoint as checkpoint_lib
from core import hlo
from core import workdir as workdir_lib
from core.data import Batches
from core.mesh import Sharder
from core.train import progress as progress_lib
from core.train import resume
from core.train.state import init_state
from core.train.step import (
    StateMetrics,
    TrainState,
    evaluate,
    learning_rate_schedule,
    lm_loss,
    make_eval_step,
    make_train_step,
)

if TYPE_CHECKING:  # annotations only: the configuration library is core.schema's, not a dependency here
    import ml_collections

__all__ = [
    "NonFiniteLossError",
    "PeerLostError",
    "PlainStepper",
    "Stepper",
    "crossed",
    "nonfinite_advice",
    "run",
    "train",
]


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


class PeerLostError(RuntimeError):
    """A call failed in a multi-process run: another process died or became unreachable and the collective that
    joined them broke. The message names the last checkpoint to resume from."""


class Stepper(abc.ABC):
    """What the training driver (`run`) advances: one call runs `steps_per_call` optimizer steps.

    A plain run calls one train step (`PlainStepper`); a federated run calls one round of K local steps on every
    site and their synchronisation (FoMoE's stepper). The driver does everything else the same way for
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
    of `train.eval_every` and at the end (a non-finite held-out loss stops the run too), and for a fresh start from
    pretrained weights (`checkpoint.init_from`) one at step 0, before the first call, and a checkpoint at
    multiples of the stepper's checkpoint cadence (`checkpoint.every` in whole calls, printed once) and at the end,
    once the state to be saved (parameters and optimizer state after the update) is checked finite. Rows go to
    `<workdir>/metrics.jsonl` and, unless `train.tensorboard` is False, as TensorBoard scalars to event files beside
    it (`core.workdir.EventLog`). The console gets "compiling ..." before the first call and its time after it, and
    `progress_bar`'s display. The checkpoint holds the state and the open metric
    window, so a rerun after a crash resumes and writes the same rows as an uninterrupted run. The workdir is
    locked for the run (`core.workdir.lock`); checkpointer and progress bar are closed whatever happens.

    Args:
      state: the initial state (its structure and shardings are also the template a checkpoint restores into).
      compat: what a checkpoint must share with this program to be resumed (core.schema.checkpoint_compat).
      provenance: how the weights are trained (core.schema.provenance): a resume refuses a change unless
        `checkpoint.accept_changes`, which records it in `<workdir>/history.jsonl`.
      hooks: called after every call as `hook(step, metrics)`; an exception stops the run as a crash would.
      on_start: called once the state is built or restored, before the first call, with the step resumed from
        (or None); the place to write run records, since a refused checkpoint never gets there. After a resume
        that accepted changes (`checkpoint.accept_changes`) it is called, and the changes go to history.jsonl,
        only with the first checkpoint trained under them: a run stopped before it records nothing.
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
    # tensorboardX missing: refused before anything runs
    tensorboard = is_main and progress_lib.tensorboard_enabled(config)
    log = workdir_lib.MetricsLog(workdir, enabled=is_main)
    checkpointer, state, loop, resumed_from, accepted = resume.open_checkpoints(
        config, workdir, state, compat, provenance, log
    )
    events = workdir_lib.EventLog(workdir, resumed_from=resumed_from, enabled=tensorboard)

    def write(row: dict[str, Any]) -> None:  # one row, to metrics.jsonl and as TensorBoard scalars
        log.write(row)
        events.write(row)

    window, steady = _Window.restore(loop), _Timer.restore(loop)  # the run's steady timing spans its resumes
    if on_start is not None and accepted is None:  # (else: with the first checkpoint trained under the changes)
        on_start(resumed_from)
    schedule = learning_rate_schedule(config.optim, tc.steps)
    tokens_per_call = config.data.batch_size * config.data.seq_len * k
    checkpoint_every = stepper.checkpoint_every(config.checkpoint.every)
    start, total = stepper.completed_steps(state) // k, tc.steps // k
    results: dict[str, Any] = {"steps": start * k, "resumed_from": resumed_from}
    if is_main and start < total:
        print(
            progress_lib.cadence_line(k, stepper.unit, config.checkpoint, checkpoint_every, checkpointer.directory),
            flush=True,
        )
    progress = progress_lib.progress_bar(
        start, total, enabled=tc.progress and is_main, desc=f"train ({stepper.unit}s)", unit=stepper.unit, steps=k
    )
    last_saved, call = resumed_from, start

    def stop(done: int, what: str) -> NonFiniteLossError:
        where = f"step {done}" if k == 1 else f"{stepper.unit} {call + 1} (steps {done - k + 1}-{done})"
        advice = nonfinite_advice(config.optim)
        return NonFiniteLossError(done, what, last_saved, checkpointer.directory, where=where, advice=advice)

    try:
        if resumed_from is None and total > 0 and config.checkpoint.get("init_from"):  # pretrained: held-out at 0
            ev = stepper.evaluate(state)
            if not math.isfinite(ev["val_loss"]):
                raise stop(
                    0, f"the held-out loss of the starting weights ({config.checkpoint.init_from}) is {ev['val_loss']}"
                )
            write({"step": 0, **ev})
            if is_main:
                progress.write(f"step 0 (the starting weights): held-out {ev['val_bits_per_byte']:.3f} bits/byte")
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
                            f"{progress_lib.position(stepper.unit, call + 1, total, k)}: held-out "
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
                if accepted is not None:  # the first checkpoint trained under accepted changes: record them now
                    resume.record_accepted(workdir, accepted)
                    if on_start is not None:
                        on_start(resumed_from)
                    accepted = None
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
        # "window_steps": the name a plain run's checkpoint record may give the window's calls
        return cls(record.get("window_loss_sum", 0.0), record.get("window_calls", record.get("window_steps", 0)))


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
        progress_lib.tensorboard_enabled(config)  # tensorboardX missing: refused before anything compiles
    graphdef, state = init_state(model_fn, optimizer, config.train.seed, sharder, init_params=init_params)
    stepper = PlainStepper(
        graphdef, optimizer, batches, sharder, eval_batches=config.train.eval_batches, state_metrics=state_metrics
    )
    return run(
        config, stepper, state, workdir=workdir, compat=compat, provenance=provenance, hooks=hooks, on_start=on_start
    )
