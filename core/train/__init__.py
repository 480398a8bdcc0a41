"""Training: the loss and the jitted train and eval steps (`step`), the state built in its shardings (`state`),
the one training loop and its steppers (`loop`), resuming from checkpoints (`resume`) and what a run shows
(`progress`). Every public name is importable from here: `from core import train; train.run(...)`."""

from core.train.loop import (
    NonFiniteLossError,
    PeerLostError,
    PlainStepper,
    Stepper,
    crossed,
    nonfinite_advice,
    run,
    train,
)
from core.train.progress import progress_bar, tensorboard_enabled
from core.train.state import init_state, optimizer_state_like, state_layout
from core.train.step import (
    StateMetrics,
    TrainState,
    count_target_bytes,
    evaluate,
    learning_rate_schedule,
    lm_loss,
    make_eval_step,
    make_train_step,
    train_step_fn,
)

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
    "nonfinite_advice",
    "optimizer_state_like",
    "progress_bar",
    "run",
    "state_layout",
    "tensorboard_enabled",
    "train",
    "train_step_fn",
]
