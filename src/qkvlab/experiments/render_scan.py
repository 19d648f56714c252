"""report.md's section on an attention-scale scan (qkvlab.experiments.scale_scan)."""

from __future__ import annotations

from qkvlab.experiments.render import gap_cells
from qkvlab.experiments.scale_scan import ScanCell, TunedGap, alpha_trends


def scan_section(cells: list[ScanCell], tuned: list[TunedGap], ref: str,
                 plots: dict[str, str]) -> list[str]:
    """The loss at each alpha, each family's best alpha per width, and the tuned gap."""
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
    for t in alpha_trends(cells):
        at = ", ".join(f"{a:.3g} at d = {w}" for w, a in zip(t.widths, t.alphas, strict=True))
        L += ["", f"- {t.family} (lr {t.lr:g}): fitted optimum {at}; alpha* = "
                  f"{t.at_128:.3g} x (d / 128)^{t.exponent:+.2f}" + (
                      " (the line through two widths)" if len(t.widths) == 2 else
                      f" (least squares over {len(t.widths)} widths)")]
    if "scale_scan" in plots:
        L += ["", f"![scale scan]({plots['scale_scan']})"]
    if tuned:
        L += ["", f"### Each arm at its own best alpha against {ref} at its best", "",
              f"Paired by seed (t-test, 95% interval), as % of {ref}'s loss, at the end "
              "(*final*) and at each run's lowest validation loss (*best*), and in training "
              "loss (*train*). One seed gives no interval.", "",
              f"| family | d | lr | alpha | {ref} alpha | seeds | final | 95% CI | p | p (Holm) "
              "| best | 95% CI | train | 95% CI |",
              "|---|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---|---:|---|"]
        for t in tuned:
            edge = " (edge)" if t.cell.edge or t.reference.edge else ""
            L.append(f"| {t.cell.family} | {t.cell.width} | {t.cell.lr:g} | "
                     f"{t.cell.best.alpha:.3g}{edge} | "
                     f"{t.reference.best.alpha:.3g} | "
                     f"{', '.join(map(str, t.gap.result.seeds))} | {gap_cells(t.gap)} |")
        if "tuned_gap_width" in plots:
            L += ["", f"![tuned gap vs width]({plots['tuned_gap_width']})"]
    return L
