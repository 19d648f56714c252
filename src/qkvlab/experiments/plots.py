"""The report's figures of groups and gaps: validation curves, the paired gap over training,
final loss against a weight-decay or lr grid, the gap against width or lr, and the headline's
comparisons with their intervals. Each panel holds at most MAX_SERIES labelled series, with its
legend beside it (qkvlab.experiments.plot_layout); the scale scan's figures are in
qkvlab.experiments.plots_scan."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from qkvlab.experiments.headline import Comparison, Headline
from qkvlab.experiments.plot_layout import (
    MAX_SERIES,
    arm_colors,
    chunks,
    ci_bars,
    facets,
    legend_beside,
    log2_axis,
    margin_band,
    nudges,
    pyplot,
    save,
    suptitle,
    variant_colors,
    variant_looks,
)
from qkvlab.experiments.results import (
    DEPTH,
    TREND_AXES,
    GroupResult,
    Report,
    SettingGap,
    TrendAxis,
    best_group,
    grid_gaps,
    mean_band,
    rel_curves,
    trend_settings,
)

__all__ = ["variant_colors", "plot_curves", "plot_rel", "plot_grid", "plot_gaps",
           "plot_headline"]

LOSS = "validation loss (nats/token)"


def _finished(g: GroupResult) -> bool:
    return any(r.status == "done" for r in g.runs)


def _setting(s: tuple[float, ...], depth: bool = False) -> str:
    """A panel's trend settings (d = 128, lr 0.001), the depth only where the sweep varies it."""
    short = {"width": "d =", "depth": "L ="}
    return ", ".join(f"{short.get(a.name, a.name)} {v:g}"
                     for a, v in zip(TREND_AXES, s, strict=True) if depth or a.name != "depth")


def group_panels(groups: list[GroupResult], first: GroupResult | None = None,
                 room: int = MAX_SERIES) -> tuple[list[tuple[str, list[GroupResult]]], bool]:
    """The groups in panels of at most `room` series, `first` (the reference) leading each. Up to
    three panels' worth: every group, in order. More (a scan of dozens of groups): one panel per
    width and lr, with each family's best group there (lowest mean final loss); the report's
    tables hold every group. Returns the (title, groups) panels and whether they were reduced
    to each family's best."""
    rest = [g for g in groups if g is not first]
    per = room - (first is not None)
    lead = [first] if first is not None else []
    if len(rest) <= 3 * per:
        parts = chunks(rest, per) or [[]]
        return [(f"{i + 1} of {len(parts)}" if len(parts) > 1 else "", lead + p)
                for i, p in enumerate(parts)], False
    by: dict[tuple[float, ...], dict[str, list[GroupResult]]] = {}
    for g in groups:
        by.setdefault(trend_settings(g), {}).setdefault(g.group.family, []).append(g)
    panels = []
    depths = len({s[TREND_AXES.index(DEPTH)] for s in by}) > 1
    for s, fams in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        best = [best_group(gs) for gs in fams.values()]
        parts = chunks(best, room)
        for i, p in enumerate(parts):
            part = f" ({i + 1} of {len(parts)})" if len(parts) > 1 else ""
            panels.append((f"{_setting(s, depths)}{part}", p))
    return panels, True


def family_colors(rep: Report) -> dict[str, str]:
    """One colour per family of the report, the same in each of its figures: the families of
    one rule (an arm's lrs, its carried and tuned curves) share its hue (arm_colors)."""
    arm_of: dict[str, str] = {}
    for g in rep.groups:
        arm_of.setdefault(g.group.family, g.rule or g.group.family)
    return arm_colors(arm_of)


def _looks(rep: Report, reduced: bool) -> Callable[[GroupResult], dict[str, str]]:
    """A series' colour and line style: by family where panels hold each family's best (the
    same family keeps its colour in every panel), else by group."""
    if reduced:
        colors = family_colors(rep)
        return lambda g: {"color": colors[g.group.family], "ls": "-"}
    looks = variant_looks([g.group.name for g in rep.groups])
    return lambda g: looks[g.group.name]


def _band(ax, steps: list[int], mean: list[float], std: list[float], color) -> None:
    """Shade mean +- std around a curve, in the curve's colour."""
    ax.fill_between(steps, [m - s for m, s in zip(mean, std, strict=True)],
                    [m + s for m, s in zip(mean, std, strict=True)], color=color, alpha=0.2, lw=0)


