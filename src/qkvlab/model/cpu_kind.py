"""What an x86 CPU offers for bf16 and wide vector math, in one word: the CPU part of the key
that `attn_impl = "auto"` looks its kernel up by (model/config.py, DEFAULT_ATTN_IMPL)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# The best first: a CPU with AMX also has AVX512-BF16, one with that also AVX512 and AVX2.
# "amx": AMX tiles for bf16 matmuls (Xeon since Sapphire Rapids); "avx512-bf16": bf16 dot
# products in AVX512 (Cooper Lake, Zen 4); "avx512" and "avx2": fp32 vectors only, bf16 emulated;
# "other": anything else (Arm, older x86).
CPU_KINDS: tuple[str, ...] = ("amx", "avx512-bf16", "avx512", "avx2", "other")
# the flag that makes each kind, as torch.cpu.get_capabilities and /proc/cpuinfo spell it
_FLAGS: dict[str, tuple[str, ...]] = {"amx": ("amx_bf16",), "avx512-bf16": ("avx512_bf16",),
                                      "avx512": ("avx512_f", "avx512f"), "avx2": ("avx2",)}


def kind_of(flags: set[str]) -> str:
    """The CPU kind of a set of feature flags."""
    return next((kind for kind, names in _FLAGS.items() if flags.intersection(names)), "other")


# a constant to torch.compile, which would otherwise trace into the capability query
@torch.compiler.assume_constant_result
def cpu_kind() -> str:
    """This machine's CPU kind (asked once per process)."""
    return _this_cpu()


@functools.cache
def _this_cpu() -> str:
    return kind_of(_flags())


def _flags() -> set[str]:
    capabilities = getattr(torch.cpu, "get_capabilities", None)  # not in every torch allowed
    if capabilities is not None:
        return {name for name, on in capabilities().items() if on is True}
    try:  # Linux without it: the flags line of /proc/cpuinfo
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
