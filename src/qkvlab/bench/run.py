"""`qkvlab bench`: training and inference speed of the projection schemes, side by side.

Method, in the order it runs:
  1. peak matmul FLOP/s for the dtype (the MFU denominator, see peak.py);
  2. training: every scheme's model, optimizer and batch are built up front (peak memory is
     recorded here) and warmed up, then the timed repeats INTERLEAVE the schemes
     (A B, B A, A B, ...: the order flips every repeat, so a steady drift favours no
     scheme), so a slow minute on a shared machine hits all schemes alike; medians;
  3. inference (unless --no-inference): prefill and decode with and without the KV cache at
     several context lengths, interleaved the same way; then model.generate end to end;
  4. the summary: ideal speed-up from FLOPs per token, measured speed-up from tokens/s, and the
     share of the ideal that the hardware actually delivered.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import platform
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from qkvlab.bench import report
from qkvlab.bench.peak import Peak, resolve_peak
from qkvlab.bench.timing import Spread, interleaved, max_rss_bytes, peak_memory
from qkvlab.bench.workloads import InferenceBench, TrainBench
from qkvlab.errors import QkvlabError, require
from qkvlab.model import ModelConfig
from qkvlab.model.config import ATTN_IMPLS, PARAMETRIZATIONS
from qkvlab.model.params import count_params, flops_per_token
from qkvlab.model.variants import derive
from qkvlab.perf import freed_memory_kept, keep_freed_memory, mfu
from qkvlab.run.config import parse_override
from qkvlab.run.machine import cpu_model


@dataclass(frozen=True)
class Shape:
    """A model size with the benchmark defaults that suit it."""

    model: dict[str, Any]
    batch_size: int  # training batch on CPU
    batch_size_cuda: int  # a GPU needs more rows to be busy
    contexts: tuple[int, ...]  # inference context lengths
    decode_tokens: int  # decoding steps timed per context
    gen_tokens: int  # new tokens for the end-to-end generate() comparison
    peak_sizes: tuple[int, ...] | None = None  # matmul sizes for the measured peak (None: auto)


SHAPES: dict[str, Shape] = {
    # for tests: seconds end to end
    "tiny": Shape(dict(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=65),
                  2, 2, (8, 16, 32), 4, 40, peak_sizes=(256,)),
    # nanoGPT's shakespeare-char model; 64 rows is nanoGPT's batch there, 12 keeps CPU steps short
    "baby": Shape(dict(n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=65),
                  12, 64, (64, 128, 256), 16, 512),
    # GPT-2 small as in docs/paper.md section 5 (micro-batch 12 there)
    "paper": Shape(dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
                   4, 12, (128, 512, 1024), 16, 512),
}
# The same sizes as Llama-style decoders (RMSNorm, SwiGLU MLP of the GELU MLP's parameters,
# RoPE, no position table): the blocks most models are trained with now.
LLAMA_STYLE = dict(norm="rmsnorm", mlp="swiglu", positions="rope")
SHAPES.update({f"{name}-llama": replace(shape, model={**shape.model, **LLAMA_STYLE})
               for name, shape in list(SHAPES.items())})

SCHEMES: tuple[str, ...] = ("baseline", "q-identity", "q-identity-wide", "nonlinear-q")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def entry_name(scheme: str, kernel: str, parametrization: str, s: Settings) -> str:
    """What a timed model is called: its scheme, then its kernel and its parametrization where
    several of each are timed (baseline/eager/mup)."""
    parts = [scheme]
    if len(s.kernels) > 1:
        parts.append(kernel)
    if len(s.parametrizations) > 1:
        parts.append(parametrization)
    return "/".join(parts)


def entry_configs(s: Settings) -> dict[str, ModelConfig]:
    """Every scheme with every kernel and parametrization, the schemes outermost
    (baseline/sdpa, baseline/eager, q-identity/sdpa, ...), so that each pair compared sits side
    by side."""
    return {entry_name(scheme, kernel, param, s):
            dataclasses.replace(scheme_config(s.model, scheme), attn_impl=kernel,
                                parametrization=param)
            for scheme in s.schemes for kernel in s.kernels for param in s.parametrizations}


def scheme_config(base: ModelConfig, scheme: str) -> ModelConfig:
    """The model of one benchmark variant, derived from the shape's (baseline) config by the
    paper's rules (`qkvlab.model.variants`): q-identity-wide gives the MLP the d^2 per
    layer that W_Q held (4d -> 4.5d, the paper's 3456 at d = 768)."""
    if scheme not in SCHEMES:
        raise QkvlabError(f"unknown scheme {scheme!r}; choose from {', '.join(SCHEMES)}")
    return derive(base, scheme).model


@dataclass
class Settings:
    """Everything that decides what is measured; recorded verbatim in the JSON."""

    shape: str
    model: ModelConfig
    schemes: list[str]
    device: torch.device
    dtype_name: str
    compile: bool
    batch_size: int
    repeats: int
    steps: int
    warmup: int
    inference: bool
    infer_batch_size: int
    contexts: tuple[int, ...]
    decode_tokens: int
    gen_tokens: int
    gen_repeats: int
    peak_flops: float | None
    peak_sizes: tuple[int, ...] | None
    overrides: dict[str, Any] = field(default_factory=dict)
    keep_freed_memory: bool = True  # CPU: perf.keep_freed_memory, as in training
    # the attention kernels timed side by side (none given: the default, model.attn_impl)
    kernels: tuple[str, ...] = ()
    # the parametrizations timed side by side (none given: the default, model.parametrization)
    parametrizations: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.kernels = tuple(self.kernels) or (self.model.attn_impl,)
        self.parametrizations = tuple(self.parametrizations) or (self.model.parametrization,)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["model"] = self.model.to_dict()
        out["device"] = str(self.device)
        out["dtype"] = out.pop("dtype_name")
        out["seq_len"] = self.model.block_size
        return out


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`--set n_layer=4` (or model.n_layer=4) -> {"n_layer": 4}: the `--set` grammar of
    `qkvlab train` (qkvlab.run.config.parse_override), for model keys only."""
    out: dict[str, Any] = {}
    for item in items:
        section, key, value = parse_override(item, default_section="model")
        require(section == "model", f"--set {item!r}: bench sets model keys only "
                                    "(n_layer=4 or model.n_layer=4)")
        out[key] = value
    require("projection" not in out,
            "the projection is chosen by --schemes, not --set projection=...")
    return out


def _csv_ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise QkvlabError(f"{what} wants comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise QkvlabError(f"{what} wants positive integers, got {text!r}")
    return values


def resolve_settings(*, shape: str = "baby", schemes: str = "baseline,q-identity",
                     overrides: list[str] | None = None, dtype: str = "bf16",
                     device: str = "auto", compile: bool | None = None,
                     batch_size: int | None = None, repeats: int = 5, steps: int = 3,
                     warmup: int = 2, inference: bool = True, infer_batch_size: int = 1,
                     contexts: str | None = None, decode_tokens: int | None = None,
                     gen_tokens: int | None = None, gen_repeats: int = 1,
                     peak_tflops: float | None = None,
                     keep_freed_memory: bool = True, kernels: str | None = None,
                     parametrizations: str | None = None) -> Settings:
    """Defaults from the shape and the device, checked so that errors come before any work.

    None means "the shape's (or the device's) default"; `schemes` and `contexts` are
    comma-separated, `overrides` are `--set` items and the error messages name the options of
    `qkvlab bench`.
    """
    if shape not in SHAPES:
        raise QkvlabError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    spec = SHAPES[shape]
    parsed = parse_overrides(overrides or [])
    model = ModelConfig.from_dict({**spec.model, **parsed}, where="bench --set")

    names = _scheme_names(schemes, model)
    if dtype not in DTYPES:
        raise QkvlabError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    dev = _device(device)
    timed = _kernel_names(kernels, parsed)
    params = _parametrization_names(parametrizations, parsed)
    compile_ = dev.type == "cuda" if compile is None else bool(compile)

    # None means "not given": 0 must stay 0
    batch = batch_size if batch_size is not None else (
        spec.batch_size_cuda if dev.type == "cuda" else spec.batch_size)
    # a --set block_size below the shape's contexts keeps the ones that fit
    lengths = (_csv_ints(contexts, "--contexts") if contexts
               else tuple(c for c in spec.contexts if c <= model.block_size)
               or (model.block_size,))
    decode = spec.decode_tokens if decode_tokens is None else decode_tokens
    gen = spec.gen_tokens if gen_tokens is None else gen_tokens
    for name, value in (("--batch-size", batch), ("--repeats", repeats),
                        ("--steps", steps), ("--infer-batch-size", infer_batch_size),
                        ("--gen-repeats", gen_repeats), ("--decode-tokens", decode)):
        if value <= 0:
            raise QkvlabError(f"{name} must be positive, got {value}")
    if warmup < 0 or gen < 0:
        raise QkvlabError("--warmup and --gen-tokens must not be negative")
    if max(lengths) > model.block_size:
        raise QkvlabError(f"--contexts {max(lengths)} exceeds block_size {model.block_size}")
    if decode >= min(lengths):
        raise QkvlabError(f"--decode-tokens ({decode}) must be below the shortest "
                          f"context ({min(lengths)}): decoding ends at each context length")
    return Settings(
        # the kernel it times, never "auto", in the JSON record
        shape=shape, model=model.on_device(dev.type, dtype), schemes=names, device=dev,
        dtype_name=dtype,
        compile=compile_, batch_size=batch, repeats=repeats, steps=steps,
        warmup=warmup, inference=inference,
        infer_batch_size=infer_batch_size, contexts=lengths,
        decode_tokens=decode, gen_tokens=gen, gen_repeats=gen_repeats,
        peak_flops=peak_tflops * 1e12 if peak_tflops else None, peak_sizes=spec.peak_sizes,
        overrides=parsed, keep_freed_memory=keep_freed_memory, kernels=timed,
        parametrizations=params,
    )


def _kernel_names(kernels: str | None, overrides: dict[str, Any]) -> tuple[str, ...]:
    """--kernels sdpa,eager: the attention kernels to time side by side (empty: the default)."""
    if kernels is None:
        return ()
    names = tuple(k.strip() for k in kernels.split(",") if k.strip())
    known = tuple(k for k in ATTN_IMPLS if k != "auto")
    if not names or any(k not in known for k in names) or len(set(names)) != len(names):
        raise QkvlabError(f"--kernels wants distinct names from {', '.join(known)}, "
                          f"got {kernels!r}")
    require("attn_impl" not in overrides,
            "--kernels and --set attn_impl both choose the kernel: give one of them")
    return names


def _parametrization_names(names: str | None, overrides: dict[str, Any]) -> tuple[str, ...]:
    """--parametrizations standard,mup: the parametrizations to time side by side (empty: the
    default). μP differs in its optimizer groups and, for a tied head, one multiply."""
    if names is None:
        return ()
    chosen = tuple(p.strip() for p in names.split(",") if p.strip())
    if not chosen or any(p not in PARAMETRIZATIONS for p in chosen) or \
            len(set(chosen)) != len(chosen):
        raise QkvlabError(f"--parametrizations wants distinct names from "
                          f"{', '.join(PARAMETRIZATIONS)}, got {names!r}")
    require("parametrization" not in overrides, "--parametrizations and --set parametrization "
                                                "both choose it: give one of them")
    return chosen


def _scheme_names(schemes: str, model: ModelConfig) -> list[str]:
    names = [s.strip() for s in schemes.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCHEMES]
    if unknown or not names:
        raise QkvlabError(f"unknown scheme(s) {', '.join(unknown) or '(none)'}; "
                          f"choose from {', '.join(SCHEMES)}")
    if len(set(names)) != len(names):
        raise QkvlabError(f"--schemes lists a scheme twice: {schemes}")
    for s in names:  # config errors (e.g. nonlinear-q with an odd width) now, not mid-run
        scheme_config(model, s)
    return names


def _device(device: str | None) -> torch.device:
    wanted = device or "auto"
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    if wanted.startswith("cuda") and not torch.cuda.is_available():
        raise QkvlabError("--device cuda, but torch sees no CUDA device")
    return torch.device(wanted)


def machine_info(s: Settings) -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(s.device),
        "device_name": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "dtype": s.dtype_name,
        "compile": s.compile,
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    if s.device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(s.device)
        info["cuda"] = torch.version.cuda
        info["allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    return info


def _free(device: torch.device) -> None:
    """Drop the previous section's tensors before the next one, so it starts on clean memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_training(s: Settings, configs: dict[str, ModelConfig], peak: Peak,
                   console: Console) -> dict[str, dict[str, Any]]:
    benches: dict[str, TrainBench] = {}
    memory: dict[str, int | None] = {}
    for name, cfg in configs.items():
        console.print(f"[dim]train: building {name}"
                      f"{' and compiling' if s.compile else ''} ({s.warmup} warm-up steps)")
        # built inside the block: on CUDA its weights, grads, optimizer state and activations
        # all count towards its peak, and the other schemes' resident tensors do not
        with peak_memory(s.device) as mem:
            bench = TrainBench(cfg, s.batch_size, s.device, s.dtype, s.compile)
            for _ in range(max(s.warmup, 1 if s.compile else 0)):
                bench.step()
        benches[name], memory[name] = bench, mem["peak_bytes"]

    # one untimed round in the interleaved order: on CPU the allocator's heap only settles once
    # every scheme has stepped after the others (the first such step faulted 0.3M pages at the
    # paper shape)
    for bench in benches.values():
        bench.time_steps(1)
    step_s: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(s.repeats):
        for name in interleaved(list(benches), r):
            step_s[name].append(benches[name].time_steps(s.steps))
        console.print(f"[dim]train repeat {r + 1}/{s.repeats}: " + ", ".join(
            f"{n} {benches[n].tokens_per_step / step_s[n][-1]:,.0f} tok/s" for n in benches))

    out: dict[str, dict[str, Any]] = {}
    for name, bench in benches.items():
        tps = Spread.of([bench.tokens_per_step / t for t in step_s[name]])
        fpt = flops_per_token(configs[name], configs[name].block_size)
        out[name] = {
            "tokens_per_step": bench.tokens_per_step,
            "step_s": Spread.of(step_s[name]).as_dict(),
            "tokens_per_s": tps.as_dict(),
            "flops_per_token": fpt,
            "achieved_flops": fpt * tps.median,
            "mfu": mfu(fpt, tps.median, peak.flops),
            "peak_memory_bytes": memory[name],
        }
    benches.clear()
    _free(s.device)
    return out


