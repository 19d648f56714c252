"""The benchmark's conclusions (ideal vs measured speed-up) and its rich tables.

Ideal speed-up of a scheme over the reference = FLOPs/token(reference) / FLOPs/token(scheme):
what a machine that runs every FLOP at the same rate would deliver. Measured = the median over
repeats of the PAIRED ratio tokens/s(scheme) / tokens/s(reference), pairing the two runs that
sat next to each other in the interleaved order, so slow drift of a shared machine cancels.
Share realised = (measured - 1) / (ideal - 1): 1 means the FLOPs saved turned fully into speed.
Both come with a distribution-free 95% confidence interval for the median paired ratio (the
sign test's order statistics, timing.median_interval): on a shared CPU one pair's ratio scatters
by several percent, as much as the effect itself, so the share is only settled by many repeats.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from qkvlab.bench.timing import Spread, median_interval
from qkvlab.console import print_table


def share_of(speedup: float, ideal: float) -> float | None:
    """(speedup - 1) / (ideal - 1); None when the ideal is within 0.5% of 1, where this ratio of
    small differences means nothing (q-identity-wide, nonlinear-q: the baseline's matmul FLOPs)."""
    return (speedup - 1) / (ideal - 1) if abs(ideal - 1) > 0.005 else None


def paired_ratios(results: dict[str, Any], name: str, ref: str) -> list[float]:
    """tokens/s of scheme `name` over `ref`'s, repeat by repeat: the two runs of a repeat sat
    next to each other in the interleaved order, so the machine's drift cancels in the ratio."""
    schemes = results["schemes"]
    return [a / b for a, b in zip(schemes[name]["train"]["tokens_per_s"]["values"],
                                  schemes[ref]["train"]["tokens_per_s"]["values"], strict=True)]


# What else than the scheme a timed model may vary in, each timed side by side against its
# default: the attention kernel (--kernels) and the parametrization (--parametrizations).
AXES: tuple[str, ...] = ("kernel", "parametrization")
_AXIS_SETTING = {"kernel": ("kernels", "attn_impl"),
                 "parametrization": ("parametrizations", "parametrization")}


def default_of(results: dict[str, Any], axis: str) -> str | None:
    """The value of `axis` the headline numbers are of: the model's own (attn_impl = auto: the
    default kernel) when it was timed, else the first one timed (None: not recorded)."""
    settings = results.get("settings", {})
    listed, key = _AXIS_SETTING[axis]
    values = settings.get(listed) or [None]
    chosen = settings.get("model", {}).get(key)
    return chosen if chosen in values else values[0]


def default_kernel(results: dict[str, Any]) -> str | None:
    """The kernel the headline numbers are of."""
    return default_of(results, "kernel")


Key = tuple[str, str | None, str | None]  # (scheme, kernel, parametrization)


def _entries(results: dict[str, Any]) -> dict[Key, str]:
    """(scheme, kernel, parametrization) -> the name it was timed under."""
    return {(d.get("scheme", name), d.get("kernel"), d.get("parametrization")): name
            for name, d in results["schemes"].items()}


def _paired(results: dict[str, Any], name: str, ref: str) -> dict[str, Any]:
    ratios = paired_ratios(results, name, ref)
    paired = Spread.of(ratios)
    ci = median_interval(ratios) if len(ratios) > 1 else None
    return {"measured_speedup": paired.median, "measured_speedup_min": paired.low,
            "measured_speedup_max": paired.high,
            "measured_speedup_ci": [ci.low, ci.high] if ci else None,
            "ci_coverage": ci.coverage if ci else None}


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    """Speed-ups against the baseline (or the first scheme when baseline was not run), each
    kernel's against the baseline on the same kernel; the headline on the default kernel."""
    schemes = results["schemes"]
    entries = _entries(results)
    main = default_kernel(results)
    main_param = default_of(results, "parametrization")
    on_main = {scheme: name for (scheme, kernel, param), name in entries.items()
               if kernel == main and param == main_param}
    ref_scheme = "baseline" if "baseline" in on_main else next(iter(on_main))
    versus: dict[str, Any] = {}
    for (scheme, kernel, param), name in entries.items():
        ref = entries[(ref_scheme, kernel, param)]
        if scheme == ref_scheme:
            continue
        ideal = schemes[ref]["flops_per_token"] / schemes[name]["flops_per_token"]
        paired = _paired(results, name, ref)
        ci = paired["measured_speedup_ci"]
        versus[name] = {
            "ideal_speedup": ideal, **paired,
            "ratio_of_medians": schemes[name]["train"]["tokens_per_s"]["median"]
            / schemes[ref]["train"]["tokens_per_s"]["median"],
            "share_realised": share_of(paired["measured_speedup"], ideal),
            "share_realised_ci": [share_of(ci[0], ideal), share_of(ci[1], ideal)]
            if ci and share_of(1, ideal) is not None else None,
        }
    head = versus.get(on_main.get("q-identity", "")) if ref_scheme == "baseline" else None
    summary: dict[str, Any] = {
        "reference": ref_scheme,
        "default_kernel": main,
        "versus_reference": versus,
        # the headline numbers: q-identity against the baseline, on the default kernel
        "ideal_speedup": head["ideal_speedup"] if head else None,
        "measured_speedup": head["measured_speedup"] if head else None,
        "speedup_of_ideal": head["measured_speedup"] / head["ideal_speedup"] if head else None,
        "share_realised": head["share_realised"] if head else None,
        "share_realised_ci": head["share_realised_ci"] if head else None,
        "baseline_mfu": schemes[on_main["baseline"]]["train"]["mfu"]
        if "baseline" in on_main else None,
        "peak_flops": results["peak"]["flops"],
        "peak_source": results["peak"]["source"],
        "warnings": warnings(results),
    }
    for axis, key in (("kernel", "kernels"), ("parametrization", "parametrizations")):
        if len({k[1 + AXES.index(axis)] for k in entries}) > 1:
            summary[key] = versus_default(results, entries, axis)
            summary[f"default_{axis}"] = default_of(results, axis)
    if all("inference" in schemes[n] for n in schemes):
        summary["cache_speedup"] = {}
        for name in schemes:
            inf = schemes[name]["inference"]
            longest = max(inf["contexts"], key=int)
            entry = {"context": int(longest),
                     "decode": inf["contexts"][longest]["cache_speedup"]}
            if "generate" in inf:
                entry["generate"] = inf["generate"]["cache_speedup"]
                entry["generate_new_tokens"] = inf["generate"]["new_tokens"]
            summary["cache_speedup"][name] = entry
    return summary


def versus_default(results: dict[str, Any], entries: dict[Key, str],
                   axis: str) -> dict[str, Any]:
    """Each other value of `axis` (kernel or parametrization) against the default's, the rest of
    the model alike: training tokens/s paired repeat by repeat (with its interval), and where
    inference ran, the median paired ratio of cached decoding's and prefill's tokens/s at each
    context (above 1: faster than the default)."""
    schemes = results["schemes"]
    i, main = 1 + AXES.index(axis), default_of(results, axis)
    out: dict[str, Any] = {}
    for key, name in entries.items():
        ref = entries.get(key[:i] + (main,) + key[i + 1:])
        if key[i] == main or ref is None:
            continue
        entry = {"scheme": key[0], "kernel": key[1], "parametrization": key[2], "default": ref,
                 "train": _paired(results, name, ref)}
        if "inference" in schemes[name] and "inference" in schemes[ref]:
            mine = schemes[name]["inference"]["contexts"]
            theirs = schemes[ref]["inference"]["contexts"]
            for kind, key in (("decode", "decode_step_s"), ("prefill", "prefill_s")):
                if all(key in mine[c] for c in mine):
                    entry[kind] = {c: Spread.of([b / a for a, b in zip(
                        mine[c][key]["values"], theirs[c][key]["values"], strict=True)]).median
                        for c in mine}
        out[name] = entry
    return out


# ---- formatting ---------------------------------------------------------------------------

def si(x: float | None, unit: str = "") -> str:
    """1234567 -> '1.23M': tables stay narrow and the digits that matter stay visible."""
    if x is None:
        return "n/a"
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g}{prefix}{unit}"
    return f"{x:.3g}{unit}"


