"""What the training loop carries from step to step: LoopState and Throughput.

`LoopState` is where the run stands (step, val losses, non-finite streak) and which checkpoint
holds weights known to work. It owns every change of that judgement: a step ran (`stepped`),
an eval measured the weights (`measured`, `improves`, `set_best`), a checkpoint was written
(`saved`), the divergence check evaluated the pending checkpoint (`judged`), a run resumed
from a checkpoint's state.json (`resumed`). `Throughput` counts tokens and seconds for the
progress line, the ETA and summary.json. Both are plain objects: no model, no files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qkvlab.run.checkpoint import Checkpoint


@dataclass
class LoopState:
    """Where the loop stands, and what a checkpoint records and restores of it.

    `last_good` is the newest checkpoint known to hold weights that work: an eval of them gave
    a finite val loss, or the step after them a finite training loss. `pending` is one saved
    since the last update whose weights are not yet judged (the next finite step promotes it).
    """

    step: int = 0
    best_val_loss: float = math.inf
    last_val_loss: float | None = None
    last_val_step: int | None = None  # the step whose weights last_val_loss measured
    last_ckpt: Path | None = None
    last_good: Path | None = None
    pending: Path | None = None
    nonfinite: int = 0  # non-finite steps in a row, up to this one
    skipped: int = 0  # non-finite steps skipped over the whole run

    # -- steps ---------------------------------------------------------------------------------
    def stepped(self, step: int, finite: bool) -> None:
        """Step `step` (numbered from 1) ran; a non-finite one was skipped, weights untouched.

        A finite step proves the weights it started from: the pending checkpoint is good.
        """
        self.step = step
        if finite:
            self.nonfinite = 0
            if self.pending is not None:
                self.last_good, self.pending = self.pending, None
        else:
            self.nonfinite += 1
            self.skipped += 1

    def diverged(self, max_nonfinite: int) -> bool:
        """This step is non-finite and ends a streak of max_nonfinite: time to give up."""
        return self.nonfinite > 0 and self.nonfinite >= max_nonfinite

    # -- evals ---------------------------------------------------------------------------------
    def measured(self, step: int, val: float) -> None:
        """An eval of the weights after `step` gave the val loss `val`."""
        self.last_val_loss, self.last_val_step = val, step

    def improves(self, step: int, val: float) -> bool:
        """`val` beats every earlier eval; step 0's (the initial weights') never goes to best/."""
        return step > 0 and val < self.best_val_loss

    def set_best(self, step: int, val: float) -> None:
        """`val` is the new bar: best/ holds it, or (step 0) no later eval may be worse."""
        self.best_val_loss = val if step > 0 else min(self.best_val_loss, val)

    # -- checkpoints ---------------------------------------------------------------------------
    def saved(self, step: int, path: Path) -> None:
        """A checkpoint of the weights after `step` was written at `path`.

        It is good at once when an eval of these weights gave a finite val loss, pending when
        no eval measured them, and never good inside a non-finite streak, since these very
        weights keep failing.
        """
        self.last_ckpt, self.pending = path, None
        if self.nonfinite:
            return
        if self.last_val_step != step:
            self.pending = path
        elif self.last_val_loss is not None and math.isfinite(self.last_val_loss):
            self.last_good = path

    def judged(self, val_finite: bool) -> None:
        """The pending checkpoint's weights were evaluated (skipped steps leave the model
        holding them): a finite val loss makes it good; either way it is no longer pending."""
        if val_finite and self.pending is not None:
            self.last_good = self.pending
        self.pending = None

    def good_checkpoint(self) -> Path | None:
        """The last good checkpoint, unless keep_last (or a user) has removed it since."""
        return self.last_good if self.last_good is not None and self.last_good.is_dir() else None

    def checkpoint_fields(self) -> dict[str, Any]:
        """What state.json records of the evals (skipped_steps is written after the layout)."""
        return {"best_val_loss": self.best_val_loss, "val_loss": self.last_val_loss,
                "val_loss_step": self.last_val_step,
                # a resume names this one when its own weights turn out bad
                "last_good": self.last_good.name if self.last_good is not None else None}

    @classmethod
    def resumed(cls, ckpt: Checkpoint) -> LoopState:
        """The state a run continues with from `ckpt` (its state.json, as `saved` judged it)."""
        state = ckpt.state
        st = cls(step=ckpt.step, best_val_loss=state.get("best_val_loss") or math.inf,
                 last_val_loss=state.get("val_loss"),
                 last_val_step=_int_or_none(state.get("val_loss_step")), last_ckpt=ckpt.path,
                 last_good=_checkpoint_named(ckpt.run_dir, state.get("last_good")),
                 skipped=state.get("skipped_steps", 0))
        if st.last_val_step == ckpt.step:  # an eval judged exactly these weights
            if st.last_val_loss is not None and math.isfinite(st.last_val_loss):
                st.last_good = ckpt.path
        else:
            st.pending = ckpt.path
        return st


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _checkpoint_named(run_dir: Path, name: Any) -> Path | None:
    """The checkpoint folder a state.json names (None unless it is a ckpt-* of this run)."""
    if not isinstance(name, str) or not name.startswith("ckpt-") or "/" in name:
        return None
    return run_dir / name if (run_dir / name).is_dir() else None


@dataclass
class Throughput:
    """Tokens and seconds of this session's steps: overall, and since the last log line."""

    tokens: int = 0
    seconds: float = 0.0
    window_tokens: int = 0
    window_seconds: float = 0.0
    recent: list[float] = field(default_factory=list)  # the last 100 step times, for the ETA

    def add(self, seconds: float, tokens: int) -> float:
        """Count one step; the tokens/s since the last log line, this step included."""
        self.recent.append(seconds)
        del self.recent[:-100]
        self.tokens += tokens
        self.seconds += seconds
        self.window_tokens += tokens
        self.window_seconds += seconds
        return self.window_tokens / self.window_seconds if self.window_seconds > 0 else 0.0

    def new_window(self) -> None:
        """A log line was written: the next tokens/s counts from here."""
        self.window_tokens, self.window_seconds = 0, 0.0

    def eta(self, steps_left: int) -> float:
        """Seconds for `steps_left` more steps at the pace of the last 20."""
        last = self.recent[-20:]
        return steps_left * (sum(last) / len(last)) if last else math.inf

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0
