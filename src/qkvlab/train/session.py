"""Setting up a training session: everything `train` checks, builds and restores before step 1.

`setup` returns a `Session`: the run's inputs (config, data, fixed validation windows), the
model as this process trains it, the optimizer, its Checkpointer, what a checkpoint restored,
and the loop's state (train/loop_state.py). The steps (train/steps.py) take the session as an
argument, so each can be called on its own in a test.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkvlab.data.loader import TokenData
from qkvlab.errors import QkvlabError
from qkvlab.model import GPT
from qkvlab.model.params import ParamCount, count_params, flops_per_token
from qkvlab.perf import bf16_slowdown, keep_freed_memory, peak_flops_for
from qkvlab.run import store
from qkvlab.run.checkpoint import Checkpoint, load_model_state
from qkvlab.run.config import RunConfig, as_recorded, config_diff, save_config
from qkvlab.run.device import check_dtype
from qkvlab.run.layout import CONFIG_FILE, METRICS_FILE, list_checkpoints
from qkvlab.run.load import check_vocab, copy_tokenizer, open_data
from qkvlab.run.metrics import MetricsLog, NullLog, check_metrics
from qkvlab.train import distributed, objectives
from qkvlab.train.checkpointer import Checkpointer
from qkvlab.train.loop_state import LoopState, Throughput
from qkvlab.train.optim import build_optimizer
from qkvlab.train.progress import Reporter, open_tensorboard
from qkvlab.train.wandb_log import WandbLog, open_wandb


@dataclass
class Session:
    """One process's training session of one run folder."""

    cfg: RunConfig
    run_dir: Path
    ctx: distributed.DistContext
    say: Callable[[str], None]
    quiet: bool
    ckpt: Checkpoint | None  # the checkpoint resumed from
    data: TokenData
    val_x: torch.Tensor
    val_y: torch.Tensor
    plan: distributed.BatchPlan
    model: GPT
    par: distributed.Parallel
    optimizer: torch.optim.Optimizer
    checkpointer: Checkpointer
    st: LoopState
    start_step: int
    params: ParamCount
    fpt: float  # model FLOPs per token
    peak: float  # peak FLOP/s of all devices, for MFU
    peak_src: str
    clock: Throughput = field(default_factory=Throughput)
    long_val: dict[str, Any] | None = None  # the final long evaluation (train/long_eval.py)
    # opened by open_outputs, closed by close_outputs
    metrics: Any = None
    tb: Any = None
    wandb: WandbLog | None = None
    reporter: Reporter | None = None

    @property
    def device(self) -> torch.device:
        return self.ctx.device  # cuda:LOCAL_RANK under torchrun

    @property
    def eval_batch_size(self) -> int:
        return self.cfg.train.eval_batch_size or self.cfg.train.batch_size


def resume_point(cfg: RunConfig, run_dir: Path, resume: bool,
                 ctx: distributed.DistContext) -> Checkpoint | None:
    """The checkpoint to resume from (None: a fresh run), refusing a mismatched one."""
    if resume:
        # a damaged metrics.jsonl would only be found when the log is reopened, after
        # config.toml was rewritten: refuse it now, before anything in the folder changes
        problem = None
        if ctx.is_main:
            try:
                check_metrics(run_dir)
            except QkvlabError as exc:
                problem = str(exc)
        problem = ctx.broadcast(problem)
        if problem:
            raise QkvlabError(problem)
    if ctx.is_main:
        store.clean_temp(run_dir)
    ctx.barrier()  # the other ranks look for checkpoints once the leftovers are gone
    existing = list_checkpoints(run_dir)
    if existing and not resume:
        raise QkvlabError(f"run dir {run_dir} already has checkpoints: pass --resume or choose "
                          "another --out")
    ckpt = store.read_checkpoint(run_dir) if existing else None
    if ckpt is not None:
        diffs = config_diff(ckpt.config, cfg)
        if diffs:
            raise QkvlabError(
                f"the config differs from the one run {run_dir} was trained with at "
                f"{'; '.join(diffs[:5])}: resume with the run's config ({run_dir / CONFIG_FILE}) "
                "or choose another --out"
            )
    return ckpt


