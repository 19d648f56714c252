"""Hostile use of the command line: Ctrl-C at start-up, signals in a job's set-up, existing
output files, a broken `latest`, conflicting sweep options, archive destinations."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import qkvlab
from helpers import refused, tiny_config, tiny_overrides

SRC = Path(qkvlab.__file__).resolve().parents[1]


def _set(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def _spawn(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
    return subprocess.Popen([sys.executable, "-m", "qkvlab", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _deferring(pid: int) -> bool:
    """Whether process `pid` catches SIGTERM: `python -m qkvlab` does from its first line
    (interrupts.defer), Python's own start-up never does."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:"))
                 .split()[1], 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def _torch_loaded(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _signal_after_start_up(proc: subprocess.Popen, delay: float, signum: int) -> bool:
    """Send `signum` `delay` seconds after `proc` defers stop signals; whether it deferred
    them before loading torch. A signal before that ends in Python's own start-up, which no
    program can catch; waiting for it, not for a guessed boot time, keeps the test
    independent of how busy the CPU is."""
    deadline = time.monotonic() + 60
    while not _deferring(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, "it never started"
        time.sleep(0.001)
    early = not _torch_loaded(proc.pid)
    time.sleep(delay)
    proc.send_signal(signum)
    return early


def _interrupt_at(args: list[str], delay: float, signum: int = signal.SIGINT
                  ) -> tuple[int, str, bool]:
    """Run `qkvlab ARGS`, send `signum` `delay` seconds after its start-up; exit status,
    output (a run that ignores the signal is killed after 60 s: status -999) and whether it
    deferred signals before loading torch."""
    proc = _spawn(args)
    early = _signal_after_start_up(proc, delay, signum)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return -999, out + err, early
    return proc.returncode, out + err, early


# ---- Ctrl-C in the first moments of a command that trains -----------------------------------
def _long_train(data_dir: Path, run: Path) -> list[str]:
    items = tiny_overrides(data_dir, "model.n_layer=1", "train.max_steps=100000",
                           "train.eval_interval=100000", "train.ckpt_interval=100000",
                           "train.log_interval=100000")
    return ["train", "shakespeare-char", "--out", str(run), *_set(items)]


def _check_stopped_train(rc: int, text: str, run: Path, delay: float) -> None:
    assert "Traceback" not in text and "terminate called" not in text, (delay, text)
    # before training or inside the loop (after its checkpoint): 130 either way
    assert rc == 130, (delay, rc, text)
    assert f"resume with: qkvlab train {run} --resume" in text, (delay, text)
    assert not (run / ".lock").exists()


@pytest.mark.parametrize("delay", [0.1, 0.35, 0.6])
def test_ctrl_c_at_start_up_stops_train_with_the_resume_command(data_dir, tmp_path, delay):
    run = tmp_path / "r"
    rc, text, _ = _interrupt_at(_long_train(data_dir, run), delay)
    _check_stopped_train(rc, text, run, delay)


@pytest.mark.slow
def test_ctrl_c_at_many_early_moments_always_stops_train(data_dir, tmp_path):
    early = []
    for i in range(16):
        delay = 0.04 * i  # from the moment it defers signals on, through its imports
        run = tmp_path / f"r{i}"
        rc, text, deferred_before_torch = _interrupt_at(_long_train(data_dir, run), delay)
        _check_stopped_train(rc, text, run, delay)
        early.append(deferred_before_torch)
    # signals are deferred before torch loads (seen at least once: the poll may come late)
    assert any(early)


# ---- compare and sweep: Ctrl-C at start-up, a signal in the estimate or a run's set-up ------
def _compare_args(data_dir: Path, out: Path, steps: int) -> list[str]:
    """A tiny fp32 compare on the test data (max_steps comes from --steps)."""
    items = [i for i in tiny_overrides(data_dir, "model.n_layer=1")
             if not i.startswith("train.max_steps")]
    return ["compare", "--steps", str(steps), "--out", str(out), *_set(items)]


def test_ctrl_c_at_start_up_stops_compare_with_the_resume_command(data_dir, tmp_path):
    out = tmp_path / "early"
    proc = subprocess.Popen([sys.executable, "-m", "qkvlab",
                             *_compare_args(data_dir, out, 100000)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(SRC)})
    _signal_after_start_up(proc, 0.4, signal.SIGINT)
    try:
        text, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in text, text
    assert f"qkvlab compare --preset quick --out {out} --steps 100000" in " ".join(text.split())
    assert not list(out.glob("*/.lock"))


# Signals this process at one moment of `qkvlab compare` (argv: moment, signal, compare args):
# in the duration estimate, or just after a run's set-up (its folder locked, nothing trained).
COMPARE_DRIVER = """
import os, sys
from qkvlab.cli import main
from qkvlab.commands import compare
from qkvlab.train import trainer

moment, signum, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

def hit(real):
    def wrapped(*a, **k):
        got = real(*a, **k)
        os.kill(os.getpid(), signum)
        return got
    return wrapped

if moment == "estimate":
    compare._expected_duration = hit(compare._expected_duration)
else:
    trainer.setup = hit(trainer.setup)
sys.exit(main(args))
"""


@pytest.mark.parametrize("moment, signum", [
    ("estimate", signal.SIGINT), ("setup", signal.SIGTERM),
    pytest.param("estimate", signal.SIGTERM, marks=pytest.mark.slow),
    pytest.param("setup", signal.SIGINT, marks=pytest.mark.slow)])
def test_a_signal_in_compare_set_up_stops_it_with_the_resume_command(data_dir, tmp_path,
                                                                    moment, signum):
    out = tmp_path / "cmp"
    proc = subprocess.run([sys.executable, "-c", COMPARE_DRIVER, moment, str(int(signum)),
                           *_compare_args(data_dir, out, 6)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(SRC)})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 128 + signum and "Traceback" not in text, text
    assert f"resume with: qkvlab compare --preset quick --out {out} --steps 6" in text
    assert not list(out.glob("*/.lock"))  # released on the way out
    assert not (out / "compare.md").exists()


def _sweep_spec(folder: Path, data_dir: Path, name: str = "fake", *changes: str) -> Path:
    from qkvlab.run.config import save_config

    folder.mkdir(parents=True, exist_ok=True)
    save_config(tiny_config(data_dir, *changes), folder / "base.toml")
    path = folder / f"{name}.toml"
    path.write_text(f'[spec]\nname = "{name}"\nbase = "base.toml"\nseeds = [1]\n\n'
                    '[[variant]]\nname = "baseline"\nbaseline = true\nrule = "baseline"\n\n'
                    '[[variant]]\nname = "q-identity"\nrule = "q-identity"\n',
                    encoding="utf-8")
    return path


def test_ctrl_c_at_start_up_stops_a_sweep_with_the_resume_command(data_dir, tmp_path):
    spec = _sweep_spec(tmp_path / "spec", data_dir, "fake", "train.max_steps=100000")
    out = tmp_path / "sweep"
    rc, text, _ = _interrupt_at(["sweep", str(spec), "--out", str(out)], 0.4)
    assert rc == 130 and "Traceback" not in text, text
    assert f"qkvlab sweep {spec} --out {out}" in " ".join(text.split())


# ---- output files that exist, a broken `latest`, conflicting sweep options -----------------
@pytest.fixture(scope="module")
def sweep_dir(data_dir, tmp_path_factory) -> Path:
    """A finished sweep of two tiny runs (spec "fake")."""
    from qkvlab.cli import main

    root = tmp_path_factory.mktemp("sweep")
    spec = _sweep_spec(root / "spec", data_dir, "fake", "train.max_steps=2")
    assert main(["sweep", str(spec), "--out", str(root / "sw")]) == 0
    return root / "sw"


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_report_to_an_existing_file_is_refused(sweep_dir, tmp_path, capsys):
    target = tmp_path / "report.md"
    target.write_text("mine\n")
    msg = refused(capsys, ["report", str(sweep_dir), "--out", str(target)])
    assert str(target) in msg and "not a folder" in msg
    assert target.read_text() == "mine\n"


def test_archive_to_an_existing_file_is_refused(sweep_dir, tmp_path, capsys):
    target = tmp_path / "archive"
    target.write_text("mine\n")
    msg = refused(capsys, ["archive", str(sweep_dir), str(target)])
    assert str(target) in msg and "not a folder" in msg
    assert target.read_text() == "mine\n"


@pytest.mark.parametrize("inside", ["copy", "baseline/seed-1/copy"])
def test_archive_inside_the_sweep_is_refused(sweep_dir, capsys, inside):
    before = _tree(sweep_dir)
    msg = refused(capsys, ["archive", str(sweep_dir), str(sweep_dir / inside)])
    assert "inside the sweep" in msg
    assert _tree(sweep_dir) == before and not (sweep_dir / inside).exists()


def test_archive_into_the_archive_of_another_sweep_is_refused(sweep_dir, tmp_path, capsys):
    from qkvlab.cli import main

    dest = tmp_path / "arch"
    assert main(["archive", str(sweep_dir), str(dest)]) == 0
    assert main(["archive", str(sweep_dir), str(dest)]) == 0  # the same sweep again: updated
    other = tmp_path / "other"
    other.mkdir()
    (other / "sweep.json").write_text(json.dumps({"spec": "other", "groups": {}}))
    before = _tree(dest)
    msg = refused(capsys, ["archive", str(other), str(dest)])
    assert "another sweep" in msg and "'fake'" in msg
    assert _tree(dest) == before


def test_a_latest_that_is_a_folder_is_refused_before_training(data_dir, tmp_path, capsys):
    from qkvlab.cli import main

    run = tmp_path / "r"
    args = ["train", "shakespeare-char", "--out", str(run)]
    assert main([*args, *_set(tiny_overrides(data_dir, "train.max_steps=4"))]) == 0
    (run / "latest").unlink()
    (run / "latest").mkdir()
    before = _tree(run)
    msg = refused(capsys, [*args, "--resume",
                           *_set(tiny_overrides(data_dir, "train.max_steps=8"))])
    assert f"{run / 'latest'} is a folder" in msg and "move it out" in msg
    assert _tree(run) == before  # nothing trained, nothing written


def test_jobs_with_a_launcher_is_refused_before_anything_is_written(data_dir, tmp_path,
                                                                    capsys):
    spec = _sweep_spec(tmp_path / "spec", data_dir)
    out = tmp_path / "sweep"
    msg = refused(capsys, ["sweep", str(spec), "--out", str(out), "--jobs", "2",
                           "--launcher", "torchrun"])
    assert "--jobs and --launcher do not go together" in msg
    assert not out.exists()
