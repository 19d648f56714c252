"""The statistics of a sweep report, group by group: summaries over seeds and the paired
tests against the reference group (the arithmetic is in qkvlab.experiments.stats)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from qkvlab.errors import QkvlabError
from qkvlab.experiments.runs import RunData
from qkvlab.experiments.spec import Group, Spec
from qkvlab.experiments.stats import (
    EquivalenceTest,
    PairedTest,
    Summary,
    holm,
    paired_t,
    relative,
    summarize,
    tost_paired,
)
from qkvlab.model.params import count_params

CONFIDENCE = 0.95
# Two arms are called level when the equivalence test (TOST) puts their paired difference
# within this share of the reference's loss (`qkvlab report --margin`).
DEFAULT_MARGIN_PCT = 0.5


def equivalence(diffs: list[float], reference_mean: float | None, margin_pct: float
                ) -> EquivalenceTest | None:
    """TOST of paired loss differences against +-margin_pct % of the reference's mean loss
    (None without a reference loss or a difference)."""
    if not diffs or not reference_mean:
        return None
    return tost_paired(diffs, margin_pct / 100.0 * abs(reference_mean))


def equivalence_json(eq: EquivalenceTest | None, reference_mean: float | None,
                     margin_pct: float) -> dict[str, Any] | None:
    """The equivalence test as report.json writes it: the test in loss units, the margin and
    the 90% interval also in % of the reference loss."""
    if eq is None:
        return None
    return {**eq.as_dict(), "margin_pct": margin_pct,
            "ci_pct": [relative(eq.ci_low, reference_mean), relative(eq.ci_high, reference_mean)]}


@dataclass
class GroupResult:
    group: Group
    rule: str | None
    params: dict[str, int]
    tokens_per_run: int
    runs: list[RunData]
    loss: Summary
    acc: Summary
    tokens_per_s: Summary
    paired: PairedTest | None = None  # vs the baseline, over seeds
    paired_seeds: list[int] = field(default_factory=list)
    baseline_mean: float | None = None  # the baseline's mean loss over the paired seeds
    rel_pct: float | None = None
    rel_ci: tuple[float | None, float | None] = (None, None)
    window_test: PairedTest | None = None
    window_rel_pct: float | None = None
    p_holm: float | None = None  # the seed-level p, Holm-adjusted over the report's comparisons
    paired_diffs: list[float] = field(default_factory=list)  # loss - reference loss, per seed

    def equivalence(self, margin_pct: float) -> EquivalenceTest | None:
        """TOST of the paired differences to the reference within +-margin_pct %."""
        return equivalence(self.paired_diffs, self.baseline_mean, margin_pct)

    @property
    def resolvable_pct(self) -> float | None:
        """Half the width of the relative 95% interval: a difference smaller than this cannot
        be told from 0 by these seeds."""
        lo, hi = self.rel_ci
        return None if lo is None or hi is None else (hi - lo) / 2

    def as_dict(self, margin_pct: float = DEFAULT_MARGIN_PCT) -> dict[str, Any]:
        g, m = self.group, self.group.config.model
        return {
            "group": g.name, "variant": g.variant, "family": g.family, "point": g.point,
            "baseline": g.baseline, "rule": self.rule, "projection": m.projection,
            "n_embd": m.n_embd, "mlp_hidden": m.hidden, "attn_scale": m.scale,
            "weight_decay": g.config.optim.weight_decay, "lr": g.config.optim.lr,
            **self.params, "tokens_per_run": self.tokens_per_run,
            "final_val_loss": self.loss.as_dict(), "final_val_acc": self.acc.as_dict(),
            "tokens_per_s": self.tokens_per_s.as_dict(),
            "paired_vs_baseline": None if self.paired is None else {
                **self.paired.as_dict(), "seeds": self.paired_seeds,
                "baseline_mean": self.baseline_mean, "relative_pct": self.rel_pct,
                "relative_ci_pct": list(self.rel_ci), "p_holm": self.p_holm,
                "resolvable_pct": self.resolvable_pct,
                "equivalence": equivalence_json(self.equivalence(margin_pct),
                                                self.baseline_mean, margin_pct)},
            "per_window_vs_baseline": None if self.window_test is None else {
                **self.window_test.as_dict(), "relative_pct": self.window_rel_pct},
        }


@dataclass
class Report:
    spec: Spec
    sweep_dir: Path
    groups: list[GroupResult]
    baseline: GroupResult  # the reference of the paired tests (the spec's, or --versus)
    record: dict[str, Any]
    per_window: bool
    margin_pct: float = DEFAULT_MARGIN_PCT  # the equivalence margin, % of the reference loss
    # the final loss compared: "long" (train.final_eval_tokens) or "windows" (the last eval's)
    loss_measure: str = "windows"

    def runs(self) -> list[RunData]:
        return [r for g in self.groups for r in g.runs]

    @property
    def ref(self) -> str:
        """How the text names the reference of the paired tests: the spec's baseline, or the
        variant `--versus` chose."""
        return "the baseline" if self.baseline.group.baseline else self.baseline.group.name

    # Derived once: the report's Markdown, JSON and plots all read them.
    @cached_property
    def training_gap(self) -> TrainingGap | None:
        return gap_over_training(self)

    @cached_property
    def fit(self) -> list[FitRow]:
        return fit_rows(self)

    @cached_property
    def attention(self) -> list[AttentionRow]:
        return attention_rows(self)

    @cached_property
    def trend_gaps(self) -> dict[str, list[SettingGap]]:
        """Per trend axis (TREND_AXES), the gaps at the same settings; [] when the sweep does
        not span that axis."""
        return {a.name: setting_gaps(self, a) for a in TREND_AXES}

    @cached_property
    def tuned_gaps(self) -> dict[str, list[SettingGap]]:
        """Per hyperparameter axis, each family at its best value against the reference's
        family at its best; [] where the sweep does not tune it."""
        return {a.name: tuned_gaps(self, a) for a in TREND_AXES}


def group_result(group: Group, rule: str | None, runs: list[RunData]) -> GroupResult:
    """A group's parameter counts and its summaries over the seeds that finished."""
    done = [r for r in runs if r.status == "done"]
    counts = count_params(group.config.model)
    cfg = group.config
    return GroupResult(
        group=group, rule=rule,
        params={"non_embedding_params": counts.non_embedding, "total_params": counts.total},
        tokens_per_run=cfg.steps * cfg.tokens_per_step,
        runs=runs,
        loss=summarize([r.final_loss for r in done]),
        acc=summarize([r.final_acc for r in done if r.final_acc is not None]),
        tokens_per_s=summarize([r.tokens_per_s for r in done if r.tokens_per_s]),
    )


