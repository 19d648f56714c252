"""AdamW with decay only on matrices and embeddings, its parameter groups from the
parametrization's table (model/parametrization.py), and the warmup + cosine lr schedule."""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from qkvlab.model.parametrization import ParamRule, Scaling, parameter_table
from qkvlab.run.config import OptimConfig, RunConfig


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """One group per set of factors in the model's parameter table (model/parametrization.py):
    matrices and embeddings decay, gains and biases don't. Each group's `lr_scale` is its lr
    over optim.lr (set_lr keeps it), its weight_decay is chosen so that lr x weight_decay, the
    fraction decayed per step, is the table's (decay independent of the group's lr), its eps
    the table's. Under "standard" parametrization without depth scaling this is two groups,
    decaying then not, as checkpoints made before the table hold them.

    named_parameters() yields a tied tensor once, so the shared embedding/head is not doubled.
    """
    model_cfg = getattr(model, "cfg", None)
    rules = parameter_table(model, model_cfg) if model_cfg is not None else \
        [ParamRule(n, "", False, p.dim() >= 2, Scaling()) for n, p in model.named_parameters()
         if p.requires_grad]  # a model outside the family (tests' toy modules): plain AdamW
    groups: dict[tuple, dict] = {}
    for rule in sorted(rules, key=lambda r: not r.decays):  # stable: decaying groups first
        s = rule.scaling
        key = (rule.decays, s.lr, s.decay, s.eps)
        if key not in groups:
            decay = cfg.weight_decay * s.decay / s.lr if rule.decays else 0.0
            groups[key] = {"params": [], "lr": cfg.lr * s.lr, "lr_scale": s.lr,
                           "weight_decay": decay, "eps": cfg.eps * s.eps}
        groups[key]["params"].append(model.get_parameter(rule.name))
    return list(groups.values())


def _kernel_flags(device: torch.device) -> dict[str, bool]:
    """fused=True where torch has the fused kernel for this device, else foreach."""
    params = inspect.signature(torch.optim.AdamW).parameters
    if "fused" in params and device.type in ("cuda", "cpu"):
        return {"fused": True}
    return {"foreach": True}


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over `param_groups`, with the config's betas/eps and a fused kernel if available."""
    device = next(model.parameters()).device
    groups = param_groups(model, cfg)
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    try:
        return torch.optim.AdamW(groups, **kwargs, **_kernel_flags(device))
    except (RuntimeError, TypeError, ValueError):
        # An older torch without the fused kernel for this device: the portable version.
        return torch.optim.AdamW(groups, **kwargs)


def lr_at(step: int, cfg: OptimConfig, max_steps: int | None = None,
          warmup_steps: int | None = None) -> float:
    """Learning rate for optimizer step `step` (0-based).

    Linear warmup (warmup_steps, else cfg.warmup_steps) reaching cfg.lr at its last step,
    cosine from cfg.lr to cfg.min_lr at the horizon (cfg.decay_steps, else max_steps), then
    constant min_lr. A run's schedule is `run_lr`.
    """
    horizon = cfg.decay_steps or max_steps
    warmup = warmup_steps if warmup_steps is not None else cfg.warmup_steps
    if warmup is None:
        raise ValueError("optim.warmup_fraction needs the run's steps: call run_lr")
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if horizon is None or horizon <= warmup:
        return cfg.lr  # no decay horizon: stay at the peak
    if step >= horizon:
        return cfg.min_lr
    progress = (step - warmup) / (horizon - warmup)
    coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


def run_lr(step: int, cfg: RunConfig) -> float:
    """The learning rate of a run's step `step`: its warmup and horizon as RunConfig resolves
    them (a flop budget's steps, a warmup fraction of them)."""
    return lr_at(step, cfg.optim, cfg.decay_steps, cfg.warmup_steps)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group: `lr` times the group's lr_scale (1 in
    groups restored from checkpoints made before the parametrization table)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
