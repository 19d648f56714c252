"""The sweep executor's one policy, in each of its three ways (in this process, one
subprocess at a time, N at once): a failed run is recorded and the others still train; a
signal stops the sweep, reaches each running run once, and nothing further starts. Fake runs
(a train function, `python -c` children) stand in for training wherever the policy is what is
tested; the last tests send Ctrl-C to a real `qkvlab sweep`."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import tiny_config
from qkvlab.errors import QkvlabError
from qkvlab.experiments import executor
from qkvlab.experiments.executor import Failure, SweepResult
from qkvlab.experiments.spec import Run, load_spec
from qkvlab.run.config import save_config
from qkvlab.run.lock import RunInUse, RunLock

SPEC = """
[spec]
name = "fake"
base = "base.toml"
seeds = [1, 2]
set = {set}

[[variant]]
name = "baseline"
baseline = true
rule = "baseline"

[[variant]]
name = "q-identity"
rule = "q-identity"
"""


def write_spec(folder: Path, data_dir: Path, *changes: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_config(tiny_config(data_dir), folder / "base.toml")
    path = folder / "fake.toml"
    path.write_text(SPEC.format(set=json.dumps(list(changes))), encoding="utf-8")
    return path


@pytest.fixture
def runs(data_dir, tmp_path) -> list[Run]:
    """Four runs (2 variants x 2 seeds), seed-major: baseline s1, q-identity s1, s2, s2."""
    return load_spec(write_spec(tmp_path / "spec", data_dir)).runs(tmp_path / "sweep")


def failed_record(run: Run) -> dict:
    return json.loads((run.run_dir / "failed.json").read_text())


# ---- the result ---------------------------------------------------------------------------
def test_the_result_is_frozen_and_its_exit_code_puts_a_signal_before_failures():
    ok = SweepResult(("a",), (), ("b",), (), None)
    failed = dataclasses.replace(ok, failed=(Failure("c", "boom"),))
    assert (ok.exit_code, failed.exit_code) == (0, 2)
    assert dataclasses.replace(failed, signum=signal.SIGINT).exit_code == 130
    assert dataclasses.replace(ok, signum=signal.SIGTERM).exit_code == 143
    with pytest.raises(dataclasses.FrozenInstanceError):
        ok.signum = 2  # type: ignore[misc]


def test_modes_that_do_not_go_together_are_refused():
    with pytest.raises(QkvlabError, match="--jobs 0: give at least 1"):
        executor.check_mode(0, None)
    with pytest.raises(QkvlabError, match="--jobs and --launcher do not go together"):
        executor.check_mode(2, "torchrun")
    executor.check_mode(1, "torchrun")
    with pytest.raises(QkvlabError, match="--threads 0: give at least 1 thread"):
        executor.check_mode(1, None, 0)
    with pytest.raises(QkvlabError, match="no-such-launcher-x is not a program on PATH"):
        executor.execute([], print, launcher="no-such-launcher-x --flag")


# ---- in this process ----------------------------------------------------------------------
def test_in_process_a_failed_run_is_recorded_and_the_others_still_train(runs, capsys):
    said, trained = [], []

    def train_fn(run: Run) -> dict:
        trained.append(run.label)
        if run.label == "baseline seed 1":
            raise QkvlabError("training diverged: non-finite loss\nat step 3")
        if run.label == "q-identity seed 1":
            raise RuntimeError("a bug")
        return {"interrupted": False, "final_val_loss": 1.5}

    result = executor.run_in_process(runs, said.append, train_fn)
    assert trained == [r.label for r in runs]  # every run was tried
    assert result == SweepResult(
        finished=("baseline seed 2", "q-identity seed 2"),
        failed=(Failure("baseline seed 1", "training diverged: non-finite loss at step 3"),
                Failure("q-identity seed 1", "RuntimeError: a bug")),
        skipped=(), left=(), signum=None)
    assert result.exit_code == 2
    assert failed_record(runs[0])["diverged"] is True
    assert failed_record(runs[1]) | {"time": None} == {
        "error": "RuntimeError: a bug", "diverged": False, "time": None}
    assert "Traceback" in capsys.readouterr().err  # a bug keeps its traceback
    assert "[red]baseline seed 1 failed[/]: training diverged: non-finite loss at step 3" in said
    assert "finished baseline seed 2: val loss 1.5000" in said
    assert said[0].startswith("[bold][1/4] started baseline seed 1[/] (")


def test_in_process_a_signal_in_a_run_stops_the_sweep_and_names_the_runs_left(runs):
    trained = []

    def train_fn(run: Run) -> dict:
        trained.append(run.label)
        if len(trained) == 2:  # the trainer caught SIGTERM, checkpointed and returned
            return {"interrupted": True, "signal": int(signal.SIGTERM)}
        return {"interrupted": False}

    result = executor.run_in_process(runs, lambda _line: None, train_fn)
    assert trained == ["baseline seed 1", "q-identity seed 1"]  # nothing further started
    assert result.finished == ("baseline seed 1",)
    assert result.left == ("q-identity seed 1", "baseline seed 2", "q-identity seed 2")
    assert (result.signum, result.exit_code) == (signal.SIGTERM, 143)


def test_in_process_a_signal_outside_the_training_loop_stops_the_run_too(runs):
    """Before the trainer's own handler is in place (setup, data loading), the executor's
    handler interrupts the run: it neither trains to the end nor counts as failed."""
    reached = []

    def train_fn(run: Run) -> dict:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler interrupts this
        reached.append(run.label)
        return {}

    old = signal.getsignal(signal.SIGTERM)
    result = executor.run_in_process(runs, lambda _line: None, train_fn)
    assert reached == [] and result.finished == () and result.failed == ()
    assert result.left == tuple(r.label for r in runs) and result.exit_code == 143
    assert not (runs[0].run_dir / "failed.json").exists()
    assert signal.getsignal(signal.SIGTERM) == old  # the handlers are given back
    # a second Ctrl-C inside the trainer's loop raises KeyboardInterrupt: a stop, not a bug
    def second_ctrl_c(run: Run) -> dict:
        raise KeyboardInterrupt

    result = executor.run_in_process(runs, lambda _line: None, second_ctrl_c)
    assert result.signum == signal.SIGINT and len(result.left) == 4


def test_in_process_a_run_another_process_trains_is_skipped_not_failed(runs):
    said, trained = [], []

    def train_fn(run: Run) -> dict:
        trained.append(run.label)
        if run.label == "baseline seed 2":  # another process took it a moment ago
            raise RunInUse("run dir ... is in use")
        return {}

    with RunLock(runs[1].run_dir):
        result = executor.run_in_process(runs, said.append, train_fn)
    assert trained == ["baseline seed 1", "baseline seed 2", "q-identity seed 2"]
    assert result.skipped == ("q-identity seed 1", "baseline seed 2")
    assert result.finished == ("baseline seed 1", "q-identity seed 2")
    assert result.exit_code == 0 and not (runs[1].run_dir / "failed.json").exists()
    assert any(line.startswith("q-identity seed 1: trained by process") and
               line.endswith("; skipped") for line in said)


# ---- as subprocesses ----------------------------------------------------------------------
# a fake `qkvlab train`: argv = run folder, exit status, error line to print
CHILD = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    run_dir, status, error = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    def stop(signum, frame):  # like the trainer: note the signal, "checkpoint", exit
        with open(run_dir / "signals", "a") as f:
            f.write(f"{signum}\\n")
        sys.exit(128 + signum)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    (run_dir / "started").write_text("")
    if error:
        print(error, flush=True)
    if status == -15:  # killed by SIGTERM, once both groups' runs at its seed are under way
        deadline = time.monotonic() + 60  # (their handlers in place: a signal is noted)
        while (len(list(run_dir.parents[1].glob(f"*/{run_dir.name}/started"))) < 2
               and time.monotonic() < deadline):
            time.sleep(0.01)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
    if status == 99:  # trains until a signal stops it
        time.sleep(60)
    sys.exit(status)
""")


