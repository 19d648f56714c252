"""One rich Console for the commands' tables, and the one way they print them: whole.

A table never cuts or wraps a number or a name. To a file or pipe it is written at the width it
needs; on a terminal too narrow for it, it is printed transposed when that is narrower (its
columns as rows, so a table of a few wide rows becomes a narrow one), and where even that does
not fit, at its natural width: the terminal wraps the lines, but every digit is there.
"""

from __future__ import annotations

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

LOG_WIDTH = 160  # log lines (not tables) are kept to this width when not writing to a terminal


def table_console() -> Console:
    """A console that uses the terminal's width, or LOG_WIDTH when not writing to a terminal."""
    console = Console()
    if not console.is_terminal:
        console.width = LOG_WIDTH
    return console


def _whole(table: Table) -> Table:
    """The table with no column allowed to wrap its cells (print_table then gives it the width
    it needs, so none is shortened either)."""
    for column in table.columns:
        column.no_wrap = True
    return table


def needed_width(table: Table, console: Console) -> int:
    """The width `table` takes with every cell whole."""
    options = console.options.update_width(1 << 16)
    return Measurement.get(console, options, _whole(table)).maximum


def transposed(table: Table) -> Table:
    """The same cells with rows and columns swapped: one row per column of `table`, headed by
    its header; one column per row of `table`, headed by that row's first cell."""
    columns = table.columns
    cells = [list(c.cells) for c in columns]
    out = Table(title=table.title, caption=table.caption, show_header=True)
    out.add_column(str(columns[0].header) if columns else "", justify="left")
    for i in range(table.row_count):
        out.add_column(cells[0][i], justify="right")
    for j in range(1, len(columns)):
        out.add_row(columns[j].header, *(cells[j][i] for i in range(table.row_count)))
    return out


def print_table(table: Table, console: Console | None = None) -> None:
    """Print `table` with every number and name whole (see the module docstring)."""
    console = console or table_console()
    width = needed_width(table, console)
    if console.is_terminal and width > console.width and table.row_count:
        flipped = transposed(table)
        flipped_width = needed_width(flipped, console)
        if flipped_width < width:  # the narrower layout: it fits, or wraps the least
            table, width = flipped, flipped_width
    if width <= console.width:
        console.print(table)
        return
    wide = Console(file=console.file, width=width, force_terminal=console.is_terminal,
                   no_color=console.no_color, highlight=False)
    wide.print(table)
