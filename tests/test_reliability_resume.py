"""Resuming over a damaged metrics log, and what the non-finite guard says and keeps."""

from __future__ import annotations

import hashlib
import math
import os
import shlex
import shutil
import signal
from pathlib import Path

import pytest
import torch

from helpers import tiny_config
from qkvlab.cli import main
from qkvlab.errors import QkvlabError
from qkvlab.model import GPT
from qkvlab.run import checkpoint as ck
from qkvlab.run import guard
from qkvlab.run.config import save_config
from qkvlab.run.layout import list_checkpoints
from qkvlab.run.metrics import read_metrics
from qkvlab.train import trainer
from qkvlab.train.trainer import train


def one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"qkvlab {command}: error: "), err
    return err


def snapshot(root: Path) -> dict[str, object]:
    """Every file's sha256 and mtime, and every folder: equal snapshots mean nothing changed."""
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "dir" if p.is_dir() else (hashlib.sha256(p.read_bytes()).hexdigest(),
                                              p.stat().st_mtime_ns)
    return out


# ---- a damaged metrics.jsonl --------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(data_dir, tmp_path_factory) -> Path:
    """A tiny run stopped at step 4 (checkpoint ckpt-0000004), to be resumed to step 8."""
    run = tmp_path_factory.mktemp("metrics") / "run"
    train(tiny_config(data_dir, "train.max_steps=4", f"run.out_dir={run}"), quiet=True)
    return run


DAMAGE = {
    "overflowing number": b'{"step": 1e400}\n',
    "not utf-8": b"\xff\n",
    "Infinity": b'{"step": Infinity}\n',
    "deep nesting": b"[" * 100_000 + b"\n",
    "no step": b'{"loss": 1.0}\n',
    "huge integer": b'{"step": ' + b"9" * 5000 + b"}\n",
}


@pytest.mark.parametrize("kind", [*DAMAGE, "a folder"])
def test_damaged_metrics_refused_on_resume_before_anything_is_written(
        finished_run, tmp_path, capsys, kind):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    metrics = run / "metrics.jsonl"
    if kind == "a folder":
        metrics.unlink()
        metrics.mkdir()
    else:
        metrics.write_bytes(metrics.read_bytes() + DAMAGE[kind])
    before = snapshot(run)
    assert main(["train", str(run), "--resume", "--set", "train.max_steps=8"]) == 2
    msg = one_line(capsys, "train")
    if kind == "a folder":
        assert f"{metrics} is a folder, not a file: move it away" in msg
    else:
        assert f"{metrics} line 6 is not a metrics record (" in msg
        assert "remove that line, or move the file away to start its log afresh" in msg
    assert snapshot(run) == before  # config.toml included: same bytes, same mtime
    # the fix the message gives works: without the file the log starts afresh at the resume
    if kind == "a folder":
        metrics.rmdir()
    else:
        metrics.rename(run / "metrics.jsonl.bad")
    assert main(["train", str(run), "--resume", "--set", "train.max_steps=8"]) == 0
    assert [r["step"] for r in read_metrics(run)] == [5, 6, 7, 8]


