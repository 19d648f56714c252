"""`qkvlab sweep`: train an experiment spec (variants x seeds) run by run, resumably.

The steps, in order: resolve the spec into runs and check everything that exists already
(`_resolve`), then either describe the plan (`--dry-run`), or record this invocation and copy
reusable runs (`_start`) and print one command per pending run (`--print-commands`) or train
them (qkvlab.experiments.executor: one after another, through a launcher, or `--jobs N` at
once, with one policy for signals and failures), then report (`_finish`). The machinery lives
in qkvlab.experiments.sweep.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkvlab import interrupts
from qkvlab.commands.common import Subparsers, add_overrides, register
from qkvlab.console import print_table
from qkvlab.errors import QkvlabError
from qkvlab.fsutil import portable_command

if TYPE_CHECKING:
    from rich.console import Console

    from qkvlab.experiments.executor import SweepResult
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
    threads: int | None = None
    overrides: list[str] = field(default_factory=list)

    def validate(self) -> None:
        """Checked once a spec is given (without one the command only lists the specs)."""
        from qkvlab.experiments.executor import check_mode

        check_mode(self.jobs, self.launcher, self.threads)

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
        if self.threads is not None:
            parts += ["--threads", str(self.threads)]
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
    interrupts.arm(None if opts.dry_run else opts.command_line(sw.out))
    if opts.dry_run:
        return _dry_run(sw)
    _start(sw, opts)
    if opts.print_commands:
        return _print_commands(sw, opts.launcher)
    from qkvlab.experiments.sweep import progress_table

    print_table(progress_table(sw.spec, sw.runs, sw.states,
                               f"sweep {sw.spec.name} in {sw.out}: before"), sw.console)
    from qkvlab.experiments.executor import execute

    result = execute(sw.todo, sw.console.print, jobs=opts.jobs, launcher=opts.launcher,
                     threads=opts.threads)
    return _finish(sw, opts, result)


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
    from qkvlab.run.config import SEED_RANGE, valid_seed

    if not text:
        return None
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise QkvlabError(f"--seeds {text!r}: give comma-separated integers, e.g. 1,2,3") from None
    if not seeds or not all(valid_seed(s) for s in seeds) or len(set(seeds)) != len(seeds):
        raise QkvlabError(f"--seeds {text!r}: give distinct integers in {SEED_RANGE}, e.g. "
                          "1,2,3")
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

    # the folder's copy of the spec records the overrides: report and resume need none
    spec = load_spec(opts.spec).with_overrides(list(opts.overrides))
    out = Path(opts.out) if opts.out else spec.default_out
    groups = spec.groups()
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
        "command": portable_command(opts.command_line(sw.out)), "started": lib.now_iso(),
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


def _finish(sw: _Sweep, opts: SweepOptions, result: SweepResult) -> int:
    """Print where the sweep stands, each failure with its error, and how to resume; the
    result's exit code (128 + the signal that stopped it, 2 when runs failed)."""
    from rich.markup import escape

    from qkvlab.experiments.sweep import progress_table, run_state

    states = {r.run_dir: run_state(r) for r in sw.runs}
    console = sw.console
    print_table(progress_table(sw.spec, sw.runs, states,
                               f"sweep {sw.spec.name} in {sw.out}: now"), sw.console)
    if result.failed:
        console.print(f"{len(result.failed)} run(s) failed (failed.json in their folders); they "
                      "are skipped on the next sweep unless you pass --retry-failed")
        for failure in result.failed:
            console.print(f"  {escape(failure.run)}: {escape(failure.error)}", soft_wrap=True)
    if result.signum is not None:
        console.print(f"stopped by signal {result.signum} with {len(result.left)} run(s) left; "
                      f"run the same command to resume: {opts.command_line(sw.out)}",
                      soft_wrap=True)
    elif all(states[r.run_dir].status == "done" for r in sw.runs):
        console.print(f"all {len(sw.runs)} runs done; report: qkvlab report {sw.out}")
    return result.exit_code


# ---- registration --------------------------------------------------------------------------
def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("sweep", help="train an experiment spec: variants x seeds, resumable")
    p.add_argument("spec", nargs="?",
                   help="shipped spec name, spec TOML file, or a sweep folder to continue; "
                        "without it, list the shipped specs")
    p.add_argument("--out", help="sweep folder (default runs/sweeps/SPEC)")
    p.add_argument("--dry-run", action="store_true",
                   help="list the runs, their state, parameter counts and tokens; train nothing")
    p.add_argument("--print-commands", action="store_true",
                   help="print one self-contained command per pending run (for a scheduler)")
    p.add_argument("--launcher",
                   help="start each run as LAUNCHER -m qkvlab train RUN --resume, e.g. "
                        "'torchrun --standalone --nproc-per-node=8'")
    p.add_argument("--only", action="append", metavar="VARIANT",
                   help="only these groups, variants or families (a family name takes all "
                        "its variants; repeatable or comma-separated)")
    p.add_argument("--seeds", help="comma-separated seeds instead of the spec's")
    p.add_argument("--yes", action="store_true", help="allow launching more than 100 runs")
    p.add_argument("--retry-failed", action="store_true", help="retrain runs that failed before")
    p.add_argument("--reuse", action="append", metavar="SWEEP_DIR",
                   help="copy finished runs with the same config and seed from this other "
                        "sweep folder instead of training them (repeatable)")
    p.add_argument("--jobs", type=int, metavar="N",
                   help="train N runs at once, the cores split between them (default %(default)s)")
    p.add_argument("--threads", type=int, metavar="T",
                   help="T threads for each run (default: every core for one run at a time, "
                        "the cores split between N at once); e.g. --threads 1 for a run "
                        "beside other work, so its time compares with --jobs runs'")
    add_overrides(p)
    register(p, SweepOptions, run_sweep, trains=True)
