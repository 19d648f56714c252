"""A short real run on the embedded tinyshakespeare corpus: the loss must really fall."""

from __future__ import annotations

import pytest

from qkvlab.cli import main
from qkvlab.run.config import load_config
from qkvlab.run.metrics import read_metrics
from qkvlab.train.trainer import train


@pytest.mark.slow
def test_short_shakespeare_run_learns(tmp_path, capsys):
    cfg = load_config("shakespeare-char", [
        # the data dir does not exist yet: training prepares the embedded corpus itself
        f"data.dir={tmp_path / 'shakespeare-char'}", f"run.out_dir={tmp_path / 'run'}",
        "model.n_layer=2", "model.n_head=4", "model.n_embd=64", "model.block_size=64",
        "model.dropout=0.0", "optim.lr=1e-2", "optim.min_lr=1e-3", "optim.warmup_steps=20",
        "train.max_steps=200", "train.batch_size=32", "train.eval_interval=100",
        "train.eval_windows=64", "train.log_interval=50", "train.ckpt_interval=1000",
        "train.peak_flops=1e12", "train.tensorboard=false", "train.dtype=fp32",
    ])
    summary = train(cfg, quiet=True)
    vals = [r["val_loss"] for r in read_metrics(tmp_path / "run") if "val_loss" in r]
    assert vals[0] == pytest.approx(4.17, abs=0.1)  # ~ln(65): a uniform guess at the start
    assert vals[-1] < 2.6 and summary["final_val_loss"] == vals[-1]
    assert summary["best_val_loss"] == min(vals[1:])
    capsys.readouterr()
    assert main(["sample", str(tmp_path / "run"), "--prompt", "ROMEO:", "--max-new-tokens",
                 "40", "--seed", "0"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("ROMEO:") and len(text.strip()) >= 40
