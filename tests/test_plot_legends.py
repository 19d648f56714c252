"""Plots of sweeps with many groups stay legible: no two variants share a look, and a long
legend sits beside the axes instead of over the lines."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from qkvlab.experiments.plots import _legend, _spaced, variant_looks  # noqa: E402


def test_every_variant_of_a_large_sweep_has_its_own_colour_and_line_style():
    names = [f"group-{i}" for i in range(40)]
    looks = variant_looks(names)
    assert len({(lk["color"], lk["ls"]) for lk in looks.values()}) == 40
    assert looks["group-0"] == {"color": "C0", "ls": "-"}
    assert looks["group-10"] == {"color": "C0", "ls": "--"}  # the palette's second round


def _figure_with_lines(n: int):
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i in range(n):
        ax.plot([0, 1], [i, i + 1], label=f"line {i}")
    return fig, ax


def test_a_short_legend_stays_inside_and_a_long_one_moves_beside_the_axes():
    fig, ax = _figure_with_lines(5)
    _legend(fig, ax)
    assert tuple(fig.get_size_inches()) == (7.5, 4.5)
    inside = ax.get_legend().get_window_extent(fig.canvas.get_renderer())
    assert ax.get_window_extent().contains(inside.x0 + 1, inside.y0 + 1)
    plt.close(fig)

    fig, ax = _figure_with_lines(40)
    _legend(fig, ax)
    assert fig.get_size_inches()[0] > 7.5 + 3.3  # widened for two columns
    legend = ax.get_legend()
    fig.canvas.draw()
    box = legend.get_window_extent(fig.canvas.get_renderer())
    assert box.x0 >= ax.get_window_extent().x1  # right of the axes: it hides no line
    plt.close(fig)


def test_an_axis_labels_the_sqrt2_grid_and_only_the_other_values_that_leave_room():
    # d = 384's rule alphas (1.11, 1.58) sit 0.15 octaves from grid points and would print over
    # their labels; 3.3 is 0.22 from 2.83 (dropped) and 12 half an octave from 8 and 16 (kept)
    values = [0.35, 0.5, 0.71, 1.0, 1.1078, 1.41, 1.58, 2.0, 2.83, 3.3, 4.0, 8.0, 12.0, 16.0]
    assert _spaced(values) == [0.35, 0.5, 0.71, 1.0, 1.41, 2.0, 2.83, 4.0, 8.0, 12.0, 16.0]
    assert _spaced([1.11, 1.58]) == [1.11, 1.58]  # off the grid, 0.51 octaves apart
