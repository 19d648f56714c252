"""Train a sweep's pending runs: one executor, one policy for signals and failures.

A sweep trains its runs in one of three ways, all through `execute`:

- one after another in this process, `train(cfg, resume=True)` (the default);
- one after another as subprocesses `LAUNCHER -m qkvlab train RUN --resume` (`--launcher`,
  e.g. torchrun), their output on the terminal;
- N at a time as subprocesses `python -m qkvlab train RUN --resume` (`--jobs N`), the usable
  cores split between them (`OMP_NUM_THREADS`) and each run's output in its folder's train.log.

`--threads T` gives every run T threads in any of the three ways (else: a run in this process
or through a launcher takes every core, as torch does; N at once split the usable cores): a run
on one lane beside other work then takes its share and no more, so its measured time means
what the same run's time means under `--jobs`.

Whichever way, one policy:

- Just before it starts, each run is checked again: one that another live process trains (its
  folder's lock) or that has finished meanwhile is skipped, not failed; so is a run that fails
  because another process took its folder a moment ago.
- A run fails when it raises (in this process) or exits non-zero (a subprocess) without a
  signal having stopped it. Its one-line error (`qkvlab train`'s own error line when the output
  is in train.log) goes to its failed.json, where "diverged" in it marks a divergence, and is
  printed at once; the remaining runs still train, and the result lists every failure with its
  error (the command then exits 2).
- SIGINT (Ctrl-C) and SIGTERM stop the sweep: no further run starts, the signal is passed once
  to the runs that train (each checkpoints and exits, as a single `qkvlab train` does; a second
  Ctrl-C aborts it without that checkpoint), the executor waits for them, and the result names
  the signal and the runs left (the command then exits 128 + the signal with the command that
  resumes). A run stopped by a signal of its own stops the sweep the same way. Subprocesses
  get their own process group, so a Ctrl-C at the terminal reaches them once, through the
  executor, just as a `kill -INT` of the sweep does.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from rich.markup import escape

from qkvlab.errors import QkvlabError, require
from qkvlab.experiments.spec import Run
from qkvlab.experiments.sweep import (
    claimed_elsewhere,
    materialize,
    record_failure,
    run_state,
    train_command_for,
)
from qkvlab.run.layout import FAILED_FILE, SUMMARY_FILE
from qkvlab.run.lock import RunInUse
from qkvlab.run.records import is_finished, read_json_record

LOG_FILE = "train.log"  # a run's output under --jobs N > 1
POLL_S = 0.2  # how often the executor looks at its subprocesses
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# exit statuses of a subprocess stopped by a signal (128 + n from its handler, -n killed by it)
SIGNAL_EXITS = {**{128 + s: int(s) for s in STOP_SIGNALS}, **{-s: int(s) for s in STOP_SIGNALS}}
ERROR_LINE = re.compile(r"^qkvlab [\w-]+: error: (.+)$", re.MULTILINE)  # cli.main's one line

Say = Callable[[str], None]  # prints one line of rich markup
TrainFn = Callable[[Run], dict[str, Any]]  # trains a run in this process, returns its summary
CommandFn = Callable[[Run], list[str]]  # the subprocess that trains a run


@dataclass(frozen=True)
class Failure:
    """A run that failed, and why."""

    run: str  # the run's label, e.g. "baseline seed 1"
    error: str  # one line, also in the run's failed.json


@dataclass(frozen=True)
class SweepResult:
    """What became of the runs given to the executor, each named by its label, in their
    order."""

    finished: tuple[str, ...]
    failed: tuple[Failure, ...]
    skipped: tuple[str, ...]  # another process trains them, or finished them meanwhile
    left: tuple[str, ...]  # not finished because a signal stopped the sweep (begun or not)
    signum: int | None  # the signal that stopped the sweep, or None

    @property
    def exit_code(self) -> int:
        """128 + the signal when one stopped the sweep (130 for Ctrl-C), else 2 when runs
        failed, else 0."""
        if self.signum is not None:
            return 128 + self.signum
        return 2 if self.failed else 0


def check_mode(jobs: int, launcher: str | None, threads: int | None = None) -> None:
    require(jobs >= 1, f"--jobs {jobs}: give at least 1 run at a time")
    require(threads is None or threads >= 1, f"--threads {threads}: give at least 1 thread "
            "a run")
    require(jobs == 1 or not launcher, "--jobs and --launcher do not go together: a launcher "
            "decides the processes itself; drop one of them")


def execute(runs: Sequence[Run], say: Say, *, jobs: int = 1, launcher: str | None = None,
            threads: int | None = None) -> SweepResult:
    """Train `runs` in the way the options choose (see the module docstring)."""
    check_mode(jobs, launcher, threads)
    if jobs > 1:
        return run_subprocesses(runs, say, qkvlab_train_command, jobs=jobs, threads=threads)
    if launcher:
        _check_launcher(launcher)
        return run_subprocesses(runs, say, lambda run: train_command_for(run, launcher),
                                threads=threads)
    return run_in_process(runs, say, threads=threads)


def run_in_process(runs: Sequence[Run], say: Say, train_fn: TrainFn | None = None,
                   threads: int | None = None) -> SweepResult:
    """Train `runs` one after another in this process with `train_fn` (qkvlab's trainer), on
    `threads` threads if given (torch's intra-op pool, restored after)."""
    fn = train_fn or _train
    if threads is None:
        return _Executor(runs, 1, lambda run: _InProcess(run, fn), say).run()
    import torch  # deferred: dry runs and subprocess sweeps never load it

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    say(f"{len(runs)} run(s), one at a time on {threads} thread(s)")
    try:
        return _Executor(runs, 1, lambda run: _InProcess(run, fn), say).run()
    finally:
        torch.set_num_threads(before)


def run_subprocesses(runs: Sequence[Run], say: Say, command_for: CommandFn,
                     jobs: int = 1, threads: int | None = None) -> SweepResult:
    """Train `runs` as subprocesses `command_for(run)`, `jobs` at a time, each on `threads`
    threads if given; with more than one at a time, the usable cores are split between them
    (unless `threads` says otherwise) and each run's output goes to its train.log."""
    env, log = None, jobs > 1
    if jobs > 1 or threads is not None:
        each = str(threads or max(1, _usable_cpus() // jobs))
        env = {**os.environ, "OMP_NUM_THREADS": each, "MKL_NUM_THREADS": each}
        where = f"; each run's output in its folder's {LOG_FILE}" if log else ""
        say(f"{len(runs)} run(s), {jobs} at a time on {each} thread(s) each{where}")
    return _Executor(runs, jobs, lambda run: _Subprocess(run, command_for(run), env, log),
                     say).run()


def _check_launcher(launcher: str) -> None:
    try:
        program = shlex.split(launcher)[0]
    except (ValueError, IndexError):
        raise QkvlabError(f"--launcher {launcher!r}: give a command line, e.g. "
                          "'torchrun --standalone --nproc-per-node=8'") from None
    require(shutil.which(program) is not None,
            f"--launcher {launcher!r}: {program} is not a program on PATH")


def qkvlab_train_command(run: Run) -> list[str]:
    """`python -m qkvlab train RUN --resume` with this interpreter."""
    return [sys.executable, "-m", "qkvlab", "train", str(run.run_dir.resolve()), "--resume"]


def _train(run: Run) -> dict[str, Any]:
    from qkvlab.train import train  # deferred: dry runs and subprocess sweeps never need it

    return train(run.config, resume=True)


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# ---- one run's outcome ----------------------------------------------------------------------
@dataclass(frozen=True)
class _Outcome:
    status: str  # done | failed | skipped | stopped
    note: str = ""  # done: the final val loss; failed: the error; skipped: why
    signum: int | None = None  # stopped: the signal


def _ended(summary: dict[str, Any] | None) -> _Outcome:
    """A run that returned (or exited 0), judged by its summary: stopped by a signal, or done."""
    summary = summary or {}
    if summary.get("interrupted"):
        return _Outcome("stopped", signum=int(summary.get("signal") or signal.SIGINT))
    loss = summary.get("final_val_loss")
    return _Outcome("done", f"val loss {loss:.4f}" if isinstance(loss, float) else "")


def _stopped(run: Run, signum: int) -> _Outcome:
    """A run a signal stopped, unless the signal came as it finished."""
    summary = read_json_record(run.run_dir / SUMMARY_FILE)
    if is_finished(summary, run.config.steps):
        return _ended(summary)
    return _Outcome("stopped", signum=signum)


class _Interrupted(BaseException):
    """A signal reached this process while a run set up or wrote its summary (the training
    loop catches its own); BaseException, like KeyboardInterrupt, so no `except Exception`
    swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


# ---- the ways to train a run ------------------------------------------------------------------
class _Job(Protocol):
    run: Run

    def begin(self) -> None: ...

    def poll(self) -> _Outcome | None: ...

    def stop(self, signum: int) -> None:
        """Pass `signum` on to the run (called from the signal handler, too)."""


class _InProcess:
    """A run trained in this process: begin() returns when it has ended."""

    def __init__(self, run: Run, train_fn: TrainFn):
        self.run, self.train_fn = run, train_fn
        self.training = False
        self.early: int | None = None  # a signal that came before training began
        self.outcome: _Outcome | None = None

    def begin(self) -> None:
        try:
            self.training = True
            try:
                if self.early is not None:
                    raise _Interrupted(self.early)
                summary = self.train_fn(self.run)
            finally:
                self.training = False
            self.outcome = _ended(summary)
        except _Interrupted as exc:
            self.outcome = _stopped(self.run, exc.signum)
        except KeyboardInterrupt:  # a second Ctrl-C inside the training loop
            self.outcome = _stopped(self.run, signal.SIGINT)
        except RunInUse as exc:  # another process took the folder a moment ago
            self.outcome = _Outcome("skipped", str(exc))
        except QkvlabError as exc:
            self.outcome = _Outcome("failed", " ".join(str(exc).splitlines()))
        except Exception as exc:  # a bug, not the run's config: keep its traceback
            traceback.print_exc()
            self.outcome = _Outcome("failed", " ".join(f"{type(exc).__name__}: {exc}".split()))

    def poll(self) -> _Outcome | None:
        return self.outcome

    def stop(self, signum: int) -> None:
        if self.training:  # while the loop trains, its own handler has the signal instead
            raise _Interrupted(signum)
        self.early = signum


class _Subprocess:
    """A run trained by a subprocess in its own process group."""

    def __init__(self, run: Run, command: list[str], env: dict[str, str] | None, log: bool):
        self.run, self.command, self.env = run, command, env
        self.log_path = run.run_dir / LOG_FILE if log else None
        self.log: IO[bytes] | None = None
        self.log_start = 0  # where this session's output begins in train.log
        self.proc: subprocess.Popen | None = None
        self.early: int | None = None  # a signal that came before the process existed
        self.sent: int | None = None  # the signal passed on to it

    def begin(self) -> None:
        materialize(self.run)  # config.toml, which `qkvlab train RUN_DIR --resume` reads
        if self.log_path is not None:
            self.log = open(self.log_path, "ab")  # noqa: SIM115 - closed when it ends
            self.log_start = self.log.seek(0, os.SEEK_END)
        proc = subprocess.Popen(self.command, stdout=self.log, env=self.env,
                                stderr=subprocess.STDOUT if self.log else None, process_group=0)
        self.proc = proc
        if self.early is not None:
            self.stop(self.early)

    def poll(self) -> _Outcome | None:
        rc = self.proc.poll() if self.proc is not None else None
        if rc is None:
            return None
        if self.log is not None:
            self.log.close()
        if rc == 0:
            return _ended(read_json_record(self.run.run_dir / SUMMARY_FILE))
        # a launcher that passed the signal on may exit with a status of its own
        signum = SIGNAL_EXITS.get(rc, self.sent)
        if signum is not None:
            return _stopped(self.run, signum)
        return _Outcome("failed", self._error(rc))

    def stop(self, signum: int) -> None:
        if self.proc is None:
            self.early = signum
        elif self.proc.returncode is None:
            self.sent = signum
            self.proc.send_signal(signum)

    def _error(self, rc: int) -> str:
        if self.log_path is None:
            return f"{Path(self.command[0]).name} exited with status {rc}"
        found = ERROR_LINE.findall(_tail(self.log_path, self.log_start))
        return f"{found[-1] if found else f'exited with status {rc}'}; see {self.log_path}"


def _tail(path: Path, start: int, size: int = 65536) -> str:
    """The last `size` bytes of `path` after `start`, as text."""
    with open(path, "rb") as f:
        f.seek(max(start, f.seek(0, os.SEEK_END) - size))
        return f.read().decode("utf-8", errors="replace")


# ---- the executor ---------------------------------------------------------------------------
class _Executor:
    """Start runs while slots are free and no signal came, collect the ones that end."""

    def __init__(self, runs: Sequence[Run], slots: int, make: Callable[[Run], _Job], say: Say):
        self.runs, self.slots, self.make, self.say = list(runs), slots, make, say
        self.running: list[_Job] = []
        self.outcomes: dict[Path, _Outcome] = {}
        self.signum: int | None = None

    def run(self) -> SweepResult:
        queue = list(enumerate(self.runs, 1))
        # every signal is passed on: a second Ctrl-C aborts the runs, as it aborts one run
        with _signals_to(lambda signum, frame: self._stop(signum)):
            while queue or self.running:
                while queue and len(self.running) < self.slots and self.signum is None:
                    self._start(*queue.pop(0))
                if self.signum is not None and not self.running:
                    break
                if not self._collect():
                    time.sleep(POLL_S)
        return self._result()

    def _stop(self, signum: int) -> None:
        """No further run starts; the running ones get the signal (again, for a second one)."""
        if self.signum is None:
            self.signum = int(signum)
        for job in list(self.running):
            job.stop(signum)

    def _start(self, i: int, run: Run) -> None:
        why = claimed_elsewhere(run)
        if why:
            self._record(run, _Outcome("skipped", why))
            return
        state = run_state(run)
        resume = f", resuming at step {state.step}" if state.status == "partial" else ""
        what = run.group.description or run.group.variant
        self.say(f"[bold][{i}/{len(self.runs)}] started {escape(run.label)}[/] "
                 f"({escape(what)}{resume}) -> {escape(str(run.run_dir))}")
        (run.run_dir / FAILED_FILE).unlink(missing_ok=True)
        job = self.make(run)
        self.running.append(job)  # first, so a signal from now on reaches it
        job.begin()

    def _collect(self) -> bool:
        """Record the runs that ended; whether any did."""
        ended = [(job, outcome) for job in self.running if (outcome := job.poll()) is not None]
        for job, outcome in ended:
            self.running.remove(job)
            self._record(job.run, outcome)
        return bool(ended)

    def _record(self, run: Run, outcome: _Outcome) -> None:
        if outcome.status == "failed":
            why = claimed_elsewhere(run)
            if why:
                outcome = _Outcome("skipped", why)
            else:
                record_failure(run, outcome.note)
                self.say(f"[red]{escape(run.label)} failed[/]: {escape(outcome.note)}")
        if outcome.status == "skipped":
            self.say(f"{escape(run.label)}: {escape(outcome.note)}; skipped")
        elif outcome.status == "done":
            self.say(f"finished {escape(run.label)}" + (f": {outcome.note}" if outcome.note
                                                        else ""))
        elif outcome.status == "stopped" and self.signum is None:
            self._stop(outcome.signum or signal.SIGINT)  # its own signal: the others get it once
        self.outcomes[run.run_dir] = outcome

    def _result(self) -> SweepResult:
        def labels(status: str) -> tuple[str, ...]:
            return tuple(r.label for r in self.runs
                         if self.outcomes.get(r.run_dir, _Outcome("stopped")).status == status)

        failed = tuple(Failure(r.label, o.note) for r in self.runs
                       if (o := self.outcomes.get(r.run_dir)) and o.status == "failed")
        return SweepResult(labels("done"), failed, labels("skipped"), labels("stopped"),
                           self.signum)


@contextmanager
def _signals_to(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """SIGINT and SIGTERM call `handler` (Python lets only the main thread set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
