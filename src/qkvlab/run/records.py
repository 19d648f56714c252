"""The small JSON records of a run folder (summary.json, failed.json, reused.json) and the one
test for "this run finished", shared by sweeps, compare and reports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_record(path: Path) -> dict[str, Any] | None:
    """A JSON object from `path`, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def is_finished(summary: dict[str, Any] | None, max_steps: int) -> bool:
    """A run's summary.json says it ran to max_steps (not stopped early by a signal)."""
    return bool(summary) and not summary.get("interrupted") \
        and int(summary.get("steps") or 0) >= max_steps
