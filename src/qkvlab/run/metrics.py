"""metrics.jsonl: one JSON object per line, written by the trainer, read by every tool.

`read_lines` is the one reader of the file: every other reader (`read_metrics`, the resume
in `MetricsLog`, `check_metrics`) goes through it, so a damaged line is judged the same way
everywhere. A record is a JSON object with a non-negative integer "step"; JSON has no
NaN/Infinity, so the writer logs non-finite values as null and the reader refuses them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qkvlab.errors import QkvlabError
from qkvlab.fsutil import write_text_atomic
from qkvlab.run.layout import METRICS_FILE

FRESH_FIX = "move the file away to start its log afresh"


def finite_or_null(record: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN/inf: non-finite float values become None (null)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()}


class _NotARecord(ValueError):
    """Why one line of metrics.jsonl is not a metrics record."""


def _no_constant(name: str) -> Any:
    raise _NotARecord(f"{name} is not JSON; the log writes null")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: a float too large for a double
        raise _NotARecord(f"the number {text[:20]} is out of range")
    return value


def parse_record(line: bytes) -> dict[str, Any]:
    """One line of metrics.jsonl as a record; `_NotARecord` (a ValueError) says why not."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _NotARecord(f"byte {exc.start + 1} is not UTF-8 text") from None
    try:
        rec = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except _NotARecord:
        raise
    except json.JSONDecodeError as exc:
        raise _NotARecord(f"not JSON: {exc.msg.lower()} at column {exc.colno}") from None
    except RecursionError:
        raise _NotARecord("JSON nested too deeply") from None
    except ValueError as exc:  # an integer of thousands of digits, ...
        raise _NotARecord(f"not JSON: {' '.join(str(exc).split())[:80]}") from None
    if not isinstance(rec, dict):
        raise _NotARecord(f"a JSON {type(rec).__name__}, not an object")
    step = rec.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        shown = "missing" if "step" not in rec else f"{json.dumps(step)[:40]}"
        raise _NotARecord(f"its step is {shown}, not a non-negative integer")
    return rec


def _bad_line(path: Path, lineno: int, why: str) -> QkvlabError:
    return QkvlabError(f"{path} line {lineno} is not a metrics record ({why}): remove that "
                       f"line, or {FRESH_FIX}")


def read_lines(path: Path, *, tolerant: bool = False, torn_tail: bool = False
               ) -> Iterator[tuple[bytes, dict[str, Any]]]:
    """(line without its newline, record) for each record of the metrics file `path`.

    Strict: a file that cannot be read or a damaged line raises a one-line `QkvlabError`
    naming the line and the fix. `torn_tail` forgives a damaged last line that lacks its
    newline: the line a crash cut short, since each record is written whole with its newline.
    `tolerant` skips every damaged line and treats an unreadable file as empty. Blank lines
    are skipped. A missing file raises FileNotFoundError unless tolerant.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        if tolerant:
            return
        raise
    except OSError as exc:  # a folder, no permission, ...
        if tolerant:
            return
        if path.is_dir():
            raise QkvlabError(f"{path} is a folder, not a file: move it away to start the "
                              "run's log afresh") from None
        raise QkvlabError(f"{path} cannot be read ({exc.strerror or type(exc).__name__}): "
                          f"fix its permissions, or {FRESH_FIX}") from None
    lines = data.split(b"\n")
    last = len(lines) - 1  # the piece after the final newline ("" for a whole file)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = parse_record(line)
        except _NotARecord as exc:
            if tolerant or (torn_tail and i == last):
                continue
            raise _bad_line(path, i + 1, str(exc)) from None
        yield line, rec


def check_metrics(run_dir: Path) -> None:
    """Refuse a run's metrics.jsonl that a resume could not keep (before anything is written)."""
    path = Path(run_dir) / METRICS_FILE
    if path.exists() or path.is_symlink():
        for _ in read_lines(path, torn_tail=True):
            pass


class MetricsLog:
    """metrics.jsonl: one JSON object per line, flushed per write; resume drops later lines."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is None:
            path.write_text("", encoding="utf-8")
        else:
            # the reader is strict: a damaged line is refused, not silently dropped
            kept = [] if not path.exists() else [
                line for line, rec in read_lines(path, torn_tail=True)
                if rec["step"] <= resume_step]
            write_text_atomic(path, "".join(k.decode("utf-8") + "\n" for k in kept))
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

    Strict by default: a missing file raises FileNotFoundError and a damaged line a one-line
    QkvlabError, since a run that was just trained must have a whole log. `tolerant` is for
    reports over runs in any state (one killed mid-write): no file, or one that cannot be read,
    gives [], and a damaged line (torn, not JSON, or without an integer step) is skipped.
    """
    path = Path(run_dir) / METRICS_FILE
    return [rec for _, rec in read_lines(path, tolerant=tolerant)]
