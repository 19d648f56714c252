"""Guarded training: disk full, non-finite steps, run-folder locks, corrupt checkpoints on resume.

Everything here runs in-process on a 2 x 32 model (milliseconds per step), except the lock
test that needs a second, live process and the tmpfs test that needs root to mount a tiny
file system (skipped elsewhere; the monkeypatched disk-full tests cover the same code).
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from helpers import tiny_config
from qkvlab.cli import main
from qkvlab.errors import QkvlabError
from qkvlab.run import checkpoint as ck
from qkvlab.run import layout, metrics, store
from qkvlab.run import lock as run_lock
from qkvlab.run.config import save_config
from qkvlab.run.lock import RunLock
from qkvlab.run.metrics import read_metrics
from qkvlab.train import trainer
from qkvlab.train.trainer import train

SRC = Path(__file__).resolve().parents[1] / "src"
def config(data_dir: Path, out: Path, *extra: str):
    """The tiny run with dropout, a checkpoint every 2 steps and no evaluation."""
    return tiny_config(data_dir, "model.dropout=0.1", "optim.decay_steps=8",
                       "train.eval_interval=100", "train.ckpt_interval=2",
                       f"run.out_dir={out}", *extra)


def losses(run: Path) -> list[tuple]:
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_metrics(run)]


def snapshot(root: Path) -> dict[str, str]:
    """Every file (sha256) and folder under root: equal snapshots mean nothing was written."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"qkvlab {command}: error: "), err
    return err


