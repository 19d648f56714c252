"""`qkvlab compare`: train the baseline, W_Q = I and W_Q = I + wider MLP (each arm at its tuned
scale), and W_Q = I with the paper's recipe (halved scale), then tabulate and plot."""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from qkvlab.commands.common import Subparsers, add_overrides, register
from qkvlab.errors import QkvlabError

if TYPE_CHECKING:
    from rich.console import Console

    from qkvlab.run.config import RunConfig

# before the user's --set, which may name another dtype (run/device.py: what "auto" picks)
DTYPE_DEFAULT = "train.dtype=auto"


@dataclass
class CompareOptions:
    preset: str = "quick"
    out: str = "runs/compare"
    steps: int | None = None
    seed: int | None = None
    fresh: bool = False
    overrides: list[str] = field(default_factory=list)

    def validate(self) -> None:
        from qkvlab.experiments.compare import PRESETS

        if self.preset not in PRESETS:
            raise QkvlabError(f"unknown preset {self.preset!r}; choose one of "
                              f"{', '.join(PRESETS)}")

    def command_line(self) -> str:
        """The command that resumes this comparison (finished runs are reused)."""
        parts = ["qkvlab", "compare", "--preset", self.preset, "--out", self.out]
        if self.steps is not None:
            parts += ["--steps", str(self.steps)]
        if self.seed is not None:
            parts += ["--seed", str(self.seed)]
        for item in self.overrides:
            parts += ["--set", item]
        return " ".join(shlex.quote(p) for p in parts)


def run_compare(opts: CompareOptions) -> int:
    """Train the variants that are not finished, then write the table and the plot. A signal
    stops the whole job (exit 128 + its number) with the command that resumes it."""
    from qkvlab import interrupts
    from qkvlab.console import print_table, table_console
    from qkvlab.experiments.compare import (
        PRESETS,
        markdown_table,
        plot_curves,
        render_table,
        summarize,
        variant_configs,
    )
    from qkvlab.run.config import load_config

    opts.validate()
    # The presets' bf16 stays as the sweeps built on compare-quick recorded it; the job itself
    # trains in bf16 only where bf16 matmuls are native (elsewhere they are emulated, ~100x
    # slower), unless the user names a dtype.
    overrides = [DTYPE_DEFAULT] + list(opts.overrides)
    if opts.steps is not None:
        overrides.append(f"train.max_steps={opts.steps}")
    if opts.seed is not None:
        overrides.append(f"train.seed={opts.seed}")
    base = load_config(PRESETS[opts.preset], overrides)
    # from here a signal (in the duration estimate, a run's set-up, between runs) stops the
    # job with the command that resumes it
    interrupts.arm(opts.command_line())
    out = Path(opts.out)
    console = table_console()
    names, signum = _train_variants(variant_configs(base, overrides, out), opts.fresh, console)
    if signum is not None:
        # soft_wrap: the command stays on one line, ready to copy
        console.print(f"stopped by signal {signum}; no comparison of unfinished runs. Resume "
                      f"with the same command: {opts.command_line()}", soft_wrap=True)
        return 128 + signum
    rows = summarize(out, names)
    print_table(render_table(rows), console)
    plot = out / "compare.png"
    plot_curves(out, names, plot)
    (out / "compare.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "compare.md").write_text(markdown_table(rows) + "\n")
    console.print(f"table: {out / 'compare.md'}  plot: {plot}")
    return 0


def _train_variants(variants: list[tuple[str, str, RunConfig]], fresh: bool, console: Console
                    ) -> tuple[list[str], int | None]:
    """Train (or resume) each (name, description, config) in its folder, reusing finished runs
    unless `fresh`. Returns the variant names and the signal that stopped training, if one did."""
    from qkvlab.experiments.compare import check_reusable
    from qkvlab.run.device import on_this_device, resolve_device
    from qkvlab.run.layout import SUMMARY_FILE
    from qkvlab.run.records import is_finished, read_json_record
    from qkvlab.train import train

    resolved = []
    for name, what, cfg in variants:
        # the dtype "auto" picks here: the duration estimate times it, the start line names
        # it, and a finished run is compared with it
        cfg = on_this_device(cfg, resolve_device(cfg.train.device))
        resolved.append((name, f"{what}, {cfg.train.dtype}", cfg))
    variants = resolved
    if not fresh:
        check_reusable(variants)  # before any work, as a resume checks its config
    todo = []
    for name, what, cfg in variants:
        run_dir = Path(cfg.out_dir)
        if fresh and run_dir.exists():
            shutil.rmtree(run_dir)
        summary = read_json_record(run_dir / SUMMARY_FILE)
        if is_finished(summary, cfg.steps):
            console.print(f"[bold]{name}[/]: finished earlier in {run_dir}, reusing it")
        else:
            todo.append((name, what, cfg, int((summary or {}).get("steps") or 0)))
    if todo:
        console.print(_expected_duration(todo))
    for name, what, cfg, _ in todo:
        console.print(f"[bold]{name}[/]: {what}")
        summary = train(cfg, resume=True)
        if summary.get("interrupted"):
            return [v[0] for v in variants], int(summary.get("signal") or signal.SIGINT)
    return [v[0] for v in variants], None


def _expected_duration(todo: list[tuple[str, str, RunConfig, int]]) -> str:
    """A line with the expected wall time of the runs still to train, from the speed of a few
    training steps of the first one's model on this machine (evaluation included)."""
    from qkvlab.bench.workloads import TrainBench
    from qkvlab.perf import torch_dtype
    from qkvlab.run.device import resolve_device
    from qkvlab.train.progress import fmt_eta

    cfg = todo[0][2]
    device = resolve_device(cfg.train.device)
    dtype = torch_dtype(cfg.train.dtype)
    bench = TrainBench(cfg.model, cfg.train.batch_size * cfg.train.grad_accum, device, dtype,
                       compile=False)
    bench.time_steps(3)  # warm-up: first-call allocations and kernel choices
    step_s = statistics.median(bench.time_steps(1) for _ in range(5))  # robust to a busy CPU
    del bench
    total = 0.0
    for _, _, c, done in todo:
        steps = max(0, c.steps - done)
        evals = steps // c.train.eval_interval + 1
        # an evaluation is a forward pass (~1/3 of a training step) over eval_windows windows
        eval_steps = evals * c.train.eval_windows / c.train.batch_size / 3
        total += (steps + eval_steps) * step_s
    return (f"expected: about {fmt_eta(total)} (h:mm:ss) for {len(todo)} run(s) (a training "
            f"step of {todo[0][0]} takes {step_s * 1e3:.0f} ms on this machine)")


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("compare", help="the main job: baseline vs W_Q = I (also with a wider "
                                       "MLP), each at its tuned scale, vs W_Q = I with the "
                                       "paper's recipe")
    p.add_argument("--preset",
                   help="quick (~11 min on 2 AMX cores in bf16; the expected time is "
                        "printed) | long")
    p.add_argument("--out", help="folder for the runs, table and plot")
    p.add_argument("--steps", type=int, help="override the number of steps")
    p.add_argument("--seed", type=int)
    p.add_argument("--fresh", action="store_true",
                   help="delete the variants' runs in --out and train them again (a folder "
                        "whose runs have another config is refused without it)")
    add_overrides(p)
    register(p, CompareOptions, run_compare, trains=True)