def seconds(t: float) -> str:
    return f"{t:.2f} s" if t >= 10 else f"{1e3 * t:.1f} ms"


def binary(n: int | None) -> str:
    if n is None:
        return "n/a"
    for factor, prefix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= factor:
            return f"{n / factor:.1f} {prefix}"
    return f"{n} B"


def print_report(results: dict[str, Any], console: Console) -> None:
    m, s, peak = results["machine"], results["settings"], results["peak"]
    schemes, summary = results["schemes"], results["summary"]
    console.print(
        f"\n[bold]qkvlab bench[/bold] shape={s['shape']} "
        f"({s['model']['n_layer']}x{s['model']['n_embd']}, ctx {s['seq_len']}, "
        f"vocab {s['model']['vocab_size']}), {m['device_name']} ({m['device']}, "
        f"{m['torch_threads']} threads), torch {m['torch']}, {s['dtype']}, "
        f"compile={'on' if s['compile'] else 'off'}")
    measured = (f", measured {si(peak['measured'], 'FLOP/s')}"
                if peak["measured"] and peak["source"] != "measured" else "")
    console.print(f"peak {si(peak['flops'], 'FLOP/s')} ({peak['source']}{measured}); "
                  f"{s['repeats']} interleaved repeats x {s['steps']} steps, medians")

    t = Table(title=f"Training step (batch {s['batch_size']} x {s['seq_len']}, fwd+bwd+AdamW)")
    for col in ("scheme", "params", "FLOPs/token", "tokens/s", "range", "step", "MFU",
                "peak mem"):
        t.add_column(col, justify="left" if col == "scheme" else "right")
    for name, d in schemes.items():
        tr = d["train"]
        tps = tr["tokens_per_s"]
        spread = (tps["max"] - tps["min"]) / tps["median"]
        t.add_row(name, si(d["params"]["total"]), si(d["flops_per_token"]), si(tps["median"]),
                  f"±{50 * spread:.1f}%", seconds(tr["step_s"]["median"]),
                  f"{100 * tr['mfu']:.1f}%", binary(tr["peak_memory_bytes"]))
    print_table(t, console)
    if s["device"].startswith("cpu"):
        console.print(f"[dim]peak memory per scheme is n/a on CPU (no allocator counter); "
                      f"process max RSS {binary(m['process_max_rss_bytes'])}")

    if all("inference" in d for d in schemes.values()):
        _print_inference(results, console)

    t = Table(title=f"Speed-up over {summary['reference']}"
                    f"{_same(summary)} "
                    "(training tokens/s)")
    levels = {v["ci_coverage"] for v in summary["versus_reference"].values()} - {None}
    ci_col = f"{100 * min(levels):.0f}% CI" if levels else "CI"
    for col in ("scheme", "ideal (FLOPs)", "measured", ci_col, "range", "ratio of medians",
                "share realised", f"share {ci_col}"):
        t.add_column(col, justify="left" if col == "scheme" else "right")
    for name, v in summary["versus_reference"].items():
        share = "n/a" if v["share_realised"] is None else f"{100 * v['share_realised']:.0f}%"
        ci, share_ci = v.get("measured_speedup_ci"), v.get("share_realised_ci")
        t.add_row(name, f"{v['ideal_speedup']:.3f}", f"{v['measured_speedup']:.3f}",
                  f"{ci[0]:.3f}-{ci[1]:.3f}" if ci else "n/a",
                  f"{v['measured_speedup_min']:.3f}-{v['measured_speedup_max']:.3f}",
                  f"{v['ratio_of_medians']:.3f}", share,
                  f"{100 * share_ci[0]:.0f}% to {100 * share_ci[1]:.0f}%" if share_ci else "n/a")
    if summary["versus_reference"]:
        print_table(t, console)
    if summary.get("speedup_of_ideal") is not None:  # (not in JSON written before it)
        console.print(f"q-identity's speed-up on {summary['default_kernel']}: "
                      f"{100 * summary['speedup_of_ideal']:.1f}% of its ideal (FLOPs)")
    for axis in AXES:
        if f"{axis}s" in summary:
            _print_versus_default(summary, axis, console)
    if summary["baseline_mfu"] is not None:
        console.print(f"baseline MFU: {100 * summary['baseline_mfu']:.1f}% of "
                      f"{si(summary['peak_flops'], 'FLOP/s')} ({summary['peak_source']})")
    for warning in summary["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {warning}")


