"""The run folders of a sweep as the report reads them: curves, final losses, speed, status.

Everything comes from the files a run leaves behind (metrics.jsonl, summary.json, failed.json,
config.toml), so an archived sweep without checkpoints reads the same; only the per-window
losses and the attention statistics need the final checkpoint, and they are cached in the
run folder.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkvlab.errors import QkvlabError
from qkvlab.experiments.spec import Group
from qkvlab.experiments.stats import median_tokens_per_s
from qkvlab.fsutil import write_text_atomic
from qkvlab.run.config import load_config
from qkvlab.run.device import resolve_device
from qkvlab.run.layout import (
    CONFIG_FILE,
    FAILED_FILE,
    REUSED_FILE,
    SUMMARY_FILE,
    list_checkpoints,
)
from qkvlab.run.load import load_model, open_data
from qkvlab.run.metrics import read_metrics
from qkvlab.run.records import is_finished, read_json_record
from qkvlab.run.store import read_checkpoint
from qkvlab.theory.scale import attention_stats
from qkvlab.train import objectives

WINDOW_FILE = "window_losses.json"
ATTENTION_FILE = "attention_stats.json"


@dataclass
class RunData:
    """One run folder as the report sees it."""

    group: str
    seed: int
    run_dir: Path
    status: str  # done | partial | failed | pending
    max_steps: int
    steps: int = 0
    curve: dict[int, float] = field(default_factory=dict)  # step -> val_loss
    acc_curve: dict[int, float] = field(default_factory=dict)  # step -> val_acc (mlm)
    final_loss: float | None = None  # the report's measure (experiments/report.py)
    final_loss_windows: float | None = None  # the last periodic eval's, on its fixed windows
    final_loss_long: float | None = None  # over train.final_eval_tokens, when it ran
    final_acc: float | None = None
    train_tail: float | None = None  # mean logged training loss over the last 10% of steps
    tokens: int = 0
    tokens_per_s: float | None = None
    error: str = ""
    diverged: bool = False
    windows: list[float] | None = None  # per-window final losses (--per-window)
    attention: list[dict[str, float]] | None = None  # per layer, final (--attention)
    reused_from: str | None = None  # copied from another sweep by `qkvlab sweep --reuse`

    @property
    def best(self) -> tuple[int, float] | None:
        """(step, loss) of the lowest validation loss after step 0: the early-stopping view."""
        evals = [(s, v) for s, v in self.curve.items() if s > 0 and math.isfinite(v)]
        return min(evals, key=lambda sv: sv[1]) if evals else None

    def as_dict(self) -> dict[str, Any]:
        best = self.best
        # the run's folder inside its sweep (<group>/seed-<n>), not a path of this machine
        return {"group": self.group, "seed": self.seed,
                "run_dir": f"{self.run_dir.parent.name}/{self.run_dir.name}",
                "status": self.status, "steps": self.steps, "max_steps": self.max_steps,
                "final_val_loss": self.final_loss, "final_val_acc": self.final_acc,
                "final_val_loss_windows": self.final_loss_windows,
                "final_val_loss_long": self.final_loss_long,
                "best_val_loss": best[1] if best else None,
                "best_val_step": best[0] if best else None,
                "train_loss_tail": self.train_tail,
                "tokens": self.tokens, "tokens_per_s": self.tokens_per_s,
                "error": self.error or None, "diverged": self.diverged,
                "reused_from": self.reused_from}


TAIL_FROM = 0.9  # the training loss of a run: its logged losses after 90% of the steps


def read_run(group: Group, seed: int, run_dir: Path) -> RunData:
    max_steps = group.config.steps
    data = RunData(group.name, seed, run_dir, "pending", max_steps)
    records = read_metrics(run_dir, tolerant=True)  # a run killed mid-write reads too
    for r in records:
        if r.get("val_loss") is not None:
            data.curve[r["step"]] = float(r["val_loss"])
        if r.get("val_acc") is not None:
            data.acc_curve[r["step"]] = float(r["val_acc"])
    data.steps = max((r["step"] for r in records), default=0)
    data.tokens_per_s = median_tokens_per_s(records)
    tail = [float(r["loss"]) for r in records
            if r.get("loss") is not None and r["step"] > TAIL_FROM * max_steps]
    data.train_tail = math.fsum(tail) / len(tail) if tail else None
    summary = read_json_record(run_dir / SUMMARY_FILE)
    failed = read_json_record(run_dir / FAILED_FILE)
    done = is_finished(summary, max_steps)
    if done:
        data.status = "done"
        data.steps = int(summary["steps"])
        # the eval at the last step; the summary's copy when metrics.jsonl lacks it
        data.final_loss = data.curve.get(data.steps, summary.get("final_val_loss"))
        data.final_acc = data.acc_curve.get(data.steps)
        if data.final_loss is None or not math.isfinite(data.final_loss):
            data.status, data.final_loss = "failed", None
            data.error = "no finite final validation loss"
        data.final_loss_windows = data.final_loss
        long = (summary.get("final_val_loss_long") or {}).get("loss")
        if data.status == "done" and isinstance(long, int | float) and math.isfinite(long):
            data.final_loss_long = float(long)
    elif failed:
        data.status = "failed"
        data.error = str(failed.get("error", ""))
        data.diverged = bool(failed.get("diverged"))
    elif records:
        data.status = "partial"
    data.tokens = data.steps * _tokens_per_step(run_dir, group)
    data.reused_from = (read_json_record(run_dir / REUSED_FILE) or {}).get("from")
    return data


def _tokens_per_step(run_dir: Path, group: Group) -> int:
    cfg = run_config(run_dir, group)
    return cfg.tokens_per_step


def run_config(run_dir: Path, group: Group):
    """The config the run was trained with (config.toml), else the spec's."""
    path = run_dir / CONFIG_FILE
    if path.is_file():
        try:
            return load_config(path)
        except QkvlabError:
            pass
    return group.config


