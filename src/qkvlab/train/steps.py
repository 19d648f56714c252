"""The steps of the training loop, each a plain function of the session (train/session.py).

`train_step` is one optimizer step; `show_step` puts a step on the display, TensorBoard and
W&B (`log_scalar`);
`evaluate` measures the fixed validation windows; `final_long_eval` the final weights on many
tokens of the whole split; `keep_best` writes best/ when an eval beats
the earlier ones; `save` writes a regular checkpoint; `check_divergence` stops a run that
keeps failing; `summary` is what a session reports. What they judge and remember between
steps is the session's LoopState (train/loop_state.py); what they write, its Checkpointer.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from qkvlab.errors import QkvlabError
from qkvlab.perf import mfu
from qkvlab.run import guard
from qkvlab.run.device import autocast, perplexity
from qkvlab.run.machine import machine_record
from qkvlab.run.metrics import finite_or_null
from qkvlab.train import objectives
from qkvlab.train.long_eval import SUMMARY_KEY, long_val_loss
from qkvlab.train.optim import run_lr, set_lr
from qkvlab.train.session import Session


def train_step(s: Session, step: int) -> dict[str, Any]:
    """Optimizer step `step` (from 0) over grad_accum micro-batches; the step's record.

    A non-finite step is skipped (its loss is None): the weights stay as they were. Under
    torchrun s.par deals this process its share of the micro-batches (BatchPlan) and syncs
    gradients once, after the last of them.
    """
    cfg, par, device = s.cfg, s.par, s.device
    t0 = time.perf_counter()
    lr = run_lr(step, cfg)
    set_lr(s.optimizer, lr)
    loss_sum = torch.zeros((), device=device)
    micros = par.micro_steps()  # one process: micro-steps 0..grad_accum-1, whole
    for i, micro in enumerate(micros):
        x, y = s.data.train_batch(step, micro.index, micro.rows, cfg.model.block_size,
                                  cfg.train.seed, micro.part, micro.parts,
                                  order=cfg.data.order, grad_accum=cfg.train.grad_accum)
        x, y = objectives.train_inputs(cfg, s.data.vocab_size, x, y, step, micro.index,
                                       micro.part, micro.parts)  # clm: unchanged; mlm: masked
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with par.grad_sync(i == len(micros) - 1):
            with autocast(device, cfg.train.dtype):
                _, loss = par.fwd(x, y)
            (loss / len(micros)).backward()
        loss_sum += loss.detach()
    # clip_grad_norm_ with an infinite bound only measures: the norm is logged either way
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    grad_norm = par.clip_grad_norm(max_norm)  # the global norm, the same on every process
    train_loss = par.mean_loss(loss_sum)
    finite = math.isfinite(train_loss) and math.isfinite(grad_norm)
    if finite:
        s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0  # float(loss) above synchronised the device
    tokens = cfg.tokens_per_step
    return {
        "tokens": (step + 1) * tokens,
        "loss": train_loss if finite else None,
        "lr": lr,
        "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
        "tokens_per_s": s.clock.add(dt, tokens),
    }


def show_step(s: Session, done: int, rec: dict[str, Any], logged: bool) -> None:
    """Step `done` on the progress display; a logged one also gets its MFU and its scalars."""
    if logged:
        rec["mfu"] = mfu(s.fpt, rec["tokens_per_s"], s.peak)
        s.clock.new_window()
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu"):
            if rec.get(key) is not None:
                log_scalar(s, f"train/{key}", rec[key], done)
    steps = s.cfg.steps
    s.reporter.step(done, steps, rec, s.clock.eta(steps - done), logged)


def log_scalar(s: Session, tag: str, value: float, step: int) -> None:
    """One scalar into TensorBoard and W&B, those of them that are open: same tag, same step."""
    for sink in (s.tb, s.wandb):
        if sink is not None:
            sink.add_scalar(tag, value, step)


# ---- evaluation and checkpoints -----------------------------------------------------------
def val_loss(s: Session, rec: dict[str, Any]) -> float:
    """The loss on the fixed validation windows (an encoder also adds val_acc to `rec`)."""
    tc = s.cfg.train
    if tc.objective == "mlm":  # masked-token loss, and accuracy (train/objectives.py)
        val, rec["val_acc"] = objectives.evaluate_masked(s.par, s.val_x, s.val_y,
                                                         s.eval_batch_size, tc.dtype)
        return val
    return s.par.evaluate(s.val_x, s.val_y, s.eval_batch_size, tc.dtype)


def evaluate(s: Session, step: int, rec: dict[str, Any]) -> float:
    """The val loss of the weights after `step`: into `rec`, the display and the scalars."""
    val = val_loss(s, rec)
    rec["val_loss"], rec["val_ppl"] = val, perplexity(val)
    s.st.measured(step, val)
    ppl = perplexity(val)
    s.reporter.line(f"step {step} | val loss {val:.4f} | val ppl "
                    f"{ppl if ppl is not None else math.nan:.2f}")
    log_scalar(s, "val/loss", val, step)
    return val


def final_long_eval(s: Session) -> None:
    """The val loss of the final weights over train.final_eval_tokens tokens spread over the
    whole val split (train/long_eval.py), onto the display and into the scalars."""
    long = s.long_val = long_val_loss(s.par.fwd, s.ctx, s.cfg, s.data, s.eval_batch_size)
    if long is None or long["loss"] is None:
        return
    parts = ", ".join(f"{name} {v['loss']:.4f}" for name, v in long.get("by_source", {}).items()
                      if v["loss"] is not None)
    s.reporter.line(f"step {s.st.step} | val loss {long['loss']:.4f} over {long['tokens']:,} "
                    f"tokens of the whole val split{f' ({parts})' if parts else ''} "
                    f"in {long['seconds']:.1f}s")
    log_scalar(s, "val/loss_long", long["loss"], s.st.step)


def keep_best(s: Session, step: int, val: float) -> None:
    """Write best/ when `val` beats every earlier eval; step 0's eval only sets the bar."""
    st = s.st
    # a finite val loss can still come with a NaN in an embedding row no window uses
    if st.improves(step, val) and s.checkpointer.weights_finite():
        st.set_best(step, val)
        s.checkpointer.save_best(ckpt_state(s, step))
    elif step == 0:
        st.set_best(step, val)


