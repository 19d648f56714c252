"""AdamW with decay only on matrices and embeddings, and the warmup + cosine lr schedule."""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from qkvlab.run.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: tensors with >= 2 dims (matrices, embeddings) decay; gains and biases don't.

    named_parameters() yields a tied tensor once, so the shared embedding/head is not doubled.
    """
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _kernel_flags(device: torch.device) -> dict[str, bool]:
    """fused=True where torch has the fused kernel for this device, else foreach."""
    params = inspect.signature(torch.optim.AdamW).parameters
    if "fused" in params and device.type in ("cuda", "cpu"):
        return {"fused": True}
    return {"foreach": True}


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over `param_groups`, with the config's betas/eps and a fused kernel if available."""
    device = next(model.parameters()).device
    groups = param_groups(model, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    try:
        return torch.optim.AdamW(groups, **kwargs, **_kernel_flags(device))
    except (RuntimeError, TypeError, ValueError):
        # An older torch without the fused kernel for this device: the portable version.
        return torch.optim.AdamW(groups, **kwargs)


def lr_at(step: int, cfg: OptimConfig, max_steps: int | None = None) -> float:
    """Learning rate for optimizer step `step` (0-based).

    Linear warmup reaching cfg.lr at step warmup_steps - 1, cosine from cfg.lr at warmup_steps
    to cfg.min_lr at the horizon (cfg.decay_steps, else max_steps), then constant min_lr.
    """
    horizon = cfg.decay_steps or max_steps
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if horizon is None or horizon <= cfg.warmup_steps:
        return cfg.lr  # no decay horizon: stay at the peak
    if step >= horizon:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / (horizon - cfg.warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr
