"""The training step: the language-model loss, jitted train and eval steps, the learning-rate schedule and the
held-out evaluation (nats per token and bits per byte)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from core.byte_tokenizer import PAD_ID, ByteTokenizer

if TYPE_CHECKING:  # annotations only: the configuration library is core.schema's, not a dependency here
    import ml_collections

__all__ = [
    "StateMetrics",
    "TrainState",
    "count_target_bytes",
    "evaluate",
    "learning_rate_schedule",
    "lm_loss",
    "make_eval_step",
    "make_train_step",
    "train_step_fn",
]

LN2 = math.log(2.0)


StateMetrics = Callable[[Any], dict[str, jax.Array]]
"""opt_state -> metrics the optimizer reports about its last update (e.g. MGUP's selected fraction)."""


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

    Metrics: the loss function's, "grad_norm" (the global L2 norm of the gradient before clipping, computed in
    float32 by `optax.tree.norm`), and `state_metrics(new optimizer state)` when given.
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
        metrics = {**metrics, "grad_norm": optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))}
        if state_metrics is not None:
            metrics.update(state_metrics(opt_state))
        return TrainState(state.step + 1, params, rest, opt_state, state.key), metrics

    return step


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


def evaluate(eval_step, state: TrainState, batches: Sequence[jax.Array], *, fetch=jax.device_get) -> dict:
    """Held-out loss (nats per token) and bits per byte = total NLL / (ln 2 x byte targets), summed in float64.

    `eval_step(params, rest, tokens)` returns the sums of `make_eval_step`; when it returns one value per site (a
    vmapped step over stacked site states) the results are arrays [M]. `fetch` brings the outputs of all batches to
    the host at once.
    """
    totals: dict[str, np.ndarray] = {}
    for sums in fetch([eval_step(state.params, state.rest, tokens) for tokens in batches]):  # one fetch
        out = {k: np.asarray(v, np.float64) for k, v in sums.items()}
        totals = {k: totals[k] + out[k] for k in out} if totals else out
    loss = totals["nll_sum"] / np.maximum(totals["tokens"], 1)
    bits = totals["nll_sum"] / (LN2 * np.maximum(totals["bytes"], 1))
    host = lambda x: float(x) if np.ndim(x) == 0 else x  # noqa: E731
    return {"val_loss": host(loss), "val_bits_per_byte": host(bits)}
