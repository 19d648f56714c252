"""Crash safety and exact resume of a real training process killed again and again.

A real `python -m qkvlab train CFG --out RUN --resume` is killed with SIGKILL at least 10 times
(at random moments, and deliberately in the middle of checkpoint writes via the test hook
QKVLAB_TEST_SLOW_CKPT, which pauses between the files of a checkpoint), interrupted once by
SIGTERM and once by SIGINT, and restarted each time with --resume until it finishes. After
every interruption every visible checkpoint must verify and the newest one must be no older
than before (no data lost); at the end the per-step losses must equal, bit for bit, those of
an uninterrupted run, with no step logged twice and no leftovers in the run folder.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import tiny_config
from qkvlab.run import checkpoint as ck
from qkvlab.run import layout
from qkvlab.run.config import save_config
from qkvlab.run.metrics import read_metrics

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_STEPS = 45
SIGKILLS = 12  # at least 10 kills, a dozen spread over the run and its checkpoints
SLOW_CKPT_S = 0.04  # pause between the files of a checkpoint (test hook)
# What each interruption does, in order; "write" waits for a checkpoint write in progress.
SCHEDULE = ["write", "random", "write", "random", "term", "write", "random", "write",
            "random", "write", "int", "random", "write", "write"]
LEFTOVER_PREFIXES = (".tmp-ckpt-", ".old-", ".trash-")


def make_config(root: Path, data_dir: Path) -> Path:
    """A 2 x 32 fp32 model with dropout (so RNG state matters), a checkpoint every 3 steps."""
    cfg = tiny_config(data_dir, "model.dropout=0.1", "optim.warmup_steps=5",
                      f"train.max_steps={MAX_STEPS}", "train.grad_accum=2",
                      "train.eval_interval=9", "train.ckpt_interval=3", "train.compile=false")
    return save_config(cfg, root / "tiny.toml")


def spawn(cfg: Path, run: Path, slow: bool) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
    env.pop(guard_env(), None)
    if slow:
        env[guard_env()] = str(SLOW_CKPT_S)
    return subprocess.Popen([sys.executable, "-m", "qkvlab", "train", str(cfg), "--out",
                             str(run), "--resume"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def guard_env() -> str:
    return ck.SLOW_CKPT_ENV


def max_logged_step(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        return -1
    steps = []
    for line in lines:
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return max(steps, default=-1)


def leftovers(run: Path) -> set[str]:
    """Names of unfinished checkpoint writes, renames or prunes in the run folder."""
    try:
        return {e.name for e in os.scandir(run) if e.name.startswith(LEFTOVER_PREFIXES)}
    except OSError:
        return set()


def wait_until(cond, proc: subprocess.Popen, timeout: float) -> bool:
    """Poll `cond` every 2 ms until it holds (True) or the process ends / time runs out."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.002)
    return False


def newest_good(run: Path) -> int:
    """Step of the newest checkpoint; asserts that every visible checkpoint verifies."""
    newest = -1
    for path in layout.list_checkpoints(run):
        ck.verify_checkpoint(path)  # raises CorruptCheckpoint: a visible checkpoint is broken
        newest = max(newest, layout.ckpt_step(path) or -1)
    if (run / layout.BEST_DIR).exists():
        ck.verify_checkpoint(run / layout.BEST_DIR)
    return newest


