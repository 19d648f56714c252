"""The training loop: deterministic batches, AdamW, warmup + cosine, eval, checkpoints, resume.

Exact resume rests on three facts: batches are a pure function of (seed, step, micro_step), a
checkpoint restores model, optimizer and RNG states bit for bit, and nothing else carries state
between steps. So N steps straight and N/2 steps + resume give the same losses on a CPU.

`train` is the entry point; train/session.py sets a session up, train/steps.py holds the
steps this loop calls, train/loop_state.py what it remembers between them and
train/checkpointer.py what it saves and restores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
from pathlib import Path
from typing import Any

from qkvlab.errors import QkvlabError
from qkvlab.fsutil import check_tree, write_text_atomic
from qkvlab.model.config import ATTN_IMPLS
from qkvlab.run import guard, store
from qkvlab.run.config import RunConfig, read_config_source
from qkvlab.run.device import on_this_device, resolve_device
from qkvlab.run.layout import CONFIG_FILE, SUMMARY_FILE
from qkvlab.run.lock import RunLock
from qkvlab.train import distributed
from qkvlab.train.optim import run_lr
from qkvlab.train.progress import StopFlag
from qkvlab.train.session import Session, close_outputs, open_outputs, setup
from qkvlab.train.steps import (
    check_divergence,
    check_initial,
    evaluate,
    final_long_eval,
    keep_best,
    save,
    show_step,
    summary,
    train_step,
    val_loss,
)
from qkvlab.train.wandb_log import drop_outside_links


def train(cfg: RunConfig, resume: bool = False, *, quiet: bool = False) -> dict[str, Any]:
    """Train `cfg` in cfg.run_dir; with resume, continue from its latest checkpoint.

    Returns the summary also written to summary.json (final val loss, tokens/s, params, ...).
    """
    run_dir = cfg.run_dir
    # config.toml and state.json name the attention kernel and dtype the run trains with,
    # never "auto"
    cfg = on_this_device(kernel_of_the_run(cfg, run_dir) if resume else cfg,
                         resolve_device(cfg.train.device))
    # refuse an absurd config before anything is allocated, locked or written
    guard.train_memory_check(cfg, resolve_device(cfg.train.device))
    # every file of the run is written in place: a link out of the folder would be written
    # through (metrics.jsonl, tokenizer/, tb/, ...); W&B's own such links, left by a session
    # killed while wandb.init ran, are removed first
    drop_outside_links(run_dir)
    check_tree(run_dir)
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


def kernel_of_the_run(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """`cfg` with attn_impl = "auto" made the kernel run_dir's config.toml records, where it
    records one: "auto" picks a kernel when a run starts, and a resume goes on with that one
    (bit for bit), even where the default for this machine has changed since."""
    if cfg.model.attn_impl != "auto" or not (run_dir / CONFIG_FILE).is_file():
        return cfg
    try:
        kernel = read_config_source(run_dir)[0]["model"]["attn_impl"]
    except (QkvlabError, OSError, KeyError, TypeError):
        return cfg  # a broken folder: the resume checks say what is wrong with it
    if kernel not in ATTN_IMPLS or kernel == "auto":
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attn_impl=kernel))


def train_locked(cfg: RunConfig, run_dir: Path, resume: bool, quiet: bool,
                 ctx: distributed.DistContext | None = None) -> dict[str, Any]:
    """Set up, run the loop and write summary.json, with the run folder already locked."""
    ctx = ctx or distributed.DistContext(device=resolve_device(cfg.train.device))
    s = setup(cfg, run_dir, resume, quiet, ctx)
    open_outputs(s)
    try:
        signum = loop(s)
        if signum is None:  # a run stopped early is measured when it finishes
            final_long_eval(s)
    finally:
        close_outputs(s)
    out = summary(s, signum)
    if ctx.is_main:
        write_text_atomic(run_dir / SUMMARY_FILE, json.dumps(out, indent=1) + "\n")
    return out


def loop(s: Session) -> int | None:
    """Train from s.start_step to the run's steps; the signal's number when one stopped it
    early."""
    tc, st = s.cfg.train, s.st
    steps = s.cfg.steps  # train.max_steps, or what train.flop_budget pays for
    with StopFlag() as stop:
        s.model.train()
        if s.ckpt is None:  # a fresh run: the initial weights' val loss is step 0's record
            rec0 = {"step": 0, "tokens": 0, "lr": run_lr(0, s.cfg)}
            val0 = evaluate(s, 0, rec0)
            keep_best(s, 0, val0)
            s.metrics.write(rec0)
            check_initial(s, val0)
        for step in range(s.start_step, steps):
            rec = train_step(s, step)  # looked up here at each call, so a test can wrap it
            done = step + 1
            st.stepped(done, finite=rec["loss"] is not None)
            evaluating = _due(done, tc.eval_interval, steps)
            logged = evaluating or rec["loss"] is None or done % tc.log_interval == 0
            show_step(s, done, rec, logged)
            if evaluating:
                keep_best(s, done, evaluate(s, done, rec))
            if logged:
                s.metrics.write({"step": done, **rec})
            check_divergence(s, done)  # after the log: the step it names is logged
            # all processes stop at the same step, even if the signal reached only some
            if s.ctx.any(stop.signum is not None):
                _stopped(s, done, stop.signum)
                # the signal every process saw (SIGINT when only some saw one)
                return stop.signum or signal.SIGINT
            # no regular checkpoint inside a non-finite streak: it would rotate good ones
            # out (keep_last) in favour of the weights that keep failing
            if _due(done, tc.ckpt_interval, steps) and st.nonfinite == 0:
                save(s, done)
        if s.start_step >= steps and s.ckpt is not None:  # finished: only re-evaluate
            st.measured(st.step, val_loss(s, {}))
    return None


def _due(done: int, interval: int, steps: int) -> bool:
    """Whether something done every `interval` steps (and after the last) is due at `done`."""
    return done % interval == 0 or done == steps


def _stopped(s: Session, done: int, signum: int | None) -> None:
    """The checkpoint of a run stopped by a signal after step `done`, and the line saying so."""
    kept = "checkpoint" if save(s, done) else \
        "its weights are not finite, so none was written; the newest checkpoint is"
    s.reporter.line(f"stopped by signal {signum} at step {done}; {kept} {s.st.last_ckpt}")
