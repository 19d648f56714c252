"""report.md's section on an attention-scale scan (qkvlab.experiments.scale_scan)."""

from __future__ import annotations

from collections.abc import Sequence

from qkvlab.experiments.render import gap_cells
from qkvlab.experiments.scale_scan import (
    AlphaGap,
    AlphaTrend,
    RuleGap,
    ScanCell,
    TunedGap,
    alpha_trends,
)


def scan_section(cells: list[ScanCell], tuned: list[TunedGap], ref: str,
                 plots: dict[str, str], rules: Sequence[RuleGap] = (),
                 fixed: Sequence[AlphaGap] = ()) -> list[str]:
    """The loss at each alpha, each family's best alpha per width, the tuned gap, each named
    scale rule against the reference under the same rule, and each alpha run on several seeds
    against the reference at its best."""
    if not cells:
        return []
    alphas = sorted({p.alpha for c in cells for p in c.points})
    L = ["", "## The attention scale: loss against alpha, best alpha against width", "",
         "alpha = scale x sqrt(d_k) (1: the standard 1/sqrt(d_k); 0.5: the paper's halving for "
         "W_Q = I). Final validation loss, mean over the seeds that finished (their number in "
         "brackets); **bold**: the family's best alpha at that width; *edge*: it is the end of "
         "the grid run, so the optimum may lie beyond it; *fitted*: the vertex of the parabola "
         "in log alpha through the best alpha and its two neighbours, an optimum between the "
         "grid's points.", "",
         "| family | d | lr | " + " | ".join(f"alpha {a:.3g}" for a in alphas)
         + " | best alpha | fitted |", "|---|---:|---:|" + "---:|" * len(alphas) + "---:|---:|"]
    for c in cells:
        by = {round(p.alpha, 6): p for p in c.points}
        row = []
        for a in alphas:
            p = by.get(round(a, 6))
            text = "" if p is None else f"{p.final:.4f} ({p.seeds})"
            row.append(f"**{text}**" if p is c.best else text)
        edge = " (edge)" if c.edge else ""
        fitted = "" if c.fitted is None else f"{c.fitted:.3g}"
        L.append(f"| {c.family} | {c.width} | {c.lr:g} | {' | '.join(row)} | "
                 f"{c.best.alpha:.3g}{edge} | {fitted} |")
    trends = alpha_trends(cells)
    if trends:
        L.append("")
    for t in trends:
        L.append(_trend_line(t))
    if "scale_scan" in plots:
        L += ["", f"![scale scan]({plots['scale_scan']})"]
    if "best_alpha" in plots:
        L += ["", f"![best alpha against width and lr]({plots['best_alpha']})"]
    if tuned:
        L += ["", f"### Each arm at its own best alpha against {ref} at its best", "",
              f"Paired by seed (t-test, 95% interval), as % of {ref}'s loss, at the end "
              "(*final*) and at each run's lowest validation loss (*best*), and in training "
              "loss (*train*). One seed gives no interval. *one alpha*: the family ran one "
              "alpha at that width, so its gap is at that alpha, which may not be its best.", "",
              f"| family | d | lr | alpha | {ref} alpha | seeds | final | 95% CI | p | p (Holm) "
              "| best | 95% CI | train | 95% CI |",
              "|---|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---|---:|---|"]
        for t in tuned:
            edge = (" (one alpha)" if not t.cell.scanned
                    else " (edge)" if t.cell.edge or t.reference.edge else "")
            L.append(f"| {t.cell.family} | {t.cell.width} | {t.cell.lr:g} | "
                     f"{t.cell.best.alpha:.3g}{edge} | "
                     f"{t.reference.best.alpha:.3g} | "
                     f"{', '.join(map(str, t.gap.result.seeds))} | {gap_cells(t.gap)} |")
        if "tuned_gap_width" in plots:
            L += ["", f"![tuned gap vs width]({plots['tuned_gap_width']})"]
    return L + _rule_table(rules, ref) + _alpha_table(fixed, ref)


def _alpha_table(alphas: Sequence[AlphaGap], ref: str) -> list[str]:
    """Each alpha run on two or more seeds against `ref` at its best alpha: the cost of a fixed
    scale (the paper's 0.5, the standard 1) against a tuned reference."""
    if not alphas:
        return []
    L = ["", f"### Each alpha run on several seeds against {ref} at its best", "",
         f"What a fixed scale costs against a tuned {ref}: every alpha of a scan that ran two or "
         f"more seeds (each family's best again, as above), paired by seed with {ref} at its "
         f"best alpha at the same width and lr, as % of its loss.", "",
         f"| family | d | lr | alpha | {ref} alpha | seeds | final | 95% CI | p | p (Holm) "
         "| best | 95% CI | train | 95% CI |",
         "|---|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---|---:|---|"]
    for a in alphas:
        L.append(f"| {a.gap.family} | {a.gap.value:g} | {a.lr:g} | {a.alpha:.3g} | "
                 f"{a.reference_alpha:.3g} | {', '.join(map(str, a.gap.result.seeds))} | "
                 f"{gap_cells(a.gap)} |")
    return L


def _rule_table(rules: Sequence[RuleGap], ref: str) -> list[str]:
    """The named rules (`model.attn_scale = "unit"`, ...): each family under a rule against
    `ref` under the same rule, each with the alpha the rule gives its shape."""
    if not rules:
        return []
    L = ["", f"### Named scale rules against {ref} under the same rule", "",
         "Each side at the alpha the rule gives its shape; paired by seed, as % of "
         f"{ref}'s loss. At a width the rule's constants were not fitted on, this is its "
         "held-out test.", "",
         f"| rule | family | d | lr | alpha | {ref} alpha | seeds | final | 95% CI | p "
         "| p (Holm) | best | 95% CI | train | 95% CI |",
         "|---|---|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---|---:|---|"]
    for r in rules:
        L.append(f"| {r.rule} | {r.gap.family} | {r.gap.value:g} | {r.lr:g} | {r.alpha:.3g} | "
                 f"{r.reference_alpha:.3g} | {', '.join(map(str, r.gap.result.seeds))} | "
                 f"{gap_cells(r.gap)} |")
    return L


def _trend_line(t: AlphaTrend) -> str:
    """One family's fitted optima along width or lr and the power through them."""
    if t.axis == "width":
        what, held, term, unit = "d = {:g}", f"lr {t.held:g}", "(d / 128)", "widths"
    else:
        what, held, term, unit = "lr {:g}", f"d = {t.held:g}", "(lr / 1e-3)", "learning rates"
    at = ", ".join(f"{a:.3g} at {what.format(x)}" for x, a in zip(t.xs, t.alphas, strict=True))
    how = (f"the line through two {unit}" if len(t.xs) == 2
           else f"least squares over {len(t.xs)} {unit}")
    product = ""
    if t.axis == "lr":  # alpha x lr, the logits' step size under Adam: constant at exponent -1
        product = "; alpha* x lr " + ", ".join(f"{a * x:.2g}" for x, a in
                                                zip(t.xs, t.alphas, strict=True))
    return (f"- {t.family} ({held}): fitted optimum {at}; alpha* = {t.at_ref:.3g} x "
            f"{term}^{t.exponent:+.2f} ({how}){product}")
