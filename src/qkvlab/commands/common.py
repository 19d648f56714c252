"""What the command modules share: the `--set` option and how a verb registers itself."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkvlab.errors import require

# argparse has no public name for what add_subparsers returns
Subparsers = argparse._SubParsersAction


def add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", metavar="KEY=VALUE",
                   help="override a config value, e.g. --set optim.lr=1e-3 (repeatable; "
                        "values are TOML literals)")


def check_output_folder(path: Path, option: str) -> None:
    """Refuse an output folder that is a file, or lies under one, before any work is done."""
    for part in (path, *path.parents):
        if os.path.lexists(part):
            require(part.is_dir(), f"{option} {path}: {part} exists and is not a folder; give "
                                   "a folder (new or existing)")
            return


def register(p: argparse.ArgumentParser, options: type, run: Callable[[Any], int],
             trains: bool = False) -> None:
    """Name the verb's options class and run function; the CLI builds one from the other.

    A verb that `trains` gets its stop signals deferred until it calls qkvlab.interrupts.arm.

    The options dataclass holds the verb's defaults, written once: they become the parser's
    defaults here (argparse's set_defaults also sets them on the arguments already added, so
    `%(default)s` in a help text shows them), and `add_argument` calls give none.
    """
    p.set_defaults(options=options, run=run, trains=trains, **option_defaults(options))


def option_defaults(options: type) -> dict[str, Any]:
    """Field name -> default of an options dataclass; a field without one is required."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(options):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out
