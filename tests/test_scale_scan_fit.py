"""The scan's optimum between grid points and its power-of-width and power-of-lr trends, on
made-up losses."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qkvlab.experiments.render_scan import scan_section
from qkvlab.experiments.scale_scan import ScanCell, ScanPoint, alpha_trends


def cell(width: int, losses: dict[float, float], family: str = "qid", lr: float = 1e-3
         ) -> ScanCell:
    points = tuple(ScanPoint(a, f"{family}-{a}", 1, y, y, y) for a, y in sorted(losses.items()))
    return ScanCell(family, width, lr, points)


def bowl(center: float, grid: list[float], depth: float = 1.5) -> dict[float, float]:
    """Losses on a parabola in log2(alpha) with its minimum at `center`."""
    return {a: depth + (math.log2(a) - math.log2(center)) ** 2 for a in grid}


def test_the_fitted_optimum_is_the_vertex_of_an_exact_parabola():
    c = cell(128, bowl(3.0, [1, 2, 4, 8]))
    assert c.best.alpha == 4 and not c.edge
    assert c.fitted == pytest.approx(3.0)
    assert c.as_dict()["fitted_alpha"] == pytest.approx(3.0)


def test_an_optimum_at_a_grid_end_is_not_fitted():
    c = cell(128, bowl(20.0, [1, 2, 4, 8]))
    assert c.edge and c.fitted is None


def test_a_tie_with_a_neighbour_puts_the_optimum_between_the_two():
    c = cell(128, {1: 1.7, 2: 1.5, 4: 1.5, 8: 1.6})
    assert c.best.alpha == 2 and c.fitted == pytest.approx(math.sqrt(2 * 4))


@given(st.floats(-3, 3), st.lists(st.floats(0.3, 1.5), min_size=3, max_size=6),
       st.floats(0.1, 5))
def test_the_fitted_optimum_lies_between_the_best_points_neighbours(start, steps, width):
    grid = [2 ** start]
    for step in steps:
        grid.append(grid[-1] * 2 ** step)
    losses = {a: 1 + width * (math.log2(a) - math.log2(grid[len(grid) // 2])) ** 2 + 0.01 * i
              for i, a in enumerate(grid)}  # a tilted bowl, not an exact one
    c = cell(128, losses)
    if c.fitted is None:
        assert c.edge
        return
    i = [p.alpha for p in c.points].index(c.best.alpha)
    assert grid[i - 1] <= c.fitted <= grid[i + 1]


def test_the_width_trend_is_the_power_through_the_fitted_optima():
    grid = [0.5, 1, 2, 4, 8, 16]
    cells = [cell(128, bowl(3.0, grid)), cell(512, bowl(6.0, grid)),
             cell(256, bowl(40.0, grid)),  # at the grid's end: left out of the fit
             cell(128, bowl(5.0, grid), family="baseline")]  # one width: no trend
    (t,) = alpha_trends(cells)
    assert (t.family, t.axis, t.held, t.xs) == ("qid", "width", 1e-3, (128, 512))
    assert t.exponent == pytest.approx(0.5) and t.at_ref == pytest.approx(3.0)
    assert t.alpha(256) == pytest.approx(3.0 * math.sqrt(2))


def test_three_widths_are_fitted_by_least_squares():
    grid = [0.5, 1, 2, 4, 8, 16]
    optima = {128: 2.0, 256: 3.0, 512: 4.0}
    (t,) = alpha_trends([cell(w, bowl(a, grid)) for w, a in optima.items()])
    import numpy as np

    slope, intercept = np.polyfit([math.log2(w / 128) for w in optima],
                                  [math.log2(a) for a in optima.values()], 1)
    assert t.exponent == pytest.approx(slope)
    assert math.log2(t.at_ref) == pytest.approx(intercept)
    assert t.alphas == pytest.approx(tuple(optima.values()))


def test_the_lr_trend_is_the_power_of_the_lr_at_one_width():
    grid = [0.5, 1, 2, 4, 8, 16, 32]
    # the optimum halves as the lr doubles: alpha x lr constant, exponent -1
    cells = [cell(128, bowl(8.0, grid), lr=1e-3), cell(128, bowl(4.0, grid), lr=2e-3),
             cell(128, bowl(2.0, grid), lr=4e-3), cell(128, bowl(0.1, grid), lr=8e-3),
             cell(256, bowl(6.0, grid), lr=1e-3)]  # another width, one lr: no lr trend there
    trends = alpha_trends(cells)
    assert [(t.axis, t.held) for t in trends] == [("width", 1e-3), ("lr", 128)]
    t = trends[1]
    assert t.xs == (1e-3, 2e-3, 4e-3)  # 8e-3's optimum lies beyond the grid: left out
    assert t.exponent == pytest.approx(-1) and t.at_ref == pytest.approx(8.0)
    assert t.alpha(8e-3) == pytest.approx(1.0)
    text = "\n".join(scan_section(cells, [], "baseline", {}))
    assert "- qid (d = 128): fitted optimum 8 at lr 0.001, 4 at lr 0.002, 2 at lr 0.004; " \
           "alpha* = 8 x (lr / 1e-3)^-1.00 (least squares over 3 learning rates); " \
           "alpha* x lr 0.008, 0.008, 0.008" in text
    assert "- qid (lr 0.001): fitted optimum 8 at d = 128, 6 at d = 256; alpha* = 8 x " \
           "(d / 128)^-0.42 (the line through two widths)" in text


@pytest.mark.parametrize("lrs, axes", [((1e-3,), ["width"]), ((1e-3, 2e-3), ["width", "lr"])])
def test_the_best_alpha_figure_adds_lr_panels_when_the_lr_was_scanned(tmp_path, lrs, axes):
    from qkvlab.experiments.plots_scan import _trend_panels, plot_best_alpha, plot_scale_scan

    grid = [1, 2, 4, 8, 16]
    cells = [cell(w, bowl(4.0 / (lr / 1e-3), grid), family=f, lr=lr)
             for f in ("baseline", "qid") for w in (128, 256) for lr in lrs]
    panels = _trend_panels(cells)
    assert sorted({axis for axis, _, _ in panels}) == sorted(axes)
    assert all(fams == ["baseline", "qid"] for _, _, fams in panels)
    assert plot_best_alpha(cells, "scan", tmp_path / "best.png")
    plot_scale_scan(cells, "scan", tmp_path / "scan.png")
    assert (tmp_path / "scan.png").stat().st_size > 5_000
    assert (tmp_path / "best.png").stat().st_size > 5_000


def test_no_best_alpha_figure_without_two_widths_or_lrs(tmp_path):
    from qkvlab.experiments.plots_scan import plot_best_alpha

    assert not plot_best_alpha([cell(128, bowl(4.0, [1, 2, 4, 8]))], "scan", tmp_path / "b.png")
    assert not (tmp_path / "b.png").exists()
