"""The steps of the training loop, each a plain function of the session (train/session.py).

`train_step` is one optimizer step; `run_eval` measures the fixed validation windows and keeps
the best checkpoint (`keep_best`); `save` writes a regular checkpoint; `log_step` records a
step; `check_divergence` stops a run that keeps failing; `summary` is what a session reports.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from qkvlab.data.loader import TokenData
from qkvlab.errors import QkvlabError
from qkvlab.model import GPT
from qkvlab.perf import mfu
from qkvlab.run import guard, store
from qkvlab.run.checkpoint import write_checkpoint
from qkvlab.run.config import RunConfig
from qkvlab.run.device import autocast, perplexity
from qkvlab.run.layout import BEST_DIR
from qkvlab.run.metrics import finite_or_null
from qkvlab.train import distributed, objectives
from qkvlab.train.optim import lr_at, set_lr
from qkvlab.train.session import Session, TrainState


def train_step(
    fwd: torch.nn.Module,
    model: GPT,
    optimizer: torch.optim.Optimizer,
    data: TokenData,
    cfg: RunConfig,
    step: int,
    device: torch.device,
    st: TrainState,
    par: distributed.Parallel | None = None,
) -> dict[str, Any]:
    """One optimizer step (grad_accum micro-batches); a non-finite step is skipped.

    Under torchrun `par` deals this process its share of the micro-batches (BatchPlan) and
    syncs gradients once, after the last of them.
    """
    tc = cfg.train
    if par is None:
        plan = distributed.plan_batches(tc.batch_size, tc.grad_accum, 1, 0)
        par = distributed.Parallel(model, distributed.DistContext(device), tc.parallel, False,
                                   plan)
    t0 = time.perf_counter()
    lr = lr_at(step, cfg.optim, tc.max_steps)
    set_lr(optimizer, lr)
    loss_sum = torch.zeros((), device=device)
    micros = par.micro_steps()  # one process: micro-steps 0..grad_accum-1, whole
    for i, micro in enumerate(micros):
        x, y = data.train_batch(step, micro.index, micro.rows, cfg.model.block_size, tc.seed,
                                micro.part, micro.parts)
        x, y = objectives.train_inputs(cfg, data.vocab_size, x, y, step, micro.index, micro.part,
                                       micro.parts)  # clm: unchanged; mlm: masked
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with par.grad_sync(i == len(micros) - 1):
            with autocast(device, tc.dtype):
                _, loss = fwd(x, y)
            (loss / len(micros)).backward()
        loss_sum += loss.detach()
    # clip_grad_norm_ with an infinite bound only measures: the norm is logged either way
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    grad_norm = par.clip_grad_norm(max_norm)  # the global norm, the same on every process
    train_loss = par.mean_loss(loss_sum)
    finite = math.isfinite(train_loss) and math.isfinite(grad_norm)
    if finite:
        optimizer.step()
        st.nonfinite = 0
    else:
        st.nonfinite += 1  # skip the update: the weights stay as they were
        st.skipped += 1
    optimizer.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0  # float(loss) above synchronised the device
    return _account(st, cfg, step, dt, lr, train_loss if finite else None, grad_norm)


def _account(st: TrainState, cfg: RunConfig, step: int, dt: float, lr: float,
             loss: float | None, grad_norm: float) -> dict[str, Any]:
    """Add a step's time and tokens to the state; the step's record."""
    st.history.append(dt)
    del st.history[:-100]
    tokens = cfg.tokens_per_step
    st.session_tokens += tokens
    st.session_time += dt
    st.window_tokens += tokens
    st.window_time += dt
    return {
        "tokens": (step + 1) * tokens,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
        "tokens_per_s": st.window_tokens / st.window_time if st.window_time > 0 else 0.0,
    }


# ---- evaluation and checkpoints -----------------------------------------------------------
def val_loss(s: Session, rec: dict[str, Any]) -> float:
    """The loss on the fixed validation windows (an encoder also adds val_acc to `rec`)."""
    tc = s.cfg.train
    if tc.objective == "mlm":  # masked-token loss, and accuracy (train/objectives.py)
        val, rec["val_acc"] = objectives.evaluate_masked(s.par, s.val_x, s.val_y,
                                                         s.eval_batch_size, tc.dtype)
        return val
    return s.par.evaluate(s.val_x, s.val_y, s.eval_batch_size, tc.dtype)


def run_eval(s: Session, step: int, rec: dict[str, Any]) -> None:
    """Evaluate after `step`: into `rec`, the display, TensorBoard and best/."""
    val = val_loss(s, rec)
    rec["val_loss"], rec["val_ppl"] = val, perplexity(val)
    s.st.last_val_loss, s.st.last_val_step = val, step
    ppl = perplexity(val)
    s.reporter.line(f"step {step} | val loss {val:.4f} | val ppl "
                    f"{ppl if ppl is not None else math.nan:.2f}")
    if s.tb is not None:
        s.tb.add_scalar("val/loss", val, step)
    keep_best(s, step, val)


def keep_best(s: Session, step: int, val: float) -> None:
    """Write best/ when `val` beats every earlier eval; step 0's eval only sets the bar."""
    st = s.st
    # a finite val loss can still come with a NaN in an embedding row no window uses
    if step > 0 and val < st.best_val_loss and not s.ctx.any(not guard.weights_finite(s.model)):
        st.best_val_loss = val
        s.par.save(lambda m, _o, extra: write_checkpoint(
            s.run_dir / BEST_DIR, m, s.cfg,
            state={**ckpt_state(s, step), **extra, "kind": "best"}), None)
    elif step == 0:
        st.best_val_loss = min(st.best_val_loss, val)


