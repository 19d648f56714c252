"""The report's Markdown: provenance, the verdict in plain words, and the tables behind it.

Each section of report.md has its own renderer returning its lines; `render_markdown` puts them
in order. Numbers are formatted here only: the statistics come ready from
qkvlab.experiments.results.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

from qkvlab.experiments.results import (
    TREND_AXES,
    GroupResult,
    Report,
    SettingGap,
    TrendAxis,
    compared_at_own_shape,
    grid_families,
    paired_shape,
    scanned_settings,
)
from qkvlab.experiments.runs import ATTENTION_WINDOWS
from qkvlab.experiments.spec import Spec
from qkvlab.experiments.stats import Summary, sign_test_floor
from qkvlab.experiments.sweep import machine_info, now_iso
from qkvlab.run.layout import SUMMARY_FILE
from qkvlab.run.records import read_json_record
from qkvlab.theory.scale import uniform_entropy

# What docs/paper.md reports for the variants the rules make (GPT-2 small, OpenWebText, one seed).
PAPER_SAYS: dict[str, str] = {
    "q-identity": "comparable to the baseline (117M vs 124M params)",
    "q-identity-wide": "better: 3.004 vs 3.016 (-0.40%)",
    "nonlinear-q": "better: -2.40% log-loss (60k steps, tuned lr)",
}


def paper_says(spec: Spec, g: GroupResult, ref: GroupResult) -> str:
    """The paper's finding for a variant that is exactly one of its rules (no fields, no grid,
    no overrides), compared with the spec's baseline; "-" otherwise, since the paper says
    nothing about other settings or other references."""
    v = next((v for v in spec.variants if v.name == g.group.variant), None)
    if not ref.group.baseline or v is None or v.fields or v.grid or v.set \
            or v.rule not in PAPER_SAYS:
        return "-"
    if g.group.config.train.objective == "mlm":
        return "claimed for encoders, never trained"
    return PAPER_SAYS[v.rule]


# ---- plain words ---------------------------------------------------------------------------
def _f(x: float | None, fmt: str = ".4f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _pct(x: float | None, fmt: str = "+.3f", prefix: str = "") -> str:
    """A percentage as the tables print it, "n/a" when there is none."""
    return "n/a" if x is None or math.isnan(x) else f"{prefix}{format(x, fmt)}%"


def _pct_ci(ci: tuple[float | None, float | None]) -> str:
    return "n/a" if None in ci else f"[{_pct(ci[0])}, {_pct(ci[1])}]"


def _p(p: float | None) -> str:
    if p is None:
        return "n/a"
    return "< 0.0001" if p < 1e-4 else f"{p:.4f}" if p < 0.01 else f"{p:.3f}"


def verdict(g: GroupResult, ref: str = "the baseline") -> str:
    """One sentence on a variant vs the reference, in words a reader can check in the tables."""
    t = g.paired
    if t is None or t.mean is None:
        return f"{g.group.name}: no seed has both this variant and {ref} finished."
    diff = f"{t.mean:+.4f} ({_f(g.rel_pct, '+.2f')}%)"
    if t.n < 2:
        return (f"{g.group.name}: one seed only, difference {diff}; one seed cannot tell a "
                "difference from seed noise.")
    ci = f"95% CI [{_f(t.ci_low, '+.4f')}, {_f(t.ci_high, '+.4f')}]"
    if t.significant:
        word = "lower (better)" if t.mean < 0 else "higher (worse)"
        return (f"{g.group.name}: validation loss {word} than {ref} by {diff}, {ci}, "
                f"p = {_p(t.p)} over {t.n} seeds.")
    return (f"{g.group.name}: no significant difference from {ref} at the 5% level "
            f"({diff}, {ci} includes 0, p = {_p(t.p)}, {t.n} seeds).")


def verdicts(rep: Report) -> list[str]:
    """The verdict of each variant against the reference, then one line counting the groups
    compared at their own shape instead and one naming those that have no paired seed yet (a
    scan in progress has dozens)."""
    others = [g for g in rep.groups if compared_at_own_shape(g, rep.baseline, rep.groups)]
    elsewhere = {id(g) for g in others}
    unpaired = [g for g in rep.groups if g is not rep.baseline and id(g) not in elsewhere
                and (g.paired is None or g.paired.mean is None)]
    skip = elsewhere | {id(g) for g in unpaired}
    lines = [verdict(g, rep.ref) for g in rep.groups
             if g is not rep.baseline and id(g) not in skip]
    if others:
        width, depth, budget = paired_shape(rep.baseline)
        at = f"d = {width}, {depth} layers" + (f", {budget:.3g} FLOPs" if budget else "")
        lines.append(f"{len(others)} group(s) at another width, depth or budget than {rep.ref} "
                     f"({at}) are not paired with it here (the gap would compare two sizes of "
                     "model or two budgets): the sections below compare each shape's arms.")
    if unpaired and not rep.baseline.loss.n:
        lines.append(f"{rep.ref} has no finished run yet, so no variant is paired with it "
                     "(--versus GROUP names another reference).")
    elif unpaired:
        lines.append(f"{len(unpaired)} variant(s) have no seed finished beside {rep.ref} yet: "
                     + ", ".join(g.group.name for g in unpaired) + ".")
    return lines


def tuned_verdicts(rep: Report) -> list[str]:
    """One line per tuned comparison (each family at its own best hyperparameter, and alpha
    where a scan ran too, against the reference family at its best): a sweep's answer when the
    spec's reference cell alone would not be a fair one."""
    groups = {g.group.name: g.group.config for g in rep.groups}
    lines = []
    for axis in TREND_AXES:
        for w in rep.tuned_gaps.get(axis.name, []):
            cfg, ref = groups[w.group], groups[w.reference]
            r = w.result
            edge = f"; a best {axis.name} lies at the end of the values run" if w.edge else ""
            lines.append(
                f"Each family at its own best {axis.name} (d = {cfg.model.n_embd}): "
                f"**{w.family}** at {axis.name} {w.value:g} and alpha {cfg.model.alpha:.3g} "
                f"against {rep.baseline.group.family} at {axis.name} {w.reference_value:g} "
                f"and alpha {ref.model.alpha:.3g}: "
                + (f"{_pct(r.rel_pct)} {_pct_ci(r.rel_ci)} over {r.test.n} seeds "
                   f"(p {_p(r.test.p)})" if r.test.n > 1 else
                   f"{_pct(r.rel_pct)} on one seed (no interval)") + f"{edge}.")
    return lines