def pick_reference(results: list[GroupResult], versus: str | None, spec: Spec) -> GroupResult:
    """The spec's baseline, or the group (or single-group variant) named by `versus`."""
    if versus is None:
        return next(g for g in results if g.group.baseline)
    return _reference(results, versus, spec)


def _reference(results: list[GroupResult], name: str, spec: Spec) -> GroupResult:
    hits = [g for g in results if g.group.name == name] or \
        [g for g in results if g.group.variant == name]
    if len(hits) != 1:
        names = ", ".join(g.group.name for g in results)
        why = "names several groups" if hits else "is not a variant of"
        raise QkvlabError(f"--versus {name} {why} spec {spec.name}: choose one of {names}")
    return hits[0]


def paired_shape(g: GroupResult) -> tuple[int, int, float | None]:
    """Where a group meets its reference: its width, depth and training-FLOP budget."""
    cfg = g.group.config
    return cfg.model.n_embd, cfg.model.n_layer, cfg.train.flop_budget


def compared_at_own_shape(g: GroupResult, ref: GroupResult, groups: list[GroupResult]) -> bool:
    """Whether `g` is compared at its own shape rather than with `ref`: it has another width,
    depth or FLOP budget than `ref` and the sweep runs `ref`'s family there too (a sweep over
    widths or budgets, whose gaps are taken at each: trend_gaps, tuned_gaps, the scale scan,
    the IsoFLOP minima), or it trains for another FLOP budget than `ref` (a gap would compare
    two budgets; the IsoFLOP section compares it with its own budget's reference, if any). A
    group at another width with no reference there (a narrower model matched in parameters) is
    paired with `ref`, as the spec means."""
    mine, theirs = paired_shape(g), paired_shape(ref)
    if mine == theirs:
        return False
    if None not in (mine[2], theirs[2]) and mine[2] != theirs[2]:
        return True
    return any(h.group.family == ref.group.family and paired_shape(h) == mine for h in groups)


