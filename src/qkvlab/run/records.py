"""The small JSON records of a run folder (summary.json, failed.json, reused.json) and the one
test for "this run finished", shared by sweeps, compare and reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qkvlab.errors import QkvlabError
from qkvlab.jsonfile import read_json_object


def read_json_record(path: Path) -> dict[str, Any] | None:
    """A JSON object from `path`, or None when it is missing, unreadable, not an object or
    nested absurdly deep."""
    try:
        return read_json_object(path, fix="")
    except QkvlabError:
        return None


def is_finished(summary: dict[str, Any] | None, max_steps: int) -> bool:
    """A run's summary.json says it ran to max_steps (not stopped early by a signal)."""
    steps = (summary or {}).get("steps")
    # a record from disk: a steps field that is no number is no finished run
    return bool(summary) and not summary.get("interrupted") and isinstance(steps, int | float) \
        and not isinstance(steps, bool) and steps >= max_steps