def _pm(s: Summary, fmt: str = ".4f") -> str:
    if s.mean is None:
        return "n/a"
    return f"{s.mean:{fmt}} +- {s.std:{fmt}}" if s.std is not None else f"{s.mean:{fmt}}"


def _machine_line(m: dict[str, Any]) -> str:
    gpus = f", GPUs: {', '.join(m['gpus'])}" if m.get("gpus") else ""
    usable = f" ({m['cpus_usable']} usable)" if m.get("cpus_usable") not in (None,
                                                                             m.get("cpu_count")) \
        else ""
    return (f"{m.get('cpu', '?')}, {m.get('cpu_count', '?')} CPUs{usable}{gpus}; "
            f"torch {m.get('torch', '?')}, Python {m.get('python', '?')}, "
            f"{m.get('platform', '?')}, qkvlab {m.get('qkvlab', '?')}")


# ---- report.md -------------------------------------------------------------------------------
def render_markdown(rep: Report, command: str, plots: dict[str, str],
                    scan: list[str] | None = None, headline: list[str] | None = None) -> str:
    """report.md; `plots` maps "curves", "rel", "weight_decay", "lr", ... to the written
    figures; `scan` is the attention-scale scan's section (qkvlab.experiments.render_scan) and
    `headline` the comparisons that answer the report's question
    (qkvlab.experiments.render_headline), if any."""
    L: list[str] = [f"# qkvlab report: {rep.spec.name}", ""]
    if rep.spec.description:
        L += [rep.spec.description, ""]
    L += _provenance(rep, command)
    L += headline or []
    L += _findings(rep)
    L += _variants_table(rep)
    L += _paired_table(rep)
    if rep.per_window:
        L += _per_window_table(rep)
    L += _training_gap_section(rep)
    L += _fit_section(rep)
    L += _attention_section(rep)
    L += _curves(plots)
    for axis in TREND_AXES:
        L += _gap_section(rep, axis, plots)
        L += _tuned_section(rep, axis)
    L += scan or []
    for key, title in (("weight_decay", "Stability: final loss vs weight decay"),
                       ("lr", "Final loss vs learning rate")):
        fams = grid_families(rep, key)
        if fams:
            L += _grid_section(key, title, fams, plots)
    L += _runs_table(rep)
    L.append("")
    return "\n".join(L)