def ckpt_state(s: Session, step: int) -> dict[str, Any]:
    """The loop's part of a checkpoint's state.json after `step`."""
    tc = s.cfg.train
    return {"step": step, "tokens": step * s.cfg.tokens_per_step,
            **s.st.checkpoint_fields(),
            "world_size": s.ctx.world_size, "parallel": s.par.mode,
            # batches are a pure function of these: a resume continues the same stream
            "data_stream": {"seed": tc.seed, "order": s.cfg.data.order, "next_step": step,
                            **s.plan.as_dict()},
            "skipped_steps": s.st.skipped}


def save(s: Session, step: int) -> bool:
    """A regular checkpoint after `step` (every process takes part: FSDP gathers shards).

    Weights with a NaN or inf are not saved (False): such a checkpoint could be neither
    resumed nor evaluated, and keep_last would rotate a good one out for it.
    """
    if not s.checkpointer.weights_finite():
        s.reporter.line(f"step {step}: the weights are not finite; no checkpoint written")
        return False
    s.st.saved(step, s.checkpointer.save(step, ckpt_state(s, step)))
    return True


def check_divergence(s: Session, done: int) -> None:
    """Stop with a QkvlabError after max_nonfinite non-finite steps in a row.

    Called once step `done` (numbered as in metrics.jsonl and ckpt-*) is logged, its loss as
    null, so the step the error names is in the log.
    """
    st, cfg = s.st, s.cfg
    if not st.diverged(cfg.train.max_nonfinite):
        return
    if st.pending is not None:
        # skipped steps leave the weights alone, so the model still holds the pending
        # checkpoint's weights: one eval tells whether they or the batches were at fault
        st.judged(math.isfinite(val_loss(s, {})))
    raise QkvlabError(guard.divergence_message(
        s.run_dir, st.nonfinite, done, st.good_checkpoint(), cfg.optim.lr, cfg.optim.min_lr,
        cfg.train.dtype))


def check_initial(s: Session, val: float) -> None:
    """Stop a fresh run whose initial weights already give a non-finite val loss: no step has
    run, so the model settings are at fault, not optim.lr (which the divergence stop blames)."""
    if math.isfinite(val):
        return
    m = s.cfg.model
    raise QkvlabError(
        f"the initial weights give a non-finite val loss ({val}) before any training step: "
        f"the model settings are at fault, not the learning rate (init_std={m.init_std:g}, "
        f"attn_scale={m.attn_scale}, scale {m.scale:.3g}, dtype {s.cfg.train.dtype}); fix "
        "them in a fresh run")


def summary(s: Session, signum: int | None) -> dict[str, Any]:
    """What the session did (summary.json); non-finite values are null. `signum`: the signal
    that stopped it early, if one did."""
    st, tc = s.st, s.cfg.train
    tps = s.clock.tokens_per_s
    return finite_or_null({
        "steps": st.step,
        "tokens": st.step * s.cfg.tokens_per_step,
        "train_flops": st.step * s.cfg.flops_per_step,  # what a flop budget counts
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
        "train_time_s": s.clock.seconds,
        "resumed_from": s.start_step if s.ckpt is not None else None,
        "interrupted": signum is not None,
        "signal": int(signum) if signum is not None else None,
        "device": s.device.type,
        "dtype": tc.dtype,
        "checkpoint": st.last_ckpt.name if st.last_ckpt else None,  # a folder of the run's
        "skipped_steps": st.skipped,
        "world_size": s.ctx.world_size,
        # where the numbers came from: kernels differ between CPU kinds, dtypes and versions
        "machine": machine_record(s.device),
        SUMMARY_KEY: s.long_val,
    })
