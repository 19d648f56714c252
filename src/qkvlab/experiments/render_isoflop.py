"""The report's IsoFLOP section (qkvlab.experiments.isoflop): the curves' minima per budget, the
arms compared at their minima over fresh seeds, and the gap's trend against compute."""

from __future__ import annotations

from qkvlab.experiments.isoflop import (
    TREND_BUDGETS,
    VERTEX_DIP,
    BudgetGap,
    GapTrend,
    IsoCurve,
    LrScan,
    ScalingFit,
    paper_flops,
)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2f}%"


def _size(n: float | None) -> str:
    return "at an end of the sizes (a bound)" if n is None else f"{n:,.0f}"


def _lr(x: float) -> str:
    """1.6e-2, 8e-3: the way lrs are written in specs and docs."""
    return f"{x:.1e}".replace(".0e", "e").replace("e-0", "e-").replace("e+0", "e")


def _vertex(c: IsoCurve) -> str:
    v = c.vertex
    if v is None:
        return "no minimum (opens down)" if c.fit else "-"
    why = ("" if c.inside else " (untrusted: the lowest size run is an end)" if not c.bracketed
           else f" (untrusted: more than {VERTEX_DIP:.0%} below every run, a cliff beside it)"
           if c.dips
           else " (outside the sizes run)")
    return f"{v[0]:,.0f}, {v[1]:.4f}{why}"


def isoflop_section(curves: list[IsoCurve], gaps: list[BudgetGap], trends: list[GapTrend],
                    fits: list[ScalingFit], margin_pct: float,
                    plots: dict[str, str]) -> list[str]:
    if not curves:
        return []
    L = ["", "## IsoFLOP: the arms at equal compute", "",
         "Each family trained at several sizes for exactly each budget (`train.flop_budget`); "
         "its curve is the final loss against non-embedding parameters N at the seed every "
         "size ran, the vertex that of a parabola in ln N through the lowest run and its "
         "neighbour on each side (trusted only where those bracket it). Each family is "
         "compared with its reference family (the baseline's, or the one its `versus` names) "
         "at each one's minimum over the seeds that did not pick it (paired by seed; Holm over "
         f"that comparison's budgets; TOST at ±{margin_pct:g}%).", ""]
    if "isoflop" in plots:
        L += [f"![loss against parameters at each budget]({plots['isoflop']})", ""]
    by_family = {f.family: f for f in fits}
    L += ["| budget (FLOPs) | family | sizes | minimum run: d x L, N, loss | vertex N*, loss* "
          "| L(N, D) fit's N* | its training time (s) |", "|---|---|---|---|---|---|---|"]
    for c in curves:
        m, f = c.minimum, by_family.get(c.family)
        vertex = _vertex(c)
        n_fit = "-" if f is None else _size(f.optimum(c))
        seconds = m.seconds(c.seed)
        L.append(f"| {c.budget:.3g} | {c.family} | {len(c.points)} | d {m.width} x {m.depth}, "
                 f"{m.params:,}, {m.loss:.4f} | {vertex} | {n_fit} | "
                 f"{'-' if seconds is None else f'{seconds:,.0f}'} |")
    for f in fits:
        L += ["", f"- **{f.family}'s L(N, D)** through its {f.points} sizes at {f.budgets} "
              f"budgets (Huber on ln L): E = {f.E:.3f}, A = {f.A:.3g}, a = {f.a:.3f}, "
              f"B = {f.B:.3g}, b = {f.b:.3f}; its N* along each budget, in the table, checks "
              "the parabola's vertex."]
    if "isoflop_frontier" in plots:
        L += ["", f"![loss against training FLOPs and training time]({plots['isoflop_frontier']})"]
    # a comparison with neither fresh seeds nor two trusted vertices has nothing to show yet
    shown = [g for g in gaps if g.fresh or g.vertex_gap_pct is not None]
    if shown:
        L += ["", "| budget | family vs reference (minima) | fresh seeds | gap [95% CI] | "
              f"Holm p | TOST ±{margin_pct:g}% p | parabolas' minima |",
              "|---|---|---|---|---|---|---|"]
        for g in shown:
            f = g.fresh
            eq = f.equivalence(margin_pct) if f else None
            ci = f"[{_pct(f.rel_ci[0])}, {_pct(f.rel_ci[1])}]" if f else ""
            holm = "-" if g.p_holm is None else f"{g.p_holm:.3g}"
            L.append(f"| {g.budget:.3g} | {g.group} vs {g.reference} | "
                     f"{len(f.seeds) if f else 0} | "
                     f"{_pct(f.rel_pct) if f else '-'} {ci} | {holm} | "
                     f"{'-' if eq is None or eq.p is None else f'{eq.p:.3g}'} | "
                     f"{_pct(g.vertex_gap_pct)} |")
    if len(shown) < len(gaps):
        L += ["", f"- {len(gaps) - len(shown)} more comparison(s) of minima with neither fresh "
              "seeds nor two trusted vertices yet (single-seed checks): in report.json."]
    tested = {g.budget for g in gaps if g.fresh}
    if tested and not trends:
        L += ["", f"- No line of the gap against compute yet: it takes {TREND_BUDGETS} budgets "
              f"with fresh seeds at their minima ({len(tested)} so far); through fewer, a line "
              "is fixed by their means alone, and nothing checks that a line fits."]
    paper = paper_flops()
    for t in trends:
        at = t.at(paper)
        L += ["", f"- **{t.family}'s gap against compute** (least squares over {t.n} fresh "
              f"pairs): {t.slope:+.3f} percentage points per decade of FLOPs. Extrapolated to "
              f"the paper's run ({paper:.2g} FLOPs, GPT-2 small on 51.6B tokens): "
              f"{at[0]:+.2f}% [{at[1]:+.2f}%, {at[2]:+.2f}%]: an extrapolation across orders "
              "of magnitude on another corpus and tokenizer, not a prediction to rely on. The "
              "paper's W_Q = I model was comparable to its baseline and the one with the wider "
              "MLP beat it, 3.004 against 3.016 (-0.4%, one seed): only sign and size compare."]
    if "isoflop_gap" in plots:
        L += ["", f"![the gap of the minima against compute]({plots['isoflop_gap']})"]
    return L


