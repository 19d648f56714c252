"""The matmul peak measurement stays short where bf16 is emulated, and says so."""

import torch

from helpers import tiny_config
from qkvlab import perf
from qkvlab.train import session, train


def fake_rates(monkeypatch, rates: dict[str, float]) -> list[tuple[str, int]]:
    """Make every timed matmul run at rates[dtype] FLOP/s; returns the (dtype, size) timed."""
    calls: list[tuple[str, int]] = []

    def measure(dtype: str, device: str, size: int, repeats: int) -> float:
        calls.append((dtype, size))
        return rates[dtype]

    monkeypatch.setattr(perf, "_measure", measure)
    return calls


def test_a_slow_dtype_is_measured_at_a_smaller_size(monkeypatch):
    calls = fake_rates(monkeypatch, {"bf16": 1e9, "fp32": 1e11})
    assert perf.measure_matmul_peak("bf16", "cpu", size=2048) == 1e9
    # 2 * 1024^3 / 1e9 = 2.1 s is over the limit, 2 * 512^3 / 1e9 = 0.27 s is not
    assert calls == [("bf16", perf.PROBE_SIZE), ("bf16", 512)]
    calls.clear()
    perf.measure_matmul_peak("fp32", "cpu", size=2048)
    assert calls[-1] == ("fp32", 2048)  # fast enough: the size asked for


def test_bf16_slowdown_names_an_emulating_cpu_only(monkeypatch):
    fake_rates(monkeypatch, {"bf16": 1e9, "fp32": 1e11})
    assert perf.bf16_slowdown(torch.device("cpu")) == 100.0
    fake_rates(monkeypatch, {"bf16": 8e11, "fp32": 1e11})
    assert perf.bf16_slowdown(torch.device("cpu")) is None
    assert perf.bf16_slowdown(torch.device("meta")) is None


def test_a_bf16_run_on_such_a_cpu_says_how_to_train_faster(monkeypatch, tmp_path, data_dir,
                                                             capsys):
    monkeypatch.setattr(session, "peak_flops_for", lambda *a: (1e12, "measured matmul"))
    monkeypatch.setattr(session, "bf16_slowdown", lambda device: 50.0)
    cfg = tiny_config(data_dir, "train.dtype=bf16", "train.max_steps=1",
                      f"run.out_dir={tmp_path / 'r'}")
    train(cfg)
    assert "bf16 matmuls run 50x slower than fp32 on this CPU" in capsys.readouterr().out
