"""Parameter accounting rows of model configs (the data behind `qkvlab params`)."""

from __future__ import annotations

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
