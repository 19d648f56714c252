"""Tables never cut a number or a name: print_table on terminals of any width and on pipes."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from qkvlab.console import print_table, transposed

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