def fake_child(plan: dict[str, tuple[int, str]]):
    """command_for: each run's fake child by its label (default: exit 0)."""
    def command_for(run: Run) -> list[str]:
        status, error = plan.get(run.label, (0, ""))
        return [sys.executable, "-c", CHILD, str(run.run_dir), str(status), error]
    return command_for


def signals_seen(run: Run) -> list[str]:
    path = run.run_dir / "signals"
    return path.read_text().split() if path.exists() else []


def test_one_at_a_time_a_failed_subprocess_is_recorded_and_the_others_still_train(runs):
    said = []
    command_for = fake_child({"q-identity seed 1": (3, "")})
    result = executor.run_subprocesses(runs, said.append, command_for)
    assert result.finished == ("baseline seed 1", "baseline seed 2", "q-identity seed 2")
    name = Path(sys.executable).name
    assert result.failed == (Failure("q-identity seed 1", f"{name} exited with status 3"),)
    assert result.exit_code == 2
    assert failed_record(runs[1])["error"] == f"{name} exited with status 3"
    assert (runs[0].run_dir / "config.toml").is_file()  # what `qkvlab train RUN` reads
    assert f"[red]q-identity seed 1 failed[/]: {name} exited with status 3" in said


@pytest.mark.parametrize("jobs, threads, want", [(1, 1, "1"), (2, 3, "3"), (1, None, None)])
def test_threads_reach_every_subprocess(runs, jobs, threads, want, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(executor, "_usable_cpus", lambda: 8)
    child = "import os, sys; open(sys.argv[1] + '/omp', 'w').write(os.environ.get(" \
            "'OMP_NUM_THREADS', 'unset'))"

    def command_for(run: Run) -> list[str]:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        return [sys.executable, "-c", child, str(run.run_dir)]

    said = []
    result = executor.run_subprocesses(runs[:2], said.append, command_for, jobs=jobs,
                                       threads=threads)
    assert len(result.finished) == 2
    seen = {(r.run_dir / "omp").read_text() for r in runs[:2]}
    assert seen == {want or "unset"}  # no --threads, one at a time: the child's own default
    if want:
        assert f"{jobs} at a time on {want} thread(s) each" in said[0]


def test_threads_bound_a_run_in_this_process_and_are_restored_after(runs):
    import torch

    before, seen = torch.get_num_threads(), []

    def train_fn(run: Run) -> dict:
        seen.append(torch.get_num_threads())
        return {"interrupted": False, "final_val_loss": 1.5}

    want = 1 if before > 1 else 2
    executor.run_in_process(runs[:2], lambda _line: None, train_fn, threads=want)
    assert seen == [want, want] and torch.get_num_threads() == before


def test_n_at_once_a_failure_keeps_the_error_line_of_its_log(runs):
    log = runs[0].run_dir / "train.log"
    log.parent.mkdir(parents=True)
    log.write_text("qkvlab train: error: an earlier session's error\n")
    command_for = fake_child({
        "baseline seed 1": (5, ""),
        "q-identity seed 1": (2, "qkvlab train: error: training diverged: non-finite loss"),
    })
    result = executor.run_subprocesses(runs, lambda _line: None, command_for, jobs=2)
    assert result.finished == ("baseline seed 2", "q-identity seed 2")
    assert result.failed == (
        Failure("baseline seed 1", f"exited with status 5; see {log}"),  # not the old line
        Failure("q-identity seed 1", "training diverged: non-finite loss; see "
                f"{runs[1].run_dir / 'train.log'}"))
    assert failed_record(runs[1])["diverged"] is True
    assert failed_record(runs[0])["diverged"] is False


def test_n_at_once_a_run_stopped_by_its_own_signal_stops_the_sweep(runs):
    """One child killed by SIGTERM: the other running one gets SIGTERM once and the runs not
    begun never start (the executor does not wait for a queue that no longer moves)."""
    command_for = fake_child({"baseline seed 1": (99, ""), "q-identity seed 1": (-15, "")})
    start = time.monotonic()
    result = executor.run_subprocesses(runs, lambda _line: None, command_for, jobs=2)
    assert time.monotonic() - start < 30
    assert signals_seen(runs[0]) == [str(int(signal.SIGTERM))]
    assert (result.signum, result.exit_code) == (signal.SIGTERM, 143)
    assert result.left == tuple(r.label for r in runs) and result.failed == ()
    assert not (runs[2].run_dir / "started").exists()
    assert not (runs[2].run_dir / "config.toml").exists()


# ---- a signal to the executor's process, in each way ---------------------------------------
DRIVER = textwrap.dedent("""
    import json, signal, sys, time
    from pathlib import Path
    from qkvlab.experiments import executor
    from qkvlab.experiments.spec import load_spec
    mode, spec, out, child = sys.argv[1:5]
    runs = load_spec(spec).runs(Path(out))

    def train_fn(run):  # like the trainer: its own handler, a checkpoint, an early return
        got, old = [], {}
        run.run_dir.mkdir(parents=True, exist_ok=True)
        if mode == "in-process":
            old = {s: signal.signal(s, lambda n, f: got.append(n)) for s in (2, 15)}
        (run.run_dir / "started").write_text("")
        while not got:  # "setup" (no handler of its own): the executor interrupts it
            time.sleep(0.05)
        with open(run.run_dir / "signals", "a") as f:
            f.write(f"{got[0]}\\n")
        for s, h in old.items():
            signal.signal(s, h)
        return {"interrupted": True, "signal": got[0]}

    def command_for(run):
        return [sys.executable, "-c", child, str(run.run_dir), "99", ""]

    if mode in ("in-process", "in-setup"):
        result = executor.run_in_process(runs, print, train_fn)
    else:
        result = executor.run_subprocesses(runs, print, command_for, jobs=int(mode))
    print(json.dumps({"signum": result.signum, "left": result.left,
                      "finished": result.finished,
                      "failed": [f.__dict__ for f in result.failed]}))
    sys.exit(result.exit_code)
""")


def wait_for(paths: list[Path], proc: subprocess.Popen, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the runs did not start"
        time.sleep(0.05)


@pytest.mark.parametrize("mode, running", [("in-process", 1), ("in-setup", 1), ("1", 1),
                                           ("2", 2)])
@pytest.mark.parametrize("signum", [signal.SIGINT,
                                    pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_a_signal_to_the_executor_stops_every_way_alike(runs, tmp_path, mode, running, signum):
    """As a Ctrl-C at the terminal: the signal goes to the executor's process group; each
    running run gets it exactly once, nothing further starts, the exit status is 128 + n."""
    spec = tmp_path / "spec" / "fake.toml"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, mode, str(spec), str(tmp_path / "sweep"),
                             CHILD], stdout=subprocess.PIPE, text=True, process_group=0)
    try:
        wait_for([r.run_dir / "started" for r in runs[:running]], proc)
        os.killpg(proc.pid, signum)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, out
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"signum": signum, "left": [r.label for r in runs], "finished": [],
                   "failed": []}
    expected = [] if mode == "in-setup" else [str(int(signum))]
    assert [signals_seen(r) for r in runs[:running]] == [expected] * running
    assert not any((r.run_dir / "started").exists() for r in runs[running:])


# ---- `qkvlab sweep`, stopped by Ctrl-C -----------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("how", [[], ["--launcher", shlex.quote(sys.executable)],
                                 ["--jobs", "2"]])