def pair_with_reference(results: list[GroupResult], baseline: GroupResult) -> None:
    """Fill in each group's paired tests against `baseline`, over the seeds both finished (none
    for a group compared at its own shape, `compared_at_own_shape`)."""
    base_by_seed = {r.seed: r for r in baseline.runs if r.status == "done"}
    for g in results:
        if g is baseline or compared_at_own_shape(g, baseline, results):
            continue
        pairs = [(r, base_by_seed[r.seed]) for r in g.runs
                 if r.status == "done" and r.seed in base_by_seed]
        if pairs:
            _seed_test(g, pairs)
            _window_test(g, pairs)
    tested = [g for g in results if g.paired is not None]
    for g, p in zip(tested, holm([g.paired.p for g in tested]), strict=True):
        g.p_holm = p


@dataclass
class PairedRelative:
    """The seed-level paired test of a group against a reference, also as % of its loss."""

    seeds: list[int]
    test: PairedTest
    reference_mean: float | None
    rel_pct: float | None
    rel_ci: tuple[float | None, float | None]
    diffs: list[float] = field(default_factory=list)  # value - reference value, per seed

    def equivalence(self, margin_pct: float) -> EquivalenceTest | None:
        """TOST of the paired differences within +-margin_pct % of the reference."""
        return equivalence(self.diffs, self.reference_mean, margin_pct)

    def as_dict(self, margin_pct: float | None = None) -> dict[str, Any]:
        """The test; with `margin_pct`, the equivalence test at that margin too."""
        eq = {} if margin_pct is None else {"equivalence": equivalence_json(
            self.equivalence(margin_pct), self.reference_mean, margin_pct)}
        return {"seeds": self.seeds, **self.test.as_dict(), "relative_pct": self.rel_pct,
                "relative_ci_pct": list(self.rel_ci), **eq}


def paired_relative(pairs: list[tuple[RunData, RunData]],
                    value: Callable[[RunData], float] = lambda r: r.final_loss
                    ) -> PairedRelative:
    """(variant run, reference run) pairs of the same seed -> the paired test of `value` (the
    final validation loss unless told), in loss and %."""
    diffs = [value(r) - value(b) for r, b in pairs]
    test = paired_t(diffs, CONFIDENCE)
    ref = summarize([value(b) for _, b in pairs]).mean
    return PairedRelative([r.seed for r, _ in pairs], test, ref, relative(test.mean, ref),
                          (relative(test.ci_low, ref), relative(test.ci_high, ref)), diffs)


def _seed_test(g: GroupResult, pairs: list[tuple[RunData, RunData]]) -> None:
    pr = paired_relative(pairs)
    g.paired_seeds, g.paired, g.baseline_mean = pr.seeds, pr.test, pr.reference_mean
    g.rel_pct, g.rel_ci, g.paired_diffs = pr.rel_pct, pr.rel_ci, pr.diffs


@dataclass(frozen=True)
class TrendAxis:
    """A setting a sweep can vary along (a trend): each group is paired with the reference
    family's group at the same setting, and the gap is drawn against it."""

    name: str  # "width": the report.json key <name>_gaps, the section and plot names
    section: str  # where the setting lives in the run config
    key: str
    label: str  # the plot's x axis
    tuned: bool = False  # a hyperparameter: also compare each family at its own best value


TREND_AXES = (TrendAxis("width", "model", "n_embd", "width d (n_embd)"),
              TrendAxis("lr", "optim", "lr", "peak learning rate", tuned=True),
              TrendAxis("depth", "model", "n_layer", "depth L (n_layer)"))
DEPTH = TREND_AXES[2]


@dataclass
class SettingGap:
    """A group against the reference family's group at the same trend settings."""

    family: str
    value: float  # the group's value on the axis
    group: str
    reference: str
    result: PairedRelative  # the final validation loss
    best: PairedRelative  # each run's lowest validation loss: the gap with early stopping
    train: PairedRelative | None  # the training loss after 90% of the steps, where logged
    p_holm: float | None = None  # the final loss's p, Holm-adjusted over the axis's gaps
    reference_value: float | None = None  # the reference's value, where it is not `value`
    edge: bool = False  # tuned: a best value lies at the end of the values run

    def as_dict(self, margin_pct: float = DEFAULT_MARGIN_PCT) -> dict[str, Any]:
        return {**self.result.as_dict(margin_pct), "p_holm": self.p_holm,
                "best_val": self.best.as_dict(),
                "train": self.train.as_dict() if self.train else None}


