"""The plotting the benchmark and reproduction scripts share: one figure style, written to a PNG and closed.

    with plotting.figure("out/decode.png", size=(11, 4), ncols=2) as (ax1, ax2):
        ax1.loglog(contexts, ms, "o-", color=plotting.colors(FORMATS)["fp4"], label="fp4")
        ...

`figure` holds what every plot of experiments/bench/*.py, experiments/reproduce/*.py and experiments/report.py
does: matplotlib on the non-interactive Agg backend (scripts run headless), `plt.subplots` at 120 dpi, and on
leaving the block a light grid (alpha 0.3) and a legend on every axis, `tight_layout`, `savefig` and `close` (also
when the block raises, so a failed plot leaks no figure). `colors` gives each method one colour across a
script's plots; `mean_curve` and `moving_average` are the two curve reductions the training reproductions use.
matplotlib is imported on first use, so importing this module (and the scripts) stays cheap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np

__all__ = ["DPI", "colors", "figure", "mean_curve", "moving_average", "pyplot"]

DPI = 120
GRID_ALPHA = 0.3


def pyplot():
    """`matplotlib.pyplot`, with the Agg backend selected first (no display needed; PNG output only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextlib.contextmanager
def figure(
    path: str,
    *,
    size: tuple[float, float],
    ncols: int = 1,
    squeeze: bool = True,
    grid: str | None = "major",
    grid_axis: str = "both",
    legend_size: float | str | None = 7,
    legend_columns: int = 1,
    title: str | None = None,
) -> Iterator:
    """A figure of `ncols` axes in one row, `size` = (width, height) in inches at `DPI`; saved to `path` (PNG).

    Yields the axis when `ncols == 1` and `squeeze`, else a list of the `ncols` axes. When the block ends, every
    axis gets `grid(alpha=0.3, which=grid, axis=grid_axis)` (`grid=None`: none; `"both"` adds the minor lines of
    log axes) and `legend(fontsize=legend_size, ncols=legend_columns)` (`legend_size=None`: none), the figure
    gets `title` as its suptitle (fontsize 9), then `tight_layout`, `savefig(path)`; the figure is closed in
    every case.
    """
    if ncols < 1:
        raise ValueError(f"figure: ncols = {ncols} must be >= 1")
    plt = pyplot()
    fig, axes = plt.subplots(1, ncols, figsize=size, dpi=DPI, squeeze=False)
    axes = list(axes[0])
    try:
        yield axes[0] if squeeze and ncols == 1 else axes
        for ax in axes:
            if grid is not None:
                ax.grid(alpha=GRID_ALPHA, which=grid, axis=grid_axis)
            if legend_size is not None:
                ax.legend(fontsize=legend_size, ncols=legend_columns)
        if title is not None:
            fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def colors(names: Sequence[str]) -> dict[str, str]:
    """name -> matplotlib colour "C<i>", i = the name's index in `names` (a script's fixed list of methods), so a
    method keeps its colour in every plot of the script whatever subset a run draws."""
    return {name: f"C{i}" for i, name in enumerate(names)}


def mean_curve(curves: Sequence[Sequence[tuple[int, float]]]) -> tuple[list[int], np.ndarray]:
    """(steps, mean) of curves logged at the same steps, e.g. one per seed.

    curves: C lists of (step, value) pairs, each the same length T with the same steps.
    Returns the T steps and the float64 [T] array mean_c value[c, t]. A curve logged at other steps is an error
    (averaging it point by point would mix steps).
    """
    if not curves:
        raise ValueError("mean_curve: no curves to average")
    steps = [s for s, _ in curves[0]]
    for i, c in enumerate(curves[1:], 1):
        if [s for s, _ in c] != steps:
            raise ValueError(f"mean_curve: curve {i} is logged at other steps than curve 0 ({len(c)} vs {len(steps)})")
    return steps, np.mean([[v for _, v in c] for c in curves], axis=0)


def moving_average(
    steps: Sequence[int], values: Sequence[float] | np.ndarray, window: int = 5
) -> tuple[list[int], np.ndarray]:
    """The `window`-point trailing mean of `values` [T], m_t = mean(values[t - window + 1 .. t]), at the steps
    where a whole window exists: (steps[window - 1:], m) with T - window + 1 points."""
    if not 1 <= window <= len(values):
        raise ValueError(f"moving_average: window = {window} must be in [1, {len(values)}] (the number of values)")
    return list(steps[window - 1 :]), np.convolve(values, np.ones(window) / window, mode="valid")