def _is_mlm(rep: Report) -> bool:
    return rep.baseline.group.config.train.objective == "mlm"


def _provenance(rep: Report, command: str) -> list[str]:
    spec, cfg = rep.spec, rep.baseline.group.config
    L = ["## Provenance", "", f"- Report: `{command}` (written {now_iso()})"]
    sessions = [s for s in rep.record.get("sessions", []) if s.get("mode") == "run"] or \
        rep.record.get("sessions", [])
    commands = list(dict.fromkeys(s.get("command", "") for s in sessions if s.get("command")))
    for c in commands:
        L.append(f"- Runs: `{c}`")
    machines = list(dict.fromkeys(_machine_line(s.get("machine", {})) for s in sessions
                                  if s.get("machine")))
    for m in machines:
        L.append(f"- Trained on: {m}")
    copied = Counter(str(Path(r.reused_from).parent.parent) for r in rep.runs()
                     if r.reused_from)  # <sweep>/<group>/seed-<n> -> <sweep>
    for src, n in sorted(copied.items()):
        L.append(f"- {n} run(s) copied from the sweep `{src}` (same config and seed; "
                 "`qkvlab sweep --reuse`)")
    L.append(f"- Report machine: {_machine_line(machine_info())}")
    devices = sorted({f"{s.get('device')} {s.get('dtype')}" for r in rep.runs()
                      if r.status == "done"
                      for s in [read_json_record(r.run_dir / SUMMARY_FILE) or {}]
                      if s.get("device")})
    fp = rep.record.get("fingerprint")
    L.append(f"- Spec fingerprint: `{fp[:16] if fp else 'n/a'}`; base `{spec.base}`"
             + (f" with {', '.join(f'`{s}`' for s in spec.set)}" if spec.set else ""))
    length = (f"{cfg.steps:,} steps" if cfg.train.flop_budget is None else
              "the steps each group's train.flop_budget pays for")
    L.append(f"- Shared settings: {length} x {cfg.tokens_per_step:,} tokens "
             f"({cfg.train.batch_size} x {cfg.train.grad_accum} x {cfg.model.block_size}), "
             f"objective {cfg.train.objective}, data `{cfg.data.dir}` ({cfg.data.tokenizer}), "
             f"eval on {cfg.train.eval_windows} fixed windows of {cfg.model.block_size} tokens"
             + (f", {', '.join(devices)}" if devices else ""))
    L.append("- The final loss compared: " + (
        f"over {cfg.train.final_eval_tokens:,} validation tokens spread over the whole split "
        "(`final_val_loss_long`), which every finished run has" if rep.loss_measure == "long"
        else "the last periodic eval's, on its fixed windows"))
    if _is_mlm(rep):
        L.append("- Encoders (objective mlm): val loss is the masked-token cross-entropy and val "
                 "acc the masked-token accuracy, on one fixed mask shared by every run")
    return L


def _findings(rep: Report) -> list[str]:
    base = rep.baseline
    L = ["", "## What the data shows", ""]
    n_done = sum(r.status == "done" for r in rep.runs())
    # the spec's grid, plus any extra seeds the folder holds; not only the folders begun so far
    n_all = sum(len(set(rep.spec.seeds) | {r.seed for r in g.runs}) for g in rep.groups)
    role = "Baseline" if base.group.baseline else "Reference (`--versus`)"
    L.append(f"{n_done} of {n_all} runs finished. {role}: **{base.group.name}**, final "
             f"validation loss {_pm(base.loss)} over {base.loss.n} seed(s).")
    L.append("")
    L += [f"- {line}" for line in tuned_verdicts(rep) + verdicts(rep)]
    fails = [r for r in rep.runs() if r.status == "failed"]
    if fails:
        why = ["diverged" if r.diverged else r.error[:80] for r in fails]
        L.append(f"- {len(fails)} run(s) failed: " + "; ".join(
            f"{r.group} seed {r.seed} ({w})" for r, w in zip(fails, why, strict=True)))
    return L