def open_inputs(cfg: RunConfig, say: Callable[[str], None]
                ) -> tuple[TokenData, torch.Tensor, torch.Tensor]:
    """(data, val_x, val_y): the run's data, checked against the model and objective."""
    tc = cfg.train
    data = open_data(cfg.data, say)
    check_vocab(cfg, data)
    objectives.check_objective(cfg, data.vocab_size)
    block = cfg.model.block_size
    val_x, val_y = data.val_windows(tc.eval_windows, block)
    val_x, val_y = objectives.eval_inputs(cfg, data.vocab_size, val_x, val_y)  # mlm: fixed mask
    data.train_batch(0, 0, 1, block, tc.seed)  # fail now, not at step 1, if data is too short
    return data, val_x, val_y


def build_model(cfg: RunConfig, ctx: distributed.DistContext, ckpt: Checkpoint | None,
                plan: distributed.BatchPlan
                ) -> tuple[GPT, distributed.Parallel, torch.optim.Optimizer]:
    """The model (a checkpoint's weights, else the seed's init), its wrapper, the optimizer."""
    tc = cfg.train
    device = ctx.device
    # Same seed -> same initial weights, whatever happened in this process before.
    torch.manual_seed(tc.seed)
    model = GPT(cfg.model).to(device)
    if ckpt is not None:
        load_model_state(model, ckpt)  # into the whole model, before FSDP shards it
    use_compile = tc.compile if tc.compile is not None else device.type == "cuda"
    # plain on one process, DDP or FSDP2 under torchrun; par.fwd is what forwards call
    par = distributed.Parallel(model, ctx, tc.parallel, use_compile, plan)
    optimizer = build_optimizer(model, cfg.optim)  # after wrapping: under FSDP it holds shards
    if not ctx.is_main:
        torch.manual_seed(distributed.rank_seed(tc.seed, ctx.rank))  # dropout masks of its own
    return model, par, optimizer


def restore(ckpt: Checkpoint | None, resume: bool, ctx: distributed.DistContext,
            checkpointer: Checkpointer, say: Callable[[str], None]) -> LoopState:
    """The optimizer, RNG and loop state of the checkpoint (a fresh state without one)."""
    if ckpt is None:
        if resume:
            say(f"no checkpoint in {checkpointer.run_dir}: starting fresh")
        return LoopState()
    checkpointer.restore(ckpt)
    saved_world = int(ckpt.state.get("world_size", 1))
    if saved_world != ctx.world_size:
        say(f"{ckpt.path.name} was written by {saved_world} process(es), this run has "
            f"{ctx.world_size}: the global batch and its data stream are the same")
    st = LoopState.resumed(ckpt)
    say(f"resuming {checkpointer.run_dir} from {ckpt.path.name} (step {st.step})")
    return st


