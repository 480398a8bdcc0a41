"""The plotting the benchmark and reproduction scripts share: one figure style, written to a PNG and closed.

    with plotting.figure("out/decode.png", size=(11, 4), ncols=2) as (ax1, ax2):
        ax1.loglog(contexts, ms, "o-", color=plotting.colors(FORMATS)["fp4"], label="fp4")
        ...

`figure` holds what every plot of experiments/bench/*.py, experiments/reproduce/*.py and experiments/report.py
does: matplotlib on the non-interactive Agg backend (scripts run headless), `plt.subplots` at 120 dpi, and on
leaving the block a light grid (alpha 0.3) and a legend on every axis (or one under the axes), a title saying what
run the figure shows, an optional caption, `tight_layout`, `savefig` and `close` (also when the block raises, so a
failed plot leaks no figure). `place_labels` puts point labels where they overlap neither each other nor the
points. `colors` gives each method one colour across a
script's plots; `mean_curve` and `moving_average` are the two curve reductions the training reproductions use.
matplotlib is imported on first use, so importing this module (and the scripts) stays cheap.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Sequence

import numpy as np

__all__ = ["DPI", "colors", "figure", "mean_curve", "moving_average", "place_labels", "pyplot"]

DPI = 120
GRID_ALPHA = 0.3
_AFTER_LAYOUT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # figure -> what to draw once laid out


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
    legend_below: bool = False,
    title: str | None = None,
    caption: str | None = None,
) -> Iterator:
    """A figure of `ncols` axes in one row, `size` = (width, height) in inches at `DPI`; saved to `path` (PNG).

    Yields the axis when `ncols == 1` and `squeeze`, else a list of the `ncols` axes. When the block ends, every
    axis gets `grid(alpha=0.3, which=grid, axis=grid_axis)` (`grid=None`: none; `"both"` adds the minor lines of
    log axes) and `legend(fontsize=legend_size, ncols=legend_columns)` (`legend_size=None`: none), or with
    `legend_below` one legend for the whole figure under the axes (every axis's entries, each label once), so no
    legend covers data; the figure gets `title` as its suptitle (fontsize 9; say there what run or command the
    figure shows) and `caption` (fontsize 7, wrapped to the width; e.g. what the point labels mean) at the bottom,
    then `tight_layout` in the space left above them, `savefig(path)`; the figure is closed in every case.
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
            if legend_size is not None and not legend_below:
                ax.legend(fontsize=legend_size, ncols=legend_columns)
        if title is not None:
            fig.suptitle(_wrap(title, size[0], 9), fontsize=9)
        bottom = _bottom_matter(fig, size, axes, legend_size if legend_below else None, legend_columns, caption)
        fig.tight_layout(rect=(0, bottom, 1, 1))
        for job in _AFTER_LAYOUT.pop(fig, []):
            job()
        fig.savefig(path)
    finally:
        plt.close(fig)


def _wrap(text: str, width_inches: float, fontsize: float) -> str:
    """`text` with each line wrapped at spaces to fit `width_inches` at `fontsize` (about 0.5 em per character)."""
    import textwrap

    chars = int(width_inches * 72 / (0.62 * fontsize))
    return "\n".join(textwrap.fill(line, width=chars, break_on_hyphens=False) for line in text.splitlines())


def _bottom_matter(fig, size, axes, legend_size, legend_columns, caption) -> float:
    """Draws the caption (at the bottom) and the figure legend (above it) and returns the height they take, as a
    fraction of the figure's, for `tight_layout` to keep free."""
    renderer = fig.canvas.get_renderer()
    pad = 0.06 / size[1]  # 0.06 inch
    bottom = 0.0
    if caption:
        text = fig.text(0.01, pad, _wrap(caption, size[0], 7), fontsize=7, ha="left", va="bottom")
        bottom = pad + text.get_window_extent(renderer).height / (DPI * size[1])
    if legend_size is not None:
        entries: dict[str, object] = {}
        for ax in axes:
            for handle, label in zip(*ax.get_legend_handles_labels()):
                entries.setdefault(label, handle)
        if entries:
            legend = fig.legend(
                list(entries.values()),
                list(entries),
                loc="lower center",
                bbox_to_anchor=(0.5, bottom + pad),
                ncols=legend_columns,
                fontsize=legend_size,
                frameon=False,
            )
            bottom += pad + legend.get_window_extent(renderer).height / (DPI * size[1])
    return bottom + (pad if bottom else 0.0)


def place_labels(
    ax,
    xs: Sequence[float],
    ys: Sequence[float],
    labels: Sequence[str],
    *,
    fontsize: float = 6,
    marker_radius: float = 5,
) -> None:
    """Labels the points (xs[i], ys[i]) (data coordinates) with labels[i], each where its text overlaps no label
    placed before it, no point (a square of +- `marker_radius` points around each) and stays inside the axes: the
    first free spot on rings of growing radius around its point (to the right first); a label set away from its
    point gets a thin grey leader line; if no spot is free, the one overlapping least. Each label has a
    translucent white background, so lines it sits on do not hide it. The placing happens once
    `figure` has laid the figure out (the positions depend on the final size of the axes), so call it inside a
    `figure` block."""
    fig = ax.figure
    _AFTER_LAYOUT.setdefault(fig, []).append(lambda: _place(ax, xs, ys, labels, fontsize, marker_radius))


def _place(ax, xs, ys, labels, fontsize, marker_radius) -> None:
    """`place_labels`' work, on the laid-out figure (display coordinates are pixels)."""
    renderer = ax.figure.canvas.get_renderer()
    px = ax.figure.dpi / 72  # pixels per point
    points = ax.transData.transform(list(zip(xs, ys)))
    frame = ax.get_window_extent(renderer)
    r = marker_radius * px
    taken = [(x - r, y - r, x + r, y + r) for x, y in points]  # boxes (x0, y0, x1, y1) in pixels

    def overlap(box) -> float:
        x0, y0, x1, y1 = box
        outside = max(0.0, frame.x0 - x0) + max(0.0, x1 - frame.x1) + max(0.0, frame.y0 - y0) + max(0.0, y1 - frame.y1)
        area = sum(max(0.0, min(x1, b[2]) - max(x0, b[0])) * max(0.0, min(y1, b[3]) - max(y0, b[1])) for b in taken)
        return area + 1e3 * outside

    angles = (0, 30, -30, 60, -60, 90, -90, 120, -120, 150, -150, 180)
    rings = (5, 9, 14, 20, 28, 38, 50)

    def annotate(xy, label, radius, angle, **style):
        c, s = math.cos(math.radians(angle)), math.sin(math.radians(angle))
        ha = "left" if c > 0.3 else "right" if c < -0.3 else "center"
        va = "bottom" if s > 0.3 else "top" if s < -0.3 else "center"
        offset = dict(xytext=(radius * c, radius * s), textcoords="offset points")
        return ax.annotate(label, xy, **offset, ha=ha, va=va, fontsize=fontsize, **style)

    for xy, label in zip(zip(xs, ys), labels):
        best = None
        for radius in rings:
            for angle in angles:
                text = annotate(xy, label, radius, angle)
                e = text.get_window_extent(renderer)
                box = (e.x0 - px, e.y0 - px, e.x1 + px, e.y1 + px)
                cost = overlap(box)
                text.remove()
                if best is None or cost < best[0]:
                    best = (cost, radius, angle, box)
                if cost == 0:
                    break
            if best is not None and best[0] == 0:
                break
        assert best is not None
        _, radius, angle, box = best
        annotate(
            xy,
            label,
            radius,
            angle,
            bbox=dict(boxstyle="square,pad=0.05", facecolor="white", edgecolor="none", alpha=0.75),
            arrowprops=None
            if radius <= rings[1]
            else dict(arrowstyle="-", lw=0.5, color="0.35", shrinkA=0, shrinkB=marker_radius * 0.8),
        )
        taken.append(box)


def colors(names: Sequence[str]) -> dict[str, str]:
    """name -> matplotlib colour "C<i>", i = the name's index in `names` (a script's fixed list of methods), so a
    method keeps its colour in every plot of the script whatever subset a run draws. More than the ten "C<i>" (which
    repeat after C9): the 20 colours of the tab20 map; more than 20 is refused."""
    if len(names) <= 10:
        return {name: f"C{i}" for i, name in enumerate(names)}
    if len(names) > 20:
        raise ValueError(f"colors: {len(names)} names, at most 20 distinct colours")
    from matplotlib import colormaps
    from matplotlib import colors as mcolors

    tab20 = colormaps["tab20"]
    return {name: mcolors.to_hex(tab20(i)) for i, name in enumerate(names)}


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
