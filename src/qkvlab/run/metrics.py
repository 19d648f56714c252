"""metrics.jsonl: one JSON object per line, written by the trainer, read by every tool."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from qkvlab.fsutil import write_text_atomic
from qkvlab.run.layout import METRICS_FILE


def finite_or_null(record: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN/inf: non-finite float values become None (null)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()}


class MetricsLog:
    """metrics.jsonl: one JSON object per line, flushed per write; resume drops later lines."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is None:
            path.write_text("", encoding="utf-8")
        else:
            kept = []
            if path.is_file():
                for line in path.read_text(encoding="utf-8").splitlines():
                    try:
                        if int(json.loads(line)["step"]) <= resume_step:
                            kept.append(line)
                    except (ValueError, KeyError, TypeError):
                        continue  # a line torn by a crash
            write_text_atomic(path, "".join(k + "\n" for k in kept))
        self.f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        self.f.write(json.dumps(finite_or_null(record)) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


class NullLog:
    """metrics.jsonl on ranks other than 0: nothing is written."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def read_metrics(run_dir: Path, *, tolerant: bool = False) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl.

    Strict by default: a missing file or a line that is not JSON raises, since a run that was
    just trained must have a whole log. `tolerant` is for reports over runs in any state (one
    killed mid-write): no file gives [], and a torn line or a record without an integer step
    is skipped.
    """
    path = Path(run_dir) / METRICS_FILE
    if not tolerant:
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
                if line]
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
    return out