def bench_inference(s: Settings, configs: dict[str, ModelConfig],
                    console: Console) -> dict[str, dict[str, Any]]:
    # generate() of gen_tokens new tokens should measure the cache against recomputing the whole
    # prefix, not the sliding window past block_size: give the inference models room for it
    # (a longer learned-position table; every other weight and the per-token cost are the same).
    configs = {name: replace(cfg, block_size=max(cfg.block_size, 1 + s.gen_tokens))
               for name, cfg in configs.items()}
    benches = {name: InferenceBench(cfg, s.infer_batch_size, s.device, s.dtype, s.compile)
               for name, cfg in configs.items()}
    times = _time_steps(s, benches, console)
    gen = _time_generate(s, benches, console) if s.gen_tokens else {}
    out = {name: _inference_entry(s, bench, times[name], gen.get(name),
                                  configs[name].block_size)
           for name, bench in benches.items()}
    benches.clear()
    _free(s.device)
    return out


def _time_steps(s: Settings, benches: dict[str, InferenceBench],
                console: Console) -> dict[str, dict[str, dict[int, list[float]]]]:
    """Seconds of prefill, cached decode and recomputing decode, per scheme, kind and context."""
    B, n = s.infer_batch_size, s.decode_tokens
    # Warm-up runs every timed workload once: CPU backends (oneDNN) build a kernel per new
    # matrix shape (~0.5 ms per linear here), and decoding at a new length is a new shape; a
    # first-seen shape would bill that one-time cost to whichever repeat met it first.
    console.print(f"[dim]inference: warming up {len(benches)} models at contexts "
                  f"{', '.join(map(str, s.contexts))}")
    for bench in benches.values():
        for c in s.contexts:
            bench.prefill(c)
            bench.decode_cached(c, n)
            bench.decode_recompute(c, n)
    times: dict[str, dict[str, dict[int, list[float]]]] = {
        name: {kind: {c: [] for c in s.contexts} for kind in ("prefill", "cached", "recompute")}
        for name in benches}
    for r in range(s.repeats):
        for name in interleaved(list(benches), r):
            bench = benches[name]
            for c in s.contexts:
                times[name]["prefill"][c].append(bench.prefill(c))
                times[name]["cached"][c].append(bench.decode_cached(c, n))
                times[name]["recompute"][c].append(bench.decode_recompute(c, n))
        c = max(s.contexts)
        console.print(f"[dim]inference repeat {r + 1}/{s.repeats}: decode @{c} " + ", ".join(
            f"{name} {B / times[name]['cached'][c][-1]:,.0f} tok/s" for name in benches))
    return times


