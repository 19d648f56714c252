"""`qkvlab verify` and `qkvlab convert`: the paper's theorems, checked and applied."""

from __future__ import annotations

from dataclasses import dataclass

from qkvlab.commands.common import Subparsers, register


# ---- verify --------------------------------------------------------------------------------
@dataclass
class VerifyOptions:
    seed: int = 0


def run_verify(opts: VerifyOptions) -> int:
    """Print the table; exit status 1 if any row fails."""
    import time

    from rich.table import Table

    from qkvlab.console import print_table, table_console
    from qkvlab.errors import require
    from qkvlab.run.config import SEED_RANGE, valid_seed
    from qkvlab.theory.verify import run_checks

    require(valid_seed(opts.seed), f"--seed must be an integer in {SEED_RANGE}, got {opts.seed}")
    start = time.perf_counter()
    results = run_checks(int(opts.seed or 0))
    elapsed = time.perf_counter() - start
    table = Table(title=f"docs/paper.md sections 1-4, float64, seed {opts.seed}")
    for col, kw in (("§", {}), ("statement", {}), ("hypotheses", {}),
                    ("max |diff|", {"justify": "right"}), ("expect", {}), ("tolerance", {}),
                    ("result", {})):
        table.add_column(col, **kw)
    for r in results:
        table.add_row(r.section, r.statement, r.hypotheses, f"{r.value:.2e}", r.expect,
                      r.criterion, "[green]PASS[/green]" if r.passed else "[red]FAIL[/red]")
    console = table_console()
    print_table(table, console)
    failed = sum(not r.passed for r in results)
    console.print(f"{len(results) - failed}/{len(results)} PASS in {elapsed:.1f} s")
    return 1 if failed else 0


# ---- convert -------------------------------------------------------------------------------
@dataclass
class ConvertOptions:
    path: str
    to: str = "q-identity"
    out: str | None = None


def run_convert(opts: ConvertOptions) -> int:
    """Convert, report parameters saved and the max logit difference on held-out data."""
    import math

    from qkvlab.theory.convert_checkpoint import convert_checkpoint

    to = opts.to or "q-identity"
    result = convert_checkpoint(opts.path, to, opts.out)
    dest, report, saved, exact = result.dest, result.report, result.saved, result.exact
    before, after = saved.val_loss_before, saved.val_loss_after
    print(f"converted {opts.path} -> {dest} ({to})")
    print(f"theorem: {report.theorem}")
    for note in report.notes:
        print(f"  note: {note}")
    print(f"parameters: {report.params_before:,} -> {report.params_after:,} "
          f"(saved {report.params_saved:,}); max condition number {report.max_condition:.3g}")
    print(f"max |logit diff| on {saved.windows} held-out windows (float64): "
          f"{saved.max_logit_diff:.3e} as saved; {exact.max_logit_diff:.3e} before rounding to "
          "the checkpoint dtype")
    print(f"val loss: {before:.6f} -> {after:.6f} (|diff| {abs(after - before):.2e})")
    if report.max_condition * result.eps > 1e-4:
        print(f"  note: condition number {report.max_condition:.3g}: storing W^-1 W_P in the "
              f"checkpoint dtype loses about {math.log10(report.max_condition):.0f} digits, "
              "hence the gap between the two logit differences")
    return 0


# ---- registration --------------------------------------------------------------------------
def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("verify", help="check the paper's theorems numerically (float64)")
    p.add_argument("--seed", type=int)
    register(p, VerifyOptions, run_verify)

    p = sub.add_parser("convert", help="convert a checkpoint exactly to an identity projection")
    p.add_argument("path", help="run folder or checkpoint folder")
    p.add_argument("--to", help="q-identity | k-identity | v-identity")
    p.add_argument("--out", help="folder for the converted checkpoint")
    register(p, ConvertOptions, run_convert)
