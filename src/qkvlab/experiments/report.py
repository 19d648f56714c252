"""`qkvlab report SPEC_OR_DIR`: the Markdown report and plots of a sweep, from its run files.

Everything comes from the run folders: the resolved config (config.toml), the validation curve
(metrics.jsonl: val_loss, and val_acc for masked-LM encoders) and the speed (tokens_per_s).
The spec only supplies the structure: which group is the baseline, which groups form a family
in the stability view, which rule made each variant.

Statistics (qkvlab.experiments.results; the arithmetic in qkvlab.experiments.stats):

* per variant: final validation loss mean +- sample std over the seeds that finished;
* primary test, seed level: for each seed s, d_s = loss(variant, s) - loss(baseline, s), the
  two runs sharing initial-weight seed, batch order and validation windows; mean, t-based 95%
  confidence interval and two-sided p-value of the paired t-test over seeds;
* secondary, with --per-window: each final checkpoint is scored window by window on the same
  fixed windows, differences are averaged over seeds per window and tested over windows. It
  has many more pairs, but windows are neighbouring text scored by the same few models, so
  they are not independent draws: the seed-level test is the one to believe.

Files written to the report folder: report.md, report.json, val_curves.png, rel_diff.png and,
when a family spans several weight decays (learning rates), final_vs_weight_decay.png
(final_vs_lr.png).

This module reads the sweep and writes those files; the run folders are read by
qkvlab.experiments.runs, the figures drawn by qkvlab.experiments.plots and the Markdown
written by qkvlab.experiments.render.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkvlab.errors import QkvlabError
from qkvlab.experiments.headline import Headline, headline
from qkvlab.experiments.isoflop import (
    BudgetGap,
    GapTrend,
    IsoCurve,
    LrScan,
    ScalingFit,
    budget_gaps,
    gap_trend,
    isoflop_curves,
    lr_scans,
    paper_flops,
    scaling_fit,
    sized_curves,
)
from qkvlab.experiments.machines import machine_report, with_warning
from qkvlab.experiments.plots import (
    family_colors,
    plot_curves,
    plot_gaps,
    plot_grid,
    plot_headline,
    plot_rel,
    trend_gap_panels,
)
from qkvlab.experiments.plots_isoflop import (
    plot_frontier,
    plot_gap_trend,
    plot_isoflop,
    plot_lr_scans,
)
from qkvlab.experiments.plots_scan import plot_best_alpha, plot_scale_scan
from qkvlab.experiments.plots_transfer import plot_transfer
from qkvlab.experiments.render import render_markdown
from qkvlab.experiments.render_headline import headline_section
from qkvlab.experiments.render_isoflop import isoflop_section, lr_scan_section
from qkvlab.experiments.render_scan import scan_section
from qkvlab.experiments.results import (
    CONFIDENCE,
    DEFAULT_MARGIN_PCT,
    TREND_AXES,
    FitRow,
    PairedRelative,
    Report,
    grid_families,
    grid_gaps,
    group_result,
    pair_with_reference,
    pick_reference,
)
from qkvlab.experiments.runs import (
    RunData,
    attention_summary,
    find_seeds,
    per_window_losses,
    read_run,
)
from qkvlab.experiments.scale_scan import ScaleScan, alpha_trends
from qkvlab.experiments.spec import Group, Spec, identity_diff
from qkvlab.experiments.sweep import SWEEP_FILE, machine_info, now_iso
from qkvlab.experiments.transfer import transfer_rows, transfer_section
from qkvlab.fsutil import write_text_atomic
from qkvlab.run.records import read_json_record


def build_report(spec: Spec, sweep_dir: Path, per_window: bool = False,
                 overrides: list[str] | None = None, versus: str | None = None,
                 attention: bool = False, margin_pct: float = DEFAULT_MARGIN_PCT) -> Report:
    """The statistics of a sweep folder; the paired tests are against the spec's baseline, or
    against the group (or single-group variant) named by `versus`. `per_window` and
    `attention` measure the final checkpoints too (cached in the run folders); `margin_pct`
    is the equivalence margin of the headline's TOST, in % of the reference's loss."""
    record = _sweep_record(spec, sweep_dir)
    rules = {v.name: v.rule for v in spec.variants}
    read: list[tuple[Group, list[RunData]]] = []
    for g in spec.groups(overrides):
        _check_identity(g, record, sweep_dir, from_folder=spec.sweep_dir is not None)
        seeds = sorted(set(find_seeds(sweep_dir / g.name)))
        runs = [read_run(g, s, sweep_dir / g.name / f"seed-{s}") for s in seeds]
        for r in runs:
            if r.status == "done" and per_window:
                r.windows = per_window_losses(r, g)
            if r.status == "done" and attention:
                r.attention = attention_summary(r, g)
        read.append((g, runs))
    measure = use_loss_measure([r for _, runs in read for r in runs])
    results = [group_result(g, rules.get(g.variant), runs) for g, runs in read]
    if not any(r.status == "done" for g in results for r in g.runs):
        raise QkvlabError(f"no finished runs in {sweep_dir}: run `qkvlab sweep` to train them "
                          "(`--dry-run` shows their state)")
    baseline = pick_reference(results, versus, spec)
    pair_with_reference(results, baseline)
    return Report(spec, sweep_dir, results, baseline, record, per_window, margin_pct, measure)


def use_loss_measure(runs: list[RunData]) -> str:
    """The final loss the report compares: "long" (`train.final_eval_tokens`, 1M validation
    tokens over the whole split) when every finished run has it, else "windows" (the last
    periodic eval's fixed windows) for all, so that no pair mixes the two. Sets each finished
    run's final_loss to it."""
    done = [r for r in runs if r.status == "done"]
    if not done or any(r.final_loss_long is None for r in done):
        return "windows"
    for r in done:
        r.final_loss = r.final_loss_long
    return "long"


def _sweep_record(spec: Spec, sweep_dir: Path) -> dict[str, Any]:
    """The folder's sweep.json (empty for a folder without one), checked to be this spec's."""
    if not sweep_dir.is_dir():
        raise QkvlabError(f"no sweep folder at {sweep_dir}: run `qkvlab sweep "
                          f"{spec.source or spec.name} --out {sweep_dir}` first (or pass "
                          "--runs DIR)")
    record = read_json_record(sweep_dir / SWEEP_FILE) or {}
    if record and record.get("spec") != spec.name:
        raise QkvlabError(f"{sweep_dir} holds the sweep of spec {record.get('spec')!r}, not "
                          f"{spec.name!r}: report that folder with its own spec "
                          f"(qkvlab report {sweep_dir})")
    return record


def _check_identity(g: Group, record: dict[str, Any], sweep_dir: Path,
                    from_folder: bool = False) -> None:
    """Refuse a group whose runs were trained with another config than the spec gives now
    (`from_folder`: the spec is the folder's own copy)."""
    old = (record.get("groups") or {}).get(g.name)
    if old is not None and old.get("fingerprint") != g.fingerprint \
            and identity_diff(old.get("identity", {}), g.identity):
        # a folder's spec copy holds its --set overrides, unless it predates their record
        fix = ("pass the sweep's --set overrides (its sweep.json lists the commands)"
               if from_folder else "pass the sweep's --set overrides, or report the folder "
               f"itself (qkvlab report {sweep_dir})")
        raise QkvlabError(f"variant {g.name} in {sweep_dir} was made with another config "
                          f"than the spec resolves to now: {fix}")


def _training_gap_json(rep: Report) -> dict[str, Any] | None:
    gap = rep.training_gap
    return None if gap is None else {"steps": gap.steps, "relative_pct": gap.rel_pct}


def _fit_json(row: FitRow) -> dict[str, Any]:
    def vs(pr: PairedRelative | None) -> dict[str, Any] | None:
        return None if pr is None else pr.as_dict()

    return {"group": row.group, "train_loss_tail": row.train.mean, "best_val_loss": row.best.mean,
            "rise_after_best": row.rise.mean, "train_vs_reference": vs(row.train_vs_ref),
            "best_vs_reference": vs(row.best_vs_ref)}


def report_json(rep: Report, command: str, scan: ScaleScan, head: Headline,
                plots: dict[str, str], machines: dict[str, Any]) -> dict[str, Any]:
    m = rep.margin_pct
    return {
        "spec": rep.spec.name,
        "fingerprint": rep.record.get("fingerprint"),
        "command": command,
        "written": now_iso(),
        "machine": machine_info(),
        "sessions": rep.record.get("sessions", []),
        "baseline": rep.baseline.group.name,
        "confidence": CONFIDENCE,
        "equivalence_margin_pct": m,
        "loss_measure": rep.loss_measure,
        "headline": {**head.as_dict(), "figure": plots.get("headline")},
        "figures": plots,
        "groups": [g.as_dict(m) for g in rep.groups],
        "gap_over_training": _training_gap_json(rep),
        "fit": [_fit_json(row) for row in rep.fit],
        "attention": {row.group: {"seeds": row.seeds, "logit_std": row.logit_std,
                                  "entropy": row.entropy} for row in rep.attention},
        **{f"{a.name}_gaps": [{"family": w.family, a.name: w.value, "group": w.group,
                               "reference": w.reference, **w.as_dict(m)}
                              for w in rep.trend_gaps[a.name]]
           for a in TREND_AXES},
        **{f"{a.name}_grid_gaps": _grid_gaps_json(rep, a.key) for a in TREND_AXES if a.tuned},
        **{f"{a.name}_tuned_gaps": [
            {"family": w.family, a.name: w.value, "group": w.group, "reference": w.reference,
             f"reference_{a.name}": w.reference_value, "at_edge": w.edge, **w.as_dict(m)}
            for w in rep.tuned_gaps[a.name]] for a in TREND_AXES if a.tuned},
        "scale_scan": [c.as_dict() for c in scan.cells],
        "scale_tuned_gaps": [t.as_dict(m) for t in scan.tuned],
        "alpha_trends": [t.as_dict() for t in alpha_trends(scan.cells)],
        "scale_rule_gaps": [r.as_dict(m) for r in scan.rules],
        "scale_alpha_gaps": [a.as_dict(m) for a in scan.alphas],
        "runs": [r.as_dict() for r in rep.runs()],
        **machines,  # experiments/machines.py
    }


def _grid_gaps_json(rep: Report, key: str) -> dict[str, list[dict[str, Any]]]:
    """final_vs_<key>.png's right panel: per row, the gap to the reference family's row at each
    value both ran (each the best of its value)."""
    gaps = grid_gaps(rep, key, grid_families(rep, key)) or {}
    return {label: [{key: w.value, "group": w.group, "reference": w.reference,
                     **w.as_dict(rep.margin_pct)}
                    for w in ws] for label, ws in gaps.items() if ws}


def _draw(rep: Report, out: Path, scan: ScaleScan, head: Headline) -> dict[str, str]:
    """Every figure of the report, by role: "curves", "rel", "weight_decay" / "lr" (the
    grids), "gap_width" / "gap_lr", "scale_scan", "best_alpha", "tuned_gap_width", and
    "headline", the figure that answers the report's question (report.md shows it first)."""
    plots: dict[str, str] = {}
    ref, colors = rep.baseline.group.family, family_colors(rep)
    plot_curves(rep, out / "val_curves.png")
    plots["curves"] = "val_curves.png"
    if any(g.paired is not None for g in rep.groups):
        plot_rel(rep, out / "rel_diff.png")
        plots["rel"] = "rel_diff.png"
    for key in ("weight_decay", "lr"):
        fams = grid_families(rep, key)
        if fams:
            plot_grid(rep, key, fams, out / f"final_vs_{key}.png")
            plots[key] = f"final_vs_{key}.png"
    for axis in TREND_AXES:
        if rep.trend_gaps[axis.name]:
            name = f"gap_vs_{axis.name}.png"
            plot_gaps(trend_gap_panels(rep, axis), axis, ref,
                      f"{rep.spec.name}: gap to {ref} at the same {axis.name}, final "
                      "validation loss, paired by seed", out / name, rep.margin_pct,
                      colors=colors)
            plots[f"gap_{axis.name}"] = name
    if scan.cells:
        plot_scale_scan(scan.cells, rep.spec.name, out / "scale_scan.png", colors)
        plots["scale_scan"] = "scale_scan.png"
        if plot_best_alpha(scan.cells, rep.spec.name, out / "best_alpha.png", colors):
            plots["best_alpha"] = "best_alpha.png"
    if len({t.cell.width for t in scan.tuned}) > 1:
        by_lr: dict[float, list] = {}
        for t in scan.tuned:
            by_lr.setdefault(t.cell.lr, []).append(t.gap)
        plot_gaps([(f"lr {lr:g}", gaps) for lr, gaps in sorted(by_lr.items())], TREND_AXES[0],
                  ref, f"{rep.spec.name}: each arm at its own best alpha against {ref} at its "
                  "best, final validation loss by width, one panel per lr",
                  out / "tuned_gap_vs_width.png", rep.margin_pct, best=False, colors=colors)
        plots["tuned_gap_width"] = plots["headline"] = "tuned_gap_vs_width.png"
    if "headline" not in plots and head.kind in ("width", "lr"):
        plots["headline"] = plots.get(head.kind) or plots[f"gap_{head.kind}"]
    elif "headline" not in plots and head.rows:
        plot_headline(head, ref, rep.spec.name, out / "gaps.png")
        plots["headline"] = "gaps.png"
    return plots


@dataclass(frozen=True)
class IsoFlop:
    """A sweep's IsoFLOP analysis (experiments/isoflop.py) and its figures."""

    curves: list[IsoCurve]
    gaps: list[BudgetGap]
    trends: list[GapTrend]
    fits: list[ScalingFit]
    scans: list[LrScan]

    @classmethod
    def of(cls, rep: Report) -> IsoFlop:
        curves = isoflop_curves(rep)
        versus = {g.group.family: g.group.versus for g in rep.groups if g.group.versus}
        gaps = budget_gaps(curves, rep.baseline.group.family, versus)
        trends = [t for fam in dict.fromkeys(g.family for g in gaps)
                  if (t := gap_trend(gaps, fam)) is not None]
        fits = [f for fam in dict.fromkeys(c.family for c in curves)
                if (f := scaling_fit(curves, fam)) is not None]
        return cls(curves, gaps, trends, fits, lr_scans(rep))

    def draw(self, rep: Report, out: Path, plots: dict[str, str]) -> None:
        """The figures, each named in `plots` when drawn."""
        name, colors = rep.spec.name, family_colors(rep)
        if not self.curves:
            return
        plot_isoflop(sized_curves(self.curves, self.scans),
                     f"{name}: final loss against size at equal training compute",
                     out / "isoflop.png", colors)
        plots["isoflop"] = "isoflop.png"
        if plot_frontier(self.curves, f"{name}: loss against compute and against time",
                         out / "isoflop_frontier.png", colors):
            plots["isoflop_frontier"] = "isoflop_frontier.png"
        if any(g.fresh for g in self.gaps):
            plot_gap_trend(self.gaps, self.trends, rep.margin_pct, f"{name}: the gap of the "
                           "arms' minima against compute", out / "isoflop_gap.png",
                           extrapolate_to=paper_flops() if self.trends else None, colors=colors)
            plots["isoflop_gap"] = "isoflop_gap.png"
        if self.scans:
            plot_lr_scans(self.scans, f"{name}: final loss against the peak lr at a budget's "
                          "sizes", out / "isoflop_lr.png", colors)
            plots["isoflop_lr"] = "isoflop_lr.png"

    def as_dict(self, margin_pct: float) -> dict[str, Any] | None:
        if not self.curves:
            return None
        paper = paper_flops()
        fits = {f.family: f for f in self.fits}
        return {"curves": [{**c.as_dict(), "fit_optimum_params": fits[c.family].optimum(c)
                            if c.family in fits else None} for c in self.curves],
                "scaling_fits": [dataclasses.asdict(f) for f in self.fits],
                "gaps": [g.as_dict(margin_pct) for g in self.gaps],
                "trends": [{"family": t.family, "slope_pct_per_decade": t.slope,
                            "intercept_pct": t.intercept, "pairs": t.n,
                            "paper_flops": paper, "at_paper_flops_pct": list(t.at(paper))}
                           for t in self.trends],
                "lr_scans": [sc.as_dict() for sc in self.scans]}


def write_report(rep: Report, out: Path, command: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    scan = ScaleScan.of(rep)
    iso = IsoFlop.of(rep)
    head = headline(rep, scan, iso.gaps)
    plots = _draw(rep, out, scan, head)
    machines = machine_report(rep)  # which runs trained on which CPU kind and dtype
    rows = transfer_rows(rep)
    if plot_transfer(rows, f"{rep.spec.name}: does the tuned setting carry across shapes?",
                     out / "transfer.png"):
        plots["transfer"] = "transfer.png"
    iso.draw(rep, out, plots)
    # a sweep over budgets or shapes asks the question its own figure answers (an IsoFLOP
    # sweep with fresh seeds at its minima: their gaps, gaps.png)
    for answer in ("isoflop", "transfer"):
        if answer in plots and head.kind != "isoflop":
            plots["headline"] = plots[answer]
            break
    write_text_atomic(out / "report.json", json.dumps(
        {**report_json(rep, command, scan, head, plots, machines),
         "transfer": [r.as_dict() for r in rows], "isoflop": iso.as_dict(rep.margin_pct)},
        indent=1) + "\n")
    path = out / "report.md"
    section = (scan_section(scan.cells, scan.tuned, rep.baseline.group.family, plots,
                            scan.rules, scan.alphas)
               + transfer_section(rows, plots.get("transfer"))
               + isoflop_section(iso.curves, iso.gaps, iso.trends, iso.fits, rep.margin_pct,
                                 plots)
               + lr_scan_section(iso.scans, plots))
    top = headline_section(head, rep.baseline.group.name, plots.get("headline"))
    write_text_atomic(path, with_warning(render_markdown(rep, command, plots, section, top),
                                         machines))
    return path
