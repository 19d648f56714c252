"""IsoFLOP curves of a sweep whose groups train for fixed compute (`train.flop_budget`), Hoffmann
et al.'s approach 2: per family and budget, the final loss against the model's non-embedding
parameters N, a parabola in ln N through the lowest run and its neighbour on each side and its
vertex, the size that budget buys best and its loss, trusted only where those sizes bracket it
(a lowest run at an end, a vertex outside them, or a parabola that opens downwards bounds the
optimum and no more).

The curve is drawn from the seed every point shares (the sweep's first seed: the one that picks
each arm's minimum). Seeds run later at an arm's minimum cell test the comparison without the
seed that chose it: per budget, the two arms' minimum cells are paired by those fresh seeds (a
paired t-test, Holm-adjusted over the budgets, and TOST at the report's margin). The relative
gap's trend against compute is a least-squares line in log10 C through every fresh pair's gap,
with the interval of its mean at a given C: extrapolating it orders of magnitude past the
budgets run is a guess with an interval, labelled as such wherever it is shown.

A budget's size run at several peak lrs, all else equal, is an lr scan (`lr_scans`): the lr a
setting tuned at a short run carries to a longer one can sit far off the longer run's best
(the best lr falls as the token horizon grows, under μP too: Bjorck et al., ICLR 2025), so the
curves at the carried lr are checked against each arm's best lr at its minimum.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

import numpy as np
from scipy import stats as sst

from qkvlab.experiments.results import (
    CONFIDENCE,
    GroupResult,
    PairedRelative,
    Report,
    paired_relative,
)
from qkvlab.experiments.runs import RunData
from qkvlab.experiments.stats import holm
from qkvlab.model import ModelConfig
from qkvlab.model.params import count_params, flops_per_token

WINDOW = 1  # sizes on each side of a curve's lowest run that its parabola reads
# Through three runs near a smooth minimum the vertex sits within seed noise (0.1-1%) of the
# lowest run; a vertex further below it comes from a cliff on one side, not from a minimum.
VERTEX_DIP = 0.01


@dataclass(frozen=True)
class IsoPoint:
    group: str
    width: int
    depth: int
    params: int  # non-embedding
    loss: float  # final loss at the curve's seed
    runs: tuple[RunData, ...]  # every finished run of the group
    flops_per_token: float  # training, as qkvlab counts it: the budget buys budget / this

    def tokens(self, budget: float) -> float:
        return budget / self.flops_per_token

    def seconds(self, seed: int) -> float | None:
        """Seed `seed`'s training time, measured: its tokens over its median logged throughput
        (robust to a resume, which restarts the run's own clock)."""
        run = next((r for r in self.runs if r.seed == seed), None)
        return run.tokens / run.tokens_per_s if run and run.tokens and run.tokens_per_s else None


@dataclass(frozen=True)
class IsoCurve:
    family: str
    budget: float
    seed: int  # the seed the curve (and each minimum) is read at
    points: tuple[IsoPoint, ...]  # by params

    @property
    def window(self) -> tuple[IsoPoint, ...]:
        """The sizes the parabola goes through: the lowest run and its neighbour on each side
        (at an end, the three nearest it). A parabola through every size is biased on a wide
        or off-centre grid, and runs far from the minimum can sit on the early plateau, which
        no parabola or power law describes; centred on the minimum it reads the minimum."""
        i = self.points.index(self.minimum)
        lo = min(max(i - WINDOW, 0), max(len(self.points) - 2 * WINDOW - 1, 0))
        return self.points[lo:lo + 2 * WINDOW + 1]

    @cached_property  # read by vertex, inside, the plot and the JSON: fitted once
    def fit(self) -> tuple[float, float, float] | None:
        """(a, b, c) of loss = a x^2 + b x + c, x = ln N, through the window (None: fewer
        than 3 sizes)."""
        if len(self.points) < 3:
            return None
        x = [math.log(p.params) for p in self.window]
        a, b, c = np.polyfit(x, [p.loss for p in self.window], 2)
        return float(a), float(b), float(c)

    @property
    def vertex(self) -> tuple[float, float] | None:
        """(N*, loss*) of the parabola's minimum (None: no fit, or it opens downwards)."""
        fit = self.fit
        if fit is None or fit[0] <= 0:
            return None
        a, b, c = fit
        x = -b / (2 * a)
        return math.exp(x), a * x * x + b * x + c

    @property
    def bracketed(self) -> bool:
        """The lowest size run has a size run on each side: the data bracket the minimum."""
        i = self.points.index(self.minimum)
        return 0 < i < len(self.points) - 1

    @property
    def inside(self) -> bool:
        """The vertex is trusted: the sizes run bracket the minimum and the vertex lies within
        the window (a parabola through a curve whose lowest point is an end, or through a
        cliff, can put its vertex anywhere)."""
        v = self.vertex
        return (v is not None and self.bracketed and not self.dips
                and self.window[0].params <= v[0] <= self.window[-1].params)

    @property
    def dips(self) -> bool:
        """The vertex lies more than VERTEX_DIP below the lowest run: one neighbour is far up
        a cliff (a run on the early plateau), and the parabola's bottom is made up, not read."""
        v = self.vertex
        return v is not None and v[1] < (1 - VERTEX_DIP) * self.minimum.loss

    @property
    def minimum(self) -> IsoPoint:
        """The size run with the lowest loss at the curve's seed: where fresh seeds go."""
        return min(self.points, key=lambda p: p.loss)

    def as_dict(self) -> dict[str, Any]:
        v = self.vertex
        return {"family": self.family, "flop_budget": self.budget, "seed": self.seed,
                "points": [{"group": p.group, "width": p.width, "depth": p.depth,
                            "params": p.params, "loss": p.loss} for p in self.points],
                "window": [p.group for p in self.window],
                "fit": self.fit, "vertex_params": v[0] if v else None,
                "vertex_loss": v[1] if v else None, "vertex_inside": self.inside,
                "bracketed": self.bracketed, "vertex_dips": self.dips,
                "minimum": self.minimum.group}


@dataclass
class BudgetGap:
    """One budget's comparison of a family's minimum with the reference family's."""

    budget: float
    family: str
    group: str
    reference: str
    fresh: PairedRelative | None  # over the seeds that did not pick either minimum
    vertex_gap_pct: float | None  # the parabolas' minima, at the curve's seed
    shapes: str = ""  # the two minima's d x L, e.g. "d 64 x 2 vs d 64 x 2"
    reference_family: str = ""  # the family whose minimum `reference` is
    p_holm: float | None = None

    def as_dict(self, margin_pct: float) -> dict[str, Any]:
        return {"flop_budget": self.budget, "family": self.family, "group": self.group,
                "reference": self.reference, "reference_family": self.reference_family,
                "shapes": self.shapes,
                "vertex_gap_pct": self.vertex_gap_pct,
                "fresh_seeds": self.fresh.as_dict(margin_pct) if self.fresh else None,
                "p_holm": self.p_holm}


@dataclass(frozen=True)
class GapTrend:
    """gap % = intercept + slope x log10 C, through every fresh pair's gap."""

    family: str
    slope: float
    intercept: float
    n: int
    x_mean: float
    sxx: float
    residual_sd: float

    def at(self, flops: float) -> tuple[float, float, float]:
        """(gap %, low, high) of the line's mean at `flops`, with its CONFIDENCE interval."""
        x = math.log10(flops)
        mean = self.intercept + self.slope * x
        se = self.residual_sd * math.sqrt(1 / self.n + (x - self.x_mean) ** 2 / self.sxx)
        half = sst.t.ppf(0.5 + CONFIDENCE / 2, self.n - 2) * se
        return mean, mean - half, mean + half


def _done(g: GroupResult) -> list[RunData]:
    return [r for r in g.runs if r.status == "done" and r.final_loss is not None]


def _shared_seed(groups: list[GroupResult]) -> int | None:
    """The first seed every group finished (None: none they all share)."""
    shared = set.intersection(*({r.seed for r in _done(g)} for g in groups))
    return min(shared) if shared else None


def _loss_at(g: GroupResult, seed: int) -> float:
    return next(r.final_loss for r in _done(g) if r.seed == seed)


def isoflop_curves(rep: Report) -> list[IsoCurve]:
    """Per family and budget, the sizes run at the seed they share (3 sizes or more make a
    fit); empty when no group has a FLOP budget."""
    found: dict[tuple[str, float], list[GroupResult]] = {}
    for g in rep.groups:
        budget = g.group.config.train.flop_budget
        if budget is not None and _done(g):
            found.setdefault((g.group.family, float(budget)), []).append(g)
    curves = []
    for (family, budget), groups in sorted(found.items()):
        seed = _shared_seed(groups)
        if seed is None:
            continue
        points = []
        for g in groups:
            m = g.group.config.model
            loss = _loss_at(g, seed)
            points.append(IsoPoint(g.group.name, m.n_embd, m.n_layer,
                                   count_params(m).non_embedding, loss, tuple(_done(g)),
                                   flops_per_token(m)))
        curves.append(IsoCurve(family, budget, seed, tuple(sorted(points,
                                                                  key=lambda p: p.params))))
    return curves


@dataclass(frozen=True)
class LrPoint:
    lr: float
    group: str
    family: str
    loss: float  # at the scan's seed


@dataclass(frozen=True)
class LrScan:
    """One model at one budget trained at several peak lrs, everything else equal, read at the
    seed they all ran: where that model's best lr lies at that budget's length."""

    arm: str  # the name its families share ("baseline" for baseline and baseline-lr8e-3)
    budget: float
    width: int
    depth: int
    seed: int
    points: tuple[LrPoint, ...]  # by lr

    @property
    def best(self) -> LrPoint:
        return min(self.points, key=lambda p: p.loss)

    @property
    def bracketed(self) -> bool:
        """An lr run on each side of the best: the scan has found it, not bounded it."""
        return 0 < self.points.index(self.best) < len(self.points) - 1

    def as_dict(self) -> dict[str, Any]:
        return {"arm": self.arm, "flop_budget": self.budget, "width": self.width,
                "depth": self.depth, "seed": self.seed, "best_lr": self.best.lr,
                "bracketed": self.bracketed,
                "points": [{"lr": p.lr, "group": p.group, "family": p.family, "loss": p.loss}
                           for p in self.points]}


def _shared_name(families: list[str]) -> str:
    """The arm the families share, whole dash-separated words: "baseline" for baseline-lr4e-3
    and baseline-lr2e-3 (a character prefix would leave "baseline-lr")."""
    words = os.path.commonprefix([f.split("-") for f in families])
    return "-".join(words) or " / ".join(dict.fromkeys(families))


SCAN_LRS = 3  # through two lrs the better one is an end: a bound, not a scan's best


def lr_scans(rep: Report) -> list[LrScan]:
    """Per budget, each model (its whole model config and every optimiser setting but the
    peak lr) run at SCAN_LRS lrs or more, at the seed they share."""
    found: dict[tuple[float, str], list[GroupResult]] = {}
    for g in rep.groups:
        cfg = g.group.config
        if cfg.train.flop_budget is not None and _done(g):
            optim = {k: v for k, v in asdict(cfg.optim).items() if k != "lr"}
            key = (float(cfg.train.flop_budget), repr((cfg.model, optim)))
            found.setdefault(key, []).append(g)
    scans = []
    for (budget, _), groups in found.items():
        by_lr = {g.group.config.optim.lr: g for g in groups}  # one group per lr
        seed = _shared_seed(list(by_lr.values()))
        if len(by_lr) < SCAN_LRS or seed is None:
            continue
        points = tuple(LrPoint(lr, g.group.name, g.group.family, _loss_at(g, seed))
                       for lr, g in sorted(by_lr.items()))
        m = groups[0].group.config.model
        scans.append(LrScan(_shared_name([p.family for p in points]), budget, m.n_embd,
                            m.n_layer, seed, points))
    return sorted(scans, key=lambda s: (s.budget, s.width, s.depth, s.arm))


def sized_curves(curves: list[IsoCurve], scans: list[LrScan]) -> list[IsoCurve]:
    """The curves the IsoFLOP figure draws: a single-size check that is part of an lr scan
    is drawn against its lr (the lr figure), not as a size."""
    scanned = {(p.family, sc.budget) for sc in scans for p in sc.points}
    return [c for c in curves if len(c.points) > 1 or (c.family, c.budget) not in scanned]


def budget_gaps(curves: list[IsoCurve], reference: str,
                versus: dict[str, str] | None = None) -> list[BudgetGap]:
    """Each other family's minimum against its reference family's (`versus[family]`, else
    `reference`), per budget, over the fresh seeds both minima ran; Holm over each family's
    budgets."""
    by = {(c.family, c.budget): c for c in curves}
    gaps = []
    for c in curves:
        theirs_family = (versus or {}).get(c.family) or reference
        r = by.get((theirs_family, c.budget))
        if c.family == reference or r is None:
            continue
        mine, theirs = c.minimum, r.minimum
        base = {run.seed: run for run in theirs.runs if run.seed != r.seed}
        pairs = [(run, base[run.seed]) for run in mine.runs
                 if run.seed != c.seed and run.seed in base]
        fresh = paired_relative(pairs) if pairs else None
        cv, rv = c.vertex, r.vertex
        vgap = 100.0 * (cv[1] / rv[1] - 1.0) if cv and rv and c.inside and r.inside else None
        shapes = f"d {mine.width} x {mine.depth} vs d {theirs.width} x {theirs.depth}"
        gaps.append(BudgetGap(c.budget, c.family, mine.group, theirs.group, fresh, vgap,
                              shapes, theirs_family))
    # Holm over the budgets of each comparison (a family meets one reference): the question
    # "does this family differ from that one" is asked once per budget
    for family in dict.fromkeys(g.family for g in gaps):
        mine = [g for g in gaps if g.family == family]
        adjusted = holm([g.fresh.test.p if g.fresh else None for g in mine])
        for g, p in zip(mine, adjusted, strict=True):
            g.p_holm = p
    return gaps


TREND_BUDGETS = 3  # a line through two budgets' means has nothing to check its shape against


def gap_trend(gaps: list[BudgetGap], family: str) -> GapTrend | None:
    """The line through the fresh pairs' relative gaps against log10 C (None: fewer than
    TREND_BUDGETS budgets with fresh pairs: through two, it is fixed by their two means, and
    its interval knows only the seeds' noise, not whether a line fits)."""
    xs, ys = [], []
    for g in gaps:
        if g.family != family or g.fresh is None or not g.fresh.reference_mean:
            continue
        for d in g.fresh.diffs:
            xs.append(math.log10(g.budget))
            ys.append(100.0 * d / g.fresh.reference_mean)
    if len(set(xs)) < TREND_BUDGETS:
        return None
    x, y = np.array(xs), np.array(ys)
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (intercept + slope * x)
    sd = math.sqrt(float(resid @ resid) / (len(x) - 2))
    return GapTrend(family, float(slope), float(intercept), len(x), float(x.mean()),
                    float(((x - x.mean()) ** 2).sum()), sd)


@dataclass(frozen=True)
class ScalingFit:
    """L(N, D) = E + A / N^a + B / D^b through every size and budget of a family at the curves'
    seed (Hoffmann et al.'s approach 3: a Huber loss on ln L, the best of a grid of starts), D
    the tokens each budget buys. It checks the parabolas' vertices: its optimum along a budget
    is the N that minimises L(N, C / F(N)), F(N) the FLOPs per token, log-linear between the
    sizes run. (Through the parabolas' windows alone, 3 sizes a budget, its 5 parameters are
    not identified.)"""

    family: str
    E: float
    A: float
    a: float
    B: float
    b: float
    points: int
    budgets: int

    def loss(self, n: float, d: float) -> float:
        return self.E + self.A / n ** self.a + self.B / d ** self.b

    def optimum(self, curve: IsoCurve) -> float | None:
        """N* along `curve`'s budget, within the sizes run (None: at an end of them, a bound)."""
        ln_n = np.log([p.params for p in curve.points])
        ln_f = np.log([p.flops_per_token for p in curve.points])
        grid = np.linspace(ln_n[0], ln_n[-1], 400)
        d = curve.budget / np.exp(np.interp(grid, ln_n, ln_f))
        best = int(np.argmin(self.loss(np.exp(grid), d)))  # loss takes arrays too
        return math.exp(grid[best]) if 0 < best < len(grid) - 1 else None


HUBER_DELTA = 1e-3  # Hoffmann et al.'s, on ln L
_STARTS = [(e, a, al, b, be) for e in (0.0, 0.5) for a in (0.0, 5.0, 15.0) for al in (0.3, 0.7)
           for b in (0.0, 5.0, 15.0) for be in (0.3, 0.7)]


def scaling_fit(curves: list[IsoCurve], family: str) -> ScalingFit | None:
    """The family's L(N, D) fit (None: fewer than 2 budgets or 6 points, 5 parameters)."""
    from scipy.optimize import minimize  # only here: the fit is the one optimiser qkvlab runs

    mine = [c for c in curves if c.family == family]
    rows = [(p.params, p.tokens(c.budget), p.loss) for c in mine for p in c.points]
    if len(mine) < 2 or len(rows) < 6:
        return None
    ln_n, ln_d, ln_l = (np.log([r[i] for r in rows]) for i in range(3))

    def objective(x: np.ndarray) -> tuple[float, np.ndarray]:
        e, a, alpha, b, beta = x
        terms = np.stack([a - alpha * ln_n, b - beta * ln_d, np.full_like(ln_n, e)])
        pred = np.logaddexp.reduce(terms, axis=0)
        w = np.exp(terms - pred)  # d pred / d (a, b, e)
        r = pred - ln_l
        small = np.abs(r) <= HUBER_DELTA
        value = np.where(small, 0.5 * r * r, HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA))
        slope = np.where(small, r, HUBER_DELTA * np.sign(r))
        grad = [slope @ w[2], slope @ w[0], -(slope * w[0]) @ ln_n, slope @ w[1],
                -(slope * w[1]) @ ln_d]
        return float(value.sum()), np.array(grad)

    best = min((minimize(objective, np.array(x0), jac=True, method="L-BFGS-B")
                for x0 in _STARTS),
               key=lambda res: res.fun)
    e, a, alpha, b, beta = (float(v) for v in best.x)
    return ScalingFit(family, math.exp(e), math.exp(a), alpha, math.exp(b), beta, len(rows),
                      len(mine))


# The paper's GPT-2 small run (docs/paper.md section 5): 12 x 768, context 1024, vocab 50304,
# ~51.6B tokens; its training FLOPs counted as qkvlab counts every run's (model/params.py).
PAPER_TOKENS = 51.6e9


def paper_flops() -> float:
    cfg = ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304)
    return flops_per_token(cfg, 1024) * PAPER_TOKENS