def ckpt_state(s: Session, step: int) -> dict[str, Any]:
    """The loop's part of a checkpoint's state.json after `step`."""
    tc, st = s.cfg.train, s.st
    return {"step": step, "tokens": step * s.cfg.tokens_per_step,
            "best_val_loss": st.best_val_loss, "val_loss": st.last_val_loss,
            "val_loss_step": st.last_val_step,
            # a resume names this one when its own weights turn out bad
            "last_good": st.last_good.name if st.last_good is not None else None,
            "world_size": s.ctx.world_size, "parallel": s.par.mode,
            # batches are a pure function of these: a resume continues the same stream
            "data_stream": {"seed": tc.seed, "next_step": step, **s.plan.as_dict()},
            "skipped_steps": st.skipped}


def save(s: Session, step: int) -> bool:
    """A regular checkpoint after `step` (every process takes part: FSDP gathers shards).

    Weights with a NaN or inf are not saved (False): such a checkpoint could be neither
    resumed nor evaluated, and keep_last would rotate a good one out for it. A saved one is
    good at once when an eval of these weights gave a finite val loss, pending (judged by the
    next finite step, see `judge_step`) when no eval measured them, and never good inside a
    non-finite streak, since these very weights keep failing.
    """
    tc, st = s.cfg.train, s.st
    if s.ctx.any(not guard.weights_finite(s.model)):
        s.reporter.line(f"step {step}: the weights are not finite; no checkpoint written")
        return False
    st.last_ckpt = s.par.save(lambda m, o, extra: store.save_checkpoint(
        s.run_dir, step, m, o, s.cfg, {**ckpt_state(s, step), **extra}, tc.keep_last),
        s.optimizer)
    st.pending = None
    if st.nonfinite == 0:
        if st.last_val_step != step:
            st.pending = st.last_ckpt
        elif st.last_val_loss is not None and math.isfinite(st.last_val_loss):
            st.last_good = st.last_ckpt
    return True


def judge_step(st: TrainState, rec: dict[str, Any]) -> None:
    """A finite step proves the weights it started from: promote the pending checkpoint."""
    if rec["loss"] is not None and st.pending is not None:
        st.last_good, st.pending = st.pending, None


def good_checkpoint(st: TrainState) -> Path | None:
    """The last good checkpoint, unless keep_last (or a user) has removed it since."""
    return st.last_good if st.last_good is not None and st.last_good.is_dir() else None


# ---- after each step ----------------------------------------------------------------------
def check_divergence(s: Session, rec: dict[str, Any], done: int) -> None:
    """Stop with a QkvlabError after max_nonfinite non-finite steps in a row.

    Called after `log_step`, so step `done` (numbered as in metrics.jsonl and ckpt-*) is
    already logged, its loss as null.
    """
    st, cfg = s.st, s.cfg
    if rec["loss"] is None and st.nonfinite >= cfg.train.max_nonfinite:
        if st.pending is not None:
            # skipped steps leave the weights alone, so the model still holds the pending
            # checkpoint's weights: one eval tells whether they or the batches were at fault
            val = val_loss(s, {})
            if math.isfinite(val):
                st.last_good = st.pending
            st.pending = None
        raise QkvlabError(guard.divergence_message(
            s.run_dir, st.nonfinite, done, good_checkpoint(st), cfg.optim.lr, cfg.optim.min_lr,
            cfg.train.dtype))


def log_step(s: Session, done: int, rec: dict[str, Any]) -> None:
    """Progress, TensorBoard, the eval when due, and metrics.jsonl for step `done`."""
    tc, st = s.cfg.train, s.st
    recent = st.history[-20:]
    eta = (tc.max_steps - done) * (sum(recent) / len(recent)) if recent else math.inf
    is_eval = done % tc.eval_interval == 0 or done == tc.max_steps
    is_log = done % tc.log_interval == 0 or is_eval or rec["loss"] is None
    if is_log:
        rec["mfu"] = mfu(s.fpt, rec["tokens_per_s"], s.peak)
        st.window_tokens, st.window_time = 0, 0.0
        if s.tb is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu"):
                if rec.get(key) is not None:
                    s.tb.add_scalar(f"train/{key}", rec[key], done)
    s.reporter.step(done, tc.max_steps, rec, eta, is_log)
    if is_eval:
        run_eval(s, done, rec)
    if is_log:
        s.metrics.write({"step": done, **rec})


def summary(s: Session, signum: int | None) -> dict[str, Any]:
    """What the session did (summary.json); non-finite values are null. `signum`: the signal
    that stopped it early, if one did."""
    st, tc = s.st, s.cfg.train
    tps = st.session_tokens / st.session_time if st.session_time > 0 else 0.0
    return finite_or_null({
        "run_dir": str(s.run_dir),
        "steps": st.step,
        "tokens": st.step * s.cfg.tokens_per_step,
        "final_val_loss": st.last_val_loss,
        "final_val_ppl": perplexity(st.last_val_loss),
        "final_val_step": st.last_val_step,  # the step whose weights final_val_loss measured
        "best_val_loss": st.best_val_loss if math.isfinite(st.best_val_loss) else None,
        "tokens_per_s": tps,
        "mfu": mfu(s.fpt, tps, s.peak),
        "peak_flops": s.peak,
        "params": s.params.total,
        "non_embedding_params": s.params.non_embedding,
        "flops_per_token": s.fpt,
        "train_time_s": st.session_time,
        "resumed_from": s.start_step if s.ckpt is not None else None,
        "interrupted": signum is not None,
        "signal": int(signum) if signum is not None else None,
        "device": s.device.type,
        "dtype": tc.dtype,
        "checkpoint": str(st.last_ckpt) if st.last_ckpt else None,
        "skipped_steps": st.skipped,
        "world_size": s.ctx.world_size,
    })