def _variants_table(rep: Report) -> list[str]:
    mlm = _is_mlm(rep)
    L = ["", "## Variants", "",
         "| variant | rule | projection | d | MLP hidden | scale | wd | lr | non-emb params | "
         "total params | tokens/run | seeds | final val loss (mean +- std) |"
         + (" final val acc |" if mlm else "") + " tokens/s |",
         "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
         + ("---:|" if mlm else "") + "---:|"]
    for g in rep.groups:
        m, o = g.group.config.model, g.group.config.optim
        name = f"**{g.group.name}**" if g is rep.baseline else g.group.name
        L.append(f"| {name} | {g.rule or '-'} | "
                 f"{m.projection} | {m.n_embd} | {m.hidden} | {m.scale:.4g} | "
                 f"{o.weight_decay:.4g} | {o.lr:.3g} | {g.params['non_embedding_params']:,} | "
                 f"{g.params['total_params']:,} | {g.tokens_per_run:,} | {g.loss.n} | "
                 f"{_pm(g.loss)} |" + (f" {_pm(g.acc)} |" if mlm else "")
                 + f" {_f(g.tokens_per_s.mean, ',.0f')} |")
    return L


def _paired_table(rep: Report) -> list[str]:
    base = rep.baseline
    L = ["", f"## Paired differences vs {base.group.name} (primary: seed level)", "",
         "d_s = final val loss(variant, seed s) - final val loss"
         f"({base.group.name}, seed s); same seed = same initial-weight seed and batch order, "
         "same fixed validation windows. "
         "t-test of the d_s against 0 (n - 1 degrees of freedom), two-sided p, 95% t "
         "interval. Negative = the variant has lower loss.", "", *_resolution(rep), "",
         "| variant | pairs (seeds) | mean diff | std | 95% CI | t | p | p (Holm) | relative | "
         "relative 95% CI | resolvable | paper says |",
         "|---|---|---:|---:|---|---:|---:|---:|---:|---|---:|---|"]
    for g in rep.groups:
        if g is base:
            continue
        t = g.paired
        if t is None:  # listed under "What the data shows"
            continue
        paper = paper_says(rep.spec, g, base)
        L.append(f"| {g.group.name} | {t.n} ({', '.join(map(str, g.paired_seeds))}) | "
                 f"{_f(t.mean, '+.4f')} | {_f(t.std)} | "
                 f"[{_f(t.ci_low, '+.4f')}, {_f(t.ci_high, '+.4f')}] | {_f(t.t, '.2f')} | "
                 f"{_p(t.p)} | {_p(g.p_holm)} | {_pct(g.rel_pct)} | {_pct_ci(g.rel_ci)} | "
                 f"{_pct(g.resolvable_pct, '.3f', '+-')} | {paper} |")
    return L


def _resolution(rep: Report) -> list[str]:
    """What these seeds can and cannot show, in two sentences."""
    tested = [g for g in rep.groups if g is not rep.baseline and g.paired is not None
              and g.paired.n >= 2]
    if not tested:
        return ["Fewer than two paired seeds: no test is possible."]
    n = min(g.paired.n for g in tested)
    widths = [g.resolvable_pct for g in tested if g.resolvable_pct is not None]
    spread = (f"+-{min(widths):.2f}%" if f"{min(widths):.2f}" == f"{max(widths):.2f}"
              else f"+-{min(widths):.2f}% to +-{max(widths):.2f}%")
    span = (f"a difference smaller than {spread} (half the "
            "95% interval, column *resolvable*) cannot be told from 0" if widths else "")
    return [f"What {n} seeds can show: {span}; the t-test assumes the seed differences are "
            f"normal, and a distribution-free sign test over {n} seeds cannot go below "
            f"p = {sign_test_floor(n):.3g}. *p (Holm)* adjusts p for the {len(tested)} "
            f"comparison{'s' if len(tested) > 1 else ''} of this report with a test "
            "(family-wise 5%)."]