def trajectory(run: Path) -> list[tuple]:
    """Everything a step logs that must not depend on interruptions (not timings)."""
    return [(r["step"], r.get("loss"), r.get("val_loss"), r.get("lr"), r.get("grad_norm"))
            for r in read_metrics(run)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_anywhere_then_resume_gives_identical_losses(tmp_path, data_dir):
    cfg = make_config(tmp_path, data_dir)
    started = time.monotonic()

    # the reference: one uninterrupted process, same thread count, no test hook
    ref = spawn(cfg, tmp_path / "straight", slow=False)
    out, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err

    run = tmp_path / "killed"
    rng = random.Random(20240607)
    kinds: dict[str, int] = {}
    sigkills = signals = stale_locks = data_lost = 0
    best_before = -1
    schedule = list(SCHEDULE)
    finished = False
    while not finished:
        before = leftovers(run)
        action = schedule.pop(0) if schedule else None
        proc = spawn(cfg, run, slow=action is not None)  # the last run needs no hook
        if action is None:  # enough interruptions: let it finish
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err
            assert f"done at step {MAX_STEPS}" in out
            break
        if action in ("term", "int"):
            sig = signal.SIGTERM if action == "term" else signal.SIGINT
            base = max(0, max_logged_step(run))
            # signal once training is under way (the handlers are installed by then)
            if wait_until(lambda b=base: max_logged_step(run) > b, proc, 120):
                proc.send_signal(sig)
            out, err = proc.communicate(timeout=120)
            finished = f"done at step {MAX_STEPS}" in out
            # a clean stop (128 + the signal, after its checkpoint), not a traceback or a kill
            assert proc.returncode == (0 if finished else 128 + sig), err
            assert "stopped by signal" in out or finished, out
            if not finished:
                step = int(out.split("stopped by signal")[1].split("at step ")[1].split(";")[0])
                assert (run / "latest").read_text().strip() == layout.ckpt_name(step)
                assert not (run / ".lock").exists()  # released on the way out
                signals += 1
                kinds[sig.name] = kinds.get(sig.name, 0) + 1
        else:
            if action == "write":  # strike somewhere inside a checkpoint write
                wait_until(lambda b=before: bool(leftovers(run) - b), proc, 120)
                time.sleep(rng.uniform(0.0, 4 * SLOW_CKPT_S))
            else:  # strike at a random moment: imports, resume, training, writing
                wait_until(lambda: False, proc, rng.uniform(0.3, 3.0))
            proc.kill()
            proc.wait()  # reap it: a zombie would still answer os.kill(pid, 0)
            out, err = proc.communicate()
            if proc.returncode == 0:  # it finished before we struck
                finished = True
                break
            assert proc.returncode == -signal.SIGKILL, err
            sigkills += 1
            # unfinished temp/renamed folders of this process: the kill hit a checkpoint write
            where = "checkpoint write" if leftovers(run) - before else "elsewhere"
            kinds[f"SIGKILL during {where}"] = kinds.get(f"SIGKILL during {where}", 0) + 1
            stale_locks += (run / ".lock").exists()
        # after every interruption: all visible checkpoints verify, and none was lost
        good = newest_good(run) if run.exists() else -1
        if good < best_before:
            data_lost += 1
        best_before = max(best_before, good)
    elapsed = time.monotonic() - started

    print(f"\ninterruptions: {kinds}; SIGKILLs survived {sigkills}, signal stops {signals}, "
          f"stale locks taken over {stale_locks}, data lost {data_lost}, {elapsed:.0f} s")
    assert sigkills >= 10
    assert kinds.get("SIGKILL during checkpoint write", 0) >= 3
    assert signals == 2
    assert data_lost == 0
    a, b = trajectory(tmp_path / "straight"), trajectory(run)
    assert [r[0] for r in b] == list(range(MAX_STEPS + 1))  # every step once, no duplicates
    assert a == b  # bitwise: JSON round-trips floats exactly
    last = layout.ckpt_name(MAX_STEPS)
    for name in (layout.MODEL_FILE, layout.OPTIM_FILE):
        assert (tmp_path / "straight" / last / name).read_bytes() == \
            (run / last / name).read_bytes()
    rest = [p.name for p in run.iterdir()
            if p.name.startswith(LEFTOVER_PREFIXES) or p.name.endswith(".tmp") or p.name == ".lock"]
    assert rest == []
    assert len(layout.list_checkpoints(run)) == 2  # keep_last, plus best/
    assert (run / layout.BEST_DIR).is_dir()
