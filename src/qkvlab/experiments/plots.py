"""The report's figures: validation curves, the paired relative difference, and final loss
against a weight-decay or learning-rate grid. Written with matplotlib's Agg backend (no display)."""

from __future__ import annotations

import math
from pathlib import Path

from qkvlab.experiments.results import (
    GroupResult,
    Report,
    SettingGap,
    TrendAxis,
    grid_gaps,
    mean_band,
    rel_curves,
)
from qkvlab.experiments.scale_scan import ScanCell, alpha_trends


def _pyplot():
    # matplotlib takes ~0.7 s to import (measured): only a report that plots pays for it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def variant_colors(names: list[str]) -> dict[str, str]:
    """One colour per variant, by its place in the full list, so a variant keeps its colour in
    every panel and plot (a panel that leaves the baseline out does not shift the others)."""
    palette = [f"C{i}" for i in range(10)]  # matplotlib's default cycle
    return {name: palette[i % len(palette)] for i, name in enumerate(names)}


_STYLES = ["-", "--", ":", "-."]
_LEGEND_INSIDE = 8  # entries a legend may hold inside the axes before it hides the lines
_LEGEND_ROWS = 24  # entries per column of a legend beside the axes


def variant_looks(names: list[str]) -> dict[str, dict[str, str]]:
    """Colour and line style per variant: past ten variants the colours repeat, so each round
    of the palette takes the next line style and no two variants look alike."""
    colors = variant_colors(names)
    return {name: {"color": colors[name], "ls": _STYLES[i // 10 % len(_STYLES)]}
            for i, name in enumerate(names)}


def _legend(fig, ax, inside: int = _LEGEND_INSIDE) -> None:
    """Inside the axes when it has at most `inside` entries; beside them otherwise, in columns,
    with the figure widened to hold them, where it cannot cover the lines."""
    entries = len(ax.get_legend_handles_labels()[1])
    if entries <= inside:
        ax.legend(fontsize=8)
        return
    cols = -(-entries // _LEGEND_ROWS)
    width, height = fig.get_size_inches()
    fig.set_size_inches(width + 3.3 * cols, max(height, 0.16 * min(entries, _LEGEND_ROWS) + 1))
    ax.legend(fontsize=7, ncol=cols, loc="upper left", bbox_to_anchor=(1.01, 1))


def _band(ax, steps: list[int], mean: list[float], std: list[float], color) -> None:
    """Shade mean +- std around a curve, in the curve's colour."""
    ax.fill_between(steps, [m - s for m, s in zip(mean, std, strict=True)],
                    [m + s for m, s in zip(mean, std, strict=True)], color=color, alpha=0.2, lw=0)


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curves(rep: Report, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    looks = variant_looks([g.group.name for g in rep.groups])
    top = None
    for g in rep.groups:
        curves = [r.curve for r in g.runs if r.status == "done"]
        steps, mean, std = mean_band(curves)
        if not steps:
            continue
        look = looks[g.group.name]
        ax.plot(steps, mean, label=f"{g.group.name} (n={len(curves)})",
                lw=2.0 if g.group.baseline else 1.3, **look)
        if len(curves) > 1:
            _band(ax, steps, mean, std, look["color"])
        # zoom past the first evals: the interesting part is where curves are close
        later = mean[len(mean) // 5:] or mean
        top = max(top or -math.inf, max(later))
    ax.set(xlabel="step", ylabel="validation loss",
           title=f"{rep.spec.name}: validation loss (mean, band = +-1 std over seeds)")
    if top is not None and math.isfinite(top):
        ax.set_ylim(top=top)
    ax.grid(alpha=0.3)
    _legend(fig, ax)
    _save(plt, fig, path)


def plot_rel(rep: Report, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    looks = variant_looks([g.group.name for g in rep.groups])
    for g in rep.groups:
        if g is rep.baseline:
            continue
        steps, mean, std, n = rel_curves(rep, g)
        if not steps:
            continue
        look = looks[g.group.name]
        ax.plot(steps, mean, label=f"{g.group.name} (n={n})", **look)
        if n > 1:
            _band(ax, steps, mean, std, look["color"])
    ax.axhline(0, color="gray", lw=0.8)
    ref = rep.baseline.group.name
    ax.set(xlabel="step", ylabel=f"% vs {ref} (same seed)",
           title=f"relative validation-loss difference vs {ref} (below 0: better)")
    ax.grid(alpha=0.3)
    _legend(fig, ax)
    _save(plt, fig, path)


def plot_grid(rep: Report, key: str, fams: dict[str, list[GroupResult]], path: Path) -> None:
    """Left: final loss (mean +- std over seeds) vs optim.<key> per row (family and width).
    Right, on a tuned axis (the lr): each row's gap to the reference family's row at the same
    value (%, paired by seed, 95% interval), i.e. the gap with both arms at that lr; on another
    axis (the weight decay): the paired difference to the one reference, which removes the seed
    spread that all groups share."""
    plt = _pyplot()
    fig, (ax, ax_d) = plt.subplots(1, 2, figsize=(11.5, 4.5))
    colors = variant_colors(list(fams))
    gaps = grid_gaps(rep, key, fams)
    for i, (fam, gs) in enumerate(fams.items()):
        pts = sorted(gs, key=lambda g: getattr(g.group.config.optim, key))
        ok = [g for g in pts if g.loss.mean is not None]
        xs = [getattr(g.group.config.optim, key) for g in ok]
        color = colors[fam]
        ax.errorbar(xs, [g.loss.mean for g in ok], yerr=[g.loss.std or 0.0 for g in ok],
                    marker="o", capsize=3, label=fam, color=color)
        if gaps is None:
            _errorbars(ax_d, *_paired_points(rep, ok, key), color=color, label=fam)
        elif gaps.get(fam):
            _errorbars(ax_d, *_gap_points(gaps[fam], 1.015 ** i), color=color, label=fam)
        bad = [getattr(g.group.config.optim, key) for g in pts
               if any(r.status == "failed" for r in g.runs)]
        if bad and ok:
            ax.plot(bad, [max(g.loss.mean for g in ok)] * len(bad), "x", color="red", ms=9,
                    label=f"{fam}: failed/diverged run(s)")
    values = sorted({getattr(g.group.config.optim, key) for gs in fams.values() for g in gs})
    for a in (ax, ax_d):
        if key == "weight_decay":
            a.set_xscale("symlog", linthresh=1e-3)
        else:
            a.set_xscale("log")
            a.set_xticks(values, [f"{v:g}" for v in values])  # the values run, not decades
            a.minorticks_off()
        a.grid(alpha=0.3, which="both")
        if a.get_legend_handles_labels()[0]:  # the paired panel is empty without the baseline
            a.legend(fontsize=8)
    ax.set(xlabel=key, ylabel="final validation loss", title=f"final loss vs {key} "
           "(mean +- std over seeds)")
    ax_d.axhline(0, color="gray", lw=0.8)
    ref = rep.baseline.group
    if gaps is None:
        ax_d.set(xlabel=key, ylabel=f"loss - {ref.name} (same seed)",
                 title=f"paired difference vs {ref.name} (95% CI)")
    else:
        ax_d.set(xlabel=key, ylabel=f"% vs {ref.family} at the same {key} (same seed)",
                 title=f"gap to {ref.family} at the same {key}, each its best (95% CI)")
    _save(plt, fig, path)


def _errorbars(ax, xs: list[float], ys: list[float], lo: list[float], hi: list[float], *,
               color: str, label: str) -> None:
    if xs:
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, color=color, label=label)


def _gap_points(gaps: list[SettingGap], nudge: float, best: bool = False
                ) -> tuple[list[float], list[float], list[float], list[float]]:
    """x (times `nudge`, so that lines at one value do not hide each other), the gap in % at
    the end (or at each run's best validation loss) and its interval's lower/upper error bar
    (0 for one seed)."""
    rs = [(w.value * nudge, w.best if best else w.result) for w in gaps]
    rs = [(x, r) for x, r in rs if r.rel_pct is not None]
    lo = [r.rel_pct - r.rel_ci[0] if r.rel_ci[0] is not None else 0.0 for _, r in rs]
    hi = [r.rel_ci[1] - r.rel_pct if r.rel_ci[1] is not None else 0.0 for _, r in rs]
    return [x for x, _ in rs], [r.rel_pct for _, r in rs], lo, hi


def _paired_points(rep: Report, groups: list[GroupResult], key: str
                   ) -> tuple[list[float], list[float], list[float], list[float]]:
    """x, the paired mean difference and its interval's lower/upper error bar, for the groups
    with a paired test (the reference itself sits at 0)."""
    dx, dy, lo, hi = [], [], [], []
    for g in groups:
        x = getattr(g.group.config.optim, key)
        if g is rep.baseline:
            dx.append(x)
            dy.append(0.0)
            lo.append(0.0)
            hi.append(0.0)
        elif g.paired is not None and g.paired.mean is not None:
            t = g.paired
            dx.append(x)
            dy.append(t.mean)
            lo.append(t.mean - t.ci_low if t.ci_low is not None else 0.0)
            hi.append(t.ci_high - t.mean if t.ci_high is not None else 0.0)
    return dx, dy, lo, hi


def _log_xlim(ax, values: list[float], pad: float = 1.3) -> None:
    """x limits a factor `pad` beyond the settings run: with a single setting, autoscaling would
    stretch the small nudge between its points across the whole axis."""
    ax.set_xlim(min(values) / pad, max(values) * pad)


def plot_gaps(gaps: list[SettingGap], axis: TrendAxis, ref: str, path: Path) -> None:
    """The paired gap to the reference at the same setting (%, 95% interval) against the
    setting (width or learning rate), one line per family: at the end (solid) and at each
    run's best validation loss (dashed, nudged right so the bars do not overlap)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    fams = list(dict.fromkeys(w.family for w in gaps))
    colors = variant_colors(fams)
    for fam in fams:
        for which, nudge, style, fill in (("final", 1.0, "-", None), ("best", 1.04, "--", "none")):
            xs, ys, lo, hi = _gap_points([w for w in gaps if w.family == fam], nudge,
                                         best=which == "best")
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3,
                        ls=style, mfc=fill, label=f"{fam} ({which} val)", color=colors[fam])
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    values = sorted({w.value for w in gaps})
    ax.set_xticks(values, [f"{v:g}" for v in values])  # the settings run, not powers of 2
    _log_xlim(ax, values)
    ax.minorticks_off()
    ax.set(xlabel=axis.label, ylabel=f"% vs {ref} at the same {axis.name} (same seed)",
           title=f"gap to the baseline against {axis.name} (mean, 95% interval over seeds)")
    ax.grid(alpha=0.3, which="both")
    _legend(fig, ax, inside=6)  # a final and a best line per family: three families
    _save(plt, fig, path)


def plot_scale_scan(cells: list[ScanCell], path: Path) -> None:
    """Left: final validation loss against alpha, one line per family, width and lr (the curves
    the best alphas come from). Then each family's best alpha against width, and where more
    than one lr was scanned, against the lr (hollow: at the end of its grid, so the optimum may
    lie beyond; x: the fitted optimum between grid points; dotted: the power of the width or lr
    fitted to those optima, `alpha_trends`)."""
    plt = _pyplot()
    lrs = sorted({c.lr for c in cells})
    fig, axes = plt.subplots(1, 3 if len(lrs) > 1 else 2, figsize=(16 if len(lrs) > 1 else 11, 4.5))
    left = axes[0]
    fams = list(dict.fromkeys(c.family for c in cells))
    colors = variant_colors(fams)
    widths = sorted({c.width for c in cells})
    styles = dict(zip(widths, _STYLES * 4, strict=False))
    markers = dict(zip(lrs, "osD^v" * 4, strict=False))
    for c in cells:
        left.plot([p.alpha for p in c.points], [p.final for p in c.points],
                  marker=markers[c.lr], ls=styles[c.width], color=colors[c.family],
                  label=c.family + (f", lr {c.lr:g}" if len(lrs) > 1 else "") + f" d {c.width}")
        left.plot([c.best.alpha], [c.best.final], marker="*", ms=12, color=colors[c.family])
    alphas = _spaced(sorted({p.alpha for c in cells for p in c.points}))
    _log2_axis(left, alphas, "alpha = scale x sqrt(d_k)")
    left.set(ylabel="final val loss (mean over seeds)", title="loss against the logit scale")
    if len(cells) > _LEGEND_INSIDE:  # a long legend below the curves, where it hides none
        rows = -(-len(cells) // 2)
        fig.set_size_inches(fig.get_size_inches()[0], 4.5 + 0.17 * rows)
        left.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    else:
        left.legend(fontsize=8)
    _best_alpha_panel(axes[1], cells, "width", colors, markers, alphas)
    if len(lrs) > 1:
        _best_alpha_panel(axes[2], cells, "lr", colors, styles, alphas)
    _save(plt, fig, path)


def _best_alpha_panel(ax, cells: list[ScanCell], axis: str, colors: dict[str, str],
                      looks: dict, alphas: list[float]) -> None:
    """Each family's best alpha against `axis` ("width" or "lr"), one line per value of the
    other (its marker for the lr, its line style for the width)."""
    def x_of(c: ScanCell) -> float:
        return c.width if axis == "width" else c.lr

    def held(c: ScanCell) -> float:
        return c.lr if axis == "width" else c.width

    lines = list(dict.fromkeys((c.family, held(c)) for c in cells))
    for i, (fam, other) in enumerate(lines):
        nudge = 1 + 0.012 * i  # lines at the same best alpha stay visible side by side
        mine = sorted((c for c in cells if (c.family, held(c)) == (fam, other)), key=x_of)
        look = {"marker": looks[other]} if axis == "width" else {"ls": looks[other], "marker": "o"}
        label = f"{fam}, lr {other:g}" if axis == "width" else f"{fam}, d {other:g}"
        ax.plot([x_of(c) * nudge for c in mine], [c.best.alpha for c in mine], color=colors[fam],
                mfc="none", label=label, **look)
        for c in mine:
            ax.plot([x_of(c) * nudge], [c.best.alpha], marker=look["marker"], color=colors[fam],
                    mfc="none" if c.edge else colors[fam])
            if c.fitted is not None:
                ax.plot([x_of(c) * nudge], [c.fitted], marker="x", ms=9, color=colors[fam])
    xs = sorted({x_of(c) for c in cells})
    span = [xs[0] * (xs[-1] / xs[0]) ** (i / 24) for i in range(25)]
    for t in alpha_trends(cells):  # the fitted power, dotted, across the whole axis
        if t.axis == axis:
            ax.plot(span, [t.alpha(x) for x in span], ls=":", lw=1, color=colors[t.family])
    _log2_axis(ax, xs, "width d" if axis == "width" else "learning rate")
    ax.legend(fontsize=8)
    ax.set_yscale("log", base=2)
    ax.set_yticks(alphas, [f"{a:.3g}" for a in alphas])
    ax.minorticks_off()
    ax.set(ylabel="best alpha",
           title=f"best alpha against {'width' if axis == 'width' else 'lr'}\n"
                 "(hollow: grid end; x: fitted; dotted: their power)")


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


def _log2_axis(ax, xs: list[float], label: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:.3g}" for x in xs])
    _log_xlim(ax, xs)
    ax.minorticks_off()
    ax.set_xlabel(label)
    ax.grid(alpha=0.3)