def plot_curves(rep: Report, path: Path) -> None:
    """Validation loss over training, mean over seeds with a +-1 std band."""
    plt = pyplot()
    groups = [g for g in rep.groups if _finished(g)]
    panels, reduced = group_panels(groups, None if len(groups) > 3 * MAX_SERIES
                                   else rep.baseline if _finished(rep.baseline) else None)
    look = _looks(rep, reduced)
    fig, axes = facets(plt, len(panels))
    for ax, (title, gs) in zip(axes, panels, strict=True):
        top, bottom = None, None
        for g in gs:
            curves = [r.curve for r in g.runs if r.status == "done"]
            steps, mean, std = mean_band(curves)
            if not steps:
                continue
            lk = look(g)
            ax.plot(steps, mean, label=f"{g.group.name} (n={len(curves)})",
                    lw=2.0 if g is rep.baseline else 1.3, **lk)
            if len(curves) > 1:
                _band(ax, steps, mean, std, lk["color"])
            # zoom past the first evals: the interesting part is where curves are close
            later = mean[len(mean) // 5:] or mean
            top = max(top or -math.inf, max(later))
            bottom = min(bottom or math.inf, min(m - s for m, s in zip(mean, std, strict=True)))
        if top is not None and bottom is not None and math.isfinite(top - bottom):
            pad = 0.05 * (top - bottom) or 0.01
            ax.set_ylim(bottom - pad, top)
        ax.set(xlabel="step", ylabel=LOSS, title=title)
        ax.grid(alpha=0.3)
        legend_beside(ax)
    what = "each family's best group per width and lr" if reduced else "every group"
    suptitle(fig, f"{rep.spec.name}: validation loss over training, {what} "
                 "(mean over seeds; band: ±1 std)")
    save(plt, fig, path)


def plot_rel(rep: Report, path: Path) -> None:
    """Each group's paired gap to the reference over training, in % of its loss."""
    plt = pyplot()
    ref = rep.baseline.group.name
    curves = {g.group.name: rel_curves(rep, g) for g in rep.groups if g is not rep.baseline}
    groups = [g for g in rep.groups if curves.get(g.group.name, ([],))[0]]
    panels, reduced = group_panels(groups, room=MAX_SERIES - 1)  # and the margin's band
    look = _looks(rep, reduced)
    fig, axes = facets(plt, len(panels))
    for ax, (title, gs) in zip(axes, panels, strict=True):
        for g in gs:
            steps, mean, std, n = curves[g.group.name]
            lk = look(g)
            ax.plot(steps, mean, label=f"{g.group.name} (n={n})", **lk)
            if n > 1:
                _band(ax, steps, mean, std, lk["color"])
        margin_band(ax, rep.margin_pct)
        ax.set(xlabel="step", ylabel="gap to the reference (% of its val loss)", title=title)
        ax.grid(alpha=0.3)
        legend_beside(ax)
    suptitle(fig, f"{rep.spec.name}: validation-loss gap to {ref} over training, paired by seed "
                 "(mean; band: ±1 std; below 0: better)")
    save(plt, fig, path)


def _gap_xy(gaps: list[SettingGap], x: Callable[[SettingGap], float], best: bool = False
            ) -> tuple[list[float], list[float], list[list[float]]]:
    """x, the gap in % at the end (or at each run's best validation loss) and its 95% interval
    as error bar lengths below and above (0 for one seed)."""
    rs = [(x(w), w.best if best else w.result) for w in gaps]
    rs = [(v, r) for v, r in rs if r.rel_pct is not None]
    return ([v for v, _ in rs], [r.rel_pct for _, r in rs],
            ci_bars([(r.rel_pct, r.rel_ci) for _, r in rs]))


def plot_gaps(panels: list[tuple[str, list[SettingGap]]], axis: TrendAxis, ref: str,
              title: str, path: Path, margin_pct: float | None, best: bool = True,
              colors: dict[str, str] | None = None) -> None:
    """The paired gap to `ref` at the same setting (% of its final loss, mean and 95% interval
    over seeds) against the setting (width or lr), one line per family, one panel per `panels`
    entry (the other setting held); with `best`, hollow markers give the gap at each run's
    lowest validation loss. Families and their markers stand side by side at each setting."""
    plt = pyplot()
    split = [(f"{t} ({i + 1} of {len(ps)})" if len(ps) > 1 else t, fams, gaps)
             for t, gaps in panels
             for ps in [chunks(_families(gaps), MAX_SERIES - 1)] for i, fams in enumerate(ps)]
    colors = colors or variant_colors(_families([w for _, gaps in panels for w in gaps]))
    fig, axes = facets(plt, len(split), sharey=True)
    for ax, (sub, fams, gaps) in zip(axes, split, strict=True):
        shifts = nudges(len(fams) * (2 if best else 1))
        values = sorted({w.value for w in gaps if w.family in fams})
        for i, fam in enumerate(fams):
            mine = sorted((w for w in gaps if w.family == fam), key=lambda w: w.value)
            k = 2 * i if best else i
            xs, ys, err = _gap_xy(mine, lambda w, s=shifts[k]: w.value * s)
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=colors[fam], label=fam)
            if best:
                xs, ys, err = _gap_xy(mine, lambda w, s=shifts[k + 1]: w.value * s, best=True)
                ax.errorbar(xs, ys, yerr=err, marker="o", mfc="none", ls="none", capsize=2,
                            color=colors[fam], alpha=0.7)
        margin_band(ax, margin_pct)
        if values:
            log2_axis(ax, values, axis.label, fmt="g")
        ax.set(ylabel=f"gap to {ref} (% of its final val loss)", title=sub)
        legend_beside(ax)
    suptitle(fig, title + ("\n(filled: final; hollow: at each run's best val loss; bars: 95% "
                          "interval over seeds)" if best else
                          "\n(bars: 95% interval over seeds; one seed: no bar)"))
    save(plt, fig, path)