def trend_settings(g: GroupResult) -> tuple[float, ...]:
    """The group's value on each trend axis (TREND_AXES order: width, lr, depth)."""
    return tuple(getattr(getattr(g.group.config, a.section), a.key) for a in TREND_AXES)


def setting_gaps(rep: Report, axis: TrendAxis) -> list[SettingGap]:
    """When the reference's family spans two or more values on `axis` (a width or learning-rate
    trend), each other group paired with the reference-family group at its own settings on every
    trend axis; else nothing. A setting where the reference family has several groups (an
    attention-scale scan, which experiments/scale_scan.py compares) pairs nothing."""
    fam = rep.baseline.group.family
    at = TREND_AXES.index(axis)
    found = _reference_family_settings(rep)
    refs = {k: gs[0] for k, gs in found.items() if len(gs) == 1}
    if len({k[at] for k in refs}) < 2:
        return []
    gaps = [setting_gap(g, refs.get(trend_settings(g)), at) for g in rep.groups
            if g.group.family != fam]
    return _holm_sorted([w for w in gaps if w is not None])


def _reference_family_settings(rep: Report) -> dict[tuple[float, ...], list[GroupResult]]:
    found: dict[tuple[float, ...], list[GroupResult]] = {}
    for g in rep.groups:
        if g.group.family == rep.baseline.group.family:
            found.setdefault(trend_settings(g), []).append(g)
    return found


def scanned_settings(rep: Report) -> int:
    """How many trend settings (width, lr) the reference family ran several groups at (an
    attention-scale scan): `setting_gaps` pairs nothing there."""
    return sum(len(gs) > 1 for gs in _reference_family_settings(rep).values())


def tuned_gaps(rep: Report, axis: TrendAxis) -> list[SettingGap]:
    """On a hyperparameter axis (the learning rate), each family at its own best value (lowest
    mean final validation loss, `best_group`) against the reference's family at its best, the
    other trend settings equal: is the gap a mismatch of that hyperparameter? Empty unless the
    reference family and another family both span two or more values (groups that differ
    elsewhere, an attention-scale scan, compete with their value's other groups: the best of
    both settings)."""
    fam, at = rep.baseline.group.family, TREND_AXES.index(axis)
    if not axis.tuned:
        return []
    cells: dict[tuple[str, tuple[float, ...]], list[GroupResult]] = {}
    for g in rep.groups:
        if g.loss.n:
            rest = tuple(v for i, v in enumerate(trend_settings(g)) if i != at)
            cells.setdefault((g.group.family, rest), []).append(g)
    gaps = []
    for (family, rest), gs in cells.items():
        refs = cells.get((fam, rest), [])
        spans = [{trend_settings(g)[at] for g in c} for c in (gs, refs)]
        if family == fam or min(len(v) for v in spans) < 2:
            continue
        best, ref = best_group(gs), best_group(refs)
        w = setting_gap(best, ref, at)
        if w is not None:
            w.reference_value = trend_settings(ref)[at]
            w.edge = any(trend_settings(b)[at] in (min(v), max(v)) for b, v in (
                (best, [trend_settings(g)[at] for g in gs]),
                (ref, [trend_settings(g)[at] for g in refs])))
            gaps.append(w)
    return _holm_sorted(gaps)


def best_group(groups: list[GroupResult]) -> GroupResult:
    """The group with the lowest mean final validation loss over the seeds every one of them
    finished, so that seeds added later to a few groups measure the choice without changing
    it; over each group's own seeds where they share none."""
    finals = [{r.seed: r.final_loss for r in g.runs
               if r.status == "done" and r.final_loss is not None} for g in groups]
    shared = set.intersection(*(set(f) for f in finals))
    if not shared:
        return min(groups, key=lambda g: g.loss.mean)
    by_shared = [sum(f[s] for s in shared) / len(shared) for f in finals]
    return groups[by_shared.index(min(by_shared))]


def setting_gap(g: GroupResult, ref: GroupResult | None, at: int) -> SettingGap | None:
    """`g` paired by seed with `ref` (final, best and training loss), or None without pairs."""
    if ref is None:
        return None
    base = {r.seed: r for r in ref.runs if r.status == "done" and r.best}
    pairs = [(r, base[r.seed]) for r in g.runs
             if r.status == "done" and r.best and r.seed in base]
    if not pairs:
        return None
    logged = [(r, b) for r, b in pairs if r.train_tail is not None and b.train_tail is not None]
    return SettingGap(
        g.group.family, trend_settings(g)[at], g.group.name, ref.group.name,
        paired_relative(pairs), paired_relative(pairs, lambda r: r.best[1]),
        paired_relative(logged, lambda r: r.train_tail) if logged else None)


