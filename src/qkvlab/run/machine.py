"""What machine a number came from: the CPU model, its kernel level, torch, the GPU.

Training's kernels differ between CPU kinds (an AMD EPYC's AVX2 fp32 against an Intel Xeon's
AMX bf16) and torch versions, so two runs compared as a pair should have run on the same kind;
summary.json records this, and `qkvlab report` flags a pair that did not.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import torch


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else what `platform` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine_record(device: torch.device) -> dict[str, Any]:
    """summary.json's "machine": the CPU model and the vector extensions torch's CPU kernels
    use, the torch version, and the GPU where the run used one (no host names)."""
    out: dict[str, Any] = {"cpu": cpu_model(),
                           "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                           "torch": torch.__version__}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out
