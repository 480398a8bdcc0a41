"""experiments.plotting, the figure helper and curve reductions the benchmark and reproduction scripts share, and
the title experiments.report puts on a run's loss curve."""

import json

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
    many = plotting.colors([f"m{i}" for i in range(16)])  # past C9 the "C<i>" colours repeat: all 16 distinct
    assert len(set(many.values())) == 16
    with pytest.raises(ValueError, match="21 names"):
        plotting.colors([f"m{i}" for i in range(21)])


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


def _boxes(ax, artists):
    """Display boxes of `artists` of a figure `plotting.figure` has saved and closed (a fresh Agg canvas measures
    them: closing detached the figure's own)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    renderer = FigureCanvasAgg(ax.figure).get_renderer()
    # a label's own text (Text's extent: an annotation's adds its leader line)
    return [
        Text.get_window_extent(a, renderer) if isinstance(a, Text) else a.get_window_extent(renderer) for a in artists
    ]


def test_place_labels_puts_every_label_clear_of_the_others_and_of_the_points(tmp_path):
    """A tight cluster of 10 points (as in the FoMoE Pareto plot): once placed, no two labels overlap, no label
    covers a point's marker, every label lies inside the axes, and a label set away from its point has a leader."""
    rng = np.random.default_rng(0)
    xs, ys = list(100 + 40 * rng.random(10)), list(8 + 0.6 * rng.random(10))
    labels = [f"LA M{i % 3 + 2} O{i % 4 + 1} K8" for i in range(10)]
    with plotting.figure(str(tmp_path / "p.png"), size=(6, 4), legend_size=None) as ax:
        ax.scatter(xs, ys, s=40)
        ax.set_xlim(60, 180)
        ax.set_ylim(7, 10)
        plotting.place_labels(ax, xs, ys, labels)
    texts = [t for t in ax.texts if t.get_text() in labels]
    assert sorted(t.get_text() for t in texts) == sorted(labels)
    boxes = _boxes(ax, texts)
    for i, a in enumerate(boxes):
        assert not any(a.overlaps(b) for b in boxes[i + 1 :])
        assert ax.get_window_extent().contains(a.x0, a.y0) and ax.get_window_extent().contains(a.x1, a.y1)
    px = ax.figure.dpi / 72 * 4  # a marker of s=40 has a radius of ~3.2 points
    for x, y in ax.transData.transform(list(zip(xs, ys))):
        assert not any(b.x0 < x + px and x - px < b.x1 and b.y0 < y + px and y - px < b.y1 for b in boxes)
    for t in texts:
        far = np.hypot(*t.xyann) > 9
        assert (t.arrow_patch is not None) == far


def test_legend_below_and_caption_sit_under_the_axes_in_a_figure_of_the_requested_size(tmp_path):
    """One legend for both axes (each label once) under them, the caption under the legend, the title above;
    nothing of it overlaps an axis, and the PNG keeps the requested size."""
    plt = plotting.pyplot()
    path = tmp_path / "c.png"
    with plotting.figure(
        str(path), size=(6, 4), ncols=2, legend_below=True, title="python -m x --out y", caption="A = a; B = b."
    ) as (ax1, ax2):
        ax1.plot([1, 2], [1, 2], label="a")
        ax2.plot([1, 2], [2, 1], label="a")
        ax2.plot([1, 2], [1, 1], label="b")
    fig = ax1.figure
    assert ax1.get_legend() is None and ax2.get_legend() is None and len(fig.legends) == 1
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["a", "b"]
    caption_text = next(t for t in fig.texts if t.get_text() == "A = a; B = b.")
    legend, caption = _boxes(ax1, [fig.legends[0], caption_text])
    lowest_axis = min(b.y0 for b in _boxes(ax1, [ax1, ax2]))
    assert caption.y1 <= legend.y0 + 1 and legend.y1 <= lowest_axis
    assert fig.get_suptitle() == "python -m x --out y"
    assert plt.imread(path).shape[:2] == (4 * plotting.DPI, 6 * plotting.DPI)


def test_a_runs_loss_curve_title_names_its_workdir_and_key_settings(tmp_path):
    from experiments import report

    config: dict[str, dict] = {
        "model": {"d_model": 64, "num_layers": 2, "mlp": "swiglu", "d_ff": 192},
        "moe": {"every": 1, "num_experts": 4, "expert_size": 32, "top_k": 2},
        "mesh": {"site": 2},
        "fomoe": {"overlap": 1, "local_steps": 5, "outer": "diloco"},
        "optim": {"name": "mgup_adamw", "learning_rate": 0.002},
        "precision": {"recipe": "ufp4"},
        "train": {"steps": 40, "seed": 3},
        "data": {"batch_size": 4, "seq_len": 32, "path": "/data/corpus.jsonl"},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    title = report.run_title(str(tmp_path))
    assert title.startswith(f"run {tmp_path}\n")
    for words in (
        "d_model 64 x 2 layers",
        "MoE 4 experts of 32 (top-2)",
        "2 FoMoE sites (O_e 1, K 5, diloco)",
        "mgup_adamw lr 0.002",
        "GEMMs ufp4",
        "40 steps x 4 x 32 tokens, seed 3",
        "corpus.jsonl",
    ):
        assert words in title
    config["moe"]["every"], config["mesh"]["site"] = 0, 1
    dense = report.run_settings(config)
    assert "dense FFN swiglu d_ff 192" in dense and "FoMoE" not in dense


@pytest.mark.parametrize("tokenizer", ["bytes", "tok/tokenizer.json"])
def test_a_runs_loss_curve_has_one_unit_per_axis(tmp_path, monkeypatch, tokenizer):
    """Byte tokens: train loss and held-out bits per byte share one bits-per-byte axis. Another tokenizer: the
    train loss (bits per token) keeps the left axis and the held-out bits per byte get a right axis of their own;
    the legend names both curves either way, and the held-out curve starts at its step-0 point."""
    from experiments import report

    plt = plotting.pyplot()
    figures: list = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    (tmp_path / "config.json").write_text(json.dumps({"data": {"tokenizer": tokenizer}}))
    rows = [
        {"step": 0, "val_bits_per_byte": 2.5},
        {"step": 5, "train_loss": 1.3},
        {"step": 5, "val_bits_per_byte": 2.1},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report.plot_loss_curve(str(tmp_path / "metrics.jsonl"), str(tmp_path / "c.png"), title="t")
    [fig] = figures
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any(label.startswith("train loss") for label in labels) and any("held-out" in x for x in labels)
    held = [line for ax in fig.axes for line in ax.get_lines() if list(line.get_xdata()) == [0, 5]]
    assert [list(line.get_ydata()) for line in held] == [[2.5, 2.1]]
    if tokenizer == "bytes":
        assert len(fig.axes) == 1 and fig.axes[0].get_ylabel() == "bits per byte"
    else:
        assert [ax.get_ylabel() for ax in fig.axes] == ["train loss, bits per token", "held-out bits per byte"]
        assert held[0].axes is fig.axes[1]
    monkeypatch.undo()
    plt.close(fig)
