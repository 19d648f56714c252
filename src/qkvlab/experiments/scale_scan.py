"""The attention-scale scan of a sweep: loss against alpha, each arm's best alpha against width,
and the gap between the tuned arms against width.

alpha is the logit scale in units of the standard one, alpha = scale * sqrt(d_k) (1: 1/sqrt(d_k);
the paper's halved scale for W_Q = I: 0.5), read from each group's resolved config, so rules and
numbers mix. A cell is one family at one width and learning rate; a family scans alpha there when
it has two or more alphas with finished runs. Each family's best alpha is the one with the lowest
mean final validation loss over the seeds every alpha of the cell finished (the scan's seeds), so
seeds added later to a few alphas measure the choice without changing it. The tuned gap pairs (by
seed) the best group of each family with the reference family's best group at the same width and
learning rate: the comparison of two arms each at its own scale. A family that ran one alpha there
(a cell that is not `scanned`, such as W_V = I at the baseline's best scale) is paired with the
reference's best too: its gap is at that alpha, which may not be its best. The best alpha is picked
on the scan's runs, which flatters each side a little; a best alpha at the end of its grid means
the optimum may lie beyond it. Between grid points, the vertex of a parabola in log alpha through
the best point and its neighbours estimates the optimum (`fitted`), and a power of the width (at
one lr) or of the lr (at one width) fitted to those optima says how it moves (`alpha_trends`). A
group whose scale is a named rule (`model.attn_scale = "unit"`, `"fitted"`) is also paired with the
reference family's group under the same rule at the same width and lr (`rule_gaps`): at a width the
rule was not fitted on, that is the rule's held-out test. Every alpha of a scan that ran two or
more seeds is also paired with the reference's best (`alpha_gaps`): what a fixed scale (the paper's
0.5, the standard 1) costs against a tuned reference, with an interval.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from qkvlab.experiments.results import (
    DEFAULT_MARGIN_PCT,
    GroupResult,
    Report,
    SettingGap,
    setting_gap,
)
from qkvlab.experiments.runs import RunData
from qkvlab.experiments.stats import holm
from qkvlab.model.scale import alpha_of


@dataclass(frozen=True)
class ScanPoint:
    alpha: float
    group: str
    seeds: int
    final: float  # mean final validation loss over the seeds that finished
    best: float  # mean of each run's lowest validation loss
    choice: float  # mean final validation loss over the cell's shared seeds: picks the best


@dataclass(frozen=True)
class ScanCell:
    """One family's alpha scan at one width and learning rate."""

    family: str
    width: int
    lr: float
    points: tuple[ScanPoint, ...]  # by alpha

    @property
    def scanned(self) -> bool:
        """Two or more alphas ran: the best is chosen among them, not just measured."""
        return len(self.points) > 1

    @property
    def best(self) -> ScanPoint:
        return min(self.points, key=lambda p: p.choice)

    @property
    def edge(self) -> bool:
        """The best alpha of a scan is the smallest or the largest run: the optimum may lie
        beyond. A cell of one alpha has no edge: it is not `scanned`."""
        return self.scanned and self.best.alpha in (self.points[0].alpha, self.points[-1].alpha)

    @property
    def fitted(self) -> float | None:
        """The optimum between the grid's points: the vertex of the parabola in log2(alpha)
        through the best point and its two neighbours (their `choice` losses). None at a grid
        end, where the optimum is not bracketed."""
        i = self.points.index(self.best)
        if i in (0, len(self.points) - 1):
            return None
        (x0, y0), (x1, y1), (x2, y2) = ((math.log2(p.alpha), p.choice)
                                        for p in self.points[i - 1:i + 2])
        # the best is the first lowest, so y0 > y1 <= y2: the curvature is positive
        left, right = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
        curve = (right - left) / (x2 - x0)
        return 2 ** ((x0 + x1) / 2 - left / (2 * curve))

    def as_dict(self) -> dict[str, Any]:
        return {"family": self.family, "width": self.width, "lr": self.lr,
                "scanned": self.scanned, "best_alpha": self.best.alpha,
                "best_at_edge": self.edge,
                "fitted_alpha": self.fitted, "points": [vars(p) for p in self.points]}


# Where each trend is anchored: alpha* = at_ref (x / REFERENCE[axis])^exponent.
REFERENCE = {"width": 128, "lr": 1e-3}


@dataclass(frozen=True)
class AlphaTrend:
    """How one family's optimum moves along one axis with the other held: with the width (at one
    lr) or with the learning rate (at one width). alpha* = at_ref (x / REFERENCE[axis])^exponent,
    least squares in log2 over the values whose optimum the grid brackets (`fitted`); an lr
    exponent of -1 means a constant alpha x lr."""

    family: str
    axis: str  # "width" or "lr"
    held: float  # the other axis' value: the lr of a width trend, the width of an lr trend
    xs: tuple[float, ...]  # the widths or learning rates
    alphas: tuple[float, ...]  # the fitted optimum at each
    exponent: float
    at_ref: float

    def alpha(self, x: float) -> float:
        return self.at_ref * (x / REFERENCE[self.axis]) ** self.exponent

    def as_dict(self) -> dict[str, Any]:
        return vars(self)


