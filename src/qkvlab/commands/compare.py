"""`qkvlab compare`: train baseline, W_Q = I and W_Q = I + wider MLP, then tabulate and plot."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from qkvlab.commands.common import Subparsers, add_overrides, register
from qkvlab.errors import QkvlabError

if TYPE_CHECKING:
    from rich.console import Console

    from qkvlab.train.config import RunConfig


@dataclass
class CompareOptions:
    preset: str = "quick"
    out: str = "runs/compare"
    steps: int | None = None
    seed: int | None = None
    fresh: bool = False
    overrides: list[str] = field(default_factory=list)

    def validate(self) -> None:
        from qkvlab.experiments.compare import PRESETS

        if self.preset not in PRESETS:
            raise QkvlabError(f"unknown preset {self.preset!r}; choose one of "
                              f"{', '.join(PRESETS)}")


def run_compare(opts: CompareOptions) -> int:
    """Train the variants that are not finished, then write the table and the plot."""
    import json

    from qkvlab.console import table_console
    from qkvlab.experiments.compare import (
        PRESETS,
        markdown_table,
        plot_curves,
        render_table,
        summarize,
    )
    from qkvlab.train.config import load_config

    opts.validate()
    overrides = list(opts.overrides)
    if opts.steps is not None:
        overrides.append(f"train.max_steps={opts.steps}")
    if opts.seed is not None:
        overrides.append(f"train.seed={opts.seed}")
    base = load_config(PRESETS[opts.preset], overrides)
    out = Path(opts.out)
    console = table_console()
    names = _train_variants(base, out, opts.fresh, console)
    rows = summarize(out, names)
    console.print(render_table(rows))
    plot = out / "compare.png"
    plot_curves(out, names, plot)
    (out / "compare.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "compare.md").write_text(markdown_table(rows) + "\n")
    console.print(f"table: {out / 'compare.md'}  plot: {plot}")
    return 0


def _train_variants(base: RunConfig, out: Path, fresh: bool, console: Console) -> list[str]:
    """Train (or resume) each variant in OUT/NAME, reusing finished runs unless `fresh`."""
    import dataclasses

    from qkvlab.model.variants import compare_variants
    from qkvlab.train import train

    variants = compare_variants(base.model)
    for v in variants:
        run_dir = out / v.name
        if (run_dir / "summary.json").exists() and not fresh:
            console.print(f"[bold]{v.name}[/]: finished earlier in {run_dir}, reusing it")
            continue
        if fresh and run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        cfg = dataclasses.replace(
            base, model=v.model, optim=dataclasses.replace(base.optim, weight_decay=v.weight_decay),
            out_dir=str(run_dir), name=v.name)
        console.print(f"[bold]{v.name}[/]: {v.description}, weight decay {v.weight_decay:g}")
        train(cfg, resume=True)
    return [v.name for v in variants]


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("compare", help="the main job: baseline vs W_Q = I vs W_Q = I + wider MLP")
    p.add_argument("--preset", default="quick", help="quick (~10 min on 2 cores) | long")
    p.add_argument("--out", default="runs/compare", help="folder for the runs, table and plot")
    p.add_argument("--steps", type=int, default=None, help="override the number of steps")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--fresh", action="store_true", help="retrain runs that already finished")
    add_overrides(p)
    register(p, CompareOptions, run_compare)
