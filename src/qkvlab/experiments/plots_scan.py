"""The attention-scale scan's figures (qkvlab.experiments.scale_scan): the loss against alpha,
one panel per width and learning rate, and each family's best alpha against width and against
the learning rate with the power fitted to them."""

from __future__ import annotations

import math
from pathlib import Path

from qkvlab.experiments.plot_layout import (
    MAX_SERIES,
    chunks,
    facets,
    legend_beside,
    log2_axis,
    pyplot,
    save,
    suptitle,
    variant_colors,
)
from qkvlab.experiments.scale_scan import AlphaTrend, ScanCell, alpha_trends

ALPHA = "alpha = scale x sqrt(d_k)"


def _spaced(values: list[float], gap: float = 0.3) -> list[float]:
    """The values to label on a log2 axis: every point of the sqrt(2) grid, and another value
    (a rule's alpha, say 1.11) only where it sits `gap` octaves from each of them, so that
    neighbouring labels never print over each other."""
    def on_grid(v: float) -> bool:
        return abs(2 * math.log2(v) - round(2 * math.log2(v))) < 0.05

    kept = [v for v in values if on_grid(v)]
    for v in values:
        if not on_grid(v) and all(abs(math.log2(v / k)) >= gap for k in kept):
            kept.append(v)
    return sorted(kept)


def _families(cells: list[ScanCell]) -> dict[str, str]:
    return variant_colors(list(dict.fromkeys(c.family for c in cells)))


def plot_scale_scan(cells: list[ScanCell], spec: str, path: Path,
                    colors: dict[str, str] | None = None) -> None:
    """Final validation loss against alpha, one panel per width and lr (by lr, then width),
    one line per family; a star marks each family's best alpha (hollow: at the end of its grid,
    so the optimum may lie beyond), a dotted vertical line its fitted optimum."""
    plt = pyplot()
    colors = colors or _families(cells)
    settings = sorted({(c.lr, c.width) for c in cells})
    panels = [((lr, w), part) for lr, w in settings
              for part in chunks([c for c in cells if (c.lr, c.width) == (lr, w)], MAX_SERIES)]
    fig, axes = facets(plt, len(panels), ncols=4, legend=False,
                       panel=(4.0, 3.1) if len(panels) > 2 else (6.0, 3.6))
    for ax, ((lr, width), mine) in zip(axes, panels, strict=True):
        for c in mine:
            color = colors[c.family]
            ax.plot([p.alpha for p in c.points], [p.final for p in c.points], marker="o",
                    ms=4, color=color, label=c.family)
            ax.plot([c.best.alpha], [c.best.final], marker="*", ms=13, color=color,
                    mfc="none" if c.edge else color)
            if c.fitted is not None:
                ax.axvline(c.fitted, color=color, ls=":", lw=1.2)
        log2_axis(ax, _spaced(sorted({p.alpha for c in mine for p in c.points})), ALPHA)
        ax.tick_params(axis="x", labelsize=7)
        ax.set(ylabel="final val loss (nats/token)", title=f"d = {width}, lr {lr:g}")
        ax.legend(fontsize=7, loc="upper center", frameon=False,
                  bbox_to_anchor=(0.5, -0.25), ncol=min(3, len(mine)))
    suptitle(fig, f"{spec}: final validation loss against the logit scale, one panel per width "
                 "and lr (mean over seeds)\n★ best alpha run (hollow: at the grid's end); "
                 "dotted: the optimum fitted between grid points")
    save(plt, fig, path)


def _trend_panels(cells: list[ScanCell]) -> list[tuple[str, float, list[str]]]:
    """(axis, held value, families) for each width at one lr, or lr at one width, where a
    family's optimum was fitted at two or more values (a power through them); where none was,
    where its best alpha was found at two or more."""
    fitted = {(t.axis, t.held) for t in alpha_trends(cells)}
    out = []
    for axis in ("width", "lr"):
        held = sorted({c.lr if axis == "width" else c.width for c in cells})
        for h in held:
            mine = [c for c in cells if (c.lr if axis == "width" else c.width) == h]
            fams = [f for f in dict.fromkeys(c.family for c in mine)
                    if sum(c.family == f for c in mine) > 1]
            for part in chunks(fams, MAX_SERIES // 2):  # a line and its fit per family
                out.append((axis, h, part))
    return [p for p in out if p[:2] in fitted] or out


def plot_best_alpha(cells: list[ScanCell], spec: str, path: Path,
                    colors: dict[str, str] | None = None) -> bool:
    """Each family's best alpha against width (at one lr) and against the lr (at one width),
    with the power fitted to the optima the grid brackets (`alpha_trends`). False (nothing
    drawn) where no family's best was found at two widths or lrs."""
    panels = _trend_panels(cells)
    if not panels:
        return False
    plt = pyplot()
    colors = colors or _families(cells)
    trends = {(t.family, t.axis, t.held): t for t in alpha_trends(cells)}
    fig, axes = facets(plt, len(panels), ncols=2)
    alphas = _spaced(sorted({p.alpha for c in cells for p in c.points}))
    for ax, (axis, held, fams) in zip(axes, panels, strict=True):
        xs: set[float] = set()
        for fam in fams:
            mine = sorted((c for c in cells if c.family == fam and
                           (c.lr if axis == "width" else c.width) == held),
                          key=lambda c: c.width if axis == "width" else c.lr)
            x = [c.width if axis == "width" else c.lr for c in mine]
            xs |= set(x)
            ax.plot(x, [c.best.alpha for c in mine], color=colors[fam], lw=1, label=fam)
            for xi, c in zip(x, mine, strict=True):
                ax.plot([xi], [c.best.alpha], "o", color=colors[fam],
                        mfc="none" if c.edge else colors[fam])
                if c.fitted is not None:
                    ax.plot([xi], [c.fitted], "x", ms=8, color=colors[fam])
            t = trends.get((fam, axis, held))
            if t is not None:
                _trend_line(ax, t, x, colors[fam])
        what = "width d" if axis == "width" else "learning rate"
        log2_axis(ax, sorted(xs), what, fmt="g")
        ax.set_yscale("log", base=2)
        ax.set_yticks(alphas, [f"{a:.3g}" for a in alphas])
        ax.minorticks_off()
        ax.set(ylabel=f"best {ALPHA}",
               title=f"against {what}, at " + (f"lr {held:g}" if axis == "width"
                                               else f"d = {held:g}"))
        legend_beside(ax)
    suptitle(fig, f"{spec}: each family's best logit scale against width and learning rate\n"
                 "(o: best alpha run, hollow at the grid's end; x: fitted optimum; dotted: "
                 "the power fitted to the x's)")
    save(plt, fig, path)
    return True


def _trend_line(ax, t: AlphaTrend, xs: list[float], color: str) -> None:
    lo, hi = min(xs), max(xs)
    span = [lo * (hi / lo) ** (i / 24) for i in range(25)]
    var = "d" if t.axis == "width" else "lr"
    ax.plot(span, [t.alpha(x) for x in span], ls=":", lw=1.2, color=color,
            label=f"{t.family} fit: ∝ {var}^{t.exponent:+.2f}")
