"""Multi-process training under torchrun: process groups, DDP / FSDP2, the global batch plan.

Launch with `torchrun --nproc_per_node=N -m qkvlab train CONFIG`: every process runs the normal
`train` command, and this module turns the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) into a process group (NCCL on GPUs, gloo on CPUs). Everything that
crosses processes goes through torch.distributed (DDP, FSDP2, all_reduce, barrier,
torch.distributed.checkpoint.state_dict): there is no communication code of our own.

The global batch does not depend on the world size. `train.batch_size` x `train.grad_accum`
sequences make one optimizer step, cut into grad_accum micro-batches of batch_size rows, and
micro-batch m of step s is a pure function of (seed, s, m) (`TokenData.train_batch`). With W
processes the micro-batches are dealt out, whole when W divides grad_accum, else split by rows
(see `BatchPlan`). Every process therefore reads windows no other process reads, the averaged
gradient equals the single-process one (up to float summation order), and a run may resume on
another number of processes: the data stream and the trajectory stay the same.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from qkvlab.errors import QkvlabError
from qkvlab.run.config import PARALLEL
from qkvlab.run.device import autocast, evaluate

PARALLEL_MODES = PARALLEL  # the train.parallel choices
_ENV_KEYS = ("RANK", "WORLD_SIZE")


# ---- the global batch -----------------------------------------------------------------------
@dataclass(frozen=True)
class MicroStep:
    """One forward/backward of a process: rows `part` of `parts` of micro-batch `index`."""

    index: int  # micro_step of the global step: seeds the batch, as in a single process
    rows: int  # rows this process takes from that micro-batch
    part: int  # which slice of the micro-batch (TokenData.train_batch's rank)
    parts: int  # slices the micro-batch is cut into (TokenData.train_batch's world_size)


@dataclass(frozen=True)
class BatchPlan:
    """How one global step (batch_size x grad_accum sequences) is dealt out to W processes.

    With g = gcd(grad_accum, W) and s = W / g, the processes form g groups of s. Group k runs
    micro-batches k*M .. k*M + M - 1 (M = grad_accum / g) and its s members split the rows of
    each of them evenly (batch_size / s rows each). W = 1 is the single-process loop; W dividing
    grad_accum hands out whole micro-batches (nanoGPT's split); W = 8 with grad_accum = 1 cuts
    the one micro-batch into 8 row slices.
    """

    batch_size: int
    grad_accum: int
    world_size: int
    rank: int

    @property
    def groups(self) -> int:
        return math.gcd(self.grad_accum, self.world_size)

    @property
    def parts(self) -> int:
        return self.world_size // self.groups

    @property
    def micro_steps_per_rank(self) -> int:
        return self.grad_accum // self.groups

    @property
    def rows_per_micro_step(self) -> int:
        return self.batch_size // self.parts

    def micro_steps(self) -> list[MicroStep]:
        """This process's micro-steps in order; the last one is where gradients are synced."""
        group, part = divmod(self.rank, self.parts)
        first = group * self.micro_steps_per_rank
        return [MicroStep(first + j, self.rows_per_micro_step, part, self.parts)
                for j in range(self.micro_steps_per_rank)]

    def as_dict(self) -> dict[str, Any]:
        """What a checkpoint records about the data stream (rank 0's view, plus the layout)."""
        return {
            "batch_size": self.batch_size,
            "grad_accum": self.grad_accum,
            "global_batch_sequences": self.batch_size * self.grad_accum,
            "world_size": self.world_size,
            "micro_steps_per_rank": self.micro_steps_per_rank,
            "rows_per_micro_step": self.rows_per_micro_step,
            "layout": f"rank r runs micro-steps {self.micro_steps_per_rank} * (r // {self.parts})"
                      f" + j and takes row slice r % {self.parts} of {self.parts}",
        }


def plan_batches(batch_size: int, grad_accum: int, world_size: int, rank: int) -> BatchPlan:
    """The BatchPlan of `rank`, or a QkvlabError saying how to make the batch divisible."""
    plan = BatchPlan(batch_size, grad_accum, world_size, rank)
    if batch_size % plan.parts:
        raise QkvlabError(
            f"the global batch (train.batch_size = {batch_size} x train.grad_accum = "
            f"{grad_accum}) cannot be split evenly over {world_size} processes: each micro-batch "
            f"would go to {plan.parts} processes but {batch_size} rows do not divide by "
            f"{plan.parts}; make train.grad_accum a multiple of {world_size} or train.batch_size "
            f"a multiple of {plan.parts}"
        )
    return plan


# ---- the process group ----------------------------------------------------------------------
@dataclass
class DistContext:
    """This process's place in the job. A single process has rank 0 of world size 1."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0: the only process that logs and writes files."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def sum(self, *values: float) -> list[float]:
        """Elementwise sums over all processes, in float64 (on the device NCCL needs)."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def mean_(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce `t` in place to its mean over processes (ReduceOp.AVG is NCCL-only)."""
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            t /= self.world_size
        return t

    def any(self, flag: bool) -> bool:
        """True on every process when it is true on one (e.g. a signal reached only some)."""
        return bool(self.sum(float(flag))[0] > 0) if self.enabled else flag

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every process (a small picklable value)."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    def agree(self, value: Any, what: str) -> None:
        """Raise the same QkvlabError on every process unless they all hold the same `value`.

        Catches a multi-node run whose nodes see different files (no shared filesystem) before
        the processes resume from different steps and wait forever on each other.
        """
        values = self.gather(value)
        odd = next((r for r, v in enumerate(values) if v != values[0]), None)
        if odd is not None:
            raise QkvlabError(
                f"the processes see different {what} (rank 0: {values[0]}, rank {odd}: "
                f"{values[odd]}): every node must see the run folder and the data dir at the "
                "same paths, e.g. on a shared filesystem"
            )

    def gather(self, obj: Any) -> list[Any]:
        """Every process's `obj`, in rank order, on every process."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


def launch_env() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) from torchrun's environment, or None outside torchrun."""
    if not all(k in os.environ for k in _ENV_KEYS):
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise QkvlabError("RANK / WORLD_SIZE / LOCAL_RANK are not integers: launch with "
                          "torchrun, or unset them for a single process") from None
    if world < 1 or not 0 <= rank < world:
        raise QkvlabError(f"RANK={rank} is outside WORLD_SIZE={world}: launch with torchrun")
    return rank, world, local


def env_rank() -> int:
    """This process's rank according to the environment (0 outside torchrun)."""
    found = launch_env()
    return found[0] if found else 0


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@contextlib.contextmanager
def session(device: torch.device) -> Iterator[DistContext]:
    """The DistContext of this process, with a process group while the block runs.

    Outside torchrun (or with WORLD_SIZE=1) this is a single process on `device`. Under torchrun
    a CUDA device becomes cuda:LOCAL_RANK and the group uses NCCL; a CPU one uses gloo. A group
    that the caller already initialised is used as it is and left alone on exit.
    """
    found = launch_env()
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = found[2] if found else rank
        owned = False
    elif found is None or found[1] == 1:
        if found is not None and device.type == "cuda":
            device = _local_cuda(device, found[2])
        yield DistContext(device=device)
        return
    else:
        rank, world, local = found
        owned = True
    if world > 1 and device.type == "cuda":
        device = _local_cuda(device, local)
    if owned:
        kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend=_backend(device), **kwargs)
    try:
        yield DistContext(device=device, rank=rank, world_size=world, local_rank=local)
    except BaseException:
        # No barrier or destroy after a failure: the others may be inside a collective, where
        # either would hang; torchrun tears the job down instead.
        if owned:
            _let_workers_finish()
        raise
    if owned and dist.is_initialized():
        dist.barrier()  # every rank finishes its last collective before any group goes away
        dist.destroy_process_group()
        _let_workers_finish()


