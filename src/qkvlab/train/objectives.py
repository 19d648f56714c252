"""Training objectives: next-token prediction (clm) and BERT-style masked language modelling.

The paper trains decoders only and claims the W_Q = I result for encoders too; `mlm` is how
qkvlab tests that claim. An encoder is the same model with `model.causal = false`; what changes
is the batch (a masked copy of the window, targets only at masked positions) and the metric
(masked-token loss and accuracy).

Both transforms are pure functions of their arguments, like the loader's batches:

* training masks come from a generator seeded by (train.seed, step, micro_step), drawn for the
  whole micro-batch and sliced per process, so a resume replays the same masks and the masks do
  not depend on how many processes share the batch;
* the evaluation mask is seeded by a constant, independent of the run's seed, so every run and
  every variant of an experiment is scored on the same masked positions of the same windows:
  differences between runs are paired.

The [MASK] token is one extra id above the data's vocabulary (`mask_token_id`), so the model's
vocabulary must have room for it.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from qkvlab.data.loader import mix_seed
from qkvlab.errors import QkvlabError
from qkvlab.run.config import OBJECTIVES
from qkvlab.run.device import autocast
from qkvlab.train.distributed import DistContext

IGNORE_INDEX = -100  # GPT.forward skips these targets
# BERT's split of the selected positions: 80% [MASK], 10% a random token, 10% unchanged.
MASK_SHARE, RANDOM_SHARE = 0.8, 0.1
# Fixed seeds, unrelated to any run's train.seed (the eval mask must be the same for all runs).
_TRAIN_SALT = 0x4D4C4D  # "MLM": keeps the mask stream apart from the loader's window stream
_EVAL_SEED = 0x5EED_E7A1


def mask_token_id(data_vocab_size: int) -> int:
    """The [MASK] id: the first id above the data's tokens."""
    return data_vocab_size


def check_objective(cfg: Any, data_vocab_size: int) -> None:
    """Refuse an objective the model or data cannot serve (before anything is trained)."""
    objective = cfg.train.objective
    if objective not in OBJECTIVES:
        raise QkvlabError(f"train.objective = {objective!r}: use one of {', '.join(OBJECTIVES)}")
    if objective != "mlm":
        return
    if cfg.model.causal:
        raise QkvlabError("train.objective = mlm needs a bidirectional encoder (a causal model "
                          "cannot see the context right of a masked token): set "
                          "model.causal = false")
    need = data_vocab_size + 1
    if cfg.model.vocab_size < need:
        raise QkvlabError(
            f"train.objective = mlm needs model.vocab_size >= {need} (the data's {data_vocab_size} "
            f"tokens plus the [MASK] id {mask_token_id(data_vocab_size)}), got "
            f"{cfg.model.vocab_size}: use --set model.vocab_size={need} (or larger)"
        )


