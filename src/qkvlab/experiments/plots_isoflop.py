"""The IsoFLOP figures (qkvlab.experiments.isoflop): the loss against parameters, one panel per
budget, each family's points, parabola and vertex; and the gap of the minima against compute,
with the fitted line and its extrapolation to the paper's run, labelled as one."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from qkvlab.experiments.isoflop import (
    TREND_BUDGETS,
    VERTEX_DIP,
    BudgetGap,
    GapTrend,
    IsoCurve,
    LrScan,
)
from qkvlab.experiments.plot_layout import (
    ci_bars,
    facets,
    legend_beside,
    log2_axis,
    margin_band,
    pyplot,
    save,
    suptitle,
    variant_colors,
)

PANEL_SPAN = 0.3  # an IsoFLOP panel shows losses up to 30% above its lowest run


def plot_isoflop(curves: list[IsoCurve], title: str, path: Path,
                 colors: dict[str, str] | None = None) -> None:
    """One panel per budget: each family's final loss against non-embedding parameters (log
    axis), the parabola in ln N through the lowest run and its neighbours, its vertex (star;
    hollow when untrusted: outside them, the lowest run at an end, or a dip below it) and, at
    its minimum, the fresh seeds' mean and range. Runs far above the minimum (on the early
    plateau) are triangles at the panel's top edge, so that the minimum keeps the panel."""
    plt = pyplot()
    from matplotlib.ticker import EngFormatter, LogLocator, NullFormatter  # after pyplot's backend

    budgets = sorted({c.budget for c in curves})
    colors = colors or variant_colors(list(dict.fromkeys(c.family for c in curves)))
    fig, axes = facets(plt, len(budgets), ncols=3, sharey=False)
    for ax, budget in zip(axes, budgets, strict=True):
        mine = [c for c in curves if c.budget == budget]
        low = min(min(p.loss for p in c.points) for c in mine)
        top = min(max(p.loss for c in mine for p in c.points), low * (1 + PANEL_SPAN))
        for c in mine:
            _draw_curve(ax, c, colors[c.family], top)
        # the panel's floor: the lowest of the runs, fresh seeds and vertices drawn
        floor = min([low] + [r.final_loss for c in mine for r in c.minimum.runs]
                    + [c.vertex[1] for c in mine if c.vertex and c.vertex[1] <= top])
        pad = 0.06 * (top - floor) or 0.01
        ax.set_ylim(floor - pad, top + pad)
        ax.set_xscale("log")
        # 100k, 200k, 500k, 1M ...: the default labels every minor tick on a short log span
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set(xlabel="non-embedding parameters N", ylabel="final validation loss (nats/token)",
               title=f"{budget:.3g} training FLOPs")
        ax.grid(alpha=0.3)
        legend_beside(ax)
    suptitle(fig, f"{title}\ncircles: the sizes run (triangles: above the panel, on the early "
                  "plateau; hollow diamonds: one size run as a check); line: parabola in ln N "
                  "through the lowest and its neighbours; star: its vertex (hollow: untrusted: "
                  f"outside them, the lowest run at an end, or >{VERTEX_DIP:.0%} below it); "
                  "squares: fresh seeds at the minimum (mean, range)")
    save(plt, fig, path)


def _draw_curve(ax, c: IsoCurve, color: str, top: float) -> None:
    shown = [p for p in c.points if p.loss <= top]
    above = [p for p in c.points if p.loss > top]
    single = len(c.points) == 1  # a check beside the curves: hollow, so a point under it shows
    ax.plot([p.params for p in shown], [p.loss for p in shown], "D" if single else "o",
            color=color, mfc="none" if single else color, ms=9 if single else 6,
            label=f"{c.family} (seed {c.seed})")
    ax.plot([p.params for p in above], [top] * len(above), "^", color=color)
    if c.fit:
        ends = (c.window[0].params, c.window[-1].params)
        grid = np.exp(np.linspace(math.log(ends[0]), math.log(ends[1]), 60))
        ax.plot(grid, np.polyval(c.fit, np.log(grid)), "-", color=color, lw=1)
    if c.vertex and c.vertex[1] <= top:
        ax.plot(*c.vertex, "*", ms=13, color=color, mfc=color if c.inside else "none")
    m = c.minimum
    fresh = [r.final_loss for r in m.runs if r.seed != c.seed]
    if fresh:
        mean = sum(fresh) / len(fresh)
        ax.errorbar([m.params * 1.04], [mean], yerr=[[mean - min(fresh)], [max(fresh) - mean]],
                    fmt="s", ms=4, capsize=3, color=color, alpha=0.8)