def _let_workers_finish() -> None:
    """Give the communication threads the GIL before the interpreter shuts down.

    A gloo worker thread frees a finished collective's tensors, which needs the GIL. If the
    interpreter starts finalising before that thread got it, CPython ends the thread inside a
    C++ destructor and the process aborts ("terminate called without an active exception").
    """
    time.sleep(0.2)


def _local_cuda(device: torch.device, local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK (one GPU per process), made the current device."""
    if device.index is not None and device.index != local_rank:
        raise QkvlabError(f"train.device = {device} under torchrun: use train.device=cuda (each "
                          "process takes the GPU of its LOCAL_RANK)")
    if local_rank >= torch.cuda.device_count():
        raise QkvlabError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are "
                          "visible: start at most that many processes per node")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def rank_seed(seed: int, rank: int) -> int:
    """The torch seed of rank > 0 after initialisation, so dropout masks differ between ranks."""
    return int(np.random.SeedSequence([int(seed), 0x5EED, int(rank)]).generate_state(1)[0])


# ---- the model as trained -------------------------------------------------------------------
class Parallel:
    """The model as this process trains it: plain, DDP-wrapped or FSDP2-sharded, maybe compiled.

    `module` is the GPT itself (sharded in place under FSDP), `fwd` what forward passes call.
    Build it after loading a checkpoint's weights into `module` and before the optimizer: FSDP
    shards the parameters that exist at that moment, and the optimizer must hold the shards.
    Saving and restoring its states is train/checkpointer.py's.
    """

    def __init__(self, module: nn.Module, ctx: DistContext, mode: str, use_compile: bool,
                 plan: BatchPlan):
        if mode not in PARALLEL_MODES:
            raise QkvlabError(f"train.parallel = {mode!r}: use one of {', '.join(PARALLEL_MODES)}")
        self.module, self.ctx, self.plan = module, ctx, plan
        # one process needs no wrapper: FSDP over one rank would only add overhead
        self.mode = mode if ctx.enabled else "single"
        self.wrapped: nn.Module = module
        if self.mode == "ddp":
            ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            # The only buffers are RoPE tables, identical everywhere: broadcasting them every
            # forward would cost a collective and tie eval forwards to a matching count.
            # (torch 2.13 renamed the switch; older versions only know broadcast_buffers.)
            no_sync = {"forward_sync_buffers": False} \
                if "forward_sync_buffers" in inspect.signature(DDP).parameters \
                else {"broadcast_buffers": False}
            self.wrapped = DDP(module, device_ids=ids, **no_sync)
        elif self.mode == "fsdp":
            self._shard()
        self.fwd: nn.Module = torch.compile(self.wrapped) if use_compile else self.wrapped

    def _shard(self) -> None:
        # FSDP's modules take ~0.5 s to import (measured): only FSDP runs pay for them
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.ctx.device.type, (self.ctx.world_size,))
        blocks = getattr(self.module, "blocks", [])
        cfg = getattr(self.module, "cfg", None)
        # One unit per block bounds the gathered memory to one block; a block shared across
        # layers (share_layers) runs several times per forward, so it stays in the root unit.
        if not getattr(cfg, "share_layers", False):
            for block in blocks:
                fully_shard(block, mesh=mesh)
        fully_shard(self.module, mesh=mesh)

    # -- one optimizer step --------------------------------------------------------------------
    def micro_steps(self) -> list[MicroStep]:
        return self.plan.micro_steps()

    def grad_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """Around a micro-step's forward and backward: all-reduce its gradients only if `sync`.

        Non-final micro-steps accumulate locally; the final one reduces the sum once.
        """
        if self.mode == "ddp" and not sync:
            return self.wrapped.no_sync()
        if self.mode == "fsdp":
            self.module.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def mean_loss(self, loss_sum: torch.Tensor) -> float:
        """The step's loss: mean over this process's micro-steps, then over processes."""
        n = self.plan.micro_steps_per_rank
        if not self.ctx.enabled:
            return float(loss_sum) / n  # in float64, as the single-process loop always did
        return float(self.ctx.mean_(loss_sum / n))

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip to max_norm and return the global gradient norm (the same on every process)."""
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):  # FSDP2: a replicated DTensor
            norm = norm.full_tensor()
        return float(norm)

    # -- evaluation ----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, dtype: str) -> float:
        """Mean per-token loss over the fixed windows (x, y), as trainer.evaluate computes it.

        With several processes the eval batches are dealt out round-robin and the loss sums are
        all-reduced. Every process runs the same number of forwards (padding with a batch that
        is not counted): FSDP forwards are collectives that must pair up.
        """
        if not self.ctx.enabled:
            return evaluate(self.fwd, x, y, batch_size, self.ctx.device, dtype)
        starts = list(range(0, x.size(0), batch_size))
        mine = starts[self.ctx.rank::self.ctx.world_size]
        rounds = math.ceil(len(starts) / self.ctx.world_size)
        was_training = self.fwd.training
        self.fwd.eval()
        total, count = 0.0, 0
        try:
            for i in range(rounds):
                start = mine[i] if i < len(mine) else starts[0]
                xb = x[start:start + batch_size].to(self.ctx.device)
                yb = y[start:start + batch_size].to(self.ctx.device)
                with autocast(self.ctx.device, dtype):
                    _, loss = self.fwd(xb, yb)
                if i < len(mine):
                    total += float(loss) * xb.size(0)
                    count += xb.size(0)
        finally:
            self.fwd.train(was_training)
        total, count = self.ctx.sum(total, float(count))
        return total / count
