"""The final validation loss over many tokens, and per part of the corpus.

The curves during training use train.eval_windows fixed windows (cheap, and the same for
every run). After the last step the trainer scores `train.final_eval_tokens` target tokens
(2^20 by default; the whole val split when it holds fewer) in windows spread evenly over the
whole split, none sharing a target (data.loader.spread_starts): in eval mode, under the run's
dtype, with no random draw (a masked-LM encoder gets one fixed mask, as for its curve). Each
target token's loss also goes to the part of the corpus it comes from, where the prepared
folder records its source spans (`english`: dictionary, wikipedia, bible).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from qkvlab.data.loader import TokenData, spread_starts
from qkvlab.run.config import RunConfig
from qkvlab.run.device import autocast
from qkvlab.train import objectives
from qkvlab.train.distributed import DistContext

SUMMARY_KEY = "final_val_loss_long"


def target_labels(starts: np.ndarray, block_size: int,
                  spans: list[tuple[str, int, int]]) -> np.ndarray:
    """For each target of the windows at `starts` (shape (len(starts), block_size)), the index
    of the span holding it in the split, or len(spans) for a token outside every span."""
    pos = starts[:, None] + 1 + np.arange(block_size, dtype=np.int64)  # y = data[s + 1 ...]
    if not spans:
        return np.zeros(pos.shape, dtype=np.int64)
    first = np.array([a for _, a, _ in spans], dtype=np.int64)
    end = np.array([b for _, _, b in spans], dtype=np.int64)
    i = np.searchsorted(first, pos, side="right") - 1
    inside = (i >= 0) & (pos < end[np.maximum(i, 0)])
    return np.where(inside, i, len(spans))


@torch.no_grad()
def long_val_loss(fwd: torch.nn.Module, ctx: DistContext, cfg: RunConfig, data: TokenData,
                  batch_size: int) -> dict[str, Any] | None:
    """{"loss", "tokens", "windows", "seconds"[, "by_source": {part: {"loss", "tokens"}}]} of
    the model `fwd` (the trainer's wrapped model) on the spread val windows; None when
    train.final_eval_tokens is 0.

    Under torchrun the batches are dealt out round-robin and the sums all-reduced, every
    process running the same number of forwards (FSDP forwards are collectives that pair up).
    """
    tokens = cfg.train.final_eval_tokens
    if tokens == 0:
        return None
    t0 = time.perf_counter()
    block = cfg.model.block_size
    starts = spread_starts(data.val_tokens, block, tokens)
    x, y = data.val_windows_at(starts, block)
    x, y = objectives.eval_inputs(cfg, data.vocab_size, x, y)  # mlm: one fixed mask
    spans = data.source_spans("val") or []
    # one bin per span plus one for tokens outside them (none when spans tile the split)
    labels = torch.from_numpy(target_labels(starts, block, spans))
    n_bins = len(spans) + 1
    loss_sum = torch.zeros(n_bins, dtype=torch.float64)
    count = torch.zeros(n_bins, dtype=torch.float64)
    batches = list(range(0, len(starts), batch_size))
    mine = batches[ctx.rank::ctx.world_size]
    was_training = fwd.training
    fwd.eval()
    try:
        for i in range(math.ceil(len(batches) / ctx.world_size)):
            b = mine[i] if i < len(mine) else batches[0]  # a pad forward, not counted
            xb = x[b:b + batch_size].to(ctx.device)
            yb = y[b:b + batch_size].to(ctx.device)
            with autocast(ctx.device, cfg.train.dtype):
                logits, _ = fwd(xb)
            if i >= len(mine):
                continue
            ce = F.cross_entropy(logits.float().transpose(1, 2), yb, reduction="none",
                                 ignore_index=objectives.IGNORE_INDEX).double().cpu()
            keep = (yb != objectives.IGNORE_INDEX).cpu()
            lab = labels[b:b + batch_size][keep]
            loss_sum += torch.bincount(lab, weights=ce[keep], minlength=n_bins)
            count += torch.bincount(lab, minlength=n_bins).double()
    finally:
        fwd.train(was_training)
    sums = ctx.sum(*loss_sum.tolist(), *count.tolist())
    loss_sum, count = sums[:n_bins], sums[n_bins:]
    out: dict[str, Any] = {"loss": _mean(sum(loss_sum), sum(count)), "tokens": int(sum(count)),
                           "windows": len(starts)}
    if spans:
        by: dict[str, list[float]] = {}
        for (name, _a, _b), s, n in zip(spans, loss_sum, count, strict=False):
            acc = by.setdefault(name, [0.0, 0.0])  # a part may hold several spans
            acc[0] += s
            acc[1] += n
        out["by_source"] = {name: {"loss": _mean(s, n), "tokens": int(n)}
                            for name, (s, n) in by.items()}
    out["seconds"] = time.perf_counter() - t0
    return out


def _mean(total: float, n: float) -> float | None:
    """total / n, or None (null in JSON) for no tokens or a non-finite loss."""
    value = total / n if n else math.nan
    return value if math.isfinite(value) else None
