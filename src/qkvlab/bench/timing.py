"""Timing and memory helpers shared by the benchmark workloads.

Everything here is device-agnostic: on CUDA, kernels run asynchronously, so a timer is only
honest once the device has finished (`synchronize`); on CPU that call is a no-op.
"""

from __future__ import annotations

import contextlib
import math
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so that the wall clock covers the work and nothing else."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn: Callable[[], object], device: torch.device, iters: int = 1) -> float:
    """Seconds per call of `fn`, averaged over `iters` back-to-back calls.

    One synchronisation before (so earlier work is not billed to us) and one after (so our
    work is): synchronising inside the loop would add a host round-trip per call.
    """
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / iters


def interleaved(names: list[str], repeat: int) -> list[str]:
    """The order of one repeat: as given on even repeats, reversed on odd ones (A B, B A, ...),
    so the runs of a pair share the minute's load and no one always goes second."""
    return list(names) if repeat % 2 == 0 else list(names)[::-1]


@dataclass(frozen=True)
class Spread:
    """Median and range of repeated measurements; the median resists one-off hiccups."""

    median: float
    low: float
    high: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: list[float] | tuple[float, ...]) -> Spread:
        if not values:
            raise ValueError("a spread needs at least one value")
        return cls(statistics.median(values), min(values), max(values), tuple(values))

    def as_dict(self) -> dict[str, object]:
        return {"median": self.median, "min": self.low, "max": self.high,
                "values": list(self.values)}


@dataclass(frozen=True)
class MedianInterval:
    """A distribution-free confidence interval for a median: the order statistics
    x_(k) <= median <= x_(n+1-k), whose coverage follows from Binomial(n, 1/2) alone (the sign
    test), so it holds for any noise distribution with independent pairs."""

    low: float
    high: float
    coverage: float  # the exact coverage of [low, high]: the nominal level or, for n < 6, less


def median_interval(values: list[float] | tuple[float, ...], level: float = 0.95
                    ) -> MedianInterval:
    """The narrowest order-statistic interval whose coverage is at least `level`; with too few
    values for that (n < 6 at 95%) the widest one there is, [min, max], with its lower coverage.
    """
    xs, n = sorted(values), len(values)
    if n < 2:
        raise ValueError("a confidence interval needs at least two values")

    def coverage(k: int) -> float:  # P(x_(k) <= median <= x_(n+1-k)) = 1 - 2 P(B < k)
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n

    k = 1
    while k + 1 <= n // 2 and coverage(k + 1) >= level:
        k += 1
    return MedianInterval(xs[k - 1], xs[n - k], coverage(k))


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """bf16/fp16 autocast on the device, or nothing for fp32 (autocast to fp32 is not a thing)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def max_rss_bytes() -> int:
    """The process's resident-set high-water mark (Linux reports KiB, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024


@contextlib.contextmanager
def peak_memory(device: torch.device) -> Iterator[dict[str, int | None]]:
    """Bytes the enclosed code added at its peak, in `result["peak_bytes"]` on exit.

    CUDA: max_memory_allocated minus what was allocated on entry, so tensors that other
    models keep resident (the benchmark holds every scheme at once) are not billed to this one.
    CPU: there is no allocator counter, and the RSS high-water mark only ever rises (and the
    allocator keeps freed pages), so a per-block figure would be wrong; it stays None.
    """
    result: dict[str, int | None] = {"peak_bytes": None}
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        yield result
        synchronize(device)
        result["peak_bytes"] = torch.cuda.max_memory_allocated(device) - before
    else:
        yield result
