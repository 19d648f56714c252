"""The training loop: deterministic batches, AdamW, warmup + cosine, eval, checkpoints, resume.

Exact resume rests on three facts: batches are a pure function of (seed, step, micro_step), a
checkpoint restores model, optimizer and RNG states bit for bit, and nothing else carries state
between steps. So N steps straight and N/2 steps + resume give the same losses on a CPU.

`train` is the entry point; train/session.py sets a session up and train/steps.py holds the
steps this loop calls.
"""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path
from typing import Any

from qkvlab.fsutil import write_text_atomic
from qkvlab.run import guard, store
from qkvlab.run.config import RunConfig
from qkvlab.run.device import resolve_device
from qkvlab.run.layout import SUMMARY_FILE
from qkvlab.run.lock import RunLock
from qkvlab.train import distributed
from qkvlab.train.optim import lr_at
from qkvlab.train.progress import StopFlag
from qkvlab.train.session import Session, close_outputs, open_outputs, setup
from qkvlab.train.steps import (
    check_divergence,
    judge_step,
    log_step,
    run_eval,
    save,
    summary,
    train_step,
    val_loss,
)


def train(cfg: RunConfig, resume: bool = False, *, quiet: bool = False) -> dict[str, Any]:
    """Train `cfg` in cfg.run_dir; with resume, continue from its latest checkpoint.

    Returns the summary also written to summary.json (final val loss, tokens/s, params, ...).
    """
    run_dir = cfg.run_dir
    # refuse an absurd config before anything is allocated, locked or written
    guard.train_memory_check(cfg, resolve_device(cfg.train.device))
    # under torchrun every process runs this; rank 0 alone holds the lock and writes files
    with distributed.session(resolve_device(cfg.train.device)) as ctx, \
            (RunLock(run_dir) if ctx.is_main else contextlib.nullcontext()):
        try:
            return train_locked(cfg, run_dir, resume, quiet, ctx)
        except OSError as exc:  # disk full, read-only, ...: one line naming the good checkpoint
            err = store.storage_error(exc, run_dir)
            if err is None or err is exc:
                raise
            raise err from exc


def train_locked(cfg: RunConfig, run_dir: Path, resume: bool, quiet: bool,
                 ctx: distributed.DistContext | None = None) -> dict[str, Any]:
    """Set up, run the loop and write summary.json, with the run folder already locked."""
    ctx = ctx or distributed.DistContext(device=resolve_device(cfg.train.device))
    s = setup(cfg, run_dir, resume, quiet, ctx)
    open_outputs(s)
    try:
        signum = loop(s)
    finally:
        close_outputs(s)
    out = summary(s, signum)
    if ctx.is_main:
        write_text_atomic(run_dir / SUMMARY_FILE, json.dumps(out, indent=1) + "\n")
    return out


def loop(s: Session) -> int | None:
    """Train from s.start_step to max_steps; the signal's number when one stopped it early."""
    tc, st = s.cfg.train, s.st
    with StopFlag() as stop:
        s.model.train()
        if s.ckpt is None:
            rec0 = {"step": 0, "tokens": 0, "lr": lr_at(0, s.cfg.optim, tc.max_steps)}
            run_eval(s, 0, rec0)
            s.metrics.write(rec0)
        for step in range(s.start_step, tc.max_steps):
            # looked up here at each call, so a test can wrap the step
            rec = train_step(s.par.fwd, s.model, s.optimizer, s.data, s.cfg, step, s.device,
                             st, s.par)
            done = step + 1
            st.step = done
            judge_step(st, rec)
            log_step(s, done, rec)  # before the divergence check: the step it names is logged
            check_divergence(s, rec, done)
            # all processes stop at the same step, even if the signal reached only some
            if s.ctx.any(stop.signum is not None):
                kept = "checkpoint" if save(s, done) else \
                    "its weights are not finite, so none was written; the newest checkpoint is"
                s.reporter.line(f"stopped by signal {stop.signum} at step {done}; {kept} "
                                f"{st.last_ckpt}")
                # the signal every process saw (SIGINT when only some saw one)
                return stop.signum or signal.SIGINT
            # no regular checkpoint inside a non-finite streak: it would rotate good ones
            # out (keep_last) in favour of the weights that keep failing
            if (done % tc.ckpt_interval == 0 or done == tc.max_steps) and st.nonfinite == 0:
                save(s, done)
        if s.start_step >= tc.max_steps and s.ckpt is not None:
            st.last_val_loss, st.last_val_step = val_loss(s, {}), st.step
    return None
