"""`qkvlab compare`, the main job, end to end at a few steps."""

import json

import pytest

from helpers import refused
from qkvlab.cli import main
from qkvlab.model.params import count_params
from qkvlab.model.variants import COMPARE_RULES
from qkvlab.run.config import load_config
from qkvlab.run.metrics import read_metrics
from test_variant_overrides import tiny_compare_args


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


def test_compare_reuses_a_finished_run_only_for_the_config_it_was_trained_with(
        data_dir, tmp_path, capsys):
    """A finished run answers the command only when it was trained with the config asked for;
    any other refuses before any work, naming the keys and the two ways on."""
    out = tmp_path / "cmp"
    args = tiny_compare_args(data_dir, out)  # 2 steps
    assert main(args) == 0
    assert "| steps |" in (out / "compare.md").read_text()
    assert all(r["steps"] == 2 for r in json.loads((out / "compare.json").read_text()))
    capsys.readouterr()
    # logging and paths are no part of the result: reused
    assert main([*args, "--set", "train.log_interval=2"]) == 0
    assert capsys.readouterr().out.count("finished earlier") == 4
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    shorter = [("1" if a == "2" and args[i - 1] == "--steps" else a) for i, a in enumerate(args)]
    for changed, named in [
        ([*args, "--set", "optim.lr=5e-3"], "optim.lr (saved 0.002, now 0.005)"),
        ([*args, "--seed", "99"], "train.seed (saved 1337, now 99)"),
        ([*args, "--set", "model.n_layer=2"], "model.n_layer (saved 1, now 2)"),
        (shorter, "train.max_steps (saved 2, now 1)"),  # no 2-step losses as 1-step ones
        ([*args, "--set", "train.eval_windows=8"], "train.eval_windows (saved 4, now 8)"),
    ]:
        err = refused(capsys, changed)
        assert f"{out / 'baseline-tuned'} finished with another config" in err, err
        assert named in err and "choose a new --out, or pass --fresh" in err
        assert "expected:" not in capsys.readouterr().out  # before the duration estimate
    # a run to extend is resumed only with its trajectory, checked as early
    longer = [("3" if a == "2" and args[i - 1] == "--steps" else a) for i, a in enumerate(args)]
    err = refused(capsys, [*longer, "--set", "optim.lr=5e-3"])
    assert "holds a run to resume" in err and "optim.lr (saved 0.002, now 0.005)" in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files  # untouched
    # --fresh retrains every variant with the config asked for
    assert main([*args, "--set", "optim.lr=5e-3", "--fresh"]) == 0
    for name in COMPARE_RULES:
        assert load_config(str(out / name / "config.toml")).optim.lr == 5e-3
