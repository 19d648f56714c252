"""A report's headline: the comparisons that answer its question, read with two tests.

Which comparisons: in an attention-scale scan, each arm at its own best alpha against the
reference family at its best, per width and lr (the tuned gaps); in an IsoFLOP sweep, each
family's minimum against its reference family's at the same budget, over the fresh seeds (Holm
over each family's budgets, as the IsoFLOP section reads them); in a sweep along a width or
learning-rate trend, each group against the reference family at the same setting (and, on the
lr, each family at its best lr); otherwise each group against the reference.

How they are read: a difference is called real only where its paired t-test survives Holm's
adjustment over the headline's comparisons (p < 0.05 after it), and two arms are called level
only where the equivalence test (TOST, qkvlab.experiments.stats.tost_paired) puts the paired
difference within the stated margin, a share of the reference's loss. Neither: the seeds do not
resolve it at that margin. Every output states the margin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from qkvlab.experiments.isoflop import BudgetGap
from qkvlab.experiments.results import (
    TREND_AXES,
    GroupResult,
    PairedRelative,
    Report,
    SettingGap,
    equivalence_json,
)
from qkvlab.experiments.scale_scan import ScaleScan
from qkvlab.experiments.stats import EquivalenceTest, holm

LEVEL = 0.05  # the family-wise error rate of "different" and the alpha of each TOST


@dataclass
class Comparison:
    """One headline comparison: `group` paired by seed with `reference`."""

    group: str
    reference: str
    family: str
    setting: dict[str, float]  # the width and lr (or budget) the two share, where the sweep
    # varies them
    alpha: tuple[float, float]  # the logit scale (units of 1/sqrt(d_k)) of each side
    weight_decay: tuple[float, float]
    result: PairedRelative
    p_holm: float | None = None
    equivalence: EquivalenceTest | None = None
    reference_family: str = ""  # where each row has its own reference family (IsoFLOP)

    def where(self) -> str:
        """The shared setting as the report writes it: "d 128, lr 0.001" or "4e+13 FLOPs"."""
        return ", ".join(f"{v:.3g} FLOPs" if k == "FLOPs" else
                         f"{'d' if k == 'width' else k} {v:g}"
                         for k, v in self.setting.items() if not k.startswith("reference_"))

    @property
    def seeds(self) -> int:
        return self.result.test.n

    def reading(self, margin_pct: float) -> str:
        """"worse"/"better" (Holm p < 0.05), "level within +-m%" (TOST), both, or neither."""
        if self.seeds < 2:
            return "one seed: no test"
        eq = self.equivalence is not None and self.equivalence.equivalent
        mean = self.result.test.mean or 0.0
        if self.p_holm is not None and self.p_holm < LEVEL:
            word = "worse" if mean > 0 else "better"
            return f"{word}, by less than ±{margin_pct:g}%" if eq else word
        if eq:
            return f"level within ±{margin_pct:g}%"
        return f"not resolved at ±{margin_pct:g}%"

    def as_dict(self, margin_pct: float) -> dict[str, Any]:
        return {"group": self.group, "reference": self.reference, "family": self.family,
                **self.setting, "alpha": self.alpha[0], "reference_alpha": self.alpha[1],
                "weight_decay": self.weight_decay[0],
                "reference_weight_decay": self.weight_decay[1],
                **self.result.as_dict(), "p_holm": self.p_holm,
                "equivalence": equivalence_json(self.equivalence, self.result.reference_mean,
                                                margin_pct),
                "reading": self.reading(margin_pct)}


@dataclass
class Headline:
    kind: str  # "scale scan", "width", "lr" or "reference"
    question: str
    margin_pct: float
    rows: list[Comparison] = field(default_factory=list)
    holm_scope: str | None = None  # what Holm adjusts over, where not the table's rows

    def reference_label(self, ref: str) -> str:
        """Whom the gaps are measured against: `ref`, or "its reference" where each row has
        its own reference family (an IsoFLOP sweep's minima)."""
        own = self.rows and all(c.reference_family for c in self.rows)
        return "its reference" if own else ref

    @property
    def tested(self) -> int:
        """How many comparisons Holm's adjustment runs over (those with a p)."""
        return sum(c.result.test.p is not None for c in self.rows)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "question": self.question, "margin_pct": self.margin_pct,
                "holm_over": self.holm_scope or self.tested, "level": LEVEL,
                "comparisons": [c.as_dict(self.margin_pct) for c in self.rows]}