def _same(summary: dict[str, Any]) -> str:
    """' on the same kernel' (and parametrization) where several were timed, else ''."""
    same = [axis for axis in AXES if f"{axis}s" in summary]
    return f" on the same {' and '.join(same)}" if same else ""


def _print_versus_default(summary: dict[str, Any], axis: str, console: Console) -> None:
    t = Table(title=f"Each {axis}'s tokens/s over the default's "
                    f"({summary.get(f'default_{axis}')}), paired repeat by repeat")
    rows = summary[f"{axis}s"]
    contexts = sorted({c for v in rows.values() for c in v.get("decode", {})}, key=int)
    for col in ("scheme", axis, "training", "CI", "range",
                *(f"decode @{c}" for c in contexts)):
        t.add_column(col, justify="left" if col in ("scheme", axis) else "right")
    for v in rows.values():
        tr, ci = v["train"], v["train"]["measured_speedup_ci"]
        t.add_row(v["scheme"], str(v[axis]), f"{tr['measured_speedup']:.3f}",
                  f"{ci[0]:.3f}-{ci[1]:.3f}" if ci else "n/a",
                  f"{tr['measured_speedup_min']:.3f}-{tr['measured_speedup_max']:.3f}",
                  *(f"{v['decode'][c]:.3f}" if c in v.get("decode", {}) else "n/a"
                    for c in contexts))
    print_table(t, console)