def _families(gaps: list[SettingGap]) -> list[str]:
    return list(dict.fromkeys(w.family for w in gaps))


def trend_gap_panels(rep: Report, axis: TrendAxis) -> list[tuple[str, list[SettingGap]]]:
    """The trend gaps along `axis`, one panel per value of the other trend axis."""
    other = next(a for a in TREND_AXES if a is not axis)
    at = TREND_AXES.index(other)
    groups = {g.group.name: g for g in rep.groups}
    by: dict[float, list[SettingGap]] = {}
    for w in rep.trend_gaps[axis.name]:
        by.setdefault(trend_settings(groups[w.group])[at], []).append(w)
    name = "d =" if other.name == "width" else other.name
    return [(f"{name} {v:g}" if len(by) > 1 else "", ws) for v, ws in sorted(by.items())]


def plot_grid(rep: Report, key: str, fams: dict[str, list[GroupResult]], path: Path) -> None:
    """Top: final loss (mean +- std over seeds) against optim.<key>, one line per family, one
    column per setting of the other trend axes (the width, say). Bottom: each family's paired
    gap in % of the reference's loss (95% interval): on a tuned axis (the lr) to the reference
    family at the same value, each the best of its value; on another (the weight decay) to the
    one reference. Lines at one value stand side by side."""
    plt = pyplot()
    ref = rep.baseline.group
    gaps = grid_gaps(rep, key, fams)
    axes_i = [i for i, a in enumerate(TREND_AXES) if (a.section, a.key) != ("optim", key)]
    columns: dict[tuple[float, ...], list[tuple[str, list[GroupResult]]]] = {}
    for label, gs in fams.items():
        s = trend_settings(gs[0])
        columns.setdefault(tuple(s[i] for i in axes_i), []).append((label, gs))
    cols = [(k, part) for k, rows in sorted(columns.items()) for part in chunks(rows)
            if any(g.loss.mean is not None for _, gs in part for g in gs)]
    colors = family_colors(rep)
    width = 4.6 + 2.6
    fig, axes = plt.subplots(2, len(cols), figsize=(width * len(cols), 7.0), squeeze=False,
                             sharex="col", layout="constrained")
    for j, (k, rows) in enumerate(cols):
        ax, ax_d = axes[0][j], axes[1][j]
        shifts = nudges(len(rows))
        values: set[float] = set()
        for (label, gs), shift in zip(rows, shifts, strict=True):
            fam = gs[0].group.family
            ok = [g for g in gs if g.loss.mean is not None]
            xs = [getattr(g.group.config.optim, key) for g in ok]
            values |= set(xs)
            ax.errorbar([x * shift for x in xs], [g.loss.mean for g in ok],
                        yerr=[g.loss.std or 0.0 for g in ok], marker="o", capsize=3,
                        label=fam, color=colors[fam])
            if gaps is not None:
                pts = _gap_xy(gaps.get(label, []), lambda w, s=shift: w.value * s)
            else:
                pts = _paired_xy(rep, ok, key, shift)
            if pts[0]:
                ax_d.errorbar(pts[0], pts[1], yerr=pts[2], marker="o", capsize=3,
                              color=colors[fam])
        short = {"width": "d =", "depth": "L ="}
        where = ", ".join(f"{short.get(TREND_AXES[i].name, TREND_AXES[i].name)} {v:g}"
                          for i, v in zip(axes_i, k, strict=True) if len(columns) > 1
                          or TREND_AXES[i].name != "depth")
        ax.set(ylabel=f"final {LOSS}", title=where)
        for a in (ax, ax_d):
            if key == "weight_decay":
                a.set_xscale("symlog", linthresh=1e-3)
                a.set_xticks(sorted(values), [f"{v:g}" for v in sorted(values)])
                a.minorticks_off()
                a.grid(alpha=0.3)
            else:
                log2_axis(a, sorted(values), "peak learning rate", fmt="g")
        ax.tick_params(labelbottom=True)
        for a in (ax, ax_d):
            a.set_xlabel("peak learning rate" if key == "lr" else key.replace("_", " "))
        margin_band(ax_d, rep.margin_pct)
        vs = f"{ref.family} at the same {key}" if gaps is not None else ref.name
        ax_d.set(ylabel=f"gap to {vs} (%)")
        legend_beside(ax)
        legend_beside(ax_d)
    what = (f"gap to {ref.family} at the same {key}, each the best of its value"
            if gaps is not None else f"paired gap to {ref.name}")
    suptitle(fig, f"{rep.spec.name}: final validation loss against {key.replace('_', ' ')} "
                 f"(top: mean ± std over seeds; bottom: {what}, 95% interval)")
    save(plt, fig, path)


