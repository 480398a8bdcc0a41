"""Data: deterministic batches of a corpus's token streams (the corpus itself, its reading, split and
tokenisation, and DataError are core.corpus's).

Train batches are windows at uniformly random offsets of the train stream, drawn from a generator seeded by
``(seed, step)`` alone, so any step can be recomputed without replaying earlier ones (exact resumption) and every
process can draw the global batch and keep its own rows (no communication). Held-out batches are fixed, evenly
spread windows of the val stream. Everything is NumPy.

Errors in user input raise :class:`DataError` naming the config field (``data.seq_len``, ``data.batch_size``, ...),
the offending value and what is allowed.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from core.corpus import Corpus, DataError

__all__ = ["Batches"]


class Batches:
    """Deterministic ``[local_batch, seq_len + 1]`` token windows for one process.

    Each row is ``seq_len + 1`` consecutive tokens of a stream (inputs ``row[:-1]``, targets
    ``row[1:]``); windows may cross document boundaries. Process ``i`` of ``p`` gets rows
    ``[i * local_batch, (i + 1) * local_batch)`` of the global batch, with
    ``local_batch = global_batch // process_count``. ``tokenizer`` is the corpus's (what a loss and an evaluation
    of these batches need: its ``pad_id`` and ``byte_lengths``).
    """

    def __init__(
        self,
        corpus: Corpus,
        *,
        seq_len: int,
        global_batch: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
    ):
        self.seq_len = _int("data.seq_len", seq_len, minimum=1)
        self.global_batch = _int("data.batch_size", global_batch, minimum=1)
        self.seed = _int("data.seed", seed, minimum=0)
        self.process_count = _int("process_count", process_count, minimum=1)
        self.process_index = _int("process_index", process_index, minimum=0)
        if self.process_index >= self.process_count:
            raise DataError(f"process_index={process_index} must be < process_count={process_count}")
        if self.global_batch % self.process_count:
            raise DataError(f"data.batch_size={global_batch} must be divisible by process_count={process_count}")
        for name, stream in (("train", corpus.train), ("val", corpus.val)):
            if stream.size <= self.seq_len + 1:
                raise DataError(
                    f"data.seq_len={seq_len} is too long: the {name} stream has {stream.size} tokens and must be "
                    f"longer than seq_len + 1 = {self.seq_len + 1}"
                )
        self.local_batch = self.global_batch // self.process_count
        self.tokenizer = corpus.tokenizer
        self._train = corpus.train
        self._val = corpus.val

    def train_batch(self, step: int) -> np.ndarray:
        """``int32[local_batch, seq_len + 1]``: this process's rows of the global batch at ``step >= 0``.

        The ``global_batch`` start offsets are drawn uniformly from ``[0, len(train) - seq_len)`` by
        ``np.random.Generator(np.random.PCG64([seed, step]))``: a pure function of
        ``(seed, step, process_index)``, so resuming at any step reproduces an uninterrupted run and
        the process slices together form the single-process batch.
        """
        step = _int("step", step, minimum=0)
        rng = np.random.Generator(np.random.PCG64([self.seed, step]))
        starts = rng.integers(0, self._train.size - self.seq_len, size=self.global_batch)
        return self._rows(self._train, starts)

    def val_batches(self, num_batches: int) -> list[np.ndarray]:
        """``num_batches`` fixed ``int32[local_batch, seq_len + 1]`` held-out batches.

        The ``W = num_batches * global_batch`` windows start at ``w * (len(val) // W)`` for
        ``w = 0 .. W - 1``: evenly spread and non-overlapping, identical on every call. Batch ``b``
        holds windows ``[b * global_batch, (b + 1) * global_batch)``, sliced per process.
        """
        num_batches = _int("train.eval_batches", num_batches, minimum=1)
        windows = num_batches * self.global_batch
        stride = self._val.size // windows
        if stride < self.seq_len + 1:
            fit = self._val.size // (self.seq_len + 1) // self.global_batch
            raise DataError(
                f"train.eval_batches={num_batches} needs {windows} non-overlapping windows of seq_len + 1 = "
                f"{self.seq_len + 1} tokens, but the val stream has {self._val.size} tokens; at most {fit} batches fit"
            )
        starts = np.arange(windows) * stride
        g = self.global_batch
        return [self._rows(self._val, starts[b * g : (b + 1) * g]) for b in range(num_batches)]

    def every_row(self) -> Batches:
        """The same batch source as one process sees it (every row of every global batch), e.g. for an evaluation
        that every process runs on the whole held-out batch."""
        whole = copy.copy(self)
        whole.process_index, whole.process_count, whole.local_batch = 0, 1, self.global_batch
        return whole

    def _rows(self, stream: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """``int32[local_batch, seq_len + 1]`` windows of ``stream`` at this process's slice of ``starts``."""
        mine = starts[self.process_index * self.local_batch : (self.process_index + 1) * self.local_batch]
        return stream[mine[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)


def _int(field: str, value: Any, *, minimum: int) -> int:
    """``value`` as a Python int, or a DataError naming ``field`` unless it is an integer ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise DataError(f"{field}={value!r} must be an integer >= {minimum}")
    return int(value)
