"""`qkvlab bench`: training and inference speed of the projection schemes, side by side."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from qkvlab.commands.common import Subparsers, add_overrides, register


@dataclass
class BenchOptions:
    shape: str = "baby"
    schemes: str = "baseline,q-identity"
    batch_size: int | None = None
    repeats: int = 5
    steps: int = 3
    warmup: int = 2
    dtype: str = "bf16"
    device: str = "auto"
    compile: bool | None = None
    keep_freed_memory: bool = True
    no_inference: bool = False
    infer_batch_size: int = 1
    contexts: str | None = None
    decode_tokens: int | None = None
    gen_tokens: int | None = None
    gen_repeats: int = 1
    peak_tflops: float | None = None
    json: str | None = None
    kernels: str | None = None
    parametrizations: str | None = None
    overrides: list[str] = field(default_factory=list)


def run_bench(opts: BenchOptions) -> int:
    """Time the schemes, print the report, and write it as JSON when asked."""
    from pathlib import Path

    from qkvlab.bench import report
    from qkvlab.bench import run as bench
    from qkvlab.console import table_console

    settings = bench.resolve_settings(
        shape=opts.shape, schemes=opts.schemes, overrides=opts.overrides, dtype=opts.dtype,
        device=opts.device, compile=opts.compile, batch_size=opts.batch_size,
        repeats=opts.repeats, steps=opts.steps, warmup=opts.warmup,
        inference=not opts.no_inference, infer_batch_size=opts.infer_batch_size,
        contexts=opts.contexts, decode_tokens=opts.decode_tokens, gen_tokens=opts.gen_tokens,
        gen_repeats=opts.gen_repeats, peak_tflops=opts.peak_tflops,
        keep_freed_memory=opts.keep_freed_memory, kernels=opts.kernels,
        parametrizations=opts.parametrizations)
    console = table_console()  # wide tables stay one line per row in logs too
    results = bench.run_bench(settings, console)
    report.print_report(results, console)
    if opts.json:
        path = Path(opts.json)
        bench.save_results(results, path)
        console.print(f"wrote {path}")
    return 0


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("bench", help="training and inference speed of the projection schemes")
    p.add_argument("--shape",
                   help="baby (6x384, ctx 256) | paper (12x768, ctx 1024) | tiny (tests); "
                        "each also as NAME-llama (RMSNorm, SwiGLU, RoPE), e.g. baby-llama")
    p.add_argument("--schemes",
                   help="comma-separated variants: baseline, q-identity, q-identity-wide, "
                        "nonlinear-q")
    p.add_argument("--batch-size", type=int,
                   help="training batch (default: the shape's, larger on CUDA)")
    p.add_argument("--repeats", type=int, help="interleaved repeats (medians)")
    p.add_argument("--steps", type=int, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, help="untimed steps per scheme first")
    p.add_argument("--dtype", help="bf16 (autocast) | fp32")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction,
                   help="torch.compile the models, training and inference (default: on for CUDA, "
                        "off for CPU)")
    p.add_argument("--keep-freed-memory", action=argparse.BooleanOptionalAction,
                   help="on CPU, keep freed memory in glibc's heap as `qkvlab train` does, so "
                        "steps do not page-fault (--no-keep-freed-memory: glibc's defaults)")
    p.add_argument("--no-inference", action="store_true", help="skip prefill/decode timings")
    p.add_argument("--infer-batch-size", type=int, help="sequences decoded at once")
    p.add_argument("--contexts",
                   help="comma-separated inference context lengths (default: the shape's)")
    p.add_argument("--decode-tokens", type=int,
                   help="decoding steps timed per context (default: the shape's)")
    p.add_argument("--gen-tokens", type=int,
                   help="new tokens for generate() with vs without the cache (0 skips; "
                        "default 512, 40 for tiny)")
    p.add_argument("--gen-repeats", type=int,
                   help="repeats of the (slow, uncached) generate() comparison")
    p.add_argument("--peak-tflops", type=float,
                   help="MFU denominator in TFLOP/s (default: GPU datasheet, else measured)")
    p.add_argument("--kernels",
                   help="comma-separated attention kernels to time side by side, each against "
                        "the default (sdpa, eager; default: the one attn_impl = auto picks)")
    p.add_argument("--parametrizations",
                   help="comma-separated parametrizations to time side by side, each against "
                        "the default (standard, mup; give μP's base shape with --set "
                        "base_width=N, base_depth=N)")
    p.add_argument("--json", help="also write results as JSON to this file")
    add_overrides(p)
    register(p, BenchOptions, run_bench)