def mask_tokens(
    tokens: torch.Tensor,
    generator: torch.Generator,
    prob: float,
    data_vocab_size: int,
    part: int = 0,
    parts: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking of `tokens` (B, T): (inputs, targets), targets -100 where not selected.

    `tokens` is row slice `part` of `parts` of a micro-batch of B * parts rows; the random
    draws cover that whole micro-batch, so each row's mask is the same whatever the number of
    processes. Every row gets at least one selected position, so no row is left without a
    target (a batch of only ignored targets has no defined mean loss).
    """
    b, t = tokens.shape
    shape = (b * parts, t)
    select_u = torch.rand(shape, generator=generator)
    kind_u = torch.rand(shape, generator=generator)
    random_ids = torch.randint(data_vocab_size, shape, generator=generator)
    forced = torch.randint(t, (b * parts,), generator=generator)  # for rows with no selection
    mine = slice(part * b, (part + 1) * b)
    select_u, kind_u, random_ids, forced = (
        select_u[mine], kind_u[mine], random_ids[mine], forced[mine])
    selected = select_u < prob
    empty = (~selected.any(dim=1)).nonzero().squeeze(1)
    selected[empty, forced[empty]] = True
    inputs = tokens.clone()
    to_mask = selected & (kind_u < MASK_SHARE)
    to_random = selected & (kind_u >= MASK_SHARE) & (kind_u < MASK_SHARE + RANDOM_SHARE)
    inputs[to_mask] = mask_token_id(data_vocab_size)
    inputs[to_random] = random_ids[to_random]
    targets = torch.where(selected, tokens, torch.full_like(tokens, IGNORE_INDEX))
    return inputs, targets


def train_inputs(
    cfg: Any,
    data_vocab_size: int,
    x: torch.Tensor,
    y: torch.Tensor,
    step: int,
    micro_step: int,
    part: int = 0,
    parts: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, targets) a training micro-step feeds the model.

    clm: the loader's (x, y) as they are. mlm: x masked, targets at the masked positions; x is
    rows `part` of `parts` of the micro-batch (the same slicing as TokenData.train_batch).
    """
    if cfg.train.objective != "mlm":
        return x, y
    gen = torch.Generator().manual_seed(mix_seed(cfg.train.seed, step, micro_step, _TRAIN_SALT))
    return mask_tokens(x, gen, cfg.train.mlm_prob, data_vocab_size, part, parts)


def eval_inputs(
    cfg: Any, data_vocab_size: int, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed validation (inputs, targets): unchanged for clm, one fixed mask for mlm."""
    if cfg.train.objective != "mlm":
        return x, y
    gen = torch.Generator().manual_seed(mix_seed(_EVAL_SEED, x.size(0), x.size(1)))
    return mask_tokens(x, gen, cfg.train.mlm_prob, data_vocab_size)


def _token_sums(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-row (summed cross-entropy, correct predictions, target count) over non-ignored tokens."""
    logits = logits.float()
    keep = targets != IGNORE_INDEX
    ce = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX,
                         reduction="none")  # (B, T), 0 at ignored positions
    correct = (logits.argmax(dim=-1) == targets) & keep
    return ce.sum(dim=1), correct.sum(dim=1), keep.sum(dim=1)


@torch.no_grad()
def evaluate_masked(par: Any, x: torch.Tensor, y: torch.Tensor, batch_size: int,
                    dtype: str) -> tuple[float, float]:
    """(masked-token loss, masked-token accuracy) over the fixed windows, token-weighted.

    `par` is the trainer's train.distributed.Parallel: under torchrun the eval batches are dealt
    out round-robin and the sums all-reduced, every process running the same number of forwards
    (FSDP forwards are collectives that must pair up), as Parallel.evaluate does for clm.
    """
    ctx, fwd = par.ctx, par.fwd
    starts = list(range(0, x.size(0), batch_size))
    mine = starts[ctx.rank::ctx.world_size]
    rounds = math.ceil(len(starts) / ctx.world_size)
    was_training = fwd.training
    fwd.eval()
    loss_sum = correct = count = 0.0
    try:
        for i in range(rounds):
            start = mine[i] if i < len(mine) else starts[0]
            xb = x[start:start + batch_size].to(ctx.device)
            yb = y[start:start + batch_size].to(ctx.device)
            with autocast(ctx.device, dtype):
                logits, _ = fwd(xb)
            if i < len(mine):
                ce, ok, n = _token_sums(logits, yb)
                loss_sum += float(ce.sum())
                correct += float(ok.sum())
                count += float(n.sum())
    finally:
        fwd.train(was_training)
    loss_sum, correct, count = ctx.sum(loss_sum, correct, count)
    return loss_sum / count, correct / count


@torch.no_grad()
def window_losses(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int,
                  device: torch.device, dtype: str) -> list[float]:
    """Mean loss of each window over its targets (all tokens for clm, masked ones for mlm).

    For clm every window has the same number of targets, so the mean over windows is the
    trainer's val_loss; the experiment report pairs these per window across runs.
    """
    was_training = model.training
    model.eval()
    out: list[float] = []
    try:
        for start in range(0, x.size(0), batch_size):
            xb = x[start:start + batch_size].to(device)
            yb = y[start:start + batch_size].to(device)
            with autocast(device, dtype):
                logits, _ = model(xb)
            ce, _ok, n = _token_sums(logits, yb)
            out.extend((ce / n.clamp(min=1)).tolist())
    finally:
        model.train(was_training)
    return out


def evaluate_model_masked(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                          batch_size: int, device: torch.device, dtype: str
                          ) -> tuple[float, float]:
    """evaluate_masked for a plain model in this process (`qkvlab eval`)."""
    return evaluate_masked(SimpleNamespace(ctx=DistContext(device), fwd=model), x, y, batch_size,
                           dtype)