def _paired_xy(rep: Report, groups: list[GroupResult], key: str, shift: float
               ) -> tuple[list[float], list[float], list[list[float]]]:
    """x, the paired gap to the reference in % and its 95% interval as error bar lengths, for
    the groups with a paired test (the reference itself sits at 0)."""
    xs, gaps = [], []
    for g in groups:
        if g is rep.baseline or g.rel_pct is not None:
            xs.append(getattr(g.group.config.optim, key) * shift)
            gaps.append((0.0, (None, None)) if g is rep.baseline else (g.rel_pct, g.rel_ci))
    return xs, [y for y, _ in gaps], ci_bars(gaps)


def comparison_label(c: Comparison, settings: bool = True, alpha: bool = False) -> str:
    """A headline row as the figure names it: the group (or, where each row has its own
    reference family, the two families), the width and lr or budget it is compared at
    (`settings`) and each side's alpha (`alpha`)."""
    parts = [c.where()] if settings and c.setting else []
    if alpha:
        parts.append(f"alpha {c.alpha[0]:.3g} vs {c.alpha[1]:.3g}")
    name = f"{c.family} vs {c.reference_family}" if c.reference_family else c.group
    return name + (f" ({', '.join(parts)})" if parts else "")


def plot_headline(h: Headline, ref: str, spec: str, path: Path) -> None:
    """The headline comparisons, one row each: the paired gap in % of the reference's loss with
    its 95% interval (t-test) and its 90% interval (TOST), against the equivalence margin. `ref`
    names the reference (family) on the x axis."""
    plt = pyplot()
    rows = [c for c in h.rows if c.result.rel_pct is not None]
    fig, ax = plt.subplots(figsize=(7.5 + 2.6, 1.6 + 0.42 * max(len(rows), 3)),
                           layout="constrained")
    settings = len({tuple(sorted(c.setting.items())) for c in rows}) > 1
    ys = list(range(len(rows)))[::-1]
    for y, c in zip(ys, rows, strict=True):
        r, eq = c.result, c.equivalence
        lo, hi = r.rel_ci
        if lo is not None and hi is not None:
            ax.plot([lo, hi], [y, y], color="C0", lw=1.2, marker="|", ms=8,
                    label="95% interval (t-test)" if y == ys[0] else None)
        if eq is not None and eq.ci_low is not None and r.reference_mean:
            ax.plot([100 * eq.ci_low / r.reference_mean, 100 * eq.ci_high / r.reference_mean],
                    [y, y], color="C1", lw=4, alpha=0.6, solid_capstyle="butt",
                    label="90% interval (TOST)" if y == ys[0] else None)
        ax.plot([r.rel_pct], [y], "o", color="black", ms=5,
                label="mean gap" if y == ys[0] else None)
    ax.axvline(0, color="gray", lw=0.8)
    if h.margin_pct:
        ax.axvspan(-h.margin_pct, h.margin_pct, color="gray", alpha=0.15, lw=0,
                   label=f"±{h.margin_pct:g}% equivalence margin")
    ax.set_yticks(ys, [comparison_label(c, settings, h.kind == "scale scan") for c in rows])
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_xlabel(f"gap to {h.reference_label(ref)} (% of its final val loss; below 0: "
                  "better)")
    ax.grid(alpha=0.3, axis="x")
    suptitle(fig, f"{spec}: {h.question[0].lower()}{h.question[1:]} Gap in final validation "
                  "loss, paired by seed")
    legend_beside(ax)
    save(plt, fig, path)
