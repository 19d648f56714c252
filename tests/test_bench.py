"""`qkvlab bench`: the command end to end on a tiny shape, the scheme configs, the summary
arithmetic, the peak table and compile-friendliness. Nothing here asserts on a timing."""

import json
import math
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from qkvlab.bench import report
from qkvlab.bench.peak import resolve_peak
from qkvlab.bench.run import SCHEMES, SHAPES, scheme_config
from qkvlab.bench.timing import Spread, median_interval
from qkvlab.bench.workloads import TrainBench
from qkvlab.cli import main
from qkvlab.model import GPT, PROJECTIONS, ModelConfig
from qkvlab.model.params import count_params, flops_per_token

FAST = ["--shape", "tiny", "--repeats", "1", "--steps", "1", "--warmup", "1", "--device", "cpu",
        "--peak-tflops", "1"]


def run_json(tmp_path, *extra: str) -> dict:
    out = tmp_path / "bench.json"
    assert main(["bench", *FAST, "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_end_to_end_all_schemes(tmp_path):
    data = run_json(tmp_path, "--schemes", ",".join(SCHEMES), "--gen-tokens", "40")
    assert set(data) == {"machine", "settings", "peak", "schemes", "summary"}
    assert list(data["schemes"]) == list(SCHEMES)
    for key in ("torch", "device", "device_name", "cpu_count", "dtype", "compile"):
        assert key in data["machine"]
    assert data["machine"]["compile"] is False  # off by default on CPU
    # CPU on glibc: freed memory stays in the heap, as in `qkvlab train` (test_perf_memory.py)
    assert data["machine"]["malloc_keeps_freed_memory"] is sys.platform.startswith("linux")
    assert data["settings"]["keep_freed_memory"] is True
    assert data["peak"] == {"flops": 1e12, "source": "given",
                            "measured": data["peak"]["measured"], "spec": None}
    assert data["peak"]["measured"] > 0

    cfg = ModelConfig(**SHAPES["tiny"].model)
    for d in data["schemes"].values():
        train = d["train"]
        assert train["tokens_per_s"]["median"] > 0 and len(train["tokens_per_s"]["values"]) == 1
        assert train["tokens_per_step"] == 2 * cfg.block_size
        assert train["mfu"] > 0 and train["flops_per_token"] == d["flops_per_token"] > 0
        assert train["peak_memory_bytes"] is None  # honest n/a on CPU
        inf = d["inference"]
        # K and V, every layer: 2 * L * Hkv * dk * 4 bytes (bf16 weights, fp32 cache on CPU)
        assert inf["kv_bytes_per_token"] == 2 * cfg.n_layer * cfg.kv_heads * cfg.d_head * 4
        assert list(inf["contexts"]) == ["8", "16", "32"]
        for c in inf["contexts"].values():
            for key in ("prefill_tokens_per_s", "decode_tokens_per_s",
                        "decode_no_cache_tokens_per_s", "cache_speedup"):
                assert c[key] > 0 and math.isfinite(c[key])
        gen = inf["generate"]
        # 41 tokens outgrow the shape's block 32: the inference model gets room for all of them
        assert gen["new_tokens"] == 40 and gen["block_size"] == 41
        assert gen["cached_tokens_per_s"] > 0 and gen["no_cache_tokens_per_s"] > 0

    # q-identity-wide keeps the baseline's parameter count and FLOPs
    schemes = data["schemes"]
    assert schemes["q-identity-wide"]["params"]["total"] == schemes["baseline"]["params"]["total"]
    assert schemes["q-identity-wide"]["config"]["mlp_hidden"] == 4 * 32 + 16

    s = data["summary"]
    base, qid = (ModelConfig(**schemes[n]["config"]) for n in ("baseline", "q-identity"))
    ideal = flops_per_token(base, base.block_size) / flops_per_token(qid, qid.block_size)
    assert s["ideal_speedup"] == pytest.approx(ideal, rel=1e-12)
    assert s["reference"] == "baseline"
    assert s["baseline_mfu"] == schemes["baseline"]["train"]["mfu"]
    v = s["versus_reference"]["q-identity"]
    assert s["measured_speedup"] == v["measured_speedup"] > 0
    assert s["share_realised"] == pytest.approx((v["measured_speedup"] - 1) / (ideal - 1))
    assert s["versus_reference"]["q-identity-wide"]["share_realised"] is None  # ideal == 1
    assert set(s["cache_speedup"]) == set(SCHEMES)


@pytest.mark.slow
def test_overrides_fp32_no_inference(tmp_path):
    data = run_json(tmp_path, "--dtype", "fp32", "--no-inference", "--set", "n_layer=1",
                    "--set", "model.norm=rmsnorm", "--schemes", "q-identity,nonlinear-q")
    assert data["settings"]["model"]["n_layer"] == 1
    assert data["schemes"]["q-identity"]["config"]["norm"] == "rmsnorm"
    assert data["machine"]["dtype"] == "fp32"
    assert all("inference" not in d for d in data["schemes"].values())
    # no baseline: compared with the first scheme, no headline q-identity numbers
    assert data["summary"]["reference"] == "q-identity"
    assert data["summary"]["ideal_speedup"] is None and data["summary"]["baseline_mfu"] is None
    assert "cache_speedup" not in data["summary"]


@pytest.mark.parametrize("extra", [
    ["--schemes", "baseline,w-identity"],
    ["--schemes", "baseline,baseline"],
    ["--shape", "huge"],
    ["--dtype", "fp8"],
    ["--contexts", "8,64"],  # beyond block_size 32
    ["--decode-tokens", "8"],  # not below the shortest context
    ["--set", "projection=k-identity"],
    ["--set", "n_embd=33"],  # nonlinear-q and q-identity need n_head * dk == n_embd
    ["--repeats", "0"],
    ["--batch-size", "0"],
    ["--decode-tokens", "0"],
])
def test_bad_arguments_are_user_errors(extra, capsys):
    assert main(["bench", *FAST, *extra]) == 2
    assert "qkvlab bench: error:" in capsys.readouterr().err


def test_repeats_interleave_schemes(monkeypatch, tmp_path):
    """A B, B A, A B after one untimed round: every repeat visits each scheme once, the order
    flipping each time, and equal times give a measured speed-up of exactly 1 (so a share
    realised of exactly 0)."""
    order: list[str] = []

    def fake_time_steps(self, steps):
        order.append(self.cfg.projection)
        return 0.5

    monkeypatch.setattr(TrainBench, "time_steps", fake_time_steps)
    data = run_json(tmp_path, "--repeats", "3", "--no-inference")
    assert order == ["baseline", "q-identity",  # the untimed round
                     "baseline", "q-identity", "q-identity", "baseline", "baseline", "q-identity"]
    s = data["summary"]
    assert s["measured_speedup"] == 1.0 and s["share_realised"] == 0.0
    assert s["share_realised_ci"] == [0.0, 0.0]
    assert s["warnings"] == []  # steady timings, MFU far below 100% of the given 1 TFLOP/s
    tps = data["schemes"]["baseline"]["train"]["tokens_per_s"]
    assert tps["values"] == [2 * 32 / 0.5] * 3


def test_kernels_are_timed_side_by_side_and_against_the_default(monkeypatch, tmp_path):
    """--kernels: every scheme on every kernel, interleaved like schemes; each kernel's
    tokens/s over the default kernel's of the same scheme, repeat by repeat; W_Q = I against
    the baseline on the same kernel."""
    order: list[tuple[str, str]] = []
    seconds = {("baseline", "sdpa"): 0.5, ("baseline", "eager"): 0.4,
               ("q-identity", "sdpa"): 0.45, ("q-identity", "eager"): 0.4}

    def fake_time_steps(self, steps):
        order.append((self.cfg.projection, self.cfg.attn_impl))
        return seconds[order[-1]] * (2 if len(order) > 8 else 1)  # a slow neighbour late on

    monkeypatch.setattr(TrainBench, "time_steps", fake_time_steps)
    data = run_json(tmp_path, "--repeats", "3", "--no-inference", "--kernels", "eager,sdpa",
                    "--set", "n_layer=1")
    names = ["baseline/eager", "baseline/sdpa", "q-identity/eager", "q-identity/sdpa"]
    assert list(data["schemes"]) == names and data["settings"]["kernels"] == ["eager", "sdpa"]
    for name, d in data["schemes"].items():
        assert (d["scheme"], d["kernel"]) == tuple(name.split("/"))
        assert d["config"]["attn_impl"] == d["kernel"] and d["config"]["n_layer"] == 1
    pairs = [tuple(n.split("/")) for n in names]
    assert order == [*pairs, *pairs, *pairs[::-1], *pairs]  # untimed round, then A B, B A, A B
    s = data["summary"]
    default = data["settings"]["model"]["attn_impl"]
    assert s["default_kernel"] == default
    other = "sdpa" if default == "eager" else "eager"
    for scheme in ("baseline", "q-identity"):
        k = s["kernels"][f"{scheme}/{other}"]
        assert (k["scheme"], k["kernel"], k["default"]) == (scheme, other, f"{scheme}/{default}")
        ratio = seconds[(scheme, default)] / seconds[(scheme, other)]
        assert k["train"]["measured_speedup"] == pytest.approx(ratio)  # the slow repeat cancels
    v = s["versus_reference"][f"q-identity/{other}"]
    assert v["measured_speedup"] == pytest.approx(
        seconds[("baseline", other)] / seconds[("q-identity", other)])
    assert s["measured_speedup"] == pytest.approx(
        seconds[("baseline", default)] / seconds[("q-identity", default)])
    assert s["speedup_of_ideal"] == pytest.approx(s["measured_speedup"] / s["ideal_speedup"])


@pytest.mark.slow
def test_kernels_with_inference_compare_decoding_too(tmp_path):
    data = run_json(tmp_path, "--kernels", "sdpa,eager", "--schemes", "baseline",
                    "--gen-tokens", "0")
    k = data["summary"]["kernels"]
    [(name, entry)] = k.items()
    assert set(entry["decode"]) == set(entry["prefill"]) == {"8", "16", "32"}
    assert all(r > 0 for r in entry["decode"].values())


@pytest.mark.parametrize("extra", [
    ["--kernels", "auto"],
    ["--kernels", "sdpa,sdpa"],
    ["--kernels", "flash"],
    ["--kernels", "eager", "--set", "attn_impl=sdpa"],
])
def test_bad_kernels_are_user_errors(extra, capsys):
    assert main(["bench", *FAST, *extra]) == 2
    err = capsys.readouterr().err
    assert "qkvlab bench: error:" in err and "--kernels" in err


def test_parametrizations_are_timed_side_by_side_and_against_standard(monkeypatch, tmp_path):
    """--parametrizations: every scheme under each, on one kernel; μP's tokens/s over the
    standard's of the same scheme, repeat by repeat; μP's models carry its base shape."""
    seconds = {("baseline", "standard"): 0.5, ("baseline", "mup"): 0.55,
               ("q-identity", "standard"): 0.4, ("q-identity", "mup"): 0.42}
    calls = []

    def fake_time_steps(self, steps):
        calls.append((self.cfg.projection, self.cfg.parametrization))
        return seconds[calls[-1]] * (2 if len(calls) > 8 else 1)  # a slow neighbour late on

    monkeypatch.setattr(TrainBench, "time_steps", fake_time_steps)
    data = run_json(tmp_path, "--repeats", "3", "--no-inference", "--parametrizations",
                    "standard,mup", "--set", "base_width=16", "--set", "base_depth=1")
    names = ["baseline/standard", "baseline/mup", "q-identity/standard", "q-identity/mup"]
    assert list(data["schemes"]) == names
    assert data["settings"]["parametrizations"] == ["standard", "mup"]
    for name, d in data["schemes"].items():
        assert (d["scheme"], d["parametrization"]) == tuple(name.split("/"))
        assert d["config"]["parametrization"] == d["parametrization"]
        assert d["config"]["base_width"] == 16
    s = data["summary"]
    assert s["default_parametrization"] == "standard" and "kernels" not in s
    for scheme in ("baseline", "q-identity"):
        p = s["parametrizations"][f"{scheme}/mup"]
        assert (p["scheme"], p["parametrization"], p["default"]) == (
            scheme, "mup", f"{scheme}/standard")
        ratio = seconds[(scheme, "standard")] / seconds[(scheme, "mup")]
        assert p["train"]["measured_speedup"] == pytest.approx(ratio)
    # the headline pair is both arms under the default parametrization
    assert s["measured_speedup"] == pytest.approx(
        seconds[("baseline", "standard")] / seconds[("q-identity", "standard")])


def test_mup_models_really_differ_from_standard_in_the_bench():
    """The μP entry is trained with μP's optimizer groups: its hidden matrices' lr is scaled."""
    from qkvlab.bench.run import entry_configs, resolve_settings

    s = resolve_settings(shape="tiny", schemes="baseline", device="cpu",
                         parametrizations="standard,mup",
                         overrides=["base_width=8", "base_depth=1"])
    configs = entry_configs(s)
    benches = {n: TrainBench(c, 2, torch.device("cpu"), torch.float32, False)
               for n, c in configs.items()}
    scales = {n: sorted({g.get("lr_scale", 1.0) for g in b.opt.param_groups})
              for n, b in benches.items()}
    assert scales["baseline/standard"] == [1.0]
    assert min(scales["baseline/mup"]) < 1.0


@pytest.mark.parametrize("extra", [
    ["--parametrizations", "mu-p"],
    ["--parametrizations", "mup,mup"],
    ["--parametrizations", "mup", "--set", "parametrization=standard"],
])
def test_bad_parametrizations_are_user_errors(extra, capsys):
    assert main(["bench", *FAST, *extra]) == 2
    err = capsys.readouterr().err
    assert "qkvlab bench: error:" in err and "--parametrizations" in err


def test_scheme_configs_at_paper_shape():
    base = ModelConfig(**SHAPES["paper"].model)
    configs = {s: scheme_config(base, s) for s in SCHEMES}
    assert configs["baseline"].projection == "baseline"
    assert configs["q-identity"].scale == pytest.approx(configs["baseline"].scale / 2)
    wide = configs["q-identity-wide"]
    assert wide.projection == "q-identity" and wide.hidden == 3456  # 4.5 d, docs/paper.md section 5
    assert count_params(wide).total == count_params(base).total == 124_373_760
    assert count_params(configs["q-identity"]).total == 117_295_872


@pytest.mark.parametrize(("shape", "low", "high"), [("baby", 1.07, 1.09), ("paper", 1.04, 1.06)])
def test_ideal_speedup_of_the_shapes(shape, low, high):
    base = ModelConfig(**SHAPES[shape].model)
    qid = scheme_config(base, "q-identity")
    ideal = flops_per_token(base, base.block_size) / flops_per_token(qid, qid.block_size)
    assert low < ideal < high


def _fake_results(fpt: dict[str, float], tps: dict[str, list[float]]) -> dict:
    return {
        "peak": {"flops": 1e12, "source": "given"},
        "schemes": {name: {"flops_per_token": fpt[name],
                           "train": {"tokens_per_s": Spread.of(tps[name]).as_dict(), "mfu": 0.5}}
                    for name in fpt},
    }


def test_summary_uses_paired_ratios():
    # repeat 2 is slow for both (a noisy neighbour): pairing cancels it, medians would not
    results = _fake_results({"baseline": 110.0, "q-identity": 100.0},
                            {"baseline": [100.0, 50.0, 100.0], "q-identity": [105.0, 52.5, 105.0]})
    s = report.summarise(results)
    assert s["ideal_speedup"] == pytest.approx(1.1)
    assert s["measured_speedup"] == pytest.approx(1.05)
    assert s["share_realised"] == pytest.approx(0.5)
    v = s["versus_reference"]["q-identity"]
    assert v["measured_speedup_min"] == pytest.approx(1.05)
    assert len(s["warnings"]) == 1 and "varied" in s["warnings"][0]  # 50 vs 100 tokens/s
    assert v["measured_speedup_max"] == pytest.approx(1.05)


def test_spread():
    s = Spread.of([3.0, 1.0, 2.0])
    assert (s.median, s.low, s.high, s.values) == (2.0, 1.0, 3.0, (3.0, 1.0, 2.0))
    with pytest.raises(ValueError):
        Spread.of([])


def test_peak_resolution():
    cuda = torch.device("cuda")  # constructing a device needs no GPU; nothing runs on it
    peak = resolve_peak(cuda, "bf16", measure=False, device_name="NVIDIA H100 80GB HBM3")
    assert peak.flops == peak.spec > 1e14 and peak.source.startswith("spec: ")
    assert peak.measured is None
    peak = resolve_peak(cuda, "bf16", given=123e12, measure=False, device_name="NVIDIA H100")
    assert (peak.flops, peak.source, peak.spec) == (123e12, "given", peak.spec)
    with pytest.raises(ValueError):  # an unknown GPU needs a measurement
        resolve_peak(cuda, "bf16", measure=False, device_name="Some Future GPU")
    peak = resolve_peak(torch.device("cpu"), "fp32", sizes=(64, 128))
    assert peak.source == "measured" and peak.flops == peak.measured > 0 and peak.spec is None
    assert math.isfinite(peak.flops)


@pytest.mark.slow
@pytest.mark.parametrize("projection", PROJECTIONS)
def test_every_scheme_traces_as_one_graph(projection):
    """fullgraph=True raises on any graph break: the projection switch must not cause one,
    neither in training (forward + backward) nor in a cached decoding step. The eager backend
    traces with dynamo but skips code generation, so this takes seconds, not minutes."""
    torch._dynamo.reset()
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50,
                      projection=projection)
    model = GPT(cfg)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    idx = torch.randint(0, 50, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = compiled(idx, idx)
    loss.backward()
    model.eval()
    cache = model.new_cache(2)
    with torch.no_grad():
        compiled(idx[:, :8], cache=cache, last_only=True)
        logits, _ = compiled(idx[:, 8:9], cache=cache, start_pos=8, last_only=True)
    assert logits.shape == (2, 1, 50)


@pytest.mark.slow
def test_compiled_bench_end_to_end(tmp_path):
    """The real thing: inductor (needs a C++ compiler on CPU), two schemes, training only; fp32,
    which every CPU runs natively (bf16 compiles and runs ~100x slower without AMX)."""
    torch._dynamo.reset()
    data = run_json(tmp_path, "--compile", "--no-inference", "--dtype", "fp32")
    assert data["machine"]["compile"] is True
    assert all(d["train"]["tokens_per_s"]["median"] > 0 for d in data["schemes"].values())


def test_median_interval_order_statistics():
    # n = 5: no interval reaches 95%; [min, max] covers 1 - 2/32
    ci = median_interval([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (ci.low, ci.high, ci.coverage) == (1.0, 5.0, pytest.approx(0.9375))
    # n = 20: the sign test's textbook interval is x_(6) .. x_(15), coverage 95.86%
    ci = median_interval([float(i) for i in range(1, 21)])
    assert (ci.low, ci.high) == (6.0, 15.0)
    assert ci.coverage == pytest.approx(1 - 2 * stats.binom.cdf(5, 20, 0.5))
    with pytest.raises(ValueError):
        median_interval([1.0])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.5, 2.0), min_size=2, max_size=80))
def test_median_interval_brackets_the_median(values):
    ci = median_interval(values)
    assert ci.low <= Spread.of(values).median <= ci.high
    assert ci.coverage >= 0.95 or len(values) < 6


@pytest.mark.parametrize("n", [6, 7, 12, 25, 40, 101])
def test_median_interval_is_the_narrowest_at_the_level(n):
    ci = median_interval([float(i) for i in range(1, n + 1)])
    k = int(ci.low)  # values 1..n: the k-th order statistic is k
    assert ci.high == n + 1 - k
    assert ci.coverage == pytest.approx(1 - 2 * stats.binom.cdf(k - 1, n, 0.5))
    assert ci.coverage >= 0.95 > 1 - 2 * stats.binom.cdf(k, n, 0.5)  # k + 1 would fall short


def test_summary_share_interval():
    # ratios 1.00, 1.02, ..., 1.18 (10 pairs): the 95% interval for the median ratio is
    # x_(2) .. x_(9) = 1.02 .. 1.16, so the share (ideal 1.1) is 20% .. 160%
    ratios = [1 + 0.02 * i for i in range(10)]
    results = _fake_results({"baseline": 110.0, "q-identity": 100.0},
                            {"baseline": [100.0] * 10, "q-identity": [100.0 * r for r in ratios]})
    s = report.summarise(results)
    v = s["versus_reference"]["q-identity"]
    assert v["measured_speedup_ci"] == pytest.approx([1.02, 1.16])
    assert s["share_realised_ci"] == pytest.approx([0.2, 1.6])
    assert v["ci_coverage"] == pytest.approx(1 - 2 * stats.binom.cdf(1, 10, 0.5))


def test_glibc_defaults_on_request(tmp_path):
    # recorded as asked; the machine entry records the fact (a process cannot take it back)
    data = run_json(tmp_path, "--no-keep-freed-memory", "--no-inference")
    assert data["settings"]["keep_freed_memory"] is False
    assert isinstance(data["machine"]["malloc_keeps_freed_memory"], bool)
