"""The training loop: exact resume, locks, refusals, divergence, signals, and the CLI."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import run_qkvlab_bound_by_modes, tiny_config, tiny_overrides
from qkvlab.cli import main
from qkvlab.errors import QkvlabError
from qkvlab.run.config import load_config, save_config
from qkvlab.run.metrics import read_metrics
from qkvlab.train import trainer
from qkvlab.train.trainer import train


def vocab(data_dir: Path) -> int:
    return json.loads((data_dir / "meta.json").read_text())["vocab_size"]


def config(data_dir: Path, out: Path, *extra: str):
    """The tiny run with dropout (so RNG state matters) and 2 micro-batches per step."""
    return tiny_config(data_dir, "model.dropout=0.1", "optim.decay_steps=8",
                       "train.grad_accum=2", f"run.out_dir={out}", *extra)


def losses(run_dir: Path) -> list[tuple[int, float | None, float | None]]:
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_metrics(run_dir)]


@pytest.mark.parametrize(("dtype", "order"),
                         [("fp32", "random"), ("bf16", "random"), ("fp32", "shuffled")])
def test_resume_is_exact(data_dir, tmp_path, dtype, order):
    keys = (f"train.dtype={dtype}", f"data.order={order}")
    straight = train(config(data_dir, tmp_path / "a", *keys), quiet=True)
    # first half: a run that stops at step 4 (max_steps is a harmless key to change)
    train(config(data_dir, tmp_path / "b", *keys, "train.max_steps=4"), quiet=True)
    resumed = train(config(data_dir, tmp_path / "b", *keys), resume=True, quiet=True)
    assert load_config(tmp_path / "b/config.toml").data.order == order
    assert resumed["resumed_from"] == 4
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert [s for s, _, _ in a] == list(range(9))  # step 0 eval, then every step, no duplicates
    assert a == b  # bitwise: floats survive JSON exactly
    assert straight["final_val_loss"] == resumed["final_val_loss"]
    assert (tmp_path / "a/ckpt-0000008/model.safetensors").read_bytes() == \
        (tmp_path / "b/ckpt-0000008/model.safetensors").read_bytes()
    assert (tmp_path / "a/ckpt-0000008/optimizer.safetensors").read_bytes() == \
        (tmp_path / "b/ckpt-0000008/optimizer.safetensors").read_bytes()


def test_shuffled_resume_is_exact_across_an_epoch_boundary(data_dir, tmp_path):
    from qkvlab.data.loader import TokenData, epoch_length

    # 16 windows a step: the run crosses into epoch 1 before step 30, where it resumes
    k = epoch_length(TokenData(data_dir).train_tokens, 16)
    assert 16 * 20 < k < 16 * 30
    keys = ("data.order=shuffled", "train.batch_size=8", "train.max_steps=40",
            "train.eval_interval=10", "train.ckpt_interval=30", "train.log_interval=10",
            "optim.decay_steps=40", "train.final_eval_tokens=0")
    train(config(data_dir, tmp_path / "a", *keys), quiet=True)
    train(config(data_dir, tmp_path / "b", *keys[:-1], "train.max_steps=30",
                 "train.final_eval_tokens=0"), quiet=True)
    train(config(data_dir, tmp_path / "b", *keys), resume=True, quiet=True)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert (tmp_path / "a/ckpt-0000040/model.safetensors").read_bytes() == \
        (tmp_path / "b/ckpt-0000040/model.safetensors").read_bytes()


def test_two_arms_of_a_pair_with_one_seed_see_the_same_batches(data_dir, tmp_path,
                                                               monkeypatch):
    from qkvlab.data.loader import TokenData

    seen: dict[str, list[torch.Tensor]] = {}
    real = TokenData.train_batch

    def recording(self, *args, **kwargs):
        x, y = real(self, *args, **kwargs)
        seen.setdefault(arm, []).append(x.clone())
        return x, y

    monkeypatch.setattr(TokenData, "train_batch", recording)
    for arm, extra in (("baseline", ()), ("q-identity", ("model.projection=q-identity",)),
                       ("other seed", ("train.seed=7",))):
        train(config(data_dir, tmp_path / arm, "data.order=shuffled",
                     "train.final_eval_tokens=0", *extra), quiet=True)
    # the first draw is the setup's check that the data is long enough; then 8 steps x 2
    assert len(seen["baseline"]) == 1 + 8 * 2
    assert all(torch.equal(a, b) for a, b in zip(seen["baseline"], seen["q-identity"],
                                                  strict=True))
    assert not torch.equal(seen["baseline"][1], seen["other seed"][1])


def test_signal_checkpoints_then_resume_is_exact(data_dir, tmp_path, monkeypatch):
    train(config(data_dir, tmp_path / "a"), quiet=True)
    real_step = trainer.train_step

    def step_then_sigterm(s, step):
        rec = real_step(s, step)
        if step == 2:  # the step index: ask to stop after the 3rd step
            os.kill(os.getpid(), signal.SIGTERM)
        return rec

    monkeypatch.setattr(trainer, "train_step", step_then_sigterm)
    summary = train(config(data_dir, tmp_path / "b"), quiet=True)
    assert summary["interrupted"] and summary["steps"] == 3
    assert (tmp_path / "b/latest").read_text().strip() == "ckpt-0000003"
    assert json.loads((tmp_path / "b/summary.json").read_text())["interrupted"]
    monkeypatch.setattr(trainer, "train_step", real_step)
    train(config(data_dir, tmp_path / "b"), resume=True, quiet=True)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


def test_crash_after_checkpoint_resumes_without_duplicate_metrics(data_dir, tmp_path,
                                                                  monkeypatch):
    train(config(data_dir, tmp_path / "a"), quiet=True)
    real_step = trainer.train_step

    def crash_at_step_6(s, step):
        if step == 6:
            raise RuntimeError("power cut")
        return real_step(s, step)

    monkeypatch.setattr(trainer, "train_step", crash_at_step_6)
    with pytest.raises(RuntimeError, match="power cut"):
        train(config(data_dir, tmp_path / "b"), quiet=True)
    assert [r["step"] for r in read_metrics(tmp_path / "b")][-1] == 6  # past ckpt-0000004
    assert not (tmp_path / "b/.lock").exists()  # released on the way out
    monkeypatch.setattr(trainer, "train_step", real_step)
    train(config(data_dir, tmp_path / "b"), resume=True, quiet=True)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


def test_run_folder_contents_and_same_init_per_seed(data_dir, tmp_path):
    cfg = config(data_dir, tmp_path / "a", "train.tensorboard=true", "train.max_steps=4")
    summary = train(cfg, quiet=True)
    run = tmp_path / "a"
    names = {p.name for p in run.iterdir()}
    assert {"config.toml", "metrics.jsonl", "summary.json", "latest", "ckpt-0000004", "best",
            "tb", "tokenizer"} <= names
    assert not (run / ".lock").exists()
    assert any((run / "tb").iterdir())
    assert load_config(run) == cfg.on_device("cpu")  # the kernel it ran on
    assert set(summary) >= {"final_val_loss", "tokens_per_s", "params", "mfu"}
    # records hold no path of this machine: the checkpoint by its name in the run folder
    assert "run_dir" not in summary and summary["checkpoint"] == "ckpt-0000004"
    assert str(tmp_path) not in (run / "summary.json").read_text() + \
        (run / "config.toml").read_text()
    assert summary["params"] > 0 and summary["tokens_per_s"] > 0 and summary["steps"] == 4
    rec = read_metrics(run)[-1]
    assert set(rec) >= {"step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "mfu",
                        "val_loss", "val_ppl"}
    assert rec["tokens"] == 4 * 4 * 2 * 16
    # a second run with the same seed starts from the same weights: same step-0 val loss
    train(config(data_dir, tmp_path / "b", "train.max_steps=1"), quiet=True)
    assert read_metrics(run)[0] == read_metrics(tmp_path / "b")[0]


def test_refusals(data_dir, tmp_path):
    cfg = config(data_dir, tmp_path / "a", "train.max_steps=4")
    train(cfg, quiet=True)
    with pytest.raises(QkvlabError, match="already has checkpoints: pass --resume or choose "
                                          "another --out"):
        train(cfg, quiet=True)
    changed = config(data_dir, tmp_path / "a", "train.max_steps=4", "optim.lr=1e-3")
    with pytest.raises(QkvlabError, match=r"differs .* at optim.lr \(saved 0.003, now 0.001\)"):
        train(changed, resume=True, quiet=True)
    # resume=True without checkpoints starts fresh
    fresh = train(config(data_dir, tmp_path / "new", "train.max_steps=2"), resume=True,
                  quiet=True)
    assert fresh["resumed_from"] is None and fresh["steps"] == 2
    # resuming a finished run only re-evaluates
    again = train(cfg, resume=True, quiet=True)
    assert again["steps"] == 4 and again["final_val_loss"] is not None


def test_lock_refuses_a_live_run_and_clears_a_dead_one(data_dir, tmp_path):
    run = tmp_path / "a"
    run.mkdir()
    (run / ".lock").write_text(f"{os.getpid()} {os.uname().nodename}\n")
    with pytest.raises(QkvlabError, match=f"in use by process {os.getpid()}"):
        train(config(data_dir, run), quiet=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / ".lock").write_text(f"{dead.pid} {os.uname().nodename}\n")
    train(config(data_dir, run, "train.max_steps=1"), quiet=True)
    assert not (run / ".lock").exists()


def test_nonfinite_loss_stops_with_a_clear_error(data_dir, tmp_path):
    cfg = config(data_dir, tmp_path / "a", "optim.lr=1e30", "optim.min_lr=0", "optim.grad_clip=0",
                 "train.max_nonfinite=3", "train.max_steps=20", "train.ckpt_interval=1",
                 "optim.warmup_steps=0", "optim.decay_steps=20")
    with pytest.raises(QkvlabError) as err:
        train(cfg, quiet=True)
    msg = str(err.value)
    assert "non-finite loss or gradient for 3 consecutive steps" in msg
    assert re.search(r"the last at step \d+", msg)
    # at lr 1e30 the one checkpoint written (step 1) holds weights near 1e30 whose val loss is
    # nan: it is not offered as good
    assert "no checkpoint with good weights was kept" in msg
    assert "lower optim.lr" in msg
    records = read_metrics(tmp_path / "a")
    assert any(r.get("loss") is None for r in records[1:])  # logged as null, not NaN


def test_vocab_and_data_errors(data_dir, tmp_path):
    small = config(data_dir, tmp_path / "a", "model.vocab_size=8")
    with pytest.raises(QkvlabError, match=r"model.vocab_size = 8 is smaller .*--set "
                                          r"model.vocab_size="):
        train(small, quiet=True)
    padded = config(data_dir, tmp_path / "b", "model.vocab_size=64", "train.max_steps=1")
    assert train(padded, quiet=True)["steps"] == 1
    missing = config(data_dir, tmp_path / "c", f"data.dir={tmp_path / 'nodata'}",
                     "data.source=hf:someone/corpus", "data.tokenizer=gpt2")
    with pytest.raises(QkvlabError, match=r"no prepared data .* run `qkvlab prepare "
                                          r"hf:someone/corpus --tokenizer gpt2 --out"):
        train(missing, quiet=True)
    wrong_tok = config(data_dir, tmp_path / "d", "data.tokenizer=bytes")
    with pytest.raises(QkvlabError, match="prepared with tokenizer char"):
        train(wrong_tok, quiet=True)


# ---- the command line ---------------------------------------------------------------------
def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_cli_train_eval_sample(data_dir, tmp_path, capsys):
    cfg = config(data_dir, tmp_path / "run", "train.max_steps=4")
    path = save_config(cfg, tmp_path / "tiny.toml")
    assert main(["train", str(path), "--out", str(tmp_path / "run")]) == 0
    assert "done at step 4" in capsys.readouterr().out
    assert main(["train", str(tmp_path / "run"), "--resume", "--set", "train.max_steps=6"]) == 0
    assert read_metrics(tmp_path / "run")[-1]["step"] == 6
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--windows", "4"]) == 0
    out = capsys.readouterr().out
    assert "ckpt-0000006 (step 6): val loss" in out and "perplexity" in out
    assert main(["sample", str(tmp_path / "run"), "--prompt", "The", "--max-new-tokens", "20",
                 "--num-samples", "2", "--seed", "1"]) == 0
    texts = capsys.readouterr().out.split("\n---\n")
    assert len(texts) == 2 and all(t.startswith("The") for t in texts)
    assert main(["sample", str(tmp_path / "run"), "--prompt", "The", "--max-new-tokens", "20",
                 "--num-samples", "2", "--seed", "1", "--no-cache"]) == 0
    assert capsys.readouterr().out.split("\n---\n") == texts  # the cache changes nothing
    assert main(["sample", str(tmp_path / "run" / "best"), "--prompt", "T", "--temperature",
                 "0", "--max-new-tokens", "5"]) == 0


@pytest.mark.parametrize("argv, needle", [
    (["train", "no-such-config"], "neither a file nor a preset"),
    (["train", "shakespeare-char", "--set", "model.n_layers=2"],
     "unknown key(s) n_layers in [model]; valid keys"),
    (["train", "shakespeare-char", "--set", "optim.lr=fast"], "optim.lr must be float"),
    (["train", "shakespeare-char", "--set", "model.n_embd=100"], "divisible by n_head"),
    (["eval", "no-such-run"], "does not exist"),
    (["sample", "no-such-run"], "does not exist"),
])
def test_cli_errors_are_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"qkvlab {argv[0]}: error: ") and needle in err


def test_cli_errors_with_files(data_dir, tmp_path, capsys):
    pt = tmp_path / "model.pt"
    torch.save({"w": torch.zeros(1)}, pt)
    assert main(["eval", str(pt)]) == 2
    assert "never unpickles" in one_line_error(capsys)
    cfg = config(data_dir, tmp_path / "run", "train.max_steps=2")
    path = save_config(cfg, tmp_path / "tiny.toml")
    assert main(["train", str(path), "--set", "model.vocab_size=3"]) == 2
    assert "is smaller than the vocabulary" in one_line_error(capsys)
    assert main(["train", str(path)]) == 0
    capsys.readouterr()
    assert main(["train", str(path)]) == 2
    assert "already has checkpoints" in one_line_error(capsys)
    assert main(["sample", str(tmp_path / "run"), "--prompt", "\u2603"]) == 2
    assert "not in this char vocabulary" in one_line_error(capsys)
    assert main(["sample", str(tmp_path / "run"), "--top-p", "0"]) == 2
    assert "--top-p must be in (0, 1]" in one_line_error(capsys)
    assert main(["eval", str(tmp_path / "run"), "--windows", "0"]) == 2
    assert "--windows must be at least 1" in one_line_error(capsys)


def test_presets_command(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in ("shakespeare-char", "gpt2-small-owt", "gpt2-small-owt-qidentity"):
        assert name in out



def test_an_unwritable_tensorboard_folder_is_one_warning_and_training_goes_on(
        data_dir, tmp_path, monkeypatch, capsys):
    """The permission asked of the OS (os.access), so root, whom modes do not bind, sees it too."""
    cfg = config(data_dir, tmp_path / "a", "train.tensorboard=true", "train.max_steps=2")
    train(cfg, quiet=True)
    tb = tmp_path / "a" / "tb"
    before = sorted(p.name for p in tb.iterdir())
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if Path(path) == tb
                        else real(path, mode, **kw))
    capsys.readouterr()
    longer = config(data_dir, tmp_path / "a", "train.tensorboard=true", "train.max_steps=4")
    assert train(longer, resume=True, quiet=True)["steps"] == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"warning: TensorBoard is off for this session: {tb} is not writable "
                          "(permission denied)")
    assert sorted(p.name for p in tb.iterdir()) == before  # nothing written into it


def test_a_read_only_tensorboard_folder_for_real(data_dir, tmp_path):
    """No monkeypatching: tb/ is chmod 555 and the resume runs as a process the mode binds."""
    args = ["train", "shakespeare-char", "--out", str(tmp_path / "a"),
            *[a for item in tiny_overrides(data_dir, "train.tensorboard=true",
                                           "train.max_steps=2") for a in ("--set", item)]]
    assert main(args) == 0
    tb = tmp_path / "a" / "tb"
    tb.chmod(0o555)
    try:
        proc = run_qkvlab_bound_by_modes(
            ["train", str(tmp_path / "a"), "--resume", "--set", "train.max_steps=4"], tmp_path)
    finally:
        tb.chmod(0o755)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "b'" not in proc.stderr
    assert f"warning: TensorBoard is off for this session: {tb} is not writable" in proc.stderr
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["steps"] == 4
