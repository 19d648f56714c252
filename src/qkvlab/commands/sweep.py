"""`qkvlab sweep`: train an experiment spec (variants x seeds) run by run, resumably.

The steps, in order: resolve the spec into runs and check everything that exists already
(`_resolve`), then either describe the plan (`--dry-run`), or record this invocation and copy
reusable runs (`_start`) and print one command per pending run (`--print-commands`) or train
them (`_train`: one after another, through a launcher, or `--jobs N` at once), then report
(`_finish`). The machinery lives in qkvlab.experiments.sweep.
"""

from __future__ import annotations

import shlex
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkvlab.commands.common import Subparsers, add_overrides, register
from qkvlab.console import print_table
from qkvlab.errors import QkvlabError
from qkvlab.run.lock import RunInUse

if TYPE_CHECKING:
    from rich.console import Console

    from qkvlab.experiments.spec import Run, Spec
    from qkvlab.experiments.sweep import RunState


@dataclass
class SweepOptions:
    spec: str | None = None
    out: str | None = None
    dry_run: bool = False
    print_commands: bool = False
    launcher: str | None = None
    only: list[str] | None = None
    seeds: str | None = None
    yes: bool = False
    retry_failed: bool = False
    reuse: list[str] | None = None
    jobs: int = 1
    overrides: list[str] = field(default_factory=list)

    def validate(self) -> None:
        """Checked once a spec is given (without one the command only lists the specs)."""
        if self.jobs < 1:
            raise QkvlabError(f"--jobs {self.jobs}: give at least 1 run at a time")

    def command_line(self, out: Path) -> str:
        """The canonical command line of this invocation (for the record and the report)."""
        parts = ["qkvlab", "sweep", str(self.spec), "--out", str(out)]
        for name in self.only or []:
            parts += ["--only", name]
        if self.seeds:
            parts += ["--seeds", self.seeds]
        for item in self.overrides:
            parts += ["--set", item]
        if self.launcher:
            parts += ["--launcher", self.launcher]
        for src in self.reuse or []:
            parts += ["--reuse", src]
        if self.jobs > 1:
            parts += ["--jobs", str(self.jobs)]
        return shlex.join(parts)


@dataclass
class _Sweep:
    """One invocation's runs, resolved and checked before anything is trained."""

    spec: Spec
    out: Path
    runs: list[Run]
    states: dict[Path, RunState]
    record: dict[str, Any]
    reusable: dict[Path, Path]  # run folder -> the finished run of another sweep to copy
    todo: list[Run]
    console: Console


def run_sweep(opts: SweepOptions) -> int:
    if not opts.spec:
        return _list_specs()
    opts.validate()
    sw = _resolve(opts)
    if opts.dry_run:
        return _dry_run(sw)
    _start(sw, opts)
    if opts.print_commands:
        return _print_commands(sw, opts.launcher)
    from qkvlab.experiments.sweep import progress_table

    print_table(progress_table(sw.spec, sw.runs, sw.states,
                               f"sweep {sw.spec.name} in {sw.out}: before"), sw.console)
    stopped, failures = _train(sw, opts)
    return _finish(sw, opts, stopped, failures)


# ---- the steps -----------------------------------------------------------------------------
def _list_specs() -> int:
    from qkvlab.experiments.spec import spec_names, spec_summary

    names = spec_names()
    width = max(len(n) for n in names)
    print("shipped specs (qkvlab sweep NAME --dry-run shows the runs):")
    for name in names:
        print(f"  {name:<{width}}  {spec_summary(name)}")
    return 0