def _per_window_table(rep: Report) -> list[str]:
    L = ["", "## Per-window view (secondary)", "",
         "Each final checkpoint scored window by window on the same fixed validation "
         f"windows; per window, the difference to {rep.ref} is averaged over the paired "
         "seeds, then tested over windows. Windows are neighbouring pieces of one text "
         "scored by the same few models, so they are not independent: this narrows the "
         "interval more than the evidence warrants. Trust the seed-level test above.", "",
         "| variant | windows | mean diff | 95% CI | p | relative |",
         "|---|---:|---:|---|---:|---:|"]
    for g in rep.groups:
        t = g.window_test
        if g is rep.baseline or t is None:
            continue
        L.append(f"| {g.group.name} | {t.n} | {_f(t.mean, '+.4f')} | "
                 f"[{_f(t.ci_low, '+.4f')}, {_f(t.ci_high, '+.4f')}] | {_p(t.p)} | "
                 f"{_pct(g.window_rel_pct)} |")
    return L


def _curves(plots: dict[str, str]) -> list[str]:
    L = ["", "## Validation curves", ""]
    if "curves" in plots:
        L.append(f"![validation loss]({plots['curves']})")
    if "rel" in plots:
        L += ["", f"![relative difference]({plots['rel']})"]
    return L


def _grid_section(key: str, title: str, fams: dict[str, list[GroupResult]],
                  plots: dict[str, str]) -> list[str]:
    """Final loss per family at each value of optim.<key> (a weight-decay or lr grid)."""
    L = ["", f"## {title}", ""]
    if key == "weight_decay":
        L += ["The paper reports that W_Q = I trains stably at a >3x lower weight decay "
              "(2^-5 vs 0.1). Per family, the final loss at each weight decay; a family "
              "that degrades or diverges at low weight decay where the other does not is "
              "evidence on that claim.", ""]
    L += ["Final validation loss, mean +- std over seeds (n). A row is a family at one setting "
          "of the other axes; where several of its groups ran at one value (an attention-scale "
          "scan), the cell is the one with the lowest mean over the seeds they all finished, its "
          "alpha in brackets when the "
          "row's cells differ in it.", ""]
    values = sorted({getattr(g.group.config.optim, key) for gs in fams.values() for g in gs})
    L.append("| family | " + " | ".join(f"{key} {v:g}" for v in values) + " |")
    L.append("|---|" + "---:|" * len(values))
    for fam, gs in fams.items():
        alpha = len({round(g.group.config.model.alpha, 6) for g in gs}) > 1
        at = {getattr(g.group.config.optim, key): g for g in gs}  # one group a value
        cells = [_grid_cell(at.get(v), alpha) for v in values]
        L.append(f"| {fam} | " + " | ".join(cells) + " |")
    if key in plots:
        L += ["", f"![final loss vs {key}]({plots[key]})"]
    return L


def _grid_cell(g: GroupResult | None, alpha: bool = False) -> str:
    """The row's group at a grid point: mean +- std (n), its alpha when asked, and how many of
    its runs failed."""
    if g is None:
        return ""
    nfail = sum(r.status == "failed" for r in g.runs)
    shown = f"n={g.loss.n}" + (f", alpha {g.group.config.model.alpha:.3g}" if alpha else "")
    cell = f"{_pm(g.loss)} ({shown})" if g.loss.n else "n/a"
    return cell + (f", {nfail} failed" if nfail else "")


def _runs_table(rep: Report) -> list[str]:
    mlm = _is_mlm(rep)
    L = ["", "## Runs", "",
         "| variant | seed | status | steps | final val loss |"
         + (" final val acc |" if mlm else "") + " tokens/s | folder |",
         "|---|---:|---|---:|---:|" + ("---:|" if mlm else "") + "---:|---|"]
    for r in rep.runs():
        try:
            folder = r.run_dir.relative_to(rep.sweep_dir)
        except ValueError:
            folder = r.run_dir
        status = r.status + (" (diverged)" if r.diverged else "") \
            + (" (copied, --reuse)" if r.reused_from else "")
        L.append(f"| {r.group} | {r.seed} | {status} | {r.steps:,}/{r.max_steps:,} | "
                 f"{_f(r.final_loss)} |" + (f" {_f(r.final_acc)} |" if mlm else "")
                 + f" {_f(r.tokens_per_s, ',.0f')} | {folder} |")
    return L


