"""`qkvlab compare`: the paper's comparison at laptop scale, end to end.

The command (qkvlab.commands.compare) trains the baseline, W_Q = I and W_Q = I with the wider MLP,
each arm at the scale measured best at compare's shape, and W_Q = I with the paper's recipe
(model.variants.COMPARE_RULES; same data, same seed, same fixed validation windows); this module
summarises their runs into a table and plots the validation curves. Finished runs are reused
and interrupted ones resumed, so the command can be re-run after a kill.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rich.table import Table

from qkvlab.errors import QkvlabError
from qkvlab.experiments.plots import variant_colors
from qkvlab.experiments.rules import apply_rule, check_user_keys, user_keys
from qkvlab.experiments.stats import median_tokens_per_s
from qkvlab.model.params import count_params
from qkvlab.model.variants import COMPARE_RULES, rule_named
from qkvlab.run.config import (
    RESUME_HARMLESS,
    REUSE_HARMLESS,
    RunConfig,
    config_diff,
    load_config,
)
from qkvlab.run.layout import CONFIG_FILE, SUMMARY_FILE, list_checkpoints
from qkvlab.run.metrics import read_metrics
from qkvlab.run.records import is_finished, read_json_record

PRESETS = {"quick": "compare-quick", "long": "compare-long"}


def variant_configs(base: RunConfig, overrides: list[str], out: Path
                    ) -> list[tuple[str, str, RunConfig]]:
    """(name, description, config) of each variant of the comparison, in OUT/NAME: the rules
    of COMPARE_RULES applied to `base`, each key `overrides` sets kept as the user set it
    (experiments/rules.py)."""
    user = user_keys(overrides)
    check_user_keys({rule: rule for rule in COMPARE_RULES}, user,
                    "drop that --set, or write a sweep spec (docs/experiments.md) whose variants "
                    "set it in their own `set`")
    variants = []
    for rule in COMPARE_RULES:
        cfg = dataclasses.replace(apply_rule(base, rule, user), out_dir=str(out / rule),
                                  name=rule)
        what = (f"{rule_named(rule).description}, attn scale {cfg.model.scale:.4g} "
                f"({cfg.model.attn_scale}), weight decay {cfg.optim.weight_decay:g}")
        variants.append((rule, what, cfg))
    return variants


def reuse_problem(cfg: RunConfig) -> str | None:
    """Why the folder of `cfg` (a variant's run) cannot serve a command asking for `cfg`, or
    None: a finished run is reused only when it was trained with `cfg` (bar REUSE_HARMLESS:
    names, paths, logging), an interrupted one is resumed only with its trajectory (what
    `qkvlab train --resume` checks), and a folder without either is trained afresh."""
    run_dir = Path(cfg.out_dir)
    finished = is_finished(read_json_record(run_dir / SUMMARY_FILE), cfg.steps)
    if not finished and not list_checkpoints(run_dir):
        return None
    try:
        saved = load_config(run_dir / CONFIG_FILE)
    except QkvlabError as exc:
        return f"{run_dir} holds a run whose config qkvlab cannot read ({exc})"
    diffs = config_diff(saved, cfg, REUSE_HARMLESS if finished else RESUME_HARMLESS)
    if not diffs:
        return None
    what = "finished" if finished else "holds a run to resume, trained"
    return (f"{run_dir} {what} with another config than this command asks for, at "
            f"{'; '.join(diffs[:4])}")


def check_reusable(variants: list[tuple[str, str, RunConfig]]) -> None:
    """Refuse, before any work, a comparison whose folder holds runs of another config: their
    losses are no answer to this command."""
    problems = [p for p in (reuse_problem(cfg) for _, _, cfg in variants) if p]
    if problems:
        more = f" (and {len(problems) - 1} more variant(s))" if len(problems) > 1 else ""
        raise QkvlabError(f"{problems[0]}{more}: choose a new --out, or pass --fresh to "
                          "retrain every variant there")


def val_curve(records: list[dict]) -> tuple[list[int], list[float]]:
    points = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    return [s for s, _ in points], [v for _, v in points]


def summarize(out: Path, names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        run_dir = out / name
        records = read_metrics(run_dir)
        steps, vals = val_curve(records)
        if not vals:
            raise QkvlabError(f"run {run_dir} has no validation losses; re-run qkvlab compare")
        cfg = load_config(str(run_dir / CONFIG_FILE), [])
        counts = count_params(cfg.model)
        rows.append({
            "variant": name,
            "projection": cfg.model.projection,
            "mlp_hidden": cfg.model.hidden,
            "attn_scale": cfg.model.scale,
            "attn_scale_setting": cfg.model.attn_scale,  # e.g. "4/sqrt(d_k)", "paper"
            "alpha": cfg.model.alpha,  # scale x sqrt(d_k)
            "weight_decay": cfg.optim.weight_decay,
            "dtype": cfg.train.dtype,  # what train.dtype "auto" picked on the training machine
            "non_embedding": counts.non_embedding,
            "total": counts.total,
            "steps": steps[-1],
            "final_val_loss": vals[-1],
            "best_val_loss": min(vals),
            "tokens_per_s": median_tokens_per_s(records),
        })
    base = rows[0]["final_val_loss"]
    for r in rows:
        r["delta_vs_baseline"] = r["final_val_loss"] - base
        r["delta_pct"] = 100.0 * r["delta_vs_baseline"] / base
    return rows


def _scale_cell(r: dict) -> str:
    """The scale and its alpha; a compare.json written before alpha was recorded has none."""
    alpha = f" ({r['alpha']:.3g})" if r.get("alpha") is not None else ""
    return f"{r['attn_scale']:.4g}{alpha}"


# No speed column: the variants train one after another, so their tokens/s are of different
# minutes of a shared machine (one such table showed the baseline at 13,449 and W_Q = I at
# 23,986 tokens/s, at one shape); `qkvlab bench` times them interleaved, side by side.
SPEED_NOTE = ("Speed: the runs were timed one after another; compare their speed with "
              "`qkvlab bench`, which times them side by side.")


def render_table(rows: list[dict]) -> Table:
    table = Table(title="qkvlab compare: validation loss on the same fixed windows")
    for col in ("variant", "non-emb params", "total params", "wd", "scale (alpha)", "steps",
                "final val loss", "delta vs baseline"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in rows:
        table.add_row(r["variant"], f"{r['non_embedding']:,}", f"{r['total']:,}",
                      f"{r['weight_decay']:.4g}", _scale_cell(r), f"{r['steps']:,}",
                      f"{r['final_val_loss']:.4f}",
                      f"{r['delta_vs_baseline']:+.4f} ({r['delta_pct']:+.2f}%)")
    table.caption = SPEED_NOTE
    return table


def markdown_table(rows: list[dict]) -> str:
    lines = ["| variant | non-embedding params | total params | weight decay | attn scale "
             "(alpha = scale x sqrt(d_k)) | steps | final val loss | delta vs baseline |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['non_embedding']:,} | {r['total']:,} | "
            f"{r['weight_decay']:.4g} | {_scale_cell(r)} | {r['steps']:,} | "
            f"{r['final_val_loss']:.4f} | "
            f"{r['delta_vs_baseline']:+.4f} ({r['delta_pct']:+.2f}%) |")
    return "\n".join([*lines, "", SPEED_NOTE])


def plot_curves(out: Path, names: list[str], path: Path) -> None:
    # matplotlib takes ~0.7 s to import (measured): only a plot pays for it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_rel) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = variant_colors(names)
    curves = {name: val_curve(read_metrics(out / name)) for name in names}
    base_steps, base_vals = curves[names[0]]
    base_at = dict(zip(base_steps, base_vals, strict=True))
    for name, (steps, vals) in curves.items():
        ax.plot(steps, vals, marker=".", label=name, color=colors[name])
        rel = [(s, 100 * (v - base_at[s]) / base_at[s]) for s, v in zip(steps, vals, strict=True)
               if s in base_at and s > 0]  # step 0 differs only by initialisation
        if rel and name != names[0]:
            ax_rel.plot([s for s, _ in rel], [d for _, d in rel], marker=".", label=name,
                        color=colors[name])
    ax.set(xlabel="step", ylabel="validation loss", title="validation loss")
    ax.set_ylim(top=min(max(v[0] for _, v in curves.values() if v), ax.get_ylim()[1]))
    ax_rel.axhline(0, color="gray", lw=0.8)
    ax_rel.set(xlabel="step", ylabel="% vs baseline", title="relative difference vs baseline")
    for a in (ax, ax_rel):
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