def setup(cfg: RunConfig, run_dir: Path, resume: bool, quiet: bool,
          ctx: distributed.DistContext) -> Session:
    """Check, build and restore everything of a session, in the order exact resume needs."""
    quiet = quiet or not ctx.is_main  # one voice: rank 0 prints, logs and writes files
    say = (lambda _msg: None) if quiet else (lambda msg: print(msg, flush=True))
    ckpt = resume_point(cfg, run_dir, resume, ctx)
    tc = cfg.train
    check_dtype(ctx.device, tc.dtype)
    if ctx.device.type == "cpu":
        keep_freed_memory()  # no page faults for each step's activations
    plan = distributed.plan_batches(tc.batch_size, tc.grad_accum, ctx.world_size, ctx.rank)
    data, val_x, val_y = open_inputs(cfg, say)
    # a multi-node run needs one run folder and one data dir that every node sees
    ctx.agree((ckpt.path.name if ckpt else None, data.train_tokens, data.val_tokens),
              "checkpoints or data")
    model, par, optimizer = build_model(cfg, ctx, ckpt, plan)
    checkpointer = Checkpointer(run_dir, cfg, par, optimizer)
    st = restore(ckpt, resume, ctx, checkpointer, say)
    # Written only now that config, data and checkpoint have all been accepted: a refused
    # input leaves the run folder as it was. The saved config names its folder, so
    # `qkvlab train RUN_DIR --resume` finds it again.
    if ctx.is_main:
        save_config(as_recorded(cfg), run_dir / CONFIG_FILE)
        copy_tokenizer(data, run_dir)
    peak, peak_src = peak_flops_for(ctx.device, tc.dtype, tc.peak_flops)
    s = Session(cfg=cfg, run_dir=run_dir, ctx=ctx, say=say, quiet=quiet, ckpt=ckpt, data=data,
                val_x=val_x, val_y=val_y, plan=plan, model=model, par=par, optimizer=optimizer,
                checkpointer=checkpointer, st=st, start_step=st.step,
                params=count_params(cfg.model),
                fpt=flops_per_token(cfg.model, cfg.model.block_size),
                # tokens/s counts the whole job, so MFU is against all devices
                peak=peak * ctx.world_size, peak_src=peak_src)
    announce(s)
    return s


def announce(s: Session) -> None:
    """The run's one-line description (and the process layout under torchrun)."""
    tc = s.cfg.train
    s.say(f"run {s.run_dir}: {s.params.total:,} params ({s.params.non_embedding:,} "
          f"non-embedding), {s.cfg.tokens_per_step:,} tokens/step, {s.device.type} {tc.dtype}, "
          f"steps {s.start_step}->{s.cfg.steps}{_budget(s.cfg)}, peak {s.peak / 1e12:.3g} TFLOP/s "
          f"({s.peak_src})")
    # only where the peak was measured: a configured one (tests, clusters) costs no matmuls
    slowdown = bf16_slowdown(s.device) if tc.dtype == "bf16" and s.peak_src.startswith(
        "measured") else None
    if slowdown is not None and slowdown > 2:
        s.say(f"bf16 matmuls run {slowdown:.0f}x slower than fp32 on this CPU (it has no bf16 "
              "instructions): --set train.dtype=auto (fp32 here) trains faster")
    if s.ctx.enabled:
        s.say(f"{s.ctx.world_size} processes ({s.par.mode}): each runs "
              f"{s.plan.micro_steps_per_rank} micro-step(s) of {s.plan.rows_per_micro_step} rows "
              "per step")


def _budget(cfg: RunConfig) -> str:
    """What a flop budget buys, for the run's line ("" without one)."""
    budget = cfg.train.flop_budget
    if budget is None:
        return ""
    return f" (flop budget {budget:.4g}: {cfg.train_flops:.4g} FLOPs trained)"


def open_outputs(s: Session) -> None:
    """metrics.jsonl (cut back to the resumed step), TensorBoard, W&B and the progress display."""
    tc = s.cfg.train
    resumed = s.start_step if s.ckpt is not None else None
    s.metrics = MetricsLog(s.run_dir / METRICS_FILE, resumed) if s.ctx.is_main else NullLog()
    s.tb = open_tensorboard(s.run_dir, resumed) if tc.tensorboard and s.ctx.is_main else None
    s.wandb = open_wandb(s.cfg, s.run_dir, resumed is not None, s.quiet, s.say) \
        if tc.wandb and s.ctx.is_main else None
    s.reporter = Reporter(s.cfg.steps, s.start_step, s.quiet)


def close_outputs(s: Session) -> None:
    if s.reporter is not None:
        s.reporter.close()
    if s.metrics is not None:
        s.metrics.close()
    if s.tb is not None:
        s.tb.close()
    if s.wandb is not None:
        # called from the trainer's `finally`: an exception on its way out marks the W&B run
        # failed
        s.wandb.close(failed=sys.exc_info()[0] is not None)
