"""Device and numerics: train.device -> torch.device, bf16 autocast, the fixed-window eval."""

from __future__ import annotations

import contextlib
import math

import torch

from qkvlab.errors import QkvlabError


def device_type(name: str) -> str:
    """The device type train.device names on this machine ("auto": CUDA when visible, else
    CPU), without resolve_device's check that a named GPU is there."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_device(name: str) -> torch.device:
    """train.device -> torch.device ("auto": CUDA when visible, else CPU)."""
    if name == "auto":
        return torch.device(device_type(name))
    if name == "cuda" and not torch.cuda.is_available():
        raise QkvlabError("train.device = cuda but no CUDA GPU is visible: "
                          "use --set train.device=cpu (or auto)")
    return torch.device(name)


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """bf16 autocast on the device (matmuls in bf16, losses and norms in fp32), or nothing."""
    if dtype != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def check_dtype(device: torch.device, dtype: str) -> None:
    if dtype == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise QkvlabError(f"{torch.cuda.get_device_name(device)} has no bf16 support: "
                          "use --set train.dtype=fp32")


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    device: torch.device,
    dtype: str,
) -> float:
    """Mean per-token loss over the fixed windows (x, y), in eval mode under the same autocast."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for start in range(0, x.size(0), batch_size):
            xb = x[start:start + batch_size].to(device)
            yb = y[start:start + batch_size].to(device)
            with autocast(device, dtype):
                _, loss = model(xb, yb)
            # every window has the same length, so weighting by rows gives the token mean
            total += float(loss) * xb.size(0)
            count += xb.size(0)
    finally:
        model.train(was_training)
    return total / count


def perplexity(loss: float | None) -> float | None:
    if loss is None or not math.isfinite(loss):
        return None
    return math.exp(loss) if loss < 700 else math.inf
