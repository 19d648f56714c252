"""One rich Console for the commands' tables."""

from rich.console import Console

LOG_WIDTH = 160  # wide tables stay one line per row when output goes to a file or pipe


def table_console() -> Console:
    """A console that uses the terminal's width, or LOG_WIDTH when not writing to a terminal."""
    console = Console()
    if not console.is_terminal:
        console.width = LOG_WIDTH
    return console