def plot_gap_trend(gaps: list[BudgetGap], trends: list[GapTrend], margin_pct: float,
                   title: str, path: Path, extrapolate_to: float | None = None,
                   colors: dict[str, str] | None = None) -> None:
    """Each family's gap of the minima (fresh seeds: mean and 95% interval, % of the reference's
    loss) against training FLOPs, with the fitted line and its 95% band across the budgets run;
    where a line is extrapolated (`extrapolate_to`, the paper's run) a second panel carries it
    there, dashed, so the extrapolation's axis does not squeeze the budgets run into a corner."""
    plt = pyplot()
    families = list(dict.fromkeys(g.family for g in gaps))
    colors = colors or variant_colors(families)
    far = extrapolate_to if trends else None
    fig, axes = facets(plt, 2 if far else 1, ncols=2, panel=(6.4, 3.8))
    drawn = [f for f in families
             if any(g.family == f and g.fresh and g.fresh.rel_pct is not None for g in gaps)]
    nudge = _nudges(drawn, [g.budget for g in gaps])
    lined = {t.family for t in trends}
    for fam in drawn:  # a family without fresh seeds at its minima: nothing to draw, no legend
        mine = [g for g in gaps if g.family == fam and g.fresh and g.fresh.rel_pct is not None]
        # which sizes each gap compares, on the lined families' points only where there are
        # lines: every family's labels at one budget overprint each other
        _gap_points(axes[0], mine, nudge[fam], colors[fam], labels=not lined or fam in lined)
        trend = next((t for t in trends if t.family == fam), None)
        if trend:
            ends = (min(g.budget for g in mine), max(g.budget for g in mine))
            _trend_line(axes[0], trend, ends, "-", colors[fam])
            if far:
                _trend_line(axes[1], trend, ends, "-", colors[fam])
                _trend_line(axes[1], trend, (ends[1], far), "--", colors[fam])
                at = trend.at(far)
                axes[1].errorbar([far], [at[0]], yerr=[[at[0] - at[1]], [at[2] - at[0]]],
                                 fmt="D", mfc="none", capsize=3, color=colors[fam],
                                 label=f"{fam}: its line at the paper's run ({far:.2g} FLOPs)")
    for ax, what in zip(axes, ("the budgets run", "the line carried to the paper's run"),
                        strict=False):
        margin_band(ax, margin_pct)
        ax.set_xscale("log")
        ax.set(xlabel="training FLOPs (qkvlab's count)",
               ylabel="gap to the reference (% of its final val loss)", title=what)
        ax.grid(alpha=0.3)
        ax.margins(x=0.08)  # the points nudged beside the last budget stay inside the axes
        legend_beside(ax)
    how = ("line: least squares in log10 C with its 95% band; dashed: an extrapolation "
           "across orders of magnitude, not a measurement" if trends else
           f"no line: it takes {TREND_BUDGETS} budgets with fresh seeds")
    suptitle(fig, f"{title}\n{how}; labels: the two minima's d x layers")
    save(plt, fig, path)


def _gap_points(ax, mine: list[BudgetGap], nudge: float, color: str, labels: bool) -> None:
    """One family's gaps over fresh seeds: mean and 95% interval, labelled with their shapes."""
    xs = [g.budget * nudge for g in mine]
    gaps = [(g.fresh.rel_pct, g.fresh.rel_ci) for g in mine]
    ys = [y for y, _ in gaps]
    ax.errorbar(xs, ys, yerr=ci_bars(gaps), fmt="o", capsize=3, color=color,
                label=f"{mine[0].family} vs {mine[0].reference_family}: minima's gap "
                      "(fresh seeds)")
    for g, x, y in zip(mine, xs, ys, strict=True) if labels else ():
        left = x == max(xs) and len(xs) > 1  # the rightmost label would leave the axes
        ax.annotate(g.shapes, (x, y), xytext=(-6 if left else 6, 4), fontsize=7,
                    textcoords="offset points", ha="right" if left else "left", color=color)


