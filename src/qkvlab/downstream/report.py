"""The downstream results for people (a table, skip lines) and for files (one JSON record per
evaluation, under RUN/downstream/, never replacing an earlier one)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from qkvlab.downstream.metrics import TaskResult
from qkvlab.errors import QkvlabError
from qkvlab.fsutil import can_write, check_inside, fsync_dir, temp_sibling, write_bytes_atomic
from qkvlab.run.layout import DOWNSTREAM_DIR

FORMAT = "qkvlab-downstream"
FORMAT_VERSION = 1


def _num(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def results_table(results: Sequence[TaskResult], title: str) -> Table:
    table = Table(title=title)
    for col in ("task", "split", "acc", "acc_norm", "ppl", "scored", "chance"):
        table.add_column(col, justify="left" if col in ("task", "split") else "right")
    for r in results:
        table.add_row(r.task, r.split, _num(r.acc), _num(r.acc_norm), _num(r.perplexity, 2),
                      f"{r.scored:,} of {r.items:,}", _num(r.chance))
    return table


def skip_lines(results: Sequence[TaskResult]) -> list[str]:
    """One line per task and reason: "N of M items skipped: why"."""
    return [f"{r.task}: {n:,} of {r.items:,} items skipped: {why}"
            for r in results for why, n in r.skipped.items()]


def results_folder(run_dir: Path) -> Path:
    """RUN/downstream, refused (before any work) when a link takes it out of the run."""
    folder = Path(run_dir) / DOWNSTREAM_DIR
    check_inside(run_dir, folder)
    return folder


def check_writable(folder: Path) -> None:
    """Refuse, before any scoring, a results folder this user cannot create or write in: the
    scores of a long evaluation would be lost at the end."""
    where = folder if os.path.lexists(folder) else folder.parent
    if not where.is_dir():
        problem = "is not a folder"
    elif not can_write(where):
        problem = "is not writable (permission denied)"
    else:
        return
    raise QkvlabError(f"the downstream results go to {folder}, but {where} {problem}: give this "
                      "user write permission there, or evaluate a copy of the run folder")


def write_new(folder: Path, stem: str, record: dict[str, Any]) -> Path:
    """Write `record` as folder/STEM.json, or STEM-2.json, ... when that exists: complete or
    absent (atomic), and never over an earlier file, even one another process writes now."""
    folder.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(record, indent=1, allow_nan=False) + "\n").encode()
    tmp = write_bytes_atomic(temp_sibling(folder / f"{stem}.json"), data)
    try:
        for n in range(1, 10_000):
            path = folder / (f"{stem}.json" if n == 1 else f"{stem}-{n}.json")
            try:
                os.link(tmp, path)  # fails on an existing name, unlike a rename
            except FileExistsError:
                continue
            fsync_dir(folder)
            return path
        raise OSError(f"no free name for {stem}.json in {folder}")
    finally:
        tmp.unlink(missing_ok=True)
