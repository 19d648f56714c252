"""Shared helpers for the theory checks: random weights, special matrices, output differences.

Everything here works in float64 on CPU: the point of the checks is to separate rounding error
(~1e-13) from a real obstruction (~1e-2), which float32 cannot do.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from qkvlab.model.config import ModelConfig
from qkvlab.model.gpt import GPT


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def randomize_(model: nn.Module, seed: int, *, gain_spread: float = 0.3,
               bias_std: float = 0.1) -> nn.Module:
    """Overwrite every parameter with generic random values (in place) and return the model.

    The default init (std 0.02, unit gains, zero biases) is a very special point: zero biases
    and unit gains would hide exactly the terms the theorems are about. Here weights are
    N(0, 1/fan_in) so outputs stay O(1) through a few layers, gains are 1 + spread * N(0, 1)
    and biases N(0, bias_std).
    """
    g = generator(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                w = module.weight
                w.copy_(torch.randn(w.shape, generator=g, dtype=torch.float64)
                        / math.sqrt(w.shape[1]))
                if module.bias is not None:
                    module.bias.copy_(bias_std * torch.randn(module.bias.shape, generator=g,
                                                             dtype=torch.float64))
            elif isinstance(module, nn.Embedding):
                w = module.weight
                w.copy_(torch.randn(w.shape, generator=g, dtype=torch.float64))
            elif isinstance(module, nn.LayerNorm | nn.RMSNorm):
                if module.weight is not None:
                    module.weight.copy_(1.0 + gain_spread * torch.randn(
                        module.weight.shape, generator=g, dtype=torch.float64))
                if getattr(module, "bias", None) is not None:
                    module.bias.copy_(bias_std * torch.randn(module.bias.shape, generator=g,
                                                             dtype=torch.float64))
    return model


def random_model(cfg: ModelConfig, seed: int, **kwargs) -> GPT:
    """A float64 GPT of `cfg` with generic random weights (see `randomize_`)."""
    torch.manual_seed(seed)  # the constructor's own init; overwritten below anyway
    model = GPT(cfg).double().eval()
    return randomize_(model, seed, **kwargs)


def random_tokens(cfg: ModelConfig, seed: int, batch: int = 3,
                  length: int | None = None) -> torch.Tensor:
    """Random token ids (batch, length) with length <= block_size."""
    n = cfg.block_size if length is None else min(length, cfg.block_size)
    return torch.randint(cfg.vocab_size, (batch, n), generator=generator(seed + 7919))


@torch.no_grad()
def float64_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """Logits of a float64 CPU copy of `model` in eval mode (the model itself is untouched)."""
    m = model
    p = next(model.parameters())
    if p.dtype != torch.float64 or p.device.type != "cpu" or model.training:
        m = copy.deepcopy(model).cpu().double().eval()
    return m(idx.cpu())[0]


def max_logit_diff(a: GPT, b: GPT, idx: torch.Tensor) -> float:
    """max |logits_a - logits_b| over the batch, both evaluated in float64."""
    return float((float64_logits(a, idx) - float64_logits(b, idx)).abs().max())


def random_orthogonal(d: int, seed: int, *, keep_ones: bool = False) -> torch.Tensor:
    """A random d x d orthogonal matrix (float64); with keep_ones, one that fixes 1 = (1,..,1).

    keep_ones: T = 11^T/d + V R V^T, V an orthonormal basis of 1's complement and R a random
    rotation of it, so T 1 = 1 and T maps the complement to itself (T C = C T, the condition
    under which LayerNorm's centring commutes with the basis change).
    """
    g = generator(seed)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))  # Haar-distributed, not biased by QR's sign choice
    if not keep_ones:
        return q
    ones = torch.ones(d, 1, dtype=torch.float64) / math.sqrt(d)
    basis, _ = torch.linalg.qr(torch.cat([ones, torch.randn(d, d - 1, generator=g,
                                                            dtype=torch.float64)], dim=1))
    v = basis[:, 1:]  # orthonormal, orthogonal to 1
    rot = random_orthogonal(d - 1, seed + 1) if d > 1 else torch.ones(0, 0, dtype=torch.float64)
    return ones @ ones.T + v @ rot @ v.T


def param_count(model: nn.Module) -> int:
    """Distinct parameters (a tied head counts once)."""
    return sum(p.numel() for p in model.parameters())
