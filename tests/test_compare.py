"""`qkvlab compare`, the main job, end to end at a few steps."""

import json

import pytest

from qkvlab.cli import main
from qkvlab.model.params import count_params
from qkvlab.run.config import load_config
from qkvlab.run.metrics import read_metrics


@pytest.mark.slow
def test_compare_trains_four_variants_and_reports(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the preset's data dir is relative: prepare it here
    out = tmp_path / "cmp"
    args = ["compare", "--steps", "4", "--out", str(out), "--set", "train.eval_windows=8",
            "--set", "train.eval_interval=2", "--set", "train.peak_flops=1e12"]
    assert main(args) == 0
    rows = json.loads((out / "compare.json").read_text())
    assert [r["variant"] for r in rows] == ["baseline-tuned", "q-identity-tuned",
                                            "q-identity-tuned-wide", "q-identity"]
    assert (out / "compare.png").stat().st_size > 10_000
    assert "| q-identity |" in (out / "compare.md").read_text()

    for row in rows:  # the table is computed from the run files
        records = read_metrics(out / row["variant"])
        vals = [r["val_loss"] for r in records if r.get("val_loss") is not None]
        assert row["final_val_loss"] == vals[-1] and row["steps"] == 4
        cfg = load_config(str(out / row["variant"] / "config.toml"))
        assert row["non_embedding"] == count_params(cfg.model).non_embedding
    base, red, wide, paper = rows
    assert red["non_embedding"] == paper["non_embedding"] < base["non_embedding"] \
        == wide["non_embedding"]
    assert red["weight_decay"] == paper["weight_decay"] == 2**-5 and base["weight_decay"] == 0.1
    assert red["attn_scale"] == wide["attn_scale"] == pytest.approx(2.83 / 32**0.5)
    assert base["attn_scale"] == pytest.approx(4 / 32**0.5)  # each arm at its tuned alpha
    assert paper["attn_scale"] == pytest.approx(0.5 / 32**0.5)  # the paper's recipe
    assert red["delta_vs_baseline"] == pytest.approx(red["final_val_loss"] - base["final_val_loss"])

    # a second call reuses the finished runs instead of training again
    capsys.readouterr()
    assert main(args) == 0
    assert capsys.readouterr().out.count("finished earlier") == 4


def test_compare_rejects_unknown_preset(capsys):
    assert main(["compare", "--preset", "huge"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkvlab compare: error: unknown preset 'huge'") and "\n" not in err