def _parse_seeds(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise QkvlabError(f"--seeds {text!r}: give comma-separated integers, e.g. 1,2,3") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise QkvlabError(f"--seeds {text!r}: give distinct integers >= 0, e.g. 1,2,3")
    return seeds


def _parse_only(items: list[str] | None) -> list[str] | None:
    names = [n.strip() for item in items or [] for n in item.split(",") if n.strip()]
    return names or None


def _console(stderr: bool) -> Console:
    from rich.console import Console

    from qkvlab.console import LOG_WIDTH

    console = Console(stderr=stderr)
    if not console.is_terminal:
        console.width = LOG_WIDTH
    return console


def _resolve(opts: SweepOptions) -> _Sweep:
    """The spec's runs in their folder, with every check that needs no training done."""
    from qkvlab.experiments import sweep as lib
    from qkvlab.experiments.spec import load_spec

    spec = load_spec(opts.spec)
    out = Path(opts.out) if opts.out else spec.default_out
    groups = spec.groups(list(opts.overrides))
    runs = spec.runs(out, seeds=_parse_seeds(opts.seeds), only=_parse_only(opts.only),
                     groups=groups)
    # with --print-commands stdout carries only the commands
    console = _console(stderr=opts.print_commands)
    record = lib.check_sweep_dir(out, spec, groups)
    lib.check_run_dirs(runs)
    states = {r.run_dir: lib.run_state(r) for r in runs}
    reusable = lib.find_reusable(runs, states, opts.reuse or [])
    todo = [r for r in runs if states[r.run_dir].status in ("pending", "partial")
            or (opts.retry_failed and states[r.run_dir].status == "failed")]
    return _Sweep(spec, out, runs, states, record, reusable, todo, console)


def _dry_run(sw: _Sweep) -> int:
    """Describe the runs, their state and the work left; train nothing."""
    from qkvlab.experiments import sweep as lib

    console, runs, states = sw.console, sw.runs, sw.states
    notes = lib.preflight_data(runs, prepare=False, say=console.print)
    print_table(lib.plan_table(sw.spec, runs, states), console)
    tokens, flops = lib.remaining_work(runs, states)
    done = sum(states[r.run_dir].status == "done" for r in runs)
    failed = sum(states[r.run_dir].status == "failed" for r in runs)
    console.print(f"{len(runs)} runs in {sw.out}: {done} done, {failed} failed, "
                  f"{len(sw.todo)} to run ({tokens:,} tokens, {flops / 1e15:.3g} PFLOP left)")
    speed = lib.finished_speed(runs, states)
    if speed and flops:
        console.print(f"at the speed of the finished runs ({speed / 1e9:.3g} GFLOP/s): "
                      f"about {flops / speed / 3600:.2g} hours")
    for note in notes:
        console.print(note)
    if sw.reusable:
        console.print(f"{len(sw.reusable)} of them would be copied from --reuse, not trained")
    if len(sw.todo) > lib.MAX_RUNS_WITHOUT_YES:
        console.print(f"running them needs --yes (more than {lib.MAX_RUNS_WITHOUT_YES} runs)")
    return 0


def _start(sw: _Sweep, opts: SweepOptions) -> None:
    """Prepare the data, record this invocation in sweep.json, copy the reusable runs."""
    from qkvlab.experiments import sweep as lib

    if len(sw.todo) > lib.MAX_RUNS_WITHOUT_YES and not opts.yes:
        raise QkvlabError(f"spec {sw.spec.name} would launch {len(sw.todo):,} runs (more than "
                          f"{lib.MAX_RUNS_WITHOUT_YES}): check them with --dry-run, narrow them "
                          "with --only/--seeds, or pass --yes")
    lib.preflight_data(sw.runs, prepare=True, say=sw.console.print)
    sw.record.setdefault("sessions", []).append({
        "command": opts.command_line(sw.out), "cwd": str(Path.cwd()), "started": lib.now_iso(),
        "mode": "print-commands" if opts.print_commands else "run",
        "machine": lib.machine_info(),
    })
    sw.record["sessions"] = sw.record["sessions"][-lib.MAX_SESSIONS:]
    lib.write_sweep_record(sw.out, sw.record, sw.spec)
    for run in sw.todo:
        if run.run_dir in sw.reusable:
            lib.copy_finished_run(run, sw.reusable[run.run_dir])
            sw.states[run.run_dir] = lib.run_state(run)
            sw.console.print(f"{run.label}: copied the finished run {sw.reusable[run.run_dir]}")
    sw.todo = [r for r in sw.todo if r.run_dir not in sw.reusable]
    for run in sw.runs:  # another sweep sharing this folder, or a plain `qkvlab train`
        if sw.states[run.run_dir].status == "running":
            sw.console.print(f"{run.label}: trained by {sw.states[run.run_dir].note} now; "
                             "skipped")


def _print_commands(sw: _Sweep, launcher: str | None) -> int:
    """One self-contained command per pending run, for a scheduler."""
    from qkvlab.experiments.sweep import materialize, train_command_for

    cwd = shlex.quote(str(Path.cwd()))
    for run in sw.todo:
        materialize(run)
        print(f"cd {cwd} && {shlex.join(train_command_for(run, launcher))}")
    sw.console.print(f"{len(sw.todo)} command(s) for spec {sw.spec.name}; then: qkvlab report "
                     f"{sw.out}")
    return 0


def _train(sw: _Sweep, opts: SweepOptions) -> tuple[int | None, list[Run]]:
    """Train the pending runs; returns (the signal that stopped them or None, the runs that
    failed)."""
    if opts.jobs > 1 and opts.launcher:
        raise QkvlabError("--jobs and --launcher do not go together: a launcher decides the "
                          "processes itself; drop one of them")
    if opts.jobs > 1:
        from qkvlab.experiments.sweep import run_parallel

        return run_parallel(sw.todo, opts.jobs, sw.console)
    from qkvlab.experiments.sweep import FAILED_FILE, claimed_elsewhere, run_state

    stopped, failures = None, []
    for i, run in enumerate(sw.todo):
        why = claimed_elsewhere(run)
        if why:
            sw.console.print(f"{run.label}: {why}; skipped")
            continue
        state = sw.states[run.run_dir]
        resume = f", resuming at step {state.step}" if state.status == "partial" else ""
        what = run.group.description or run.group.variant
        sw.console.print(f"[bold][{i + 1}/{len(sw.todo)}] {run.label}[/] ({what}{resume}) -> "
                         f"{run.run_dir}")
        (run.run_dir / FAILED_FILE).unlink(missing_ok=True)
        outcome, signum = _train_one(run, opts.launcher, sw.console)
        if outcome == "stopped":
            stopped = signum
            break
        if outcome == "failed":
            failures.append(run)
            continue
        sw.states[run.run_dir] = run_state(run)
    return stopped, failures


def _train_one(run: Run, launcher: str | None, console: Console) -> tuple[str, int | None]:
    """Train one run in this process or through `launcher`: ("done" | "failed" (recorded in
    the run's failed.json) | "skipped" (another process trains it) | "stopped", the signal
    that stopped it)."""
    from qkvlab.experiments.sweep import (
        SIGNAL_EXITS,
        materialize,
        record_failure,
        train_command_for,
    )

    if launcher:
        import subprocess

        materialize(run)
        rc = subprocess.run(train_command_for(run, launcher)).returncode
        if rc in SIGNAL_EXITS:  # interrupted: stop the sweep, like a single run
            return "stopped", SIGNAL_EXITS[rc]
        if rc != 0:
            record_failure(run, f"{launcher} exited with status {rc}")
            return "failed", None
        return "done", None
    from qkvlab.train import train

    try:
        summary = train(run.config, resume=True)
    except RunInUse as exc:  # another process took it a moment ago: not this run's failure
        console.print(f"{run.label}: {exc}; skipped")
        return "skipped", None
    except QkvlabError as exc:
        record_failure(run, str(exc))
        console.print(f"[red]{run.label} failed[/]: {exc}")
        return "failed", None
    if summary.get("interrupted"):
        return "stopped", int(summary.get("signal") or signal.SIGINT)
    return "done", None


def _finish(sw: _Sweep, opts: SweepOptions, stopped: int | None, failures: list[Run]) -> int:
    """Print where the sweep stands; 128 + the signal when one stopped it (130 for Ctrl-C),
    2 when runs failed."""
    from qkvlab.experiments.sweep import progress_table, run_state

    states = {r.run_dir: run_state(r) for r in sw.runs}
    console = sw.console
    print_table(progress_table(sw.spec, sw.runs, states,
                               f"sweep {sw.spec.name} in {sw.out}: now"), sw.console)
    if stopped is not None:
        console.print(f"stopped by signal {stopped}; run the same command to resume: "
                      f"{opts.command_line(sw.out)}", soft_wrap=True)
        return 128 + stopped
    if failures:
        console.print(f"{len(failures)} run(s) failed (failed.json in their folders); they are "
                      "skipped on the next sweep unless you pass --retry-failed")
        return 2
    left = sum(states[r.run_dir].status != "done" for r in sw.runs)
    if left == 0:
        console.print(f"all {len(sw.runs)} runs done; report: qkvlab report {sw.out}")
    return 0


# ---- registration --------------------------------------------------------------------------
def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("sweep", help="train an experiment spec: variants x seeds, resumable")
    p.add_argument("spec", nargs="?", default=None,
                   help="shipped spec name, spec TOML file, or a sweep folder to continue; "
                        "without it, list the shipped specs")
    p.add_argument("--out", default=None, help="sweep folder (default runs/sweeps/SPEC)")
    p.add_argument("--dry-run", action="store_true",
                   help="list the runs, their state, parameter counts and tokens; train nothing")
    p.add_argument("--print-commands", action="store_true",
                   help="print one self-contained command per pending run (for a scheduler)")
    p.add_argument("--launcher", default=None,
                   help="start each run as LAUNCHER -m qkvlab train RUN --resume, e.g. "
                        "'torchrun --standalone --nproc-per-node=8'")
    p.add_argument("--only", action="append", default=None, metavar="VARIANT",
                   help="only these groups, variants or families (a family name takes all "
                        "its variants; repeatable or comma-separated)")
    p.add_argument("--seeds", default=None, help="comma-separated seeds instead of the spec's")
    p.add_argument("--yes", action="store_true", help="allow launching more than 100 runs")
    p.add_argument("--retry-failed", action="store_true", help="retrain runs that failed before")
    p.add_argument("--reuse", action="append", default=None, metavar="SWEEP_DIR",
                   help="copy finished runs with the same config and seed from this other "
                        "sweep folder instead of training them (repeatable)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="train N runs at once, the cores split between them (default 1)")
    add_overrides(p)
    register(p, SweepOptions, run_sweep)
