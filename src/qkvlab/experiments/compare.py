"""`qkvlab compare`: the paper's comparison at laptop scale, end to end.

Trains baseline, W_Q = I and W_Q = I with the wider MLP (same data, same seed, same fixed
validation windows), then prints a table and writes a plot of the validation curves. Finished
runs are reused and interrupted ones resumed, so the command can be re-run after a kill.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from rich.table import Table

from qkvlab.console import table_console
from qkvlab.errors import QkvlabError
from qkvlab.experiments.variants import compare_variants
from qkvlab.model.params import count_params
from qkvlab.train.trainer import read_metrics

PRESETS = {"quick": "compare-quick", "long": "compare-long"}


def val_curve(records: list[dict]) -> tuple[list[int], list[float]]:
    points = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    return [s for s, _ in points], [v for _, v in points]


def median_tokens_per_s(records: list[dict]) -> float | None:
    # the first logged steps include warm-up (allocation, first-touch): skip a quarter
    values = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
    values = sorted(values[len(values) // 4:])
    return values[len(values) // 2] if values else None


def summarize(out: Path, names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        run_dir = out / name
        records = read_metrics(run_dir)
        steps, vals = val_curve(records)
        if not vals:
            raise QkvlabError(f"run {run_dir} has no validation losses; re-run qkvlab compare")
        from qkvlab.train.config import load_config

        cfg = load_config(str(run_dir / "config.toml"), [])
        counts = count_params(cfg.model)
        rows.append({
            "variant": name,
            "projection": cfg.model.projection,
            "mlp_hidden": cfg.model.hidden,
            "attn_scale": cfg.model.scale,
            "weight_decay": cfg.optim.weight_decay,
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


def render_table(rows: list[dict]) -> Table:
    table = Table(title="qkvlab compare: validation loss on the same fixed windows")
    for col in ("variant", "non-emb params", "total params", "wd", "scale", "final val loss",
                "delta vs baseline", "tokens/s"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in rows:
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "n/a"
        table.add_row(r["variant"], f"{r['non_embedding']:,}", f"{r['total']:,}",
                      f"{r['weight_decay']:.4g}", f"{r['attn_scale']:.4g}",
                      f"{r['final_val_loss']:.4f}",
                      f"{r['delta_vs_baseline']:+.4f} ({r['delta_pct']:+.2f}%)", tps)
    return table


def markdown_table(rows: list[dict]) -> str:
    lines = ["| variant | non-embedding params | total params | weight decay | attn scale | "
             "final val loss | delta vs baseline | tokens/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "n/a"
        lines.append(
            f"| {r['variant']} | {r['non_embedding']:,} | {r['total']:,} | "
            f"{r['weight_decay']:.4g} | {r['attn_scale']:.4g} | {r['final_val_loss']:.4f} | "
            f"{r['delta_vs_baseline']:+.4f} ({r['delta_pct']:+.2f}%) | {tps} |")
    return "\n".join(lines)


def plot_curves(out: Path, names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_rel) = plt.subplots(1, 2, figsize=(11, 4.2))
    curves = {name: val_curve(read_metrics(out / name)) for name in names}
    base_steps, base_vals = curves[names[0]]
    base_at = dict(zip(base_steps, base_vals, strict=True))
    for name, (steps, vals) in curves.items():
        ax.plot(steps, vals, marker=".", label=name)
        rel = [(s, 100 * (v - base_at[s]) / base_at[s]) for s, v in zip(steps, vals, strict=True)
               if s in base_at and s > 0]  # step 0 differs only by initialisation
        if rel and name != names[0]:
            ax_rel.plot([s for s, _ in rel], [d for _, d in rel], marker=".", label=name)
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


def compare_command(args) -> int:
    from qkvlab.train.config import load_config
    from qkvlab.train.trainer import train

    if args.preset not in PRESETS:
        raise QkvlabError(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.max_steps={args.steps}")
    if args.seed is not None:
        overrides.append(f"train.seed={args.seed}")
    base = load_config(PRESETS[args.preset], overrides)
    out = Path(args.out)
    variants = compare_variants(base.model)
    console = table_console()
    for v in variants:
        run_dir = out / v.name
        if (run_dir / "summary.json").exists() and not args.fresh:
            console.print(f"[bold]{v.name}[/]: finished earlier in {run_dir}, reusing it")
            continue
        if args.fresh and run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        cfg = dataclasses.replace(
            base, model=v.model, optim=dataclasses.replace(base.optim, weight_decay=v.weight_decay),
            out_dir=str(run_dir), name=v.name)
        console.print(f"[bold]{v.name}[/]: {v.description}, weight decay {v.weight_decay:g}")
        train(cfg, resume=True)
    names = [v.name for v in variants]
    rows = summarize(out, names)
    console.print(render_table(rows))
    plot = out / "compare.png"
    plot_curves(out, names, plot)
    (out / "compare.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "compare.md").write_text(markdown_table(rows) + "\n")
    console.print(f"table: {out / 'compare.md'}  plot: {plot}")
    return 0
