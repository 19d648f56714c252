"""`qkvlab archive SWEEP DEST`: a sweep's records without its checkpoints, small enough to commit.

A finished CPU sweep is gigabytes of checkpoints but only a few hundred KB of records: the
sweep's own files and each run's config, metrics, summary and (after `qkvlab report
--per-window`) its per-window losses. `qkvlab report DEST --per-window` gives the same report
from the copy, and `qkvlab sweep DEST` sees its finished runs as done.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from qkvlab.errors import QkvlabError
from qkvlab.experiments.runs import WINDOW_FILE
from qkvlab.experiments.sweep import SWEEP_FILE
from qkvlab.run.layout import CONFIG_FILE, FAILED_FILE, METRICS_FILE, REUSED_FILE, SUMMARY_FILE

SWEEP_RECORDS = (SWEEP_FILE, "spec.toml")
RUN_RECORDS = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, FAILED_FILE, WINDOW_FILE,
               REUSED_FILE)


def archive_sweep(src: Path, dest: Path) -> int:
    """Copy the records of sweep folder `src` into `dest`; returns the number of run folders."""
    if not (src / SWEEP_FILE).is_file():
        raise QkvlabError(f"{src} is not a sweep folder (no {SWEEP_FILE}): pass the folder "
                          "`qkvlab sweep` wrote")
    if dest.resolve() == src.resolve():
        raise QkvlabError("the archive must go to another folder than the sweep itself")
    runs = sorted(p.parent for p in src.glob(f"*/seed-*/{CONFIG_FILE}"))  # every run has one
    for name in SWEEP_RECORDS:
        if (src / name).is_file():
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / name, dest / name)
    for run in runs:
        target = dest / run.relative_to(src)
        target.mkdir(parents=True, exist_ok=True)
        for name in RUN_RECORDS:
            if (run / name).is_file():
                shutil.copy2(run / name, target / name)
    return len(runs)
