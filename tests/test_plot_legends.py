"""The report's figures read at a glance: at most six labelled series per panel, every legend
outside the data, each panel with labelled axes and each figure with a title; many groups are
split over panels (a facet per width and lr, or chunks), and error bars at one setting stand
side by side."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from qkvlab.experiments.plot_layout import (  # noqa: E402
    MAX_SERIES,
    arm_colors,
    chunks,
    ci_bars,
    legend_beside,
    nudges,
    variant_looks,
)
from qkvlab.experiments.plots_scan import _spaced  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_every_variant_of_a_large_sweep_has_its_own_colour_and_line_style():
    names = [f"group-{i}" for i in range(40)]
    looks = variant_looks(names)
    assert len({(lk["color"], lk["ls"]) for lk in looks.values()}) == 40
    assert looks["group-0"] == {"color": "C0", "ls": "-"}
    assert looks["group-10"] == {"color": "C0", "ls": "--"}  # the palette's second round


def test_families_of_one_arm_share_its_hue_and_still_differ():
    # mup-isoflop's case: each arm at the carried lr, at its tuned lr and in an lr scan
    arm_of = {"baseline": "baseline", "q-identity": "q-identity", "baseline-tuned": "baseline",
              "q-identity-tuned": "q-identity", "baseline-lr2e-3": "baseline", "wide": "wide"}
    colors = arm_colors(arm_of)
    assert len(set(colors.values())) == len(arm_of)

    def hue(name: str) -> float:
        return float(matplotlib.colors.rgb_to_hsv(matplotlib.colors.to_rgb(colors[name]))[0])

    blue, orange = hue("baseline"), hue("q-identity")
    assert abs(blue - orange) > 0.3
    assert abs(hue("baseline-tuned") - blue) < 0.05 and abs(hue("baseline-lr2e-3") - blue) < 0.05
    assert abs(hue("q-identity-tuned") - orange) < 0.05
    # with one family per arm, the default cycle, as every other report draws them
    assert arm_colors({"baseline": "baseline", "q-identity": "q-identity"}) == \
        {"baseline": "C0", "q-identity": "C1"}


def test_chunks_are_even_and_never_over_the_limit():
    assert chunks(list(range(13)), 6) == [list(range(5)), list(range(5, 9)), list(range(9, 13))]
    assert chunks(list(range(6)), 6) == [list(range(6))]
    assert chunks([], 6) == []
    for n in range(1, 40):
        parts = chunks(list(range(n)), 5)
        assert sum(parts, []) == list(range(n)) and max(map(len, parts)) <= 5
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_nudges_put_series_at_one_setting_side_by_side_around_it():
    for n in range(1, 8):
        xs = nudges(n)
        assert len(set(xs)) == n and xs == sorted(xs)
        assert xs[0] * xs[-1] == pytest.approx(1.0)  # centred on the setting, on a log axis


def test_error_bars_reach_each_gaps_interval_and_none_without_one():
    # a gap of +1% with interval [0.5%, 2%]; a reference or single seed with none
    assert ci_bars([(1.0, (0.5, 2.0)), (0.0, (None, None))]) == [[0.5, 0.0], [1.0, 0.0]]


def test_a_legend_beside_the_axes_hides_no_data():
    fig, ax = plt.subplots(figsize=(7.5, 4.5), layout="constrained")
    for i in range(5):
        ax.plot([0, 1], [i, i + 1], label=f"line {i}")
    legend_beside(ax)
    fig.canvas.draw()
    box = ax.get_legend().get_window_extent(fig.canvas.get_renderer())
    assert box.x0 >= ax.get_window_extent().x1  # right of the axes
    plt.close(fig)


def test_an_axis_labels_the_sqrt2_grid_and_only_the_other_values_that_leave_room():
    # d = 384's rule alphas (1.11, 1.58) sit 0.15 octaves from grid points and would print over
    # their labels; 3.3 is 0.22 from 2.83 (dropped) and 12 half an octave from 8 and 16 (kept)
    values = [0.35, 0.5, 0.71, 1.0, 1.1078, 1.41, 1.58, 2.0, 2.83, 3.3, 4.0, 8.0, 12.0, 16.0]
    assert _spaced(values) == [0.35, 0.5, 0.71, 1.0, 1.41, 2.0, 2.83, 4.0, 8.0, 12.0, 16.0]
    assert _spaced([1.11, 1.58]) == [1.11, 1.58]  # off the grid, 0.51 octaves apart


def _group(name: str, family: str, width: int, lr: float, loss: float):
    """A finished group as group_panels reads it: its family, width, lr and one seed's loss."""
    run = SimpleNamespace(status="done", seed=1, final_loss=loss)
    config = SimpleNamespace(model=SimpleNamespace(n_embd=width, n_layer=4),
                             optim=SimpleNamespace(lr=lr))
    return SimpleNamespace(group=SimpleNamespace(name=name, family=family, config=config),
                           runs=[run], loss=SimpleNamespace(mean=loss, n=1))


