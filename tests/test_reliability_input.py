"""One Ctrl-C stops a whole job, --set takes TOML or a bare word and nothing else, a run name
stays inside runs/, and a variant keeps one colour in every panel."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from qkvlab.cli import main
from qkvlab.errors import QkvlabError
from qkvlab.run.config import load_config
from qkvlab.train import trainer

TINY = ["--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2",
        "--set", "model.block_size=16", "--set", "train.batch_size=4",
        "--set", "train.eval_windows=4", "--set", "train.eval_interval=3",
        "--set", "train.ckpt_interval=3", "--set", "train.peak_flops=1e12"]


def signal_at(monkeypatch, call: int, signum: int) -> None:
    """Deliver `signum` to this process during training step number `call` (1-based)."""
    real, calls = trainer.train_step, {"n": 0}

    def step(*a, **k):
        calls["n"] += 1
        if calls["n"] == call:
            os.kill(os.getpid(), signum)
        return real(*a, **k)

    monkeypatch.setattr(trainer, "train_step", step)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_one_signal_stops_compare_without_a_table(tmp_path, monkeypatch, capsys, signum):
    monkeypatch.chdir(tmp_path)  # the preset's data folder is relative: prepared here
    out = tmp_path / "cmp"
    args = ["compare", "--steps", "6", "--out", str(out), *TINY]
    signal_at(monkeypatch, 2, signum)
    assert main(args) == 128 + signum
    text = capsys.readouterr().out
    assert "expected: about" in text
    assert f"qkvlab compare --preset quick --out {out} --steps 6" in text
    assert sorted(p.name for p in out.iterdir()) == ["baseline-tuned"]  # nothing else started
    assert not (out / "compare.md").exists() and not (out / "compare.json").exists()
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert main(args) == 0  # the same command resumes and finishes
    rows = json.loads((out / "compare.json").read_text())
    assert [r["steps"] for r in rows] == [6, 6, 6, 6]


def test_compare_does_not_take_a_stopped_run_for_a_finished_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "cmp"
    args = ["compare", "--steps", "6", "--out", str(out), *TINY]
    signal_at(monkeypatch, 4, signal.SIGINT)
    assert main(args) == 130
    summary = json.loads((out / "baseline-tuned" / "summary.json").read_text())
    assert summary["interrupted"] and summary["signal"] == signal.SIGINT
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(args) == 0
    assert "baseline-tuned: finished earlier" not in capsys.readouterr().out


def test_sigterm_stops_a_sweep_with_143(tmp_path, monkeypatch, capsys, data_dir):
    from helpers import tiny_config
    from qkvlab.run.config import save_config

    base = tmp_path / "base.toml"
    save_config(tiny_config(data_dir, "model.n_layer=1", "train.max_steps=6",
                            "train.eval_interval=3", "train.ckpt_interval=3"), base)
    spec = tmp_path / "s.toml"
    spec.write_text('[spec]\nname = "s"\nbase = "base.toml"\nseeds = [1]\n\n[[variant]]\n'
                    'name = "baseline"\nbaseline = true\nrule = "baseline"\n\n[[variant]]\n'
                    'name = "q-identity"\nrule = "q-identity"\n', encoding="utf-8")
    signal_at(monkeypatch, 2, signal.SIGTERM)
    assert main(["sweep", str(spec), "--out", str(tmp_path / "sw")]) == 143
    assert "stopped by signal 15" in capsys.readouterr().out
    assert not (tmp_path / "sw" / "q-identity").exists()


@pytest.mark.parametrize("item", ['run.name="unterminated', 'run.name="a\nb',
                                  "data.dir=x\ny", "data.dir=[x", "run.name={bad}",
                                  "data.dir=it's"])
def test_malformed_set_values_are_refused(item):
    with pytest.raises(QkvlabError, match="not a TOML value"):
        load_config("compare-quick", [item])


@pytest.mark.parametrize("item, value", [("model.projection=q-identity", "q-identity"),
                                         ("data.dir=/tmp/x/y.z", "/tmp/x/y.z"),
                                         ('run.name="quoted-name"', "quoted-name"),
                                         ("data.source=shakespeare", "shakespeare")])
def test_bare_words_and_toml_strings_are_taken(item, value):
    section, key = item.split("=", 1)[0].split(".")
    assert load_config("compare-quick", [item]).to_dict()[section].get(key) == value


@pytest.mark.parametrize("name", ["../../../x", "a/b", ".hidden", "..", "with space", ""])
def test_run_names_stay_one_folder(tmp_path, capsys, name):
    with pytest.raises(QkvlabError, match="run.name"):
        load_config("compare-quick", [f'run.name="{name}"'])
    assert main(["train", "compare-quick", "--set", f'run.name="{name}"']) == 2
    assert "run.name" in capsys.readouterr().err
    assert not Path("x").exists()


def test_an_explicit_out_dir_stays_the_users_choice(tmp_path):
    target = tmp_path / "a" / ".." / "b"
    cfg = load_config("compare-quick", [f'run.out_dir="{target}"', "run.name=ok_name-1.2"])
    assert cfg.run_dir == target


def test_compare_plot_keeps_one_colour_per_variant(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from qkvlab.experiments import compare

    names = ["baseline", "q-identity", "q-identity-wide"]
    for i, name in enumerate(names):
        (tmp_path / name).mkdir()
        records = [{"step": s, "val_loss": 2.0 + 0.1 * i - 0.01 * s} for s in (0, 10, 20)]
        (tmp_path / name / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records))
    kept = []
    monkeypatch.setattr(plt, "close", kept.append)
    compare.plot_curves(tmp_path, names, tmp_path / "c.png")
    left, right = kept[0].axes
    colour = {line.get_label(): line.get_color() for line in left.get_lines()}
    for line in right.get_lines():
        if line.get_label() in colour:
            assert line.get_color() == colour[line.get_label()]
    assert {line.get_label() for line in right.get_lines()} >= {"q-identity",
                                                                 "q-identity-wide"}
    assert len(set(colour.values())) == 3
