"""`qkvlab report`: the Markdown report and plots of a sweep, with paired statistics."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from qkvlab.commands.common import Subparsers, add_overrides, check_output_folder, register
from qkvlab.fsutil import portable_command


@dataclass
class ReportOptions:
    spec_or_dir: str
    runs: str | None = None
    out: str | None = None
    per_window: bool = False
    attention: bool = False
    versus: str | None = None
    margin: float | None = None  # the equivalence margin, % of the reference loss
    overrides: list[str] = field(default_factory=list)

    def command_line(self, out: Path) -> str:
        """The canonical command line of this report, recorded in it."""
        parts = ["qkvlab", "report", str(self.spec_or_dir)]
        if self.runs:
            parts += ["--runs", str(self.runs)]
        parts += ["--out", str(out)]
        if self.per_window:
            parts.append("--per-window")
        if self.attention:
            parts.append("--attention")
        if self.versus:
            parts += ["--versus", self.versus]
        if self.margin is not None:
            parts += ["--margin", f"{self.margin:g}"]
        for item in self.overrides:
            parts += ["--set", item]
        return " ".join(shlex.quote(p) for p in parts)


def run_report(opts: ReportOptions) -> int:
    """Write the report and print each variant's verdict against the reference."""
    from qkvlab.errors import QkvlabError
    from qkvlab.experiments.render import verdicts
    from qkvlab.experiments.report import build_report, write_report
    from qkvlab.experiments.results import DEFAULT_MARGIN_PCT
    from qkvlab.experiments.spec import load_spec

    margin = DEFAULT_MARGIN_PCT if opts.margin is None else opts.margin
    if not 0 < margin < 100:  # also refuses nan
        raise QkvlabError(f"--margin must be a percentage between 0 and 100, got {margin:g}: "
                          f"pass e.g. --margin {DEFAULT_MARGIN_PCT:g}")
    spec = load_spec(opts.spec_or_dir)
    sweep_dir = Path(opts.runs) if opts.runs else spec.default_out
    out = Path(opts.out) if opts.out else sweep_dir / "report"
    check_output_folder(out, "--out")  # before the report's work (it may load checkpoints)
    rep = build_report(spec, sweep_dir, per_window=opts.per_window,
                       overrides=list(opts.overrides), versus=opts.versus,
                       attention=opts.attention, margin_pct=margin)
    path = write_report(rep, out, portable_command(opts.command_line(out)))
    for line in verdicts(rep):
        print(line)
    print(f"report: {path}")
    return 0


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("report", help="Markdown report and plots of a sweep: paired statistics")
    p.add_argument("spec_or_dir", help="sweep folder, or a spec (its runs in --runs or the "
                                       "spec's default folder)")
    p.add_argument("--runs", help="sweep folder when a spec is given")
    p.add_argument("--out", help="report folder (default SWEEP/report)")
    p.add_argument("--per-window", action="store_true",
                   help="also score each final checkpoint per validation window (secondary "
                        "paired view; loads the checkpoints)")
    p.add_argument("--attention", action="store_true",
                   help="also measure each final checkpoint's attention (logit std and row "
                        "entropy per layer; loads the checkpoints)")
    p.add_argument("--versus", metavar="VARIANT",
                   help="pair every variant against this one instead of the spec's baseline "
                        "(e.g. nonlinear-q vs a wider-MLP control)")
    p.add_argument("--margin", type=float, metavar="PCT",
                   help="equivalence margin in %% of the reference's loss: two arms are called "
                        "level only where the equivalence test (TOST) puts their paired "
                        "difference within +-PCT (default 0.5)")
    add_overrides(p)
    register(p, ReportOptions, run_report)