# ---- disk full ----------------------------------------------------------------------------
def full_disk_on(monkeypatch, target: str, how: str) -> None:
    """Make save_file fail like a full disk when it writes into a folder named like `target`,
    after writing half the bytes (as a real ENOSPC leaves a partial file)."""
    real = ck.save_file

    def save_file(tensors, filename, metadata=None):
        if target in str(filename) and filename.endswith(layout.OPTIM_FILE):
            real(tensors, filename, metadata=metadata)
            data = Path(filename).read_bytes()
            Path(filename).write_bytes(data[: len(data) // 2])
            if how == "safetensors":  # what safetensors really raises (its Rust io error)
                raise SafetensorError("Error while serializing: I/O error: No space left on "
                                      "device (os error 28)")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(ck, "save_file", save_file)


@pytest.mark.parametrize("how", ["safetensors", "oserror"])
def test_disk_full_while_saving_keeps_the_previous_checkpoint(data_dir, tmp_path, monkeypatch,
                                                              how, capsys):
    train(config(data_dir, tmp_path / "straight"), quiet=True)
    run = tmp_path / "run"
    cfg_file = save_config(config(data_dir, run), tmp_path / "tiny.toml")
    full_disk_on(monkeypatch, "ckpt-0000004", how)
    assert main(["train", str(cfg_file), "--out", str(run)]) == 2
    msg = one_line(capsys, "train")
    assert "writing checkpoint" in msg and "ckpt-0000004" in msg
    assert "the disk is full (No space left on device)" in msg
    assert f"the last good checkpoint {run / 'ckpt-0000002'} is intact" in msg
    assert "free some space" in msg
    # nothing of the failed write is left, the previous checkpoint verifies and is `latest`
    assert [p.name for p in layout.list_checkpoints(run)] == ["ckpt-0000002"]
    ck.verify_checkpoint(run / "ckpt-0000002")
    assert (run / "latest").read_text().strip() == "ckpt-0000002"
    assert not [p for p in run.iterdir() if p.name.startswith((".tmp-", ".old-", ".trash-"))]
    assert not (run / ".lock").exists()
    # space freed: resume and end exactly where an uninterrupted run ends
    monkeypatch.undo()
    assert main(["train", str(cfg_file), "--out", str(run), "--resume"]) == 0
    assert losses(tmp_path / "straight") == losses(run)


def test_disk_full_replacing_an_existing_checkpoint_puts_the_old_one_back(data_dir, tmp_path,
                                                                          monkeypatch):
    cfg = config(data_dir, tmp_path / "run", "train.max_steps=4")
    train(cfg, quiet=True)
    before = snapshot(tmp_path / "run" / "ckpt-0000004")
    full_disk_on(monkeypatch, "ckpt-0000004", "oserror")
    from qkvlab.model import GPT
    from qkvlab.train.checkpointer import Checkpointer
    from qkvlab.train.distributed import DistContext, Parallel, plan_batches
    from qkvlab.train.optim import build_optimizer

    model = GPT(cfg.model)
    par = Parallel(model, DistContext(torch.device("cpu")), cfg.train.parallel, False,
                   plan_batches(cfg.train.batch_size, cfg.train.grad_accum, 1, 0))
    opt = build_optimizer(model, cfg.optim)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    with pytest.raises(ck.CheckpointWriteError, match="the disk is full") as err:
        Checkpointer(cfg.run_dir, cfg, par, opt).save(4, {})
    assert isinstance(err.value, OSError)  # callers catching OSError still do
    assert snapshot(tmp_path / "run" / "ckpt-0000004") == before


def test_disk_full_in_the_metrics_log_names_the_last_good_checkpoint(data_dir, tmp_path,
                                                                     monkeypatch):
    real = metrics.MetricsLog.write

    def write(self, record):
        if record["step"] == 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return real(self, record)

    monkeypatch.setattr(metrics.MetricsLog, "write", write)
    with pytest.raises(QkvlabError) as err:
        train(config(data_dir, tmp_path / "run"), quiet=True)
    msg = str(err.value)
    assert "metrics.jsonl failed: the disk is full" in msg and "\n" not in msg
    assert f"the last good checkpoint {tmp_path / 'run' / 'ckpt-0000004'} is intact" in msg
    assert f"qkvlab train {tmp_path / 'run'} --resume" in msg


def _mount_tmpfs(where: Path, size: int) -> bool:
    if sys.platform != "linux" or os.geteuid() != 0 or not shutil.which("mount"):
        return False
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True)
    return proc.returncode == 0


def test_real_full_disk_on_a_tiny_tmpfs(data_dir, tmp_path, capsys):
    """No monkeypatching: the run folder lives on a file system too small for 2 checkpoints."""
    cfg = config(data_dir, tmp_path / "sizing", "train.max_steps=2")
    train(cfg, quiet=True)
    one = sum(p.stat().st_size for p in (tmp_path / "sizing" / "ckpt-0000002").iterdir())
    rest = sum(p.stat().st_size for p in (tmp_path / "sizing").rglob("*")
               if p.is_file() and "ckpt-" not in str(p) and "best" not in str(p))
    size = (rest + one + one // 2) // 4096 * 4096 + 8 * 4096  # room for 1.5 checkpoints
    mnt = tmp_path / "tiny-fs"
    if not _mount_tmpfs(mnt, size):
        pytest.skip("needs root and tmpfs to mount a tiny file system")
    try:
        run = mnt / "run"
        cfg_file = save_config(config(data_dir, run), tmp_path / "tiny.toml")
        assert main(["train", str(cfg_file), "--out", str(run)]) == 2
        msg = one_line(capsys, "train")
        assert "failed: the disk is full (No space left on device)" in msg
        good = ck.last_good_checkpoint(run)
        assert good is not None and f"the last good checkpoint {good} is intact" in msg
        ck.verify_checkpoint(good)
        assert store.read_checkpoint(run).path == good  # what --resume would pick up
        assert not [p for p in run.iterdir() if p.name.startswith((".tmp-", ".old-"))]
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# ---- non-finite steps ---------------------------------------------------------------------
class _InfGrad(torch.autograd.Function):
    """Adds 0 to the loss but sends an infinite gradient back: finite loss, inf grad norm."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        return torch.full(ctx.shape, float("inf"), dtype=grad.dtype)


def poison(monkeypatch, steps: dict[int, str], seen: list) -> None:
    """At the given step indices, make the loss NaN ("loss") or the gradient inf ("grad"),
    and record each step's weights and optimizer state before and after it."""
    real = trainer.train_step

    def step_fn(s, step):
        kind, fwd = steps.get(step), s.par.fwd

        def bad_fwd(x, y):
            logits, loss = fwd(x, y)
            if kind == "loss":
                return logits, loss * float("nan")
            return logits, loss + _InfGrad.apply(s.model.wte.weight)

        def state():
            return ({k: v.clone() for k, v in s.model.state_dict().items()},
                    copy.deepcopy(s.optimizer.state_dict()["state"]))

        before = state()
        s.par.fwd = bad_fwd if kind else fwd
        try:
            rec = real(s, step)
        finally:
            s.par.fwd = fwd
        after = state()
        seen.append((step, kind, rec, before, after))
        return rec

    monkeypatch.setattr(trainer, "train_step", step_fn)


def same_state(a, b) -> bool:
    (wa, oa), (wb, ob) = a, b
    weights = all(torch.equal(wa[k], wb[k]) for k in wa)
    moments = oa.keys() == ob.keys() and all(
        torch.equal(oa[i][n], ob[i][n]) for i in oa for n in oa[i])
    return weights and moments


def test_isolated_nonfinite_steps_are_skipped_and_counted(data_dir, tmp_path, monkeypatch):
    seen: list = []
    poison(monkeypatch, {2: "loss", 5: "grad"}, seen)
    summary = train(config(data_dir, tmp_path / "run", "train.max_nonfinite=2"), quiet=True)
    assert summary["steps"] == 8 and summary["skipped_steps"] == 2
    for step, kind, rec, before, after in seen:
        if kind:  # skipped: not one weight or AdamW moment moved
            assert rec["loss"] is None and same_state(before, after), step
        else:
            assert rec["loss"] is not None and not same_state(before, after), step
    logged = {r["step"]: r.get("loss") for r in read_metrics(tmp_path / "run")}
    assert logged[3] is None and logged[6] is None  # metrics count steps from 1
    assert all(logged[s] is not None for s in (1, 2, 4, 5, 7, 8))
    state = json.loads((tmp_path / "run" / "ckpt-0000008" / "state.json").read_text())
    assert state["skipped_steps"] == 2


def test_consecutive_nonfinite_steps_stop_naming_step_and_last_good_checkpoint(
        data_dir, tmp_path, monkeypatch, capsys):
    seen: list = []
    # from step index 4 on every loss is NaN: steps 5, 6, 7 (as logged) fail, K = 3
    poison(monkeypatch, {i: "loss" for i in range(4, 8)}, seen)
    run = tmp_path / "run"
    cfg_file = save_config(config(data_dir, run, "train.max_nonfinite=3",
                                  "train.ckpt_interval=1"), tmp_path / "c.toml")
    assert main(["train", str(cfg_file), "--out", str(run)]) == 2
    msg = one_line(capsys, "train")
    assert "non-finite loss or gradient for 3 consecutive steps (the last at step 7)" in msg
    assert f"the last good checkpoint is {run / 'ckpt-0000004'}" in msg
    # no checkpoint was written inside the streak, so keep_last did not rotate good ones out
    assert [p.name for p in layout.list_checkpoints(run)] == ["ckpt-0000003", "ckpt-0000004"]
    ck.verify_checkpoint(run / "ckpt-0000004")
    assert not (run / ".lock").exists()


# ---- locks --------------------------------------------------------------------------------
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_lock_file_rules(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lock = run / ".lock"
    host = socket.gethostname()
    me = run_lock._start_time(os.getpid())
    cases = {
        f"{dead_pid()} {host}": True,  # its process is gone: take over
        f"{dead_pid()} {host} 12345": True,
        f"{os.getpid()} {host} {me}": False,  # alive
        f"{os.getpid()} {host}": False,  # an old-style lock of a live process
        f"{os.getpid()} {host} 1": me is not None,  # pid reused by a later process: stale
        f"{os.getpid()} other-host.example": False,  # cannot check: assume alive
        "": True,  # torn while being written
        "garbage": True,
    }
    for text, free in cases.items():
        lock.write_text(text + "\n")
        if free:
            with RunLock(run):
                assert lock.read_text().split()[0] == str(os.getpid())
            assert not lock.exists()
        else:
            with pytest.raises(QkvlabError, match="is in use by process"):
                RunLock(run).__enter__()
            assert lock.read_text() == text + "\n"  # untouched


def _race(run: Path, n: int) -> tuple[list[RunLock], int]:
    """n threads try to take the lock of `run` at the same moment: (winners, refusals)."""
    wins: list[RunLock] = []
    refusals: list[int] = []
    go = threading.Barrier(n)

    def take():
        go.wait()
        try:
            wins.append(RunLock(run).__enter__())
        except QkvlabError:
            refusals.append(1)

    threads = [threading.Thread(target=take) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return wins, len(refusals)


def test_racing_for_a_stale_lock_only_one_wins(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for _ in range(5):
        (run / ".lock").write_text(f"{dead_pid()} {socket.gethostname()}\n")
        wins, refusals = _race(run, 8)
        assert len(wins) == 1 and refusals == 7
        wins[0].__exit__(None, None, None)


@pytest.mark.slow
def test_second_run_refused_while_the_first_lives_then_takes_over(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    cfg_file = save_config(config(data_dir, run, "train.max_steps=400",
                                  "train.ckpt_interval=1"), tmp_path / "c.toml")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC),
           "QKVLAB_TEST_SLOW_CKPT": "0.2"}  # keeps the first run busy and alive
    first = subprocess.Popen([sys.executable, "-m", "qkvlab", "train", str(cfg_file), "--out",
                              str(run)], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not layout.list_checkpoints(run) and time.monotonic() < deadline:
            assert first.poll() is None, first.stderr.read()
            time.sleep(0.05)
        assert main(["train", str(cfg_file), "--out", str(run), "--resume"]) == 2
        msg = one_line(capsys, "train")
        assert f"is in use by process {first.pid}" in msg
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
        first.stderr.close()
    assert (run / ".lock").exists()  # SIGKILL left it behind: its process is dead now
    assert main(["train", str(cfg_file), "--out", str(run), "--resume",
                 "--set", "train.max_steps=6"]) == 0  # harmless change: stop early
    assert read_metrics(run)[-1]["step"] == 6 and not (run / ".lock").exists()


def test_run_dir_that_is_a_file_is_refused(data_dir, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    cfg_file = save_config(config(data_dir, tmp_path / "afile"), tmp_path / "c.toml")
    before = snapshot(tmp_path)
    assert main(["train", str(cfg_file), "--out", str(tmp_path / "afile")]) == 2
    assert "is a file, not a folder" in one_line(capsys, "train")
    assert main(["train", str(cfg_file), "--out", str(tmp_path / "afile" / "sub")]) == 2
    one_line(capsys, "train")
    assert snapshot(tmp_path) == before


# ---- corrupt checkpoints on resume --------------------------------------------------------
def test_resume_from_a_corrupt_latest_offers_the_previous_good(data_dir, tmp_path, capsys):
    train(config(data_dir, tmp_path / "straight"), quiet=True)
    run = tmp_path / "run"
    cfg_file = save_config(config(data_dir, run, "train.max_steps=6"), tmp_path / "c.toml")
    assert main(["train", str(cfg_file), "--out", str(run)]) == 0
    capsys.readouterr()
    bad = run / "ckpt-0000006" / layout.MODEL_FILE
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    bad.write_bytes(bytes(data))
    before = snapshot(run)
    assert main(["train", str(cfg_file), "--out", str(run), "--resume",
                 "--set", "train.max_steps=8"]) == 2
    msg = one_line(capsys, "train")
    assert f"checkpoint {run / 'ckpt-0000006'} is corrupt (file model.safetensors: sha256" in msg
    assert f"the previous good checkpoint is {run / 'ckpt-0000004'}" in msg
    assert snapshot(run) == before  # refused: not one byte written
    # follow the advice: delete the corrupt one and resume from the previous good checkpoint
    shutil.rmtree(run / "ckpt-0000006")
    assert main(["train", str(cfg_file), "--out", str(run), "--resume",
                 "--set", "train.max_steps=8"]) == 0
    assert losses(tmp_path / "straight") == losses(run)


def test_keep_last_and_best(data_dir, tmp_path):
    train(config(data_dir, tmp_path / "run", "train.keep_last=3", "train.ckpt_interval=1",
                 "train.eval_interval=2"), quiet=True)
    names = sorted(p.name for p in (tmp_path / "run").iterdir() if p.is_dir())
    assert names == ["best", "ckpt-0000006", "ckpt-0000007", "ckpt-0000008", "tokenizer"]
    best = store.read_checkpoint(tmp_path / "run" / "best")
    vals = {r["step"]: r["val_loss"] for r in read_metrics(tmp_path / "run") if "val_loss" in r}
    assert best.state["val_loss"] == min(v for s, v in vals.items() if s > 0)


def test_a_permission_error_names_the_path_as_text_and_the_permission_fix(tmp_path):
    """A library that gives the file name as bytes (TensorBoard's writer) still gets a path in
    the message, and a permission problem is not sent to "fix the disk"."""
    from qkvlab.run import store

    exc = PermissionError(errno.EACCES, "Permission denied", os.fsencode(tmp_path / "tb" / "ev"))
    msg = str(store.storage_error(exc, tmp_path))
    assert f"writing {tmp_path / 'tb' / 'ev'} failed: permission denied" in msg
    assert "b'" not in msg and "fix the disk" not in msg
    assert "give this user write permission there" in msg
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))
    assert "free some space" in str(store.storage_error(full, tmp_path))