def _holm_sorted(gaps: list[SettingGap]) -> list[SettingGap]:
    for w, p in zip(gaps, holm([w.result.test.p for w in gaps]), strict=True):
        w.p_holm = p
    return sorted(gaps, key=lambda w: (w.family, w.value))


def mean_band(curves: list[dict[int, float]]) -> tuple[list[int], list[float], list[float]]:
    """Steps common to all curves, the mean and the sample std (0 for one curve)."""
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    means, stds = [], []
    for s in steps:
        st = summarize([c[s] for c in curves])
        means.append(st.mean)
        stds.append(st.std or 0.0)
    return steps, means, stds


def rel_curves(rep: Report, g: GroupResult) -> tuple[list[int], list[float], list[float], int]:
    """Per step, the paired relative difference 100 (L_g - L_b) / L_b: mean and std over seeds
    (none for a group compared at its own shape, `compared_at_own_shape`)."""
    if compared_at_own_shape(g, rep.baseline, rep.groups):
        return [], [], [], 0
    base = {r.seed: r.curve for r in rep.baseline.runs if r.status == "done"}
    rels = []
    for r in g.runs:
        if r.status != "done" or r.seed not in base:
            continue
        b = base[r.seed]
        rels.append({s: 100.0 * (v - b[s]) / b[s] for s, v in r.curve.items()
                     if s in b and s > 0 and b[s]})  # step 0: the initial weights only
    steps, mean, std = mean_band(rels)
    return steps, mean, std, len(rels)


@dataclass
class TrainingGap:
    """The paired relative gap to the reference at a few steps across training."""

    steps: list[int]
    rel_pct: dict[str, list[float | None]]  # group -> mean over seeds at each step


def gap_over_training(rep: Report, fractions: tuple[float, ...] = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0)
                      ) -> TrainingGap | None:
    """Each group's gap (rel_curves) at the evaluated steps nearest to `fractions` of training:
    whether a gap is closing, steady or opening when training stops."""
    rows = {g.group.name: dict(zip(*rel_curves(rep, g)[:2], strict=True))
            for g in rep.groups if g is not rep.baseline}
    rows = {name: row for name, row in rows.items() if row}
    if not rows:
        return None
    evaluated = sorted(set().union(*rows.values()))
    last = evaluated[-1]
    steps = sorted({min(evaluated, key=lambda s: abs(s - f * last)) for f in fractions})
    return TrainingGap(steps, {name: [row.get(s) for s in steps] for name, row in rows.items()})


@dataclass
class FitRow:
    """How a group fits: its training loss and its best validation loss, each against the
    reference's (paired by seed), and how far validation loss rose after its best."""

    group: str
    train: Summary  # train_tail over seeds
    best: Summary  # best validation loss over seeds
    rise: Summary  # final - best validation loss over seeds (> 0: it rose at the end)
    train_vs_ref: PairedRelative | None
    best_vs_ref: PairedRelative | None


def fit_rows(rep: Report) -> list[FitRow]:
    """One row per group with finished runs: is a gap a fitting deficit (train loss higher
    too) or a generalisation one (train loss lower), and does early stopping change it? (No
    pairing for a group compared at its own shape, `compared_at_own_shape`.)"""
    base = {r.seed: r for r in rep.baseline.runs if r.status == "done"}
    rows = []
    for g in rep.groups:
        done = [r for r in g.runs if r.status == "done" and r.train_tail is not None
                and r.best is not None]
        if not done:
            continue
        pairs = [(r, base[r.seed]) for r in done if r.seed in base and base[r.seed].best
                 and base[r.seed].train_tail is not None]
        vs = (g is not rep.baseline and bool(pairs)
              and not compared_at_own_shape(g, rep.baseline, rep.groups))
        rows.append(FitRow(
            g.group.name, summarize([r.train_tail for r in done]),
            summarize([r.best[1] for r in done]),
            # the rise on the eval curve: its last point, not the long final eval, minus its best
            summarize([r.final_loss_windows - r.best[1] for r in done
                       if r.final_loss_windows is not None]),
            paired_relative(pairs, lambda r: r.train_tail) if vs else None,
            paired_relative(pairs, lambda r: r.best[1]) if vs else None))
    return rows


