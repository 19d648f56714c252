"""What the command modules share: the `--set` option and how a verb registers itself."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

# argparse has no public name for what add_subparsers returns
Subparsers = argparse._SubParsersAction


def add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set optim.lr=1e-3 (repeatable; "
                        "values are TOML literals)")


def register(p: argparse.ArgumentParser, options: type, run: Callable[[Any], int]) -> None:
    """Name the verb's options class and run function; the CLI builds one from the other."""
    p.set_defaults(options=options, run=run)