def _training_gap_section(rep: Report) -> list[str]:
    """The paired gap at a few steps: is it closing, steady or opening when training stops?"""
    gap = rep.training_gap
    if gap is None:
        return []
    L = ["", "## The gap over training", "",
         f"Paired difference to {rep.baseline.group.name}'s validation loss at the same step and "
         "seed, as % of it, mean over the finished seeds (the curve is rel_diff.png).", "",
         "| variant | " + " | ".join(f"step {s:,}" for s in gap.steps) + " |",
         "|---|" + "---:|" * len(gap.steps)]
    for name, row in gap.rel_pct.items():
        L.append(f"| {name} | " + " | ".join(_pct(v) for v in row) + " |")
    return L


def _fit_section(rep: Report) -> list[str]:
    """Training loss and the best validation loss beside the final one: fitting or
    generalisation, and whether early stopping would change the comparison."""
    if not rep.fit:
        return []
    ref = rep.baseline.group.name
    L = ["", "## Fit and generalisation", "",
         "*train*: the mean training loss logged after 90% of the steps (the same batches for the "
         "same seed); *best*: the lowest validation loss of the run (the early-stopping view); "
         "*rise*: final minus best validation loss (> 0: it went up at the end, the model began "
         f"to overfit). Differences are paired by seed against {ref}, as % of its value, with "
         "95% intervals. Higher train and validation loss: the variant fits less (an "
         "optimisation or capacity deficit); lower train but higher validation loss: it "
         "generalises worse.", "",
         "| variant | train | vs ref | 95% CI | best val | vs ref | 95% CI | rise |",
         "|---|---:|---:|---|---:|---:|---|---:|"]
    for row in rep.fit:
        t, b = row.train_vs_ref, row.best_vs_ref
        L.append(f"| {row.group} | {_f(row.train.mean)} | {_pct(t.rel_pct) if t else ''} | "
                 f"{_pct_ci(t.rel_ci) if t else ''} | {_f(row.best.mean)} | "
                 f"{_pct(b.rel_pct) if b else ''} | {_pct_ci(b.rel_ci) if b else ''} | "
                 f"{_f(row.rise.mean, '+.4f')} |")
    return L


def _attention_section(rep: Report) -> list[str]:
    """How sharply each group attends after training (`--attention`), layer by layer."""
    if not rep.attention:
        return []
    n = len(rep.attention[0].logit_std)
    cfg = rep.baseline.group.config
    ceiling = uniform_entropy(cfg.model.block_size, cfg.model.causal)
    L = ["", "## Attention after training", "",
         f"Each final checkpoint on the first {ATTENTION_WINDOWS} validation windows of "
         f"{cfg.model.block_size} tokens (`qkvlab report --attention`), mean over seeds: the "
         "std of the attention logits q k^T * scale over the pairs a query may see, and the mean "
         f"entropy of the attention rows in nats (attention spread evenly: {ceiling:.2f}; "
         "lower is sharper).", "",
         "| variant | seeds | " + " | ".join(f"logit std L{i + 1}" for i in range(n)) + " | "
         + " | ".join(f"entropy L{i + 1}" for i in range(n)) + " |",
         "|---|---|" + "---:|" * (2 * n)]
    for row in rep.attention:
        L.append(f"| {row.group} | {', '.join(map(str, row.seeds))} | "
                 + " | ".join(f"{v:.2f}" for v in row.logit_std) + " | "
                 + " | ".join(f"{v:.2f}" for v in row.entropy) + " |")
    return L


