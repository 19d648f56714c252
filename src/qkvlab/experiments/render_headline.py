"""report.md's first section: the headline comparisons (qkvlab.experiments.headline), with the
figure that shows them, Holm's adjustment over them and the equivalence test at the stated
margin."""

from __future__ import annotations

from qkvlab.experiments.headline import LEVEL, Comparison, Headline, wd_text
from qkvlab.experiments.render import _p, _pct, _pct_ci


def headline_section(h: Headline, ref: str, figure: str | None) -> list[str]:
    if not h.rows:
        return []
    m = f"±{h.margin_pct:g}%"
    scope = h.holm_scope or f"the {h.tested} comparisons of this table with a p"
    whose = h.reference_label(ref)
    L = ["", "## The answer", "", h.question, "",
         f"Each row: the paired gap in final validation loss as % of {whose}'s (mean over "
         f"seeds, 95% t interval), its p and Holm's adjustment over {scope}, and the "
         "equivalence test (TOST: two one-sided t-tests, 90% interval) against a margin of "
         f"{m} of the reference's loss. *worse* / *better*: Holm's p < {LEVEL:g}; *level "
         f"within {m}*: the TOST p < {LEVEL:g}; *not resolved*: "
         "neither, so the seeds cannot tell a difference of the margin's size from none. "
         "Columns *alpha* and *wd* give each side's logit scale (units of 1/sqrt(d_k)) and "
         "weight decay, the first for the variant.", ""]
    if figure:
        L += [f"![headline]({figure})", ""]
    L += ["| comparison | alpha | wd | seeds | gap | 95% CI | p | p (Holm) | 90% CI (TOST) "
          f"| TOST p ({m}) | reading |",
          "|---|---:|---|---|---:|---|---:|---:|---|---:|---|"]
    for c in h.rows:
        L.append(_row(c, h.margin_pct))
    differ = [c for c in h.rows if c.weight_decay[0] != c.weight_decay[1]]
    if differ:
        L += ["", f"{len(differ)} of the {len(h.rows)} comparisons have arms at different "
              "weight decays (column *wd*): their gap is of the recipe, weight decay included, "
              "not of the projection alone."]
    return L


def _row(c: Comparison, margin_pct: float) -> str:
    r, eq = c.result, c.equivalence
    where = c.where()
    ref_lr = c.setting.get("reference_lr")
    vs = f"{c.reference}" + (f" (lr {ref_lr:g})" if ref_lr is not None else "")
    name = f"{c.group}" + (f" ({where})" if where else "") + f" vs {vs}"
    if eq is None or eq.ci_low is None or not r.reference_mean:
        tost = "n/a | n/a"
    else:
        lo, hi = (100 * v / r.reference_mean for v in (eq.ci_low, eq.ci_high))
        tost = f"[{_pct(lo)}, {_pct(hi)}] | {_p(eq.p)}"
    return (f"| {name} | {c.alpha[0]:.3g} vs {c.alpha[1]:.3g} | {wd_text(c.weight_decay[0])} "
            f"vs {wd_text(c.weight_decay[1])} | {', '.join(map(str, r.seeds))} | "
            f"{_pct(r.rel_pct)} | {_pct_ci(r.rel_ci)} | {_p(r.test.p)} | {_p(c.p_holm)} | "
            f"{tost} | {c.reading(margin_pct)} |")