def find_seeds(group_dir: Path) -> list[int]:
    """The seeds that have a folder under a group (a sweep may add seeds later)."""
    seeds = []
    if group_dir.is_dir():
        for p in group_dir.iterdir():
            if p.is_dir() and p.name.startswith("seed-") and p.name[5:].isdigit():
                seeds.append(int(p.name[5:]))
    return sorted(seeds)


def per_window_losses(run: RunData, group: Group) -> list[float] | None:
    """The final checkpoint's loss on each fixed validation window (cached in the run folder)."""
    if run.status != "done":
        return None
    cfg = run_config(run.run_dir, group)
    key = {"windows": cfg.train.eval_windows, "block_size": cfg.model.block_size,
           "objective": cfg.train.objective}

    def score(model: torch.nn.Module, data: Any, device: torch.device) -> list[float]:
        x, y = data.val_windows(cfg.train.eval_windows, cfg.model.block_size)
        x, y = objectives.eval_inputs(cfg, data.vocab_size, x, y)
        with torch.inference_mode():
            return objectives.window_losses(model, x, y, cfg.train.eval_batch_size
                                            or cfg.train.batch_size, device, cfg.train.dtype)

    cached = _final_checkpoint_record(run.run_dir, run.max_steps, cfg, WINDOW_FILE, key,
                                      "losses", score)
    return None if cached is None else [float(v) for v in cached]


ATTENTION_WINDOWS = 16  # validation windows the attention statistics are measured on


def attention_summary(run: RunData, group: Group) -> list[dict[str, float]] | None:
    """Per layer, the final checkpoint's attention logit std and row entropy on the first
    ATTENTION_WINDOWS validation windows (theory.scale.attention_stats; cached in the run
    folder)."""
    if run.status != "done":
        return None
    return attention_record(run.run_dir, run.max_steps, run_config(run.run_dir, group))


def attention_record(run_dir: Path, max_steps: int, cfg: Any) -> list[dict[str, float]] | None:
    """`attention_summary` of a finished run folder, given the config it trained with (what
    `qkvlab archive` measures before it leaves the checkpoints behind)."""
    key = {"windows": ATTENTION_WINDOWS, "block_size": cfg.model.block_size}

    def measure(model: torch.nn.Module, data: Any, device: torch.device) -> list[dict]:
        x, _ = data.val_windows(ATTENTION_WINDOWS, cfg.model.block_size)
        return attention_stats(model.float(), x.to(device))

    return _final_checkpoint_record(run_dir, max_steps, cfg, ATTENTION_FILE, key, "layers",
                                    measure)


def _final_checkpoint_record(run_dir: Path, max_steps: int, cfg: Any, name: str,
                             key: dict[str, Any], field_: str,
                             compute: Callable[..., Any]) -> Any:
    """`compute(model, data, device)` of a finished run's final checkpoint (step max_steps),
    cached in the run folder as `name` under `key`; an archived run (no checkpoints) answers
    from its cache."""
    cache = read_json_record(run_dir / name)
    cached = None
    if cache and cache.get("step") == max_steps and all(cache.get(k) == v
                                                        for k, v in key.items()):
        cached = cache.get(field_)
    ckpts = list_checkpoints(run_dir)
    if not ckpts:  # an archived sweep (qkvlab archive): the cache stands in
        return cached
    ckpt = read_checkpoint(ckpts[-1])
    if ckpt.step != max_steps:
        return None
    if cached is not None:
        return cached
    device = resolve_device("auto")
    model, _ = load_model(ckpt.path, device)
    value = compute(model, open_data(cfg.data, lambda _m: None), device)
    write_text_atomic(run_dir / name, json.dumps(
        {"step": ckpt.step, **key, field_: value}) + "\n")
    return value