def test_a_scan_of_dozens_of_groups_shows_each_familys_best_per_width_and_lr():
    from qkvlab.experiments.plots import group_panels

    groups = [_group(f"{fam}-d{w}-{i}", fam, w, 1e-3, 1.5 + (i - 3) ** 2 / 100 + (fam == "q"))
              for w in (128, 256) for fam in ("b", "q") for i in range(6)]
    panels, reduced = group_panels(groups)
    assert reduced
    assert [t for t, _ in panels] == ["d = 128, lr 0.001", "d = 256, lr 0.001"]
    assert [[g.group.name for g in gs] for _, gs in panels] == [
        ["b-d128-3", "q-d128-3"], ["b-d256-3", "q-d256-3"]]  # each family's lowest loss
    few, reduced = group_panels(groups[:8], first=groups[0])
    assert not reduced and [len(gs) for _, gs in few] == [5, 4]  # chunks, the first in each
    assert all(gs[0] is groups[0] for _, gs in few)


def check_figures(figures) -> int:
    """Every axes of every figure: at most MAX_SERIES legend entries, a legend (if any) outside
    the axes, an x label and a y label (or text y ticks), and a title over the figure or the
    panel. Returns how many axes were checked."""
    checked = 0
    for fig in figures:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        titled = fig._suptitle is not None and fig._suptitle.get_text()
        for ax in fig.axes:
            labels = ax.get_legend_handles_labels()[1]
            assert len(labels) <= MAX_SERIES, (fig._suptitle.get_text(), labels)
            legend = ax.get_legend()
            if legend is not None:
                box, inner = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
                overlap = (min(box.x1, inner.x1) - max(box.x0, inner.x0) > 1
                           and min(box.y1, inner.y1) - max(box.y0, inner.y0) > 1)
                assert not overlap, labels
            assert ax.get_xlabel()
            assert ax.get_ylabel() or any(t.get_text() for t in ax.get_yticklabels())
            assert titled or ax.get_title()
            checked += 1
    return checked


@pytest.fixture
def kept_figures(monkeypatch):
    """Figures the report draws stay open (pyplot.close does nothing) for the checks."""
    plt.close("all")
    monkeypatch.setattr(plt, "close", lambda *a, **k: None)
    yield lambda: [plt.figure(n) for n in plt.get_fignums()]
    monkeypatch.undo()
    plt.close("all")


def test_every_figure_of_a_scan_report_has_at_most_six_legend_entries_per_panel(
        tmp_path, data_dir, kept_figures):
    from test_stats_report import sweep_report

    data, text, rep = sweep_report(tmp_path, data_dir, """
[[variant]]
name = "baseline-a"
family = "baseline"
rule = "baseline"
grid = { attn_scale = [0.7, 2.0] }

[[variant]]
name = "qid-a"
family = "qid"
rule = "q-identity"
grid = { attn_scale = [0.1, 0.7, 2.0] }

[[variant]]
name = "baseline-wide"
family = "baseline"
rule = "baseline"
n_embd = 32
grid = { attn_scale = [0.1, 0.7] }

[[variant]]
name = "qid-wide"
family = "qid"
rule = "q-identity"
n_embd = 32
grid = { attn_scale = [0.1, 0.7, 2.0] }

[[variant]]
name = "vid-wide"
family = "vid"
rule = "v-identity"
n_embd = 32
attn_scale = 0.7
""")
    figures = kept_figures()
    names = {Path(p).name for p in data["figures"].values()}
    assert {"val_curves.png", "rel_diff.png", "scale_scan.png", "tuned_gap_vs_width.png"} <= names
    assert len(figures) == len(names)
    assert check_figures(figures) >= len(figures)
    assert data["headline"]["figure"] == "tuned_gap_vs_width.png"
    assert "![headline](tuned_gap_vs_width.png)" in text


@pytest.mark.slow
def test_the_archived_english_scale_study_draws_legible_figures(tmp_path, kept_figures):
    """The largest committed study (over a hundred groups) from its archived records."""
    from qkvlab.experiments.report import build_report, write_report
    from qkvlab.experiments.spec import load_spec

    sweep = REPO / "docs" / "results" / "sweeps" / "english-scale"
    rep = build_report(load_spec(str(sweep)), sweep)
    write_report(rep, tmp_path / "rep", "qkvlab report (test)")
    figures = kept_figures()
    assert len(figures) >= 6
    check_figures(figures)