def lr_scan_section(scans: list[LrScan], plots: dict[str, str]) -> list[str]:
    """Each budget's models run at several peak lrs: the loss per lr, the best in bold."""
    if not scans:
        return []
    lrs = sorted({p.lr for s in scans for p in s.points}, reverse=True)
    L = ["", "### The peak lr at a budget's sizes", "",
         "Models run at 3 peak lrs or more at one budget, all else equal (final loss at the seed "
         "they share; **bold**: the best; a best at the end of the lrs run bounds it, no more). "
         "An lr tuned on shorter runs can sit far above a longer run's best.", ""]
    if "isoflop_lr" in plots:
        L += [f"![loss against the peak lr at each budget]({plots['isoflop_lr']})", ""]
    L += ["| budget | arm | d x L | " + " | ".join(f"lr {_lr(lr)}" for lr in lrs)
          + " | best lr |", "|---|---|---|" + "---|" * (len(lrs) + 1)]
    for sc in scans:
        at = {p.lr: p.loss for p in sc.points}
        cells = [("-" if lr not in at else f"**{at[lr]:.4f}**" if lr == sc.best.lr
                  else f"{at[lr]:.4f}") for lr in lrs]
        best = _lr(sc.best.lr) + ("" if sc.bracketed else " (at an end: a bound)")
        L.append(f"| {sc.budget:.3g} | {sc.arm} | d {sc.width} x {sc.depth} | "
                 + " | ".join(cells) + f" | {best} |")
    return L
