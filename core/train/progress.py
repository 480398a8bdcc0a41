"""What a training run shows and where its metrics go besides metrics.jsonl: the progress bar (tqdm, an optional
dependency), plain progress lines where no terminal shows a bar, the checkpoint cadence line and the TensorBoard
switch."""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

from core import workdir as workdir_lib

if TYPE_CHECKING:  # annotations only: the configuration library is core.schema's, not a dependency here
    import ml_collections

__all__ = ["cadence_line", "progress_bar", "tensorboard_enabled"]


def progress_bar(
    start: int, total: int, *, enabled: bool, desc: str = "train", unit: str = "step", steps: int = 1, stream=None
):
    """The progress display of a training loop over calls `start`..`total` (each `steps` optimizer steps).

    Where `stream` (default stderr) is a terminal of known width: a tqdm bar on it. Elsewhere (CI, output
    redirected to a file, a terminal of 0 columns, where tqdm draws nothing), no bar: a plain line on stdout every
    tenth of the run or every minute, whichever comes first, and at the end (`round 12/70 (step 120): train loss
    2.345, 0:41 elapsed, about 3:05 left`; `step 12/70: ...` when a call is one step). The time left is estimated
    from the calls after the first, which includes compilation (the first line gives none). Disabled: nothing.
    Each has tqdm's `update`, `set_postfix`, `write` (a line that does not break the bar; printed even when
    disabled) and `close`.
    """
    stream = sys.stderr if stream is None else stream
    if enabled and stream.isatty() and _columns(stream) != 0:
        try:
            from tqdm.auto import tqdm  # optional dependency (the [experiments] extra): imported only for a bar
        except ImportError as e:
            raise ImportError(
                f"train.progress = True on a terminal draws a tqdm bar, which needs the package tqdm ({e}); install "
                "it (pip install 'lowbit-moe-lab[experiments]') or turn the bar off with --config.train.progress=False"
            ) from None
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


def _columns(stream) -> int | None:
    """The width of the terminal `stream` writes to, or None where it has no file descriptor to ask."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return None


def position(unit: str, n: int, total: int, steps: int) -> str:
    """Where a run is, for a console line: "step 3/30", or "round 3/30 (step 30)" for a unit of `steps` > 1 steps."""
    return f"{unit} {n}/{total}" + ("" if unit == "step" and steps == 1 else f" (step {n * steps})")


class _ProgressLines:
    """`progress_bar` where no terminal shows a bar: plain lines on stdout (none when disabled)."""

    seconds = 60.0  # at most this long between two lines

    def __init__(self, start: int, total: int, *, enabled: bool, unit: str, steps: int):
        self.n, self.start, self.total, self.enabled, self.unit, self.steps = start, start, total, enabled, unit, steps
        self.every = max(1, -(-(total - start) // 10))
        self.t0 = self.last_time = time.monotonic()
        self.last_n, self.loss = start, ""
        self.first: tuple[int, float] | None = None  # (calls, time) after the first call: it compiled

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self.first is None:
            self.first = (self.n, now)
        due = self.n - self.last_n >= self.every or now - self.last_time >= self.seconds or self.n == self.total
        if not (self.enabled and due):
            return
        self.last_n, self.last_time = self.n, now
        elapsed = now - self.t0
        done, since = self.n - self.first[0], now - self.first[1]
        left = f", about {_clock(since / done * (self.total - self.n))} left" if done > 0 else ""
        loss = f": train loss {self.loss}," if self.loss else ":"
        print(
            f"{position(self.unit, self.n, self.total, self.steps)}{loss} {_clock(elapsed)} elapsed{left}", flush=True
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
    When it does, tensorboardX (an optional dependency, the [experiments] extra) must be importable: WorkdirError
    saying how to install it or turn the events off, so a caller can check before it compiles anything."""
    enabled = bool(config.train.get("tensorboard", True))
    if enabled:
        workdir_lib.tensorboard_writer()
    return enabled


def cadence_line(k: int, unit: str, cc: ml_collections.ConfigDict, every: int, directory: str) -> str:
    """How often the run saves (every `every` steps, in calls of `k` steps called `unit`), said once at its
    start."""
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
