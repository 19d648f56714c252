"""Healing a converted model: a short fine-tune on the data (cross-entropy) or distillation
(KL divergence to the original model's next-token distribution), with periodic validation."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from qkvlab.data.loader import TokenData
from qkvlab.errors import QkvlabError
from qkvlab.model.gpt import GPT
from qkvlab.run.config import OptimConfig
from qkvlab.run.device import autocast
from qkvlab.train.optim import build_optimizer, lr_at, set_lr


@dataclass
class HealConfig:
    """Length, batch and optimiser of the healing run."""

    steps: int = 200
    batch_size: int = 32
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine down to lr * this
    warmup_steps: int | None = None  # None: steps // 10, at most 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    distill: bool = False  # KL to the teacher's logits instead of CE on the next token
    eval_every: int | None = None  # None: steps // 4
    seed: int = 0
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise QkvlabError(f"--steps must be >= 0, got {self.steps}")
        if self.batch_size < 1:
            raise QkvlabError(f"--batch-size must be >= 1, got {self.batch_size}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise QkvlabError(f"--lr must be > 0, got {self.lr}")
        if self.eval_every is not None and self.eval_every < 1:
            raise QkvlabError(f"--eval-every must be >= 1, got {self.eval_every}")

    def optim(self) -> OptimConfig:
        warmup = self.warmup_steps if self.warmup_steps is not None else min(50, self.steps // 10)
        return OptimConfig(lr=self.lr, min_lr=self.lr * self.min_lr_ratio, warmup_steps=warmup,
                           weight_decay=self.weight_decay, beta1=self.beta1, beta2=self.beta2,
                           grad_clip=self.grad_clip)

    @property
    def interval(self) -> int:
        return self.eval_every or max(1, self.steps // 4)


@dataclass
class HealResult:
    """Validation loss vs healing steps (step 0 = right after conversion)."""

    curve: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def final(self) -> float:
        return self.curve[-1][1]


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student) at temperature 1."""
    s = F.log_softmax(student_logits.float().flatten(0, -2), dim=-1)
    t = F.log_softmax(teacher_logits.float().flatten(0, -2), dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def heal(student: GPT, data: TokenData, cfg: HealConfig, evaluate: Callable[[GPT], float], *,
         teacher: GPT | None = None, log: Callable[[str], None] | None = None) -> HealResult:
    """Fine-tune `student` in place for cfg.steps steps; evaluate at 0, every interval, the end.

    Batches are the loader's deterministic (seed, step) windows, so two inits healed with the
    same seed see the same data.
    """
    if cfg.distill and teacher is None:
        raise QkvlabError("distillation needs the original model as the teacher")
    device = next(student.parameters()).device
    block = student.cfg.block_size
    optim_cfg = cfg.optim()
    optimizer = build_optimizer(student, optim_cfg)
    result = HealResult(curve=[(0, evaluate(student))])
    if teacher is not None:
        teacher.eval()
    start = time.perf_counter()
    student.train()
    for step in range(cfg.steps):
        set_lr(optimizer, lr_at(step, optim_cfg, cfg.steps))
        x, y = data.train_batch(step, 0, cfg.batch_size, block, cfg.seed)
        x, y = x.to(device), y.to(device)
        with autocast(device, cfg.dtype):
            if cfg.distill:
                with torch.no_grad():
                    t_logits = teacher(x)[0]  # type: ignore[misc]
                loss = distill_loss(student(x)[0], t_logits)
            else:
                loss = student(x, y)[1]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        torch.nn.utils.clip_grad_norm_(student.parameters(), clip)
        loss_value = float(loss.detach())
        if not math.isfinite(loss_value):
            raise QkvlabError(f"healing diverged at step {step} (non-finite loss): lower --lr")
        optimizer.step()
        done = step + 1
        if done % cfg.interval == 0 or done == cfg.steps:
            val = evaluate(student)
            result.curve.append((done, val))
            if log is not None:
                log(f"  heal step {done}/{cfg.steps}: train {'KL' if cfg.distill else 'CE'} "
                    f"{loss_value:.4f}, val loss {val:.4f}")
            student.train()
    student.eval()
    result.seconds = time.perf_counter() - start
    return result
