"""Device and numerics: train.device -> torch.device, train.dtype "auto" -> bf16 or fp32, bf16
autocast, the fixed-window eval."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from qkvlab.errors import QkvlabError
from qkvlab.run.config import RunConfig


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


# CPU features whose bf16 matmuls beat fp32 ones (torch.cpu.get_capabilities names them); without
# one, bf16 is emulated: 0.95 GFLOP/s against 109 in fp32 on an AVX2 EPYC (benchmarks/README.md)
_FAST_BF16_CPU = ("amx_bf16", "avx512_bf16", "bf16", "sve_bf16")


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run natively on `device`: a CUDA GPU with bf16 units, a CPU with bf16
    instructions (AMX or AVX512-BF16 on x86, BF16 on Arm)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type != "cpu":
        return False
    capabilities = getattr(torch.cpu, "get_capabilities", None)  # not in every torch allowed
    if capabilities is not None:
        found = capabilities()
        return any(bool(found.get(name)) for name in _FAST_BF16_CPU)
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # the older, private ones
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """train.dtype on `device`: "auto" is bf16 where bf16 matmuls are native, else fp32."""
    if dtype != "auto":
        return dtype
    return "bf16" if fast_bf16(device) else "fp32"


def on_this_device(cfg: RunConfig, device: torch.device) -> RunConfig:
    """`cfg` with what "auto" leaves to the device made concrete (the attention kernel and
    train.dtype), so that the saved config, fingerprints and resume all see what the run
    trains with."""
    dtype = resolve_dtype(cfg.train.dtype, device)
    if dtype != cfg.train.dtype:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dtype=dtype))
    return cfg.on_device(device.type)  # the kernel depends on the dtype


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
