"""experiments.plotting, the figure helper and curve reductions the benchmark and reproduction scripts share."""

import numpy as np
import pytest

from experiments import plotting


@pytest.mark.parametrize("length, window", [(5, 5), (23, 5), (7, 1), (40, 3)])
def test_moving_average_is_the_trailing_window_mean(length, window):
    rng = np.random.default_rng(length)
    steps, values = list(range(10, 10 * length + 1, 10)), rng.normal(size=length)
    xs, m = plotting.moving_average(steps, values, window)
    expected = [sum(values[t - window + 1 : t + 1]) / window for t in range(window - 1, length)]
    assert xs == steps[window - 1 :]
    np.testing.assert_allclose(m, expected, rtol=1e-12)


def test_moving_average_refuses_a_window_longer_than_the_curve():
    with pytest.raises(ValueError, match="window = 6"):
        plotting.moving_average([1, 2, 3], [1.0, 2.0, 3.0], 6)


@pytest.mark.parametrize("seeds, length", [(1, 4), (3, 17)])
def test_mean_curve_averages_pointwise_over_curves(seeds, length):
    rng = np.random.default_rng(seeds)
    values = rng.normal(size=(seeds, length))
    curves = [[(10 * (t + 1), float(v)) for t, v in enumerate(row)] for row in values]
    steps, mean = plotting.mean_curve(curves)
    assert steps == [10 * (t + 1) for t in range(length)]
    np.testing.assert_allclose(mean, [sum(values[:, t]) / seeds for t in range(length)], rtol=1e-12)


def test_mean_curve_refuses_curves_logged_at_other_steps():
    with pytest.raises(ValueError, match="curve 1"):
        plotting.mean_curve([[(10, 1.0), (20, 2.0)], [(10, 1.0), (30, 2.0)]])


def test_colors_are_fixed_by_the_method_list():
    c = plotting.colors(["bf16", "fp8", "fp4"])
    assert c == {"bf16": "C0", "fp8": "C1", "fp4": "C2"}


def test_figure_writes_a_png_of_the_requested_size_and_closes(tmp_path):
    plt = plotting.pyplot()
    path = tmp_path / "a.png"
    with plotting.figure(str(path), size=(5, 3), ncols=2) as (ax1, ax2):
        ax1.plot([1, 2], [3, 4], label="a")
        ax2.plot([1, 2], [4, 3], label="b")
    image = plt.imread(path)
    assert image.shape[:2] == (3 * plotting.DPI, 5 * plotting.DPI)
    assert plt.get_fignums() == []


def test_figure_closes_and_writes_nothing_when_the_block_raises(tmp_path):
    plt = plotting.pyplot()
    path = tmp_path / "b.png"
    with pytest.raises(RuntimeError), plotting.figure(str(path), size=(4, 3)) as ax:
        ax.plot([1, 2], [1, 2])
        raise RuntimeError("plotting failed")
    assert not path.exists() and plt.get_fignums() == []