def _time_generate(s: Settings, benches: dict[str, InferenceBench],
                   console: Console) -> dict[str, dict[str, list[float]]]:
    """Seconds of generate() with and without the KV cache, per scheme."""
    gen: dict[str, dict[str, list[float]]] = {name: {"cached": [], "recompute": []}
                                              for name in benches}
    console.print(f"[dim]generate: one untimed run per scheme and mode first "
                  f"({s.gen_tokens} tokens, the uncached one is slow)")
    for bench in benches.values():  # first-seen shapes cost extra, as in _time_steps
        bench.generate(s.gen_tokens, use_cache=True)
        bench.generate(s.gen_tokens, use_cache=False)
    for r in range(s.gen_repeats):
        for name, bench in benches.items():
            gen[name]["cached"].append(bench.generate(s.gen_tokens, use_cache=True))
            gen[name]["recompute"].append(bench.generate(s.gen_tokens, use_cache=False))
        ratios = {name: g["recompute"][-1] / g["cached"][-1] for name, g in gen.items()}
        console.print(f"[dim]generate repeat {r + 1}/{s.gen_repeats}: {s.gen_tokens} tokens, "
                      + ", ".join(f"{name} cache x{x:.1f}" for name, x in ratios.items()))
    return gen


def _inference_entry(s: Settings, bench: InferenceBench, t: dict[str, dict[int, list[float]]],
                     gen: dict[str, list[float]] | None, block_size: int) -> dict[str, Any]:
    """One scheme's inference results: throughput per context, cache speed-up, generate()."""
    B = s.infer_batch_size
    per_ctx: dict[str, Any] = {}
    for c in s.contexts:
        cached, recompute = Spread.of(t["cached"][c]), Spread.of(t["recompute"][c])
        per_ctx[str(c)] = {
            "prefill_tokens_per_s": B * c / Spread.of(t["prefill"][c]).median,
            "decode_tokens_per_s": B / cached.median,
            "decode_no_cache_tokens_per_s": B / recompute.median,
            "cache_speedup": recompute.median / cached.median,
            "prefill_s": Spread.of(t["prefill"][c]).as_dict(),
            "decode_step_s": cached.as_dict(),
            "decode_no_cache_step_s": recompute.as_dict(),
        }
    entry: dict[str, Any] = {"batch_size": B, "kv_bytes_per_token": bench.kv_bytes_per_token,
                             "contexts": per_ctx}
    if gen is not None:
        cached, recompute = Spread.of(gen["cached"]), Spread.of(gen["recompute"])
        entry["generate"] = {
            "new_tokens": s.gen_tokens,
            "prompt_tokens": 1,
            "block_size": block_size,
            "cached_s": cached.as_dict(),
            "no_cache_s": recompute.as_dict(),
            "cached_tokens_per_s": B * s.gen_tokens / cached.median,
            "no_cache_tokens_per_s": B * s.gen_tokens / recompute.median,
            "cache_speedup": recompute.median / cached.median,
        }
    return entry


