"""What a training run shows while it runs: the progress display, TensorBoard, stop signals."""

from __future__ import annotations

import math
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from qkvlab.fsutil import can_write
from qkvlab.run.layout import TB_DIR
from qkvlab.train.wandb_log import warn


def fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Reporter:
    """A rich progress bar on a terminal, plain lines otherwise, nothing when quiet."""

    def __init__(self, total: int, start: int, quiet: bool):
        self.quiet = quiet
        self.progress = None
        if not quiet and sys.stderr.isatty():
            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                console=Console(stderr=True, highlight=False),
            )
            self.task = self.progress.add_task("train", total=total, completed=start, info="")
            self.progress.start()

    def line(self, text: str) -> None:
        if self.quiet:
            return
        if self.progress is not None:
            self.progress.console.print(text)
        else:
            print(text, flush=True)

    def step(self, step: int, total: int, rec: dict[str, Any], eta: float, log: bool) -> None:
        loss = rec.get("loss")
        loss_s = f"loss {loss:.4f}" if loss is not None else "loss non-finite"
        speed = f"{rec.get('tokens_per_s', 0):,.0f} tok/s"
        if self.progress is not None:
            info = f"{loss_s} | {speed} | eta {fmt_eta(eta)}"
            self.progress.update(self.task, completed=step, info=info)
        elif log:
            mfu_pct = 100 * (rec.get("mfu") or 0.0)
            self.line(f"step {step}/{total} | {loss_s} | lr {rec['lr']:.2e} | {speed} | "
                      f"mfu {mfu_pct:.1f}% | eta {fmt_eta(eta)}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def open_tensorboard(run_dir: Path, purge_step: int | None):
    """A SummaryWriter into RUN_DIR/tb, or None without the tensorboard package, or (after one
    warning line, as for W&B) when tb/ cannot be written."""
    try:
        # optional dependency (the tensorboard extra)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    tb = run_dir / TB_DIR
    # checked here: the writer's own thread would print its traceback before failing
    problem = ("is not a folder" if tb.exists() and not tb.is_dir()
               else "is not writable (permission denied)" if tb.is_dir() and not can_write(tb)
               else None)
    if problem:
        warn(f"TensorBoard is off for this session: {tb} {problem}; make it a folder this "
             "user can write to log there (metrics.jsonl has every value)")
        return None
    return SummaryWriter(str(tb), purge_step=purge_step)


class StopFlag:
    """SIGINT/SIGTERM set a flag; the loop checkpoints and returns. A second SIGINT aborts."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
