"""Throughput helpers: matmul peak measurement, known GPU peaks, model FLOPs utilisation.

MFU = flops_per_token * tokens_per_second / peak_flops. On a GPU the peak comes from the
datasheet table below (dense, no sparsity); on a CPU there is no datasheet worth trusting, so
the peak is the best large-matmul rate measured on this machine.
"""

from __future__ import annotations

import ctypes
import functools
import statistics
import sys
import time

import torch

# (substring of torch.cuda.get_device_name(), bf16 dense peak, fp32 peak without tensor cores)
# Order matters: the first match wins, so more specific names come first.
GPU_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("B200", 2250e12, 80e12),
    ("H200", 989e12, 67e12),
    ("H100 PCIe", 756e12, 51e12),
    ("H100", 989e12, 67e12),
    ("H800", 989e12, 67e12),
    ("A100", 312e12, 19.5e12),
    ("A800", 312e12, 19.5e12),
    ("L40S", 362e12, 91.6e12),
    ("L40", 181e12, 90.5e12),
    ("L4", 121e12, 30.3e12),
    ("A10", 125e12, 31.2e12),
    ("RTX 4090", 165e12, 82.6e12),
    ("RTX 3090", 71e12, 35.6e12),
)


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_freed_memory_kept = False  # set once keep_freed_memory took effect in this process


def freed_memory_kept() -> bool:
    return _freed_memory_kept


def keep_freed_memory() -> bool:
    """Make glibc serve every block from its heap and keep what is freed there, for a CPU
    training or benchmark process. Returns whether it took effect (False without glibc).

    Why: by default glibc maps each large block fresh from the kernel and unmaps it on free,
    so every training step page-faults its activations in again, single-threaded. On the
    project's 2-core CPU, bf16: a baby-shape step (12 x 256) took 20-70k page faults and
    35-120 ms of system time in ~350 ms; a paper-shape step (1 x 1,024) 425k faults and
    0.84 s of system time, 1.95 s in all against 1.35 s with this. The cost: the resident size
    stays at its high-water mark, which a training process reaches every step anyway. Numerics
    are unchanged. (Where the heap cannot grow, glibc still maps memory as a fallback.)
    """
    global _freed_memory_kept
    if _freed_memory_kept or not sys.platform.startswith("linux"):
        return _freed_memory_kept
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another libc: leave it alone
        return False
    # no mmap, and never trim (-1, man mallopt): a finite threshold is an int, below the
    # 2 GiB+ that a paper-shape step frees at the top of the heap
    _freed_memory_kept = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, -1))
    return _freed_memory_kept


def torch_dtype(dtype: str) -> torch.dtype:
    """torch dtype of a config dtype name ("bf16" or "fp32")."""
    return torch.bfloat16 if dtype == "bf16" else torch.float32


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.lru_cache(maxsize=16)
def _measure(dtype: str, device: str, size: int, repeats: int) -> float:
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)  # leaves the global RNG alone
    a = torch.randn(size, size, device=dev, generator=gen).to(torch_dtype(dtype))
    b = torch.randn(size, size, device=dev, generator=gen).to(torch_dtype(dtype))
    a @ b  # warm-up: first calls pay for kernel selection and page faults
    _sync(dev)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return 2.0 * size**3 / statistics.median(times)


# A CPU without bf16 matmul instructions (AVX2 only) emulates them ~100x slower than fp32: a
# 2048 matmul would take ~18 s there. A probe at PROBE_SIZE first keeps the measurement short.
PROBE_SIZE = 256
MAX_MEASURE_S = 2.0  # the longest one timed matmul may take (a 4096 one on an AVX2 CPU: 1.4 s)


def measure_matmul_peak(
    dtype: str = "bf16", device: str | torch.device = "cpu", size: int = 2048, repeats: int = 5
) -> float:
    """FLOP/s of a size x size matmul in `dtype` ("bf16"/"fp32"), median of `repeats` runs;
    a smaller size where one matmul of `size` would take longer than MAX_MEASURE_S.

    Cached per process: the first call costs about a second on a small CPU.
    """
    device = str(torch.device(device))
    size = int(size)
    if size > PROBE_SIZE:
        probe = _measure(dtype, device, PROBE_SIZE, 2)
        while size > PROBE_SIZE and 2.0 * size**3 / probe > MAX_MEASURE_S:
            size //= 2
    return _measure(dtype, device, size, int(repeats))


def bf16_slowdown(device: torch.device) -> float | None:
    """How many times slower bf16 matmuls run than fp32 ones on this CPU, when they do (a CPU
    without bf16 instructions); None on other devices or where bf16 is not the slower one."""
    if device.type != "cpu":
        return None
    ratio = measure_matmul_peak("fp32", device) / measure_matmul_peak("bf16", device)
    return ratio if ratio > 1.0 else None


def known_gpu_peak(name: str, dtype: str) -> float | None:
    """Datasheet peak FLOP/s of a GPU (by name substring), or None when it is not in the table."""
    for key, bf16, fp32 in GPU_PEAKS:
        if key in name:
            return bf16 if dtype == "bf16" else fp32
    return None


def peak_flops_for(device: torch.device, dtype: str, configured: float | None = None
                   ) -> tuple[float, str]:
    """(peak FLOP/s, where it came from) for MFU: the config, the GPU table, or a measurement."""
    if configured is not None:
        return float(configured), "config"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = known_gpu_peak(name, dtype)
        if peak is not None:
            return peak, f"datasheet ({name})"
    return measure_matmul_peak(dtype, device), "measured matmul"


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation, a fraction of the peak."""
    return flops_per_token * tokens_per_s / peak_flops if peak_flops > 0 else 0.0
