"""`qkvlab convert CHECKPOINT --to q-identity`: exact conversion of a trained checkpoint.

Loads the checkpoint, converts it with `qkvlab.theory.convert.convert` (which refuses, with
the violated hypothesis, anything outside docs/paper.md section 2), compares both models on held-out
validation windows in float64, and writes the converted model as a regular checkpoint that
`qkvlab eval`, `qkvlab sample` and training can read.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from qkvlab.errors import QkvlabError
from qkvlab.model.gpt import GPT
from qkvlab.run.checkpoint import write_checkpoint
from qkvlab.run.layout import checkpoint_out_dir
from qkvlab.run.load import (
    carry_tokenizer,
    check_vocab,
    load_model,
    open_data,
    tokenizer_to_carry,
)
from qkvlab.theory.convert import TARGETS, ConversionReport, convert

DEFAULT_WINDOWS = 16  # float64 forward passes on CPU: enough windows to see any mismatch
EVAL_BATCH = 4


@dataclasses.dataclass
class Comparison:
    """Source vs converted model on the same windows, both evaluated in float64."""

    windows: int
    max_logit_diff: float
    val_loss_before: float
    val_loss_after: float

    @property
    def loss_diff(self) -> float:
        return abs(self.val_loss_after - self.val_loss_before)


@torch.no_grad()
def compare_models(a: GPT, b: GPT, x: torch.Tensor, y: torch.Tensor,
                   batch_size: int = EVAL_BATCH) -> Comparison:
    """max |logits_a - logits_b| and both mean losses over windows (x, y), in float64 on CPU."""
    a64 = copy.deepcopy(a).cpu().double().eval()
    b64 = copy.deepcopy(b).cpu().double().eval()
    worst, loss_a, loss_b, count = 0.0, 0.0, 0.0, 0
    for start in range(0, x.size(0), batch_size):
        xb, yb = x[start:start + batch_size].cpu(), y[start:start + batch_size].cpu()
        la, lb = a64(xb)[0], b64(xb)[0]
        worst = max(worst, float((la - lb).abs().max()))
        loss_a += float(F.cross_entropy(la.flatten(0, 1), yb.flatten(), reduction="sum"))
        loss_b += float(F.cross_entropy(lb.flatten(0, 1), yb.flatten(), reduction="sum"))
        count += yb.numel()
    return Comparison(int(x.size(0)), worst, loss_a / count, loss_b / count)


@dataclasses.dataclass
class ConvertResult:
    """Where the converted checkpoint went and how close it is to the source.

    `saved` compares the source with the converted model as stored (the source dtype, float32
    for trained runs); `exact` with the float64 conversion before that rounding.
    """

    dest: Path
    report: ConversionReport
    saved: Comparison
    exact: Comparison
    eps: float  # machine epsilon of the stored dtype


def convert_checkpoint(path: str | Path, to: str = "q-identity", out: str | Path | None = None,
                       *, windows: int | None = None, data_dir: str | None = None,
                       ) -> ConvertResult:
    """Convert a checkpoint, compare on held-out windows, write the converted checkpoint."""
    if to not in TARGETS:
        raise QkvlabError(f"--to {to!r} is not one of {', '.join(TARGETS)}")
    model, ckpt = load_model(path, "cpu")
    dest = checkpoint_out_dir(out, ckpt.run_dir / f"converted-{to}", ckpt.path,
                              "the source checkpoint")
    carried = tokenizer_to_carry(ckpt)  # read (and checked) before anything is written
    new, report = convert(model, to)  # refuses (QkvlabError) outside the theorems
    exact64, _ = convert(model, to, dtype=torch.float64)

    cfg = ckpt.config
    data_cfg = cfg.data if not data_dir else dataclasses.replace(cfg.data, dir=str(data_dir))
    data = open_data(data_cfg)
    check_vocab(cfg, data)
    n = windows if windows is not None else min(cfg.train.eval_windows, DEFAULT_WINDOWS)
    if n < 1:
        raise QkvlabError(f"--windows must be at least 1, got {n}")
    x, y = data.val_windows(n, cfg.model.block_size)
    saved = compare_models(model, new, x, y)
    exact = compare_models(model, exact64, x, y)
    if not math.isfinite(saved.max_logit_diff):
        raise QkvlabError(f"converting {ckpt.path} gave non-finite logits (overflow in the "
                          "checkpoint dtype?): nothing was written")

    new_cfg = dataclasses.replace(cfg, model=new.cfg)
    state = {
        "step": ckpt.step,
        "kind": "converted",
        "converted_from": str(ckpt.path),
        "theorem": report.theorem,
        "params_before": report.params_before,
        "params_after": report.params_after,
        "max_logit_diff": saved.max_logit_diff,
        "val_loss": saved.val_loss_after,
    }
    write_checkpoint(dest, new.state_dict(), new_cfg, state=state)
    # Sampling looks for the run's tokenizer next to the checkpoint: bring a copy along.
    carry_tokenizer(carried, dest)
    eps = torch.finfo(next(new.parameters()).dtype).eps
    return ConvertResult(dest, report, saved, exact, eps)