def run_bench(s: Settings, console: Console | None = None) -> dict[str, Any]:
    """Run every section and return the results as plain data (what --json writes)."""
    console = console or Console()
    if s.device.type == "cpu" and s.keep_freed_memory:
        keep_freed_memory()  # before anything is allocated
    configs = entry_configs(s)
    console.print(f"[dim]peak: {'given' if s.peak_flops else 'measuring'} {s.dtype_name} "
                  f"matmul FLOP/s on {s.device}")
    peak = resolve_peak(s.device, s.dtype_name, given=s.peak_flops, sizes=s.peak_sizes)
    results: dict[str, Any] = {
        "settings": s.as_dict(),
        "peak": peak.as_dict(),
        "schemes": {name: {"scheme": name.partition("/")[0], "kernel": cfg.attn_impl,
                           "parametrization": cfg.parametrization,
                           "config": cfg.to_dict(), "params": count_params(cfg).as_dict(),
                           "flops_per_token": flops_per_token(cfg, cfg.block_size)}
                    for name, cfg in configs.items()},
    }
    for name, data in bench_training(s, configs, peak, console).items():
        results["schemes"][name]["train"] = data
    if s.inference:
        for name, data in bench_inference(s, configs, console).items():
            results["schemes"][name]["inference"] = data
    results["summary"] = report.summarise(results)
    results["machine"] = machine_info(s) | {"process_max_rss_bytes": max_rss_bytes(),
                                            # a process cannot take it back: so this records
                                            # the fact, not the flag
                                            "malloc_keeps_freed_memory": freed_memory_kept()}
    return results


def save_results(results: dict[str, Any], path: Path) -> None:
    """Write `run_bench`'s results as JSON (devices, dtypes and dataclasses as plain values)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.device | torch.dtype):
        return str(obj)
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    if isinstance(obj, tuple | set):
        return list(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
