"""`qkvlab params`: parameter accounting of a config, or of the paper's five variants."""

from __future__ import annotations

from dataclasses import dataclass, field

from qkvlab.commands.common import Subparsers, add_overrides, register


@dataclass
class ParamsOptions:
    config: str | None = None
    untied: bool = False
    roles: bool = False
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
    if opts.roles:
        return _print_roles(models, opts.json)
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


def _print_roles(models: list, as_json: bool) -> int:
    """Each parameter's role and μP factors (model/parametrization.py), per model."""
    import json

    import torch
    from rich.table import Table

    from qkvlab.console import print_table
    from qkvlab.model import GPT
    from qkvlab.model.parametrization import base_std, parameter_table, readout_multiplier

    out = []
    for name, cfg in models:
        with torch.device("meta"):  # names and shapes only: no memory, no init time
            model = GPT(cfg)
        rows = [{"parameter": r.name, "role": r.role, "shape": list(model.get_parameter(
                    r.name).shape), "init_std": base_std(cfg, r.name) * r.scaling.init
                 if r.role != "gain" else None, "lr": r.scaling.lr,
                 "decay": r.scaling.decay if r.decays else 0.0, "eps": r.scaling.eps}
                for r in parameter_table(model, cfg)]
        out.append({"variant": name, "parametrization": cfg.parametrization,
                    "depth_scaling": cfg.depth_rule, "base_width": cfg.base_width or cfg.n_embd,
                    "base_depth": cfg.base_depth or cfg.n_layer,
                    "readout_multiplier": readout_multiplier(cfg), "parameters": rows})
    if as_json:
        print(json.dumps(out, indent=2))
        return 0
    for model in out:
        table = Table(title=f"{model['variant']}: {model['parametrization']}, depth "
                            f"{model['depth_scaling']}, base {model['base_width']} wide x "
                            f"{model['base_depth']} deep; readout multiplier "
                            f"{model['readout_multiplier']:.4g} (factors on optim.lr, "
                            "lr x weight_decay, eps)")
        for col in ("parameter", "role", "shape", "init std", "lr", "decay", "eps"):
            table.add_column(col, justify="left" if col in ("parameter", "role") else "right")
        for r in model["parameters"]:
            std = "1 / 0" if r["init_std"] is None else f"{r['init_std']:.4g}"
            table.add_row(r["parameter"], r["role"], "x".join(map(str, r["shape"])), std,
                          f"{r['lr']:.4g}", f"{r['decay']:.4g}", f"{r['eps']:.4g}")
        print_table(table)
    return 0


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("params", help="parameter accounting of a config or the paper's variants")
    p.add_argument("config", nargs="?",
                   help="TOML config or preset; default: the five GPT-2-small variants of the "
                        "paper")
    p.add_argument("--untied", action="store_true", help="count an untied output head")
    p.add_argument("--roles", action="store_true",
                   help="each parameter's role and its init, lr, decay and eps factors under "
                        "the config's parametrization")
    p.add_argument("--json", action="store_true", help="print JSON")
    add_overrides(p)
    register(p, ParamsOptions, run_params)