def headline(rep: Report, scan: ScaleScan, budget_gaps: list[BudgetGap] | None = None
             ) -> Headline:
    """The report's headline comparisons, Holm-adjusted over them (an IsoFLOP sweep's, from
    `budget_gaps`, over each family's budgets) and each with its TOST."""
    groups = {g.group.name: g for g in rep.groups}
    ref = rep.baseline.group.family
    fresh = [b for b in budget_gaps or [] if b.fresh is not None]
    if fresh and not scan.tuned:
        return _isoflop(rep, groups, fresh)
    if scan.tuned:
        h = Headline("scale scan", f"Each arm at its own best alpha against {ref} at its best, "
                     "per width and learning rate.", rep.margin_pct,
                     [_from_gap(w.gap, groups, {"width": w.cell.width, "lr": w.cell.lr})
                      for w in scan.tuned])
    else:
        h = _trend(rep, groups) or Headline(
            "reference", f"Each variant against {rep.ref}.", rep.margin_pct,
            [_from_group(g, rep.baseline) for g in rep.groups
             if g is not rep.baseline and g.paired is not None])
    for c, p in zip(h.rows, holm([c.result.test.p for c in h.rows]), strict=True):
        c.p_holm = p
        c.equivalence = c.result.equivalence(h.margin_pct)
    return h


def _trend(rep: Report, groups: dict[str, GroupResult]) -> Headline | None:
    """The gaps along the first trend axis the sweep spans, and each family at its best value
    on it (a tuned axis)."""
    for axis in TREND_AXES:
        gaps = rep.trend_gaps[axis.name]
        if not gaps:
            continue
        rows = [_from_gap(w, groups, _shared(groups[w.group])) for w in gaps]
        seen = {(c.group, c.reference) for c in rows}  # a best pair may be a trend's pair
        rows += [_from_gap(w, groups, {"width": groups[w.group].group.config.model.n_embd,
                                        axis.name: w.value,
                                        f"reference_{axis.name}": w.reference_value})
                 for w in rep.tuned_gaps.get(axis.name, []) if (w.group, w.reference) not in seen]
        what = "width" if axis.name == "width" else "learning rate"
        return Headline(axis.name, f"Each variant against {rep.baseline.group.family} at the "
                        f"same {what}" + (f", and each family at its own best {what}"
                                          if rep.tuned_gaps.get(axis.name) else "") + ".",
                        rep.margin_pct, rows)
    return None


def _isoflop(rep: Report, groups: dict[str, GroupResult], gaps: list[BudgetGap]) -> Headline:
    rows = []
    for b in gaps:
        assert b.fresh is not None  # only gaps with fresh seeds are passed
        ref = groups[b.reference]
        c = Comparison(b.group, b.reference, b.family, {"FLOPs": b.budget}, result=b.fresh,
                       p_holm=b.p_holm, reference_family=b.reference_family,
                       **_sides(groups[b.group], ref))
        c.equivalence = b.fresh.equivalence(rep.margin_pct)
        rows.append(c)
    return Headline("isoflop", "Each family's IsoFLOP minimum against its reference family's "
                    "at the same training budget, over the seeds that did not pick either "
                    "minimum.", rep.margin_pct, rows, holm_scope="each family's budgets")


def _shared(g: GroupResult) -> dict[str, float]:
    cfg = g.group.config
    return {"width": cfg.model.n_embd, "lr": cfg.optim.lr}


def _sides(g: GroupResult, r: GroupResult) -> dict[str, Any]:
    gm, rm = g.group.config, r.group.config
    return {"alpha": (gm.model.alpha, rm.model.alpha),
            "weight_decay": (gm.optim.weight_decay, rm.optim.weight_decay)}


def _from_gap(w: SettingGap, groups: dict[str, GroupResult], setting: dict[str, float]
              ) -> Comparison:
    g, r = groups[w.group], groups[w.reference]
    return Comparison(w.group, w.reference, w.family, setting, result=w.result, **_sides(g, r))


def _from_group(g: GroupResult, ref: GroupResult) -> Comparison:
    test = g.paired
    assert test is not None  # only paired groups are passed
    pr = PairedRelative(g.paired_seeds, test, g.baseline_mean, g.rel_pct, g.rel_ci,
                        g.paired_diffs)
    return Comparison(g.group.name, ref.group.name, g.group.family, {}, result=pr,
                      **_sides(g, ref))


def wd_text(x: float) -> str:
    """A weight decay as the docs write it: 2^-5 for a power of two below 1, else %g."""
    if 0 < x < 1 and math.log2(x).is_integer():
        return f"2^{int(math.log2(x))}"
    return f"{x:g}"
