"""`qkvlab presets`: list the shipped config presets."""

from __future__ import annotations

from dataclasses import dataclass

from qkvlab.commands.common import Subparsers, register


@dataclass
class PresetsOptions:
    pass


def run_presets(opts: PresetsOptions) -> int:
    """List the shipped presets with a one-line description each."""
    from qkvlab.run.config import preset_names, preset_summary

    names = preset_names()
    width = max(len(n) for n in names)
    for name in names:
        print(f"{name:<{width}}  {preset_summary(name)}")
    return 0


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("presets", help="list the shipped config presets")
    register(p, PresetsOptions, run_presets)
