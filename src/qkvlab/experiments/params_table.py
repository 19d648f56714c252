"""`qkvlab params`: parameter accounting of a config, or of the paper's five variants."""

from __future__ import annotations

import dataclasses
import json

from rich.table import Table

from qkvlab.console import table_console
from qkvlab.experiments.variants import paper_variants
from qkvlab.model.config import ModelConfig
from qkvlab.model.params import count_params, flops_per_token

COLUMNS = ("attn_q", "attn_k", "attn_v", "attn_o", "query_map", "mlp", "norms",
           "non_embedding", "embedding", "total")


def params_rows(models: list[tuple[str, ModelConfig]]) -> list[dict]:
    rows = []
    for name, cfg in models:
        counts = count_params(cfg).as_dict()
        rows.append({"variant": name, "projection": cfg.projection, "n_embd": cfg.n_embd,
                     "mlp_hidden": cfg.hidden, "attn_scale": cfg.scale,
                     "flops_per_token": flops_per_token(cfg), **counts})
    return rows


def params_command(args) -> int:
    if args.config is None:
        models = [(v.name, v.model) for v in paper_variants()]
        title = "PAPER.md section 5: GPT-2 small variants"
    else:
        from qkvlab.train.config import load_config

        cfg = load_config(args.config, args.overrides)
        models = [(cfg.name or "model", cfg.model)]
        title = args.config
    if args.untied:
        models = [(n, dataclasses.replace(c, tie_embeddings=False)) for n, c in models]
    rows = params_rows(models)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title=f"{title} ({'untied' if args.untied else 'tied'} embeddings)")
    for col in ("variant", "projection", "mlp_hidden", "attn_scale") + COLUMNS:
        table.add_column(col, justify="left" if col in ("variant", "projection") else "right")
    for r in rows:
        table.add_row(r["variant"], r["projection"], str(r["mlp_hidden"]),
                      f"{r['attn_scale']:.4g}", *(f"{r[c]:,}" for c in COLUMNS))
    table_console().print(table)
    return 0
