"""`qkvlab params`: parameter accounting of a config, or of the paper's five variants."""

from __future__ import annotations

from dataclasses import dataclass, field

from qkvlab.commands.common import Subparsers, add_overrides, register


@dataclass
class ParamsOptions:
    config: str | None = None
    untied: bool = False
    json: bool = False
    overrides: list[str] = field(default_factory=list)


def run_params(opts: ParamsOptions) -> int:
    """Print the parameter table (or its rows as JSON)."""
    import dataclasses
    import json

    from rich.table import Table

    from qkvlab.console import print_table
    from qkvlab.experiments.params_table import COLUMNS, params_rows
    from qkvlab.model.variants import paper_variants

    if opts.config is None:
        models = [(v.name, v.model) for v in paper_variants()]
        title = "docs/paper.md section 5: GPT-2 small variants"
    else:
        from qkvlab.run.config import load_config

        cfg = load_config(opts.config, opts.overrides)
        models = [(cfg.name or "model", cfg.model)]
        title = opts.config
    if opts.untied:
        models = [(n, dataclasses.replace(c, tie_embeddings=False)) for n, c in models]
    rows = params_rows(models)
    if opts.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title=f"{title} ({'untied' if opts.untied else 'tied'} embeddings)")
    for col in ("variant", "projection", "mlp_hidden", "attn_scale") + COLUMNS:
        table.add_column(col, justify="left" if col in ("variant", "projection") else "right")
    for r in rows:
        table.add_row(r["variant"], r["projection"], str(r["mlp_hidden"]),
                      f"{r['attn_scale']:.4g}", *(f"{r[c]:,}" for c in COLUMNS))
    print_table(table)
    return 0


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("params", help="parameter accounting of a config or the paper's variants")
    p.add_argument("config", nargs="?",
                   help="TOML config or preset; default: the five GPT-2-small variants of the "
                        "paper")
    p.add_argument("--untied", action="store_true", help="count an untied output head")
    p.add_argument("--json", action="store_true", help="print JSON")
    add_overrides(p)
    register(p, ParamsOptions, run_params)