def _gap_section(rep: Report, axis: TrendAxis, plots: dict[str, str]) -> list[str]:
    """The gap to the baseline at the same setting against a trend axis (width, learning
    rate), when the sweep spans it."""
    gaps = rep.trend_gaps[axis.name]
    if not gaps:
        return []
    fam, short = rep.baseline.group.family, "d" if axis.name == "width" else axis.name
    L = ["", f"## Gap to the baseline against {axis.name}", "",
         f"Each group against the {fam} group at its own {axis.name}, paired by seed (t-test, "
         "95% interval), as % of that baseline's loss: at the end (*final*, with p and p "
         "Holm-adjusted over this table's rows), at each "
         "run's lowest validation loss (*best*: early stopping, which takes out overfitting) "
         "and in training loss (*train*, after 90% of the steps; higher: it fits less)."
         + _scanned_note(rep), "",
         f"| family | {short} | group | vs | seeds | {fam} final | final | 95% CI | p "
         "| p (Holm) | best | 95% CI | train | 95% CI |",
         "|---|---:|---|---|---|---:|---:|---|---:|---:|---:|---|---:|---|"]
    for w in gaps:
        L.append(f"| {w.family} | {w.value:g} | {w.group} | {w.reference} | "
                 f"{', '.join(map(str, w.result.seeds))} | "
                 f"{_f(w.result.reference_mean, '.4f')} | {gap_cells(w)} |")
    if f"gap_{axis.name}" in plots:
        L += ["", f"![gap vs {axis.name}]({plots[f'gap_{axis.name}']})"]
    return L


def _scanned_note(rep: Report) -> str:
    n = scanned_settings(rep)
    if not n:
        return ""
    fam = rep.baseline.group.family
    return (f" The {n} setting(s) where the {fam} family ran several groups (an attention-scale "
            "scan, say) pair nothing here; a scale scan's section compares each arm at its best "
            "alpha.")


def _tuned_section(rep: Report, axis: TrendAxis) -> list[str]:
    """Each family at its own best value of a hyperparameter against the reference's family at
    its best: the comparison a tuned-for-each-model study makes."""
    gaps = rep.tuned_gaps[axis.name]
    if not gaps:
        return []
    fam = rep.baseline.group.family
    alpha = {g.group.name: g.group.config.model.alpha for g in rep.groups}
    L = ["", f"## Each family at its own best {axis.name}", "",
         f"Each family at the {axis.name} with its lowest mean final validation loss (over the "
         "seeds all its groups finished, so that seeds added to a few measure the choice "
         "without changing it), against "
         f"the {fam} family at its own best {axis.name}, paired by seed (as above). Every group "
         "of a family at the other settings competes, so where alpha was scanned too this is "
         f"the best {axis.name} and alpha together. The best value is picked on these same "
         "runs, which flatters each side a little; a gap that stays here is not a "
         f"{axis.name} mismatch.", "",
         f"| family | best {axis.name} | alpha | group | {fam} best {axis.name} | alpha | vs "
         "| seeds | final | 95% CI | p | p (Holm) | best | 95% CI | train | 95% CI |",
         "|---|---:|---:|---|---:|---:|---|---|---:|---|---:|---:|---:|---|---:|---|"]
    for w in gaps:
        L.append(f"| {w.family} | {w.value:g} | {alpha[w.group]:.3g} | {w.group} | "
                 f"{w.reference_value:g} | {alpha[w.reference]:.3g} | {w.reference} | "
                 f"{', '.join(map(str, w.result.seeds))} | {gap_cells(w)} |")
    if any(w.edge for w in gaps):
        L += ["", f"A best {axis.name} lies at the end of the values run: the optimum may lie "
              "beyond them, and the gap at a better value is not measured."]
    return L


def gap_cells(w: SettingGap) -> str:
    """final | 95% CI | p | p (Holm) | best | 95% CI | train | 95% CI of a gap table's row."""
    r = w.result
    train = f"{_pct(w.train.rel_pct)} | {_pct_ci(w.train.rel_ci)}" if w.train else "n/a | n/a"
    return (f"{_pct(r.rel_pct)} | {_pct_ci(r.rel_ci)} | {_p(r.test.p)} | {_p(w.p_holm)} | "
            f"{_pct(w.best.rel_pct)} | {_pct_ci(w.best.rel_ci)} | {train}")