def test_a_line_torn_by_a_crash_is_still_dropped_on_resume(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 5, "tokens": 3')  # a write cut short: no newline
    assert main(["train", str(run), "--resume", "--set", "train.max_steps=8"]) == 0
    assert [r["step"] for r in read_metrics(run)] == list(range(9))


def test_tolerant_reader_skips_every_damaged_line(tmp_path):
    good = [b'{"step": 0, "val_loss": 3.5}', b'{"step": 1, "loss": null}']
    (tmp_path / "metrics.jsonl").write_bytes(
        b"\n".join([good[0], *DAMAGE.values(), good[1]]) + b"\n")
    assert [r["step"] for r in read_metrics(tmp_path, tolerant=True)] == [0, 1]
    with pytest.raises(QkvlabError, match=r"metrics.jsonl line 2 is not a metrics record"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "metrics.jsonl").mkdir()
    assert read_metrics(tmp_path, tolerant=True) == []
    with pytest.raises(QkvlabError, match="is a folder"):
        read_metrics(tmp_path)


# ---- the non-finite guard -----------------------------------------------------------------
def test_real_divergence_names_a_logged_step_and_no_checkpoint_that_gives_nan(
        data_dir, tmp_path, capsys):
    # lr 1e6: steps 1 and 2 have a finite loss, but the weights after step 2 overflow
    run = tmp_path / "run"
    cfg = save_config(tiny_config(data_dir, "optim.lr=1e6", "optim.min_lr=0",
                                  "train.max_steps=12", "train.ckpt_interval=1",
                                  "train.eval_interval=100", "train.max_nonfinite=3",
                                  f"run.out_dir={run}"), tmp_path / "c.toml")
    assert main(["train", str(cfg)]) == 2
    msg = one_line(capsys, "train")
    step = int(msg.split("(the last at step ")[1].split(")")[0])
    logged = {r["step"]: r for r in read_metrics(run)}
    assert step in logged and logged[step]["loss"] is None  # the step it names is logged
    assert max(logged) == step
    # every kept checkpoint has finite weights; the one named also evaluates to a finite loss
    named = msg.split("the last good checkpoint is ")[1].split(":")[0] \
        if "the last good checkpoint is " in msg else None
    for path in list_checkpoints(run):
        code = main(["eval", str(path)])
        out, err = capsys.readouterr()
        if str(path) == named:
            assert code == 0 and "val loss nan" not in out
        elif code != 0:
            assert code == 2 and "gives a non-finite val loss (nan)" in err
            assert len(err.strip().splitlines()) == 1
    assert named is None or any(str(p) == named for p in list_checkpoints(run))
    # advice a user can follow: a fresh run at a tenth of the learning rate; no fp32 advice
    assert "train.dtype=fp32" not in msg and "lower optim.lr" in msg
    command = shlex.split(msg.split("`")[1])
    assert command[:3] == ["qkvlab", "train", str(run)]
    assert "--set" in command and "optim.lr=100000" in command
    assert main([*command[1:], "--set", "train.max_steps=1"]) == 0
    fresh = Path(command[command.index("--out") + 1])
    assert "lr = 100000.0" in (fresh / "config.toml").read_text()
    assert [r["step"] for r in read_metrics(fresh)] == [0, 1]


def test_divergence_advice_depends_on_dtype_and_min_lr():
    msg = guard.divergence_message("runs/a", 5, 12, None, 3e-3, 3e-4, "bf16")
    assert "no checkpoint with good weights was kept" in msg
    assert ("`qkvlab train runs/a --set optim.lr=0.0003 --set optim.min_lr=3e-05 --out "
            "runs/a-lr0.0003`") in msg
    assert msg.endswith("or add `--set train.dtype=fp32` to it")
    msg = guard.divergence_message("runs/a", 5, 12, "runs/a/ckpt-0000010", 1e-3, 0.0, "fp32")
    assert "the last good checkpoint is runs/a/ckpt-0000010" in msg
    assert "min_lr" not in msg and "fp32" not in msg


def _break_weights_after(monkeypatch, step_index: int, stop_at: int | None = None) -> None:
    """After step `step_index`, put a NaN in the weights (as an overflowing update would), so
    every later step is non-finite; SIGINT the run after step `stop_at` if given."""
    real = trainer.train_step

    def step_fn(s, step):
        rec = real(s, step)
        if step == step_index:
            with torch.no_grad():
                s.model.wte.weight[0, 0] = math.nan
        if step == stop_at:
            os.kill(os.getpid(), signal.SIGINT)
        return rec

    monkeypatch.setattr(trainer, "train_step", step_fn)


def test_nonfinite_weights_are_never_saved_nor_named(data_dir, tmp_path, monkeypatch, capsys):
    # the update of step index 5 (logged step 6) yields a NaN weight with a finite loss
    _break_weights_after(monkeypatch, 5)
    run = tmp_path / "run"
    cfg = save_config(tiny_config(data_dir, "train.max_steps=12", "train.ckpt_interval=2",
                                  "train.max_nonfinite=3", "train.eval_interval=100",
                                  f"run.out_dir={run}"), tmp_path / "c.toml")
    assert main(["train", str(cfg)]) == 2
    msg = one_line(capsys, "train")
    assert "(the last at step 9)" in msg
    assert f"the last good checkpoint is {run / 'ckpt-0000004'}:" in msg
    assert [p.name for p in list_checkpoints(run)] == ["ckpt-0000002", "ckpt-0000004"]
    assert (run / "latest").read_text().strip() == "ckpt-0000004"


def test_eval_refuses_nonfinite_weights(data_dir, tmp_path, capsys):
    cfg = tiny_config(data_dir)
    model = GPT(cfg.model)
    with torch.no_grad():
        model.wte.weight[1].fill_(math.inf)
    path = ck.write_checkpoint(tmp_path / "ckpt-0000003", model.state_dict(), cfg,
                               state={"step": 3})
    assert main(["eval", str(path)]) == 2
    assert "holds non-finite weights" in one_line(capsys, "eval")


def test_sigint_in_a_skip_streak_reports_the_last_val_loss_with_its_step(
        data_dir, tmp_path, monkeypatch, capsys):
    _break_weights_after(monkeypatch, 3, stop_at=5)  # steps 5 and 6 (logged) are non-finite
    run = tmp_path / "run"
    cfg = save_config(tiny_config(data_dir, "train.max_steps=12", "train.ckpt_interval=100",
                                  "train.eval_interval=100", "train.max_nonfinite=5",
                                  f"run.out_dir={run}"), tmp_path / "c.toml")
    assert main(["train", str(cfg)]) == 130  # stopped by SIGINT
    out = capsys.readouterr().out
    step0 = read_metrics(run)[0]["val_loss"]
    assert f"stopped at step 6: last val loss {step0:.4f}" in out and "at step 0," in out
    # the NaN weights were not written as the signal's checkpoint
    assert "its weights are not finite, so none was written" in out
    assert list_checkpoints(run) == []