@dataclass(frozen=True)
class TunedGap:
    """A family at its best alpha (or its only one, where `cell` is not scanned) against the
    reference family at its best, same width and lr."""

    cell: ScanCell
    reference: ScanCell
    gap: SettingGap  # value = the width; result: final loss, best: each run's lowest

    def as_dict(self, margin_pct: float = DEFAULT_MARGIN_PCT) -> dict[str, Any]:
        return {"family": self.cell.family, "width": self.cell.width, "lr": self.cell.lr,
                "alpha": self.cell.best.alpha, "reference_alpha": self.reference.best.alpha,
                "group": self.gap.group, "reference": self.gap.reference,
                "scanned": self.cell.scanned,
                "at_edge": self.cell.edge or self.reference.edge,
                **self.gap.as_dict(margin_pct)}


@dataclass(frozen=True)
class RuleGap:
    """A family under a named scale rule against the reference family under the same rule, at
    one width and lr; each side's alpha as the rule resolved it for its shape."""

    rule: str
    alpha: float
    reference_alpha: float
    lr: float
    gap: SettingGap  # value = the width

    def as_dict(self, margin_pct: float = DEFAULT_MARGIN_PCT) -> dict[str, Any]:
        return {"rule": self.rule, "family": self.gap.family, "width": self.gap.value,
                "lr": self.lr, "alpha": self.alpha, "reference_alpha": self.reference_alpha,
                "group": self.gap.group, "reference": self.gap.reference,
                **self.gap.as_dict(margin_pct)}


@dataclass(frozen=True)
class AlphaGap:
    """One alpha of a family's scan, on two or more seeds, against the reference family at its
    best alpha at the same width and lr."""

    alpha: float
    reference_alpha: float
    lr: float
    gap: SettingGap  # value = the width

    def as_dict(self, margin_pct: float = DEFAULT_MARGIN_PCT) -> dict[str, Any]:
        return {"family": self.gap.family, "width": self.gap.value, "lr": self.lr,
                "alpha": self.alpha, "reference_alpha": self.reference_alpha,
                "group": self.gap.group, "reference": self.gap.reference,
                **self.gap.as_dict(margin_pct)}


def _key(g: GroupResult) -> tuple[str, int, float]:
    cfg = g.group.config
    return g.group.family, cfg.model.n_embd, cfg.optim.lr


def _done(g: GroupResult) -> list[RunData]:
    return [r for r in g.runs if r.status == "done" and r.best and r.final_loss is not None]


def _point(g: GroupResult, shared: set[int]) -> ScanPoint:
    done = _done(g)
    chosen = [r.final_loss for r in done if r.seed in shared]
    return ScanPoint(g.group.config.model.alpha, g.group.name, len(done), g.loss.mean,
                     sum(r.best[1] for r in done) / len(done), sum(chosen) / len(chosen))


def _cell(key: tuple[str, int, float], by_alpha: dict[float, GroupResult]) -> ScanCell | None:
    groups = [g for _, g in sorted(by_alpha.items())]
    shared = set.intersection(*({r.seed for r in _done(g)} for g in groups))
    if not shared:
        return None
    return ScanCell(*key, tuple(_point(g, shared) for g in groups))


def _all_cells(rep: Report) -> list[ScanCell]:
    """Every (family, width, lr) with finished runs, at one alpha or at several sharing a seed,
    at the sweep's most common depth (other depths are the transfer table's,
    qkvlab.experiments.transfer: a scan cell never mixes depths)."""
    depths = Counter(g.group.config.model.n_layer for g in rep.groups)
    depth = depths.most_common(1)[0][0] if depths else None
    found: dict[tuple[str, int, float], dict[float, GroupResult]] = {}
    for g in rep.groups:
        if g.loss.n and _done(g) and g.group.config.model.n_layer == depth:
            found.setdefault(_key(g), {}).setdefault(round(g.group.config.model.alpha, 6), g)
    cells = (_cell(key, by) for key, by in sorted(found.items()))
    return [c for c in cells if c is not None]


@dataclass(frozen=True)
class ScaleScan:
    """A sweep's scale scan, built once for the report's JSON, plots and Markdown."""

    cells: list[ScanCell]  # the scanned ones: two or more alphas sharing a seed
    tuned: list[TunedGap]
    rules: list[RuleGap]  # empty outside a scan, where every group runs a rule ("paper")
    alphas: list[AlphaGap]  # each alpha run on 2+ seeds against the reference at its best

    @classmethod
    def of(cls, rep: Report) -> ScaleScan:
        every = _all_cells(rep)
        cells = [c for c in every if c.scanned]
        tuned, rules = _tuned_gaps(rep, every), rule_gaps(rep) if cells else []
        alphas = _alpha_gaps(rep, cells)
        for table in ([t.gap for t in tuned], [r.gap for r in rules], [a.gap for a in alphas]):
            _holm_within(table)
        return cls(cells, tuned, rules, alphas)