def _trend_line(ax, trend: GapTrend, span: tuple[float, float], style: str, color: str) -> None:
    """The fitted gap line over `span` (FLOPs) with its 95% band."""
    grid = np.geomspace(span[0], span[1], 40)
    mid = [trend.at(c) for c in grid]
    ax.plot(grid, [m[0] for m in mid], style, color=color, lw=1)
    ax.fill_between(grid, [m[1] for m in mid], [m[2] for m in mid], color=color, alpha=0.12,
                    lw=0)


def _nudges(families: list[str], xs: list[float]) -> dict[str, float]:
    """A factor on each family's budgets that sets their points side by side (a fiftieth of
    the axis's decades apart, at least 0.02 decade), so error bars at one budget do not hide
    each other."""
    if not families:
        return {}
    decades = max(math.log10(max(xs) / min(xs)), 1.0)
    mid = (len(families) - 1) / 2
    return {f: 10 ** (0.02 * decades * (i - mid)) for i, f in enumerate(families)}


def plot_frontier(curves: list[IsoCurve], title: str, path: Path,
                  colors: dict[str, str] | None = None) -> bool:
    """Loss against training FLOPs and against measured training time: every run at the curves'
    seed (faint), each budget's minimum joined per family. False (nothing drawn) when no run
    logged its throughput."""
    timed = [(c, p, p.seconds(c.seed)) for c in curves for p in c.points]
    if not any(t for _, _, t in timed):
        return False
    plt = pyplot()
    colors = colors or variant_colors(list(dict.fromkeys(c.family for c in curves)))
    fig, axes = facets(plt, 2, ncols=2, sharey=True)
    for ax, axis in zip(axes, ("flops", "seconds"), strict=True):
        def x_of(c: IsoCurve, t: float | None, axis: str = axis) -> float | None:
            return c.budget if axis == "flops" else t

        for fam in dict.fromkeys(c.family for c in curves):
            mine = [(c, p, x_of(c, t)) for c, p, t in timed if c.family == fam and x_of(c, t)]
            ax.plot([x for *_, x in mine], [p.loss for _, p, _ in mine], "o",
                    color=colors[fam], alpha=0.25, ms=4)
            line = sorted((x, p.loss) for c, p, x in mine if p is c.minimum)
            ax.plot([v[0] for v in line], [v[1] for v in line], "o-", color=colors[fam],
                    label=f"{fam}: each budget's best size")
        ax.set_xscale("log")
        ax.set(xlabel="training FLOPs (qkvlab's count)" if axis == "flops" else
               "training time, measured (s; tokens / median throughput)",
               ylabel="final validation loss (nats/token)")
        ax.grid(alpha=0.3)
    legend_beside(axes[-1])
    suptitle(fig, f"{title}\nfaint: every size run (the curves' seed); joined: each budget's "
                  "lowest; time on the machine that ran each, runs two at a time")
    save(plt, fig, path)
    return True


def plot_lr_scans(scans: list[LrScan], title: str, path: Path,
                  colors: dict[str, str] | None = None) -> None:
    """One panel per budget: each scanned model's final loss against its peak lr, its best
    marked with a star (hollow: at an end of the lrs run), so each arm's best lr and the arms'
    losses there read at a glance."""
    plt = pyplot()
    budgets = sorted({s.budget for s in scans})
    arms = list(dict.fromkeys(s.arm for s in scans))
    palette = variant_colors(arms)
    fig, axes = facets(plt, len(budgets), ncols=3, sharey=False)
    for ax, budget in zip(axes, budgets, strict=True):
        mine = [s for s in scans if s.budget == budget]
        for sc in mine:
            color = (colors or {}).get(sc.arm, palette[sc.arm])
            xs, ys = [p.lr for p in sc.points], [p.loss for p in sc.points]
            ax.plot(xs, ys, "o-", color=color, label=f"{sc.arm}, d {sc.width} x {sc.depth}")
            ax.plot([sc.best.lr], [sc.best.loss], "*", ms=14, color=color,
                    mfc=color if sc.bracketed else "none")
        log2_axis(ax, sorted({p.lr for s in mine for p in s.points}), "peak lr", fmt="g")
        ax.set(ylabel="final validation loss (nats/token)",
               title=f"{budget:.3g} training FLOPs")
        legend_beside(ax)
    suptitle(fig, f"{title}\nstar: each model's best lr (hollow: at an end of the lrs run, a "
                  f"bound); seed {scans[0].seed}")
    save(plt, fig, path)
