"""`qkvlab retrofit CHECKPOINT --to q-identity`: convert a trained baseline to W_Q = I, heal it,
report the validation loss before / right after conversion / during and after healing, and write
the healed model as a regular checkpoint."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qkvlab.errors import QkvlabError
from qkvlab.model.gpt import GPT
from qkvlab.model.params import count_params
from qkvlab.retrofit.heal import HealConfig, HealResult, heal
from qkvlab.retrofit.init import INITS, InitInfo, attention_moments, build_student, check_source
from qkvlab.run.checkpoint import write_checkpoint
from qkvlab.run.config import DataConfig
from qkvlab.run.device import evaluate, resolve_device
from qkvlab.run.layout import checkpoint_out_dir
from qkvlab.run.load import (
    carry_tokenizer,
    check_vocab,
    data_config,
    load_model,
    open_data,
    tokenizer_to_carry,
)

TARGETS = ("q-identity",)
MAX_DEFAULT_WINDOWS = 128  # `qkvlab retrofit --help` states this number
# What `qkvlab import-hf` records: state.json's kind, and data.tokenizer when the model folder
# had no tokenizer qkvlab can use (so its data.dir names no prepared data either).
CALIB_STEP_OFFSET = 1_000_000  # calibration batches: steps the healing run never reaches


@dataclass
class RetrofitReport:
    """Everything the retrofit measured; losses are mean validation cross-entropy."""

    source: Path
    init: str
    init_info: InitInfo
    heal_config: HealConfig
    before: float  # the original model
    heal_result: HealResult  # curve[0] is right after conversion
    other_inits: dict[str, float | None] = field(default_factory=dict)  # after conversion
    params_before: int = 0
    params_after: int = 0
    windows: int = 0
    block_size: int = 0
    dest: Path | None = None

    @property
    def after_convert(self) -> float:
        return self.heal_result.curve[0][1]

    @property
    def after_heal(self) -> float:
        return self.heal_result.final

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": str(self.source), "init": self.init, "init_note": self.init_info.note,
            "query_r2": self.init_info.query_r2, "steps": self.heal_config.steps,
            "distill": self.heal_config.distill, "lr": self.heal_config.lr,
            "batch_size": self.heal_config.batch_size, "val_loss_before": self.before,
            "val_loss_after_convert": self.after_convert, "val_loss_after_heal": self.after_heal,
            "curve": [list(p) for p in self.heal_result.curve],
            "other_inits_after_convert": self.other_inits,
            "params_before": self.params_before, "params_after": self.params_after,
            "windows": self.windows, "heal_seconds": self.heal_result.seconds,
        }

    def table(self) -> str:
        """The losses as a Markdown table (stage, steps, val loss, gap to the original)."""
        mode = "distillation" if self.heal_config.distill else "cross-entropy"
        rows = [("original (learned W_Q)", "-", self.before)]
        for name, loss in self.other_inits.items():
            rows.append((f"converted, init {name}", "0", loss))
        rows.append((f"converted, init {self.init}", "0", self.after_convert))
        for step, loss in self.heal_result.curve[1:]:
            rows.append((f"healed ({mode})", str(step), loss))
        lines = ["| stage | healing steps | val loss | vs original |", "|---|---|---|---|"]
        for stage, steps, loss in rows:
            if loss is None or not math.isfinite(loss):
                lines.append(f"| {stage} | {steps} | n/a | n/a |")
            else:
                lines.append(f"| {stage} | {steps} | {loss:.4f} | {loss - self.before:+.4f} |")
        return "\n".join(lines)


def retrofit_checkpoint(
    path: str | Path,
    *,
    to: str = "q-identity",
    init: str = "regress",
    heal_config: HealConfig | None = None,
    out: str | Path | None = None,
    write: bool = True,
    windows: int | None = None,
    calib_batches: int = 8,
    compare_inits: bool = False,
    data_dir: str | None = None,
    device: str = "auto",
    log: Callable[[str], None] | None = print,
) -> RetrofitReport:
    """Load, convert with `init`, heal, and (with `write`) save the healed checkpoint."""
    if to not in TARGETS:
        raise QkvlabError(f"--to {to!r} is not one of {', '.join(TARGETS)}")
    if init not in INITS:
        raise QkvlabError(f"--init {init!r} is not one of {', '.join(INITS)}")
    if calib_batches < 1 and init == "regress":
        raise QkvlabError(f"--calib-batches must be >= 1, got {calib_batches}")
    dev = resolve_device(device)
    teacher, ckpt = load_model(path, dev)
    check_source(teacher, init)
    dest = checkpoint_out_dir(out, ckpt.run_dir / f"retrofit-{to}", ckpt.path,
                              "the source checkpoint") if write else None
    carried = tokenizer_to_carry(ckpt) if write else {}  # checked before the heal
    cfg = ckpt.config
    hc = heal_config or HealConfig(batch_size=cfg.train.batch_size, lr=3 * cfg.optim.min_lr)
    data_cfg = data_config(ckpt, data_dir)
    data = open_data(data_cfg, log or (lambda _m: None))
    check_vocab(cfg, data)
    block = cfg.model.block_size
    n = windows if windows is not None else min(cfg.train.eval_windows, MAX_DEFAULT_WINDOWS)
    if n < 1:
        raise QkvlabError(f"--windows must be at least 1, got {n}")
    vx, vy = data.val_windows(n, block)
    eval_bs = cfg.train.eval_batch_size or cfg.train.batch_size

    def val_loss(model: GPT) -> float:
        return evaluate(model, vx, vy, eval_bs, dev, hc.dtype)

    before = val_loss(teacher)
    moments = None
    if init == "regress" or compare_inits:
        calib = (data.train_batch(CALIB_STEP_OFFSET + i, 0, hc.batch_size, block, hc.seed)[0]
                 for i in range(max(calib_batches, 1)))
        moments = attention_moments(teacher, calib)
    other = _other_inits(teacher, init, moments, val_loss, log) if compare_inits else {}
    student, info = build_student(teacher, init, moments)
    if log:
        log(f"original val loss {before:.4f}; init {init}: {info.note}")
    result = heal(student, data, hc, val_loss, teacher=teacher if hc.distill else None, log=log)
    report = RetrofitReport(
        source=ckpt.path, init=init, init_info=info, heal_config=hc, before=before,
        heal_result=result, other_inits=other, params_before=count_params(cfg.model).total,
        params_after=count_params(student.cfg).total, windows=n, block_size=block)
    if dest is not None:
        write_retrofit(dest, student, ckpt, report, data_cfg, carried)
    return report


def _other_inits(teacher: GPT, init: str, moments: Any, val_loss: Callable[[GPT], float],
                 log: Callable[[str], None] | None) -> dict[str, float | None]:
    """The val loss right after conversion with each init but `init` (None: not available)."""
    other: dict[str, float | None] = {}
    for name in INITS:
        if name == init:
            continue
        try:
            other[name] = val_loss(build_student(teacher, name, moments)[0])
        except QkvlabError as exc:
            other[name] = None
            if log:
                log(f"  init {name}: not available ({exc})")
    return other


def write_retrofit(dest: Path, student: GPT, ckpt: Any, report: RetrofitReport,
                   data_cfg: DataConfig | None = None,
                   tokenizer: dict[str, bytes] | None = None) -> Path:
    """Save the healed model as a regular checkpoint (with the report in state.json); its
    config names the data it was healed on (`data_cfg`, default the source's), the run's
    tokenizer comes along (`tokenizer`: as `tokenizer_to_carry` read it, default read now)."""
    carried = tokenizer_to_carry(ckpt) if tokenizer is None else tokenizer
    new_cfg = dataclasses.replace(ckpt.config, model=student.cfg,
                                  data=data_cfg or ckpt.config.data)
    state = {"step": ckpt.step, "kind": "retrofit", "val_loss": report.after_heal,
             "retrofit": report.as_dict()}
    write_checkpoint(dest, student.state_dict(), new_cfg, state=state)
    carry_tokenizer(carried, dest)  # so `qkvlab sample` finds it
    report.dest = dest
    return dest