def test_ctrl_c_stops_a_real_sweep_with_130_and_the_resume_command(data_dir, tmp_path, how):
    spec = write_spec(tmp_path / "spec", data_dir, "train.max_steps=100000",
                      "train.ckpt_interval=100000", "train.eval_interval=1000")
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "qkvlab", "sweep", str(spec), "--out", str(out), "--seeds", "1",
           *how]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            process_group=0)
    groups = ["baseline", "q-identity"][:2 if "--jobs" in how else 1]
    try:
        wait_for([out / g / "seed-1" / "metrics.jsonl" for g in groups], proc, seconds=120)
        time.sleep(1.0)  # a few steps in
        os.killpg(proc.pid, signal.SIGINT)
        text, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, text
    assert "stopped by signal 2 with 2 run(s) left; run the same command to resume: " \
           f"qkvlab sweep {spec} --out {out} --seeds 1" in " ".join(text.split())
    for g in groups:  # each running run checkpointed where it stopped
        assert list((out / g / "seed-1").glob("ckpt-*")), g
        summary = json.loads((out / g / "seed-1" / "summary.json").read_text())
        assert summary["interrupted"] and summary["signal"] == signal.SIGINT
    if len(groups) == 1:  # one at a time: the second run never started
        assert not (out / "q-identity" / "seed-1" / "metrics.jsonl").exists()