@dataclass
class AttentionRow:
    """A group's attention after training, per layer, averaged over its measured seeds."""

    group: str
    seeds: list[int]
    logit_std: list[float]
    entropy: list[float]


def attention_rows(rep: Report) -> list[AttentionRow]:
    """The groups whose finished runs carry attention statistics (`qkvlab report
    --attention`), each layer's logit std and row entropy averaged over seeds."""
    rows = []
    for g in rep.groups:
        runs = [r for r in g.runs if r.status == "done" and r.attention]
        if not runs:
            continue
        layers = range(len(runs[0].attention))
        rows.append(AttentionRow(
            g.group.name, [r.seed for r in runs],
            [math.fsum(r.attention[i]["logit_std"] for r in runs) / len(runs) for i in layers],
            [math.fsum(r.attention[i]["entropy"] for r in runs) / len(runs) for i in layers]))
    return rows


def _window_test(g: GroupResult, pairs: list[tuple[RunData, RunData]]) -> None:
    """The secondary test: per window, the difference averaged over seeds, tested over windows."""
    win = [(r.windows, b.windows) for r, b in pairs if r.windows and b.windows
           and len(r.windows) == len(b.windows)]
    if not win:
        return
    n = len(win[0][0])
    per_window = [math.fsum(a[w] - b[w] for a, b in win) / len(win) for w in range(n)]
    g.window_test = paired_t(per_window, CONFIDENCE)
    base_mean = math.fsum(math.fsum(b) / len(b) for _, b in win) / len(win)
    g.window_rel_pct = relative(g.window_test.mean, base_mean)


def grid_families(rep: Report, key: str) -> dict[str, list[GroupResult]]:
    """The rows of the optim.<key> view (a weight-decay or lr grid): one per family and setting
    of the other trend axes (width, and the lr when `key` is not it) that spans two or more values
    of `key`, in spec order, labelled by family (and the settings that tell its rows apart); each
    holds, per value, the best of its groups there (`best_group`: an attention-scale scan offers
    several; a value without a finished run keeps its first group), by value. Empty when no row
    spans two values."""
    axes = [i for i, a in enumerate(TREND_AXES) if (a.section, a.key) != ("optim", key)]
    rows: dict[tuple[Any, ...], dict[float, list[GroupResult]]] = {}
    for g in rep.groups:
        s = trend_settings(g)
        row = rows.setdefault((g.group.family, *(s[i] for i in axes)), {})
        row.setdefault(getattr(g.group.config.optim, key), []).append(g)
    spans = {k: [_best_finished(row[v]) for v in sorted(row)]
             for k, row in rows.items() if len(row) > 1}
    varies = [j for j in range(len(axes)) if len({k[1 + j] for k in spans}) > 1]
    return {_row_label(k, [axes[j] for j in varies], varies): gs for k, gs in spans.items()}


def grid_gaps(rep: Report, key: str, fams: dict[str, list[GroupResult]]
              ) -> dict[str, list[SettingGap]] | None:
    """On a tuned axis (the lr), each row of `grid_families` (but the reference family's) paired
    by seed with the reference family's cell at the same value and other settings, each the best
    of its value: the gap where both arms ran that value. None for an axis that is not tuned
    (a weight-decay grid compares every row with the one reference instead)."""
    axis = next((a for a in TREND_AXES if a.tuned and a.key == key), None)
    if axis is None:
        return None
    fam, at = rep.baseline.group.family, TREND_AXES.index(axis)
    refs = {trend_settings(g): g for gs in fams.values() for g in gs if g.group.family == fam}
    gaps = {label: [setting_gap(g, refs.get(trend_settings(g)), at) for g in gs
                    if g.group.family != fam] for label, gs in fams.items()}
    return {label: [w for w in ws if w is not None] for label, ws in gaps.items()}


def _best_finished(groups: list[GroupResult]) -> GroupResult:
    done = [g for g in groups if g.loss.n]
    return best_group(done) if done else groups[0]


def _row_label(key: tuple[Any, ...], axes: list[int], at: list[int]) -> str:
    short = {"width": "d", "lr": "lr", "depth": "L"}
    return " ".join([key[0], *(f"{short[TREND_AXES[i].name]} {key[1 + j]:g}"
                               for i, j in zip(axes, at, strict=True))])
