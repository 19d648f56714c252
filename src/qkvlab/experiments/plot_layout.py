"""How the report's figures are laid out so that each reads at a glance: at most MAX_SERIES
labelled series per panel (more are split over panels, a facet per setting or a chunk of
groups), every legend outside the data, error bars side by side rather than on top of each
other. matplotlib's Agg backend (no display)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

MAX_SERIES = 6  # labelled series a panel may hold: more and no line can be told apart
PANEL = (4.6, 3.2)  # inches per panel, without its legend
LEGEND_WIDTH = 2.6  # inches beside a panel for its legend


def pyplot():
    # matplotlib takes ~0.7 s to import (measured): only a report that plots pays for it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def variant_colors(names: list[str]) -> dict[str, str]:
    """One colour per name, by its place in the full list, so a series keeps its colour in every
    panel and plot (a panel that leaves one out does not shift the others)."""
    palette = [f"C{i}" for i in range(10)]  # matplotlib's default cycle
    return {name: palette[i % len(palette)] for i, name in enumerate(names)}


# one sequential colormap per arm, in the order of matplotlib's default cycle (C0 blue, C1
# orange, ...), so that an arm keeps roughly its usual colour when it has several families
HUES = ("Blues", "Oranges", "Greens", "Reds", "Purples", "YlOrBr", "RdPu", "Greys", "YlGn",
        "GnBu")
SHADES = (0.85, 0.45)  # darkest and lightest level of a hue's colormap an arm's families take


def arm_colors(arm_of: dict[str, str]) -> dict[str, str]:
    """One colour per name (a family) from its arm (`arm_of[name]`): where an arm has several
    names (one arm at several lrs, or its curve at the carried and at the tuned lr), they
    share the arm's hue, dark to light in the order given, so a figure's colours say the arm
    before the legend does; where every arm has one name, the default cycle (variant_colors)."""
    arms = list(dict.fromkeys(arm_of.values()))
    if len(arms) == len(arm_of):
        return variant_colors(list(arm_of))
    from matplotlib import colormaps, colors  # ~0.3 s: only a report that plots pays for it

    out = {}
    for k, arm in enumerate(arms):
        names = [n for n, a in arm_of.items() if a == arm]
        cmap = colormaps[HUES[k % len(HUES)]]
        for i, name in enumerate(names):  # a lone family takes the hue's middle
            level = (SHADES[0] - (SHADES[0] - SHADES[1]) * i / (len(names) - 1)
                     if len(names) > 1 else 0.75)
            out[name] = colors.to_hex(cmap(level))
    return out


STYLES = ["-", "--", ":", "-."]


def variant_looks(names: list[str]) -> dict[str, dict[str, str]]:
    """Colour and line style per name: past ten names the colours repeat, so each round of the
    palette takes the next line style and no two series look alike."""
    colors = variant_colors(names)
    return {name: {"color": colors[name], "ls": STYLES[i // 10 % len(STYLES)]}
            for i, name in enumerate(names)}


def chunks(items: Sequence[T], size: int = MAX_SERIES) -> list[list[T]]:
    """`items` in consecutive runs of at most `size`, as even as that allows (13 in 6s: 5, 4, 4
    rather than 6, 6, 1)."""
    if not items:
        return []
    n = -(-len(items) // size)
    q, extra = divmod(len(items), n)
    bounds = [i * q + min(i, extra) for i in range(n + 1)]  # the first `extra` hold q + 1
    return [list(items[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


def facets(plt, n: int, *, ncols: int = 2, legend: bool = True, sharey: bool = False,
           panel: tuple[float, float] = PANEL):
    """A figure of `n` panels in rows of `ncols`, each with room for a legend at its right
    (`legend`); constrained layout, so titles, labels and outside legends never overlap.
    Returns the figure and the n axes in reading order."""
    ncols = max(1, min(ncols, n))
    nrows = -(-n // ncols)
    width = (panel[0] + (LEGEND_WIDTH if legend else 0)) * ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, panel[1] * nrows + 0.6),
                             squeeze=False, sharey=sharey, layout="constrained")
    flat = list(axes.ravel())
    for ax in flat[n:]:
        fig.delaxes(ax)
    return fig, flat[:n]


def legend_beside(ax, fontsize: float = 7.5) -> None:
    """The panel's legend to the right of its axes, where it hides no data."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                  borderaxespad=0.0, frameon=False)


def nudges(n: int, spread: float = 0.035) -> list[float]:
    """Multiplicative x offsets for n series drawn at the same settings on a log axis, centred
    on 1, so that their error bars stand side by side."""
    return [math.exp(spread * (i - (n - 1) / 2)) for i in range(n)]


def log_xlim(ax, values: list[float], pad: float = 1.3) -> None:
    """x limits a factor `pad` beyond the settings run: with a single setting, autoscaling
    would stretch the small nudge between its points across the whole axis."""
    ax.set_xlim(min(values) / pad, max(values) * pad)


def log2_axis(ax, xs: list[float], label: str, fmt: str = ".3g") -> None:
    """A log2 x axis ticked at the values run, not at powers of two."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [format(x, fmt) for x in xs])
    log_xlim(ax, xs)
    ax.minorticks_off()
    ax.set_xlabel(label)
    ax.grid(alpha=0.3)


def ci_bars(gaps: Sequence[tuple[float, tuple[float | None, float | None]]]
            ) -> list[list[float]]:
    """Error bar lengths below and above each gap (in %) from its 95% interval, as
    `errorbar`'s yerr takes them; 0 where there is no interval (one seed, or the reference)."""
    return [[y - lo if lo is not None else 0.0 for y, (lo, _) in gaps],
            [hi - y if hi is not None else 0.0 for y, (_, hi) in gaps]]


def margin_band(ax, margin_pct: float | None) -> None:
    """The equivalence margin around 0 on a gap axis (in % of the reference), and 0 itself."""
    ax.axhline(0, color="gray", lw=0.8)
    if margin_pct:
        ax.axhspan(-margin_pct, margin_pct, color="gray", alpha=0.15, lw=0,
                   label=f"±{margin_pct:g}% equivalence margin")


def suptitle(fig, text: str, size: float = 11) -> None:
    """The figure's title, each line wrapped to the figure's width so none is cut off."""
    import textwrap

    per_line = max(40, int(fig.get_size_inches()[0] * 72 / (0.55 * size)))
    fig.suptitle("\n".join(textwrap.fill(line, per_line) for line in text.split("\n")),
                 fontsize=size)


def save(plt, fig, path: Path) -> None:
    fig.savefig(path, dpi=110)
    plt.close(fig)