def warnings(results: dict[str, Any]) -> list[str]:
    """Signs that the numbers are not to be trusted, for the reader who only skims the table."""
    out = []
    trains = [d["train"] for d in results["schemes"].values()]
    if any(t["mfu"] > 1 for t in trains):
        out.append("MFU above 100%: the peak was measured while the machine was busier than "
                   "during training; rerun on a quiet machine or pass --peak-tflops")
    spread = max((t["tokens_per_s"]["max"] - t["tokens_per_s"]["min"]) / t["tokens_per_s"]["median"]
                 for t in trains)
    if spread > 0.2:
        out.append(f"training tokens/s varied by up to {100 * spread:.0f}% between repeats (a "
                   f"busy machine?): treat the speed-ups as rough, or rerun with more repeats")
    return out


def _print_inference(results: dict[str, Any], console: Console) -> None:
    s, schemes = results["settings"], results["schemes"]
    mode = "compiled" if s["compile"] else "eager"
    t = Table(title=f"Inference (batch {s['infer_batch_size']}, {s['dtype']} weights, {mode}; "
                    f"decode = {s['decode_tokens']} steps ending at the context)")
    for col in ("scheme", "KV/token", "context", "prefill tok/s", "decode tok/s",
                "no-cache tok/s", "cache speed-up"):
        t.add_column(col, justify="left" if col == "scheme" else "right")
    for name, d in schemes.items():
        inf = d["inference"]
        for i, (ctx, c) in enumerate(inf["contexts"].items()):
            t.add_row(name if i == 0 else "", binary(inf["kv_bytes_per_token"]) if i == 0 else "",
                      ctx, si(c["prefill_tokens_per_s"]), si(c["decode_tokens_per_s"]),
                      si(c["decode_no_cache_tokens_per_s"]), f"{c['cache_speedup']:.1f}x")
        t.add_section()
    print_table(t, console)

    gens = {name: d["inference"]["generate"] for name, d in schemes.items()
            if "generate" in d["inference"]}
    if gens:
        first = next(iter(gens.values()))
        t = Table(title=f"generate(): {first['new_tokens']} new tokens from a 1-token prompt "
                        f"(context {first['block_size']}, no sliding window)")
        for col in ("scheme", "with cache tok/s", "no cache tok/s", "cache speed-up"):
            t.add_column(col, justify="left" if col == "scheme" else "right")
        for name, g in gens.items():
            t.add_row(name, si(g["cached_tokens_per_s"]), si(g["no_cache_tokens_per_s"]),
                      f"{g['cache_speedup']:.1f}x")
        print_table(t, console)
