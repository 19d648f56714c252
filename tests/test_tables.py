"""Tables never cut a number or a name: print_table on terminals of any width and on pipes."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from qkvlab.cli import main
from qkvlab.console import print_table, transposed
from qkvlab.model.params import count_params
from qkvlab.model.variants import paper_variants

COLUMNS = ("variant", "total", "non-embedding", "attn_q", "mlp")
CELLS = [("baseline", "124,373,760", "84,953,088", "7,077,888", "56,623,104"),
         ("q-identity-wide", "124,373,760", "84,953,088", "0", "63,700,992")]


def table() -> Table:
    t = Table(title="counts")
    for name in COLUMNS:
        t.add_column(name, justify="right")
    for row in CELLS:
        t.add_row(*row)
    return t


def render(width: int, terminal: bool) -> str:
    buf = io.StringIO()
    print_table(table(), Console(file=buf, width=width, force_terminal=terminal, no_color=True,
                                 color_system=None))
    return buf.getvalue()


def whole(text: str) -> bool:
    lines = text.splitlines()
    return all(any(cell in line for line in lines) for row in CELLS for cell in row) and \
        not any("…" in line for line in lines)


def test_wide_enough_prints_as_is():
    out = render(120, terminal=True)
    assert whole(out) and "non-embedding" in out.splitlines()[2]


def test_narrow_terminal_gets_the_transposed_table():
    assert len(render(100, terminal=True).splitlines()[2]) > 60  # the table as it is
    out = render(60, terminal=True)
    assert whole(out) and max(len(line) for line in out.splitlines()) <= 60
    header = next(line for line in out.splitlines() if "baseline" in line)
    assert "q-identity-wide" in header  # variants as columns


def test_too_narrow_for_either_layout_keeps_every_cell_whole():
    out = render(20, terminal=True)
    assert whole(out)


def test_pipes_get_the_full_width():
    out = render(30, terminal=False)
    assert whole(out)
    assert any("q-identity-wide" in line and "84,953,088" in line for line in out.splitlines())


def test_transposed_swaps_rows_and_columns():
    t = transposed(table())
    assert [str(c.header) for c in t.columns] == ["variant", "baseline", "q-identity-wide"]
    assert t.row_count == len(COLUMNS) - 1


# ---- every table the CLI prints, at 80 columns on a terminal and through a pipe ------------
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


@pytest.fixture(params=["terminal-80", "pipe"])
def screen(request, monkeypatch):
    """The CLI's console as an 80-column terminal, or writing to a pipe."""
    if request.param == "terminal-80":
        monkeypatch.setenv("COLUMNS", "80")
        monkeypatch.setenv("FORCE_COLOR", "1")
    else:
        monkeypatch.delenv("FORCE_COLOR", raising=False)
        monkeypatch.setenv("TERM", "dumb")
    return request.param


def cli_text(capsys, argv: list[str]) -> str:
    assert main(argv) == 0
    captured = capsys.readouterr()
    return ANSI.sub("", captured.out + captured.err)


def assert_whole(text: str, cells: list[str]) -> None:
    assert "…" not in text
    lines = text.splitlines()
    missing = [c for c in cells if not any(c in line for line in lines)]
    assert not missing, f"cut or missing: {missing}"


def test_params_table_keeps_every_count(capsys, screen):
    text = cli_text(capsys, ["params"])
    cells = []
    for v in paper_variants():
        c = count_params(v.model)
        cells += [v.name, v.model.projection, f"{c.total:,}", f"{c.non_embedding:,}",
                  f"{c.attn_q:,}", f"{c.mlp:,}"]
    assert_whole(text, cells)


def test_sweep_plan_table_keeps_group_names_and_counts(capsys, screen):
    text = cli_text(capsys, ["sweep", "cpu-ablation", "--dry-run", "--out",
                             str(Path("/nonexistent-qkvlab-plan"))])
    cells = ["q-identity.scalestandard.wd0.03125", "q-identity.scalematched.wd0.1",
             "q-identity-learned", "baseline-wd", "2,885,888", "2,885,904", "3,148,032",
             "10,240,000"]
    assert_whole(text, cells)


def test_verify_table_keeps_every_statement(capsys, screen):
    from qkvlab.theory.verify import run_checks

    text = cli_text(capsys, ["verify"])
    assert_whole(text, [r.statement for r in run_checks(0)] + ["31/31 PASS"])


def test_compare_table_keeps_every_number(screen):
    from qkvlab.console import table_console
    from qkvlab.experiments.compare import render_table

    rows = json.loads((RESULTS / "compare-quick.json").read_text())
    buf = io.StringIO()
    console = table_console()
    console.file = buf
    print_table(render_table(rows), console)
    text = ANSI.sub("", buf.getvalue())
    assert_whole(text, [r["variant"] for r in rows] + [f"{r['final_val_loss']:.4f}"
                                                       for r in rows])


def test_bench_tables_keep_every_scheme_and_number(screen):
    from qkvlab.bench.report import print_report
    from qkvlab.console import table_console

    results = json.loads((RESULTS / "bench-paper-train-sdpa.json").read_text())
    buf = io.StringIO()
    console = table_console()
    console.file = buf
    print_report(results, console)
    text = ANSI.sub("", buf.getvalue())
    assert_whole(text, list(results["schemes"]))


def test_presets_list_keeps_every_name(capsys, screen):
    from qkvlab.run.config import preset_names

    text = cli_text(capsys, ["presets"])
    assert_whole(text, preset_names())