def _holm_within(gaps: list[SettingGap]) -> None:
    """Each gap's final-loss p Holm-adjusted over the gaps of its table."""
    for w, p in zip(gaps, holm([w.result.test.p for w in gaps]), strict=True):
        w.p_holm = p


def _tuned_gaps(rep: Report, cells: list[ScanCell]) -> list[TunedGap]:
    """Each other family at its best alpha, or at its only one where it ran one, against the
    reference family's best at the same width and learning rate (where the reference scanned),
    paired by seed; by family, then width."""
    fam = rep.baseline.group.family
    groups = {g.group.name: g for g in rep.groups}
    refs = {(c.width, c.lr): c for c in cells if c.family == fam and c.scanned}
    out = []
    for c in cells:
        ref = refs.get((c.width, c.lr))
        if c.family == fam or ref is None:
            continue
        w = setting_gap(groups[c.best.group], groups[ref.best.group], 0)  # axis 0: the width
        if w is not None:
            out.append(TunedGap(c, ref, w))
    return sorted(out, key=lambda t: (t.cell.family, t.cell.width, t.cell.lr))


def _alpha_gaps(rep: Report, cells: list[ScanCell]) -> list[AlphaGap]:
    """Every scanned alpha with two or more seeds paired with the reference family's best at the
    same width and lr (the reference's own other alphas too); by family, width, lr, alpha."""
    fam = rep.baseline.group.family
    groups = {g.group.name: g for g in rep.groups}
    refs = {(c.width, c.lr): c for c in cells if c.family == fam}
    out = []
    for c in cells:
        ref = refs.get((c.width, c.lr))
        if ref is None:
            continue
        for p in c.points:
            if p.seeds < 2 or p.group == ref.best.group:
                continue
            w = setting_gap(groups[p.group], groups[ref.best.group], 0)  # axis 0: the width
            if w is not None and len(w.result.seeds) > 1:  # one pair gives no interval
                out.append(AlphaGap(p.alpha, ref.best.alpha, c.lr, w))
    return sorted(out, key=lambda a: (a.gap.family, a.gap.value, a.lr, a.alpha))


def _rule_of(g: GroupResult) -> str | None:
    setting = g.group.config.model.attn_scale
    return setting if isinstance(setting, str) and alpha_of(setting) is None else None


def rule_gaps(rep: Report) -> list[RuleGap]:
    """Each group whose scale is a named rule against the reference family's group under that
    rule at the same width and lr, paired by seed; by rule, family, then width."""
    fam = rep.baseline.group.family
    refs = {(_rule_of(g), *_key(g)[1:]): g for g in rep.groups
            if g.group.family == fam and _rule_of(g) is not None and _done(g)}
    out = []
    for g in rep.groups:
        rule = _rule_of(g)
        ref = refs.get((rule, *_key(g)[1:]))
        if rule is None or g.group.family == fam or ref is None:
            continue
        w = setting_gap(g, ref, 0)  # axis 0: the width
        if w is not None:
            out.append(RuleGap(rule, g.group.config.model.alpha, ref.group.config.model.alpha,
                               g.group.config.optim.lr, w))
    return sorted(out, key=lambda r: (r.rule, r.gap.family, r.gap.value, r.lr))


def alpha_trends(cells: list[ScanCell]) -> list[AlphaTrend]:
    """Per family, the power of the width that fits its bracketed optima at one lr, and the
    power of the lr that fits them at one width, wherever two or more values have one (two: the
    line through both). Width trends first."""
    return [t for axis in REFERENCE for t in _trends(cells, axis)]


def _trends(cells: list[ScanCell], axis: str) -> list[AlphaTrend]:
    found: dict[tuple[str, float], list[tuple[float, float]]] = {}
    for c in cells:
        if c.fitted is not None:
            x, held = (c.width, c.lr) if axis == "width" else (c.lr, c.width)
            found.setdefault((c.family, held), []).append((x, c.fitted))
    out = []
    for (family, held), pts in found.items():
        if len(pts) < 2:
            continue
        pts.sort()
        xs = [math.log2(x / REFERENCE[axis]) for x, _ in pts]
        ys = [math.log2(a) for _, a in pts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = (sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
                 / sum((x - mx) ** 2 for x in xs))
        out.append(AlphaTrend(family, axis, held, tuple(x for x, _ in pts),
                              tuple(a for _, a in pts), slope, 2 ** (my - slope * mx)))
    return out
