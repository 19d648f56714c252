"""The denominator of MFU for the benchmark: datasheet peak on a known GPU, else measured.

The measurement and the GPU table live in qkvlab.perf (one copy, shared with the trainer's
MFU). This module adds what a benchmark wants on top: several matmul sizes (the best one is
the attainable peak), and both candidates kept for the record, so the report can show how far
the datasheet is from what this machine really reaches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from qkvlab.perf import known_gpu_peak, measure_matmul_peak


def default_sizes(device: torch.device) -> tuple[int, ...]:
    """Square matmul sizes to try. Small ones underfill the cores; on CPU 4096 sometimes beats
    2048 (AMX tiles), and on a GPU a sample must be long enough to dwarf the launch cost."""
    return (4096, 8192) if device.type == "cuda" else (2048, 4096)


def measured_peak(dtype: str, device: torch.device, sizes: tuple[int, ...] | None = None,
                  repeats: int = 5) -> float:
    """Best over sizes of the median FLOP/s of `repeats` square matmuls (qkvlab.perf does one
    size; the max over sizes is the peak this machine can actually reach)."""
    return max(measure_matmul_peak(dtype, device, size=n, repeats=repeats)
               for n in (sizes or default_sizes(device)))


@dataclass(frozen=True)
class Peak:
    """The peak MFU divides by, where it came from, and both candidates for the record."""

    flops: float
    source: str  # "spec: <GPU name>", "measured", or "given"
    measured: float | None
    spec: float | None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def resolve_peak(device: torch.device, dtype: str, given: float | None = None,
                 measure: bool = True, sizes: tuple[int, ...] | None = None,
                 device_name: str | None = None) -> Peak:
    """Datasheet number on a known GPU, else the measured one; `given` overrides both.

    dtype is "bf16" or "fp32"; device_name defaults to what CUDA reports (tests pass one).
    """
    measured = measured_peak(dtype, device, sizes) if measure else None
    spec, name = None, device_name
    if device.type == "cuda":
        name = name or torch.cuda.get_device_name(device)
        spec = known_gpu_peak(name, dtype)
    if given is not None:
        return Peak(given, "given", measured, spec)
    if spec is not None:
        return Peak(spec, f"spec: {name}", measured, spec)
    if measured is None:
        raise ValueError("no peak: not a known GPU and measuring was switched off")
    return Peak(measured, "measured", measured, None)
